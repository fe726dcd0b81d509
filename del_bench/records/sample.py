"""The per-sample line of samples.jsonl (`SampleRecord`, with a multi-turn sample's `turns`) and what a run's
samples add up to: throughput, the host reads a round and a token, the batch's eTPL (per the batch's loads)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SampleRecord:
    """One line of samples.jsonl: one generated output (a prompt's `repeat`-th sample)."""

    sample_id: str
    repeat: int
    task_version: str
    prompt: str
    prompt_ids: list[int]  # what the model saw
    output_ids: list[int]
    output_text: str
    generated_tokens: int
    num_layers: int
    loaded_layers: float  # Σ over rounds of drafted·E + L (prefill: L); SWIFT: drafted·(L − skipped sublayers/2) + L
    head_calls: int  # LM-head rows
    rounds: int  # rounds.jsonl lines of this output, prefill included
    wall_s: float  # prefill + rounds, tokenisation excluded
    tokens_per_s: float | None
    etpl: float | None  # generated_tokens ÷ loaded_layers
    drafted: int
    accepted: int
    scores: dict | None  # the task's per-sample quality (pass, rouge2, …); a batch-scoring task's is None until
    # the runner scores it after generation (runner.score_pending)
    peak_memory_bytes: int | None = None
    memory_measure: str | None = None
    model_bytes: int | None = None
    kv_cache_bytes: int | None = None
    sandbox: str | None = None  # where generated code ran when it was scored: bwrap | fallback (HumanEval)
    category: str | None = None  # the sample's category where the task has them (Spec-Bench)
    prompt_format: str | None = None  # multi-turn tasks: how turns were rendered (chat_template:<digest> | plain)
    # multi-turn samples (else None): one dict per turn (TURN_FIELDS); the fields above are then over the whole
    # conversation: prompt/prompt_ids = turn 0's, output_ids = the turns' concatenated, output_text = the turns'
    # texts joined by a blank line, and generated_tokens, rounds, wall_s, loaded_layers, head_calls, drafted,
    # accepted = sums over turns (so tokens_per_s = all tokens ÷ all seconds of the conversation)
    turns: list[dict] | None = None
    # the decoder-layer loop that decoded it (LayerStack.layer_path): fused | eager (None: a record from before the
    # choice existed, which was eager). It changes speed, never tokens; machine_of keeps the two apart
    layer_path: str | None = None
    # greedy half-precision runs only (else None): per output token, the top-2 gap of the logits it was chosen from,
    # in ulps of the model's dtype at the top logit (del_bench/numerics.py). A Vanilla run's gaps say whether another
    # run's first departure from it is a near-tie (≤ NEAR_TIE_ULPS: allowed in half precision) or a real one
    top2_gap_ulps: list[float] | None = None
    # the machine's load around this sample's timed decoding (del_bench/machine_load.py: load averages, busy CPUs,
    # our own, cores, torch threads); None in records from before it was kept. `overloaded` judges it
    load: dict | None = None
    # seconds from the start of its generation to its first token (the prefill; at batch size B > 1 its waiting for
    # the batch too; a multi-turn sample: the first turn's). None in records from before it was kept
    ttft_s: float | None = None
    # batch size B > 1 only (else None; engine/batch.py, or a peer's methods/peers.PeerBatch): {"size": B, "slot",
    # "session" (the decoding session: the run's setup line), "start_s", "end_s" (when its generation began and
    # ended, seconds after its session's batch began: its latency is wall_s, waiting for the batch included),
    # "loaded_layers", "head_passes" (its share of the layers and head passes the batch loaded: a batched call's loads
    # ÷ the rows running it; the shares sum to the batch's), "idle_layers" (sublayers computed in its slot for nothing,
    # ½ each: idle, masked, in a batch's step), "reads", "rounds" (its shares of the batch's host reads and rounds:
    # a read carrying n rows' values 1/n each; a prefill its own)}
    batch: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# one entry of SampleRecord.turns; that turn's rounds are the rounds.jsonl lines with the same `turn`
TURN_FIELDS = ("turn", "user", "prompt", "prompt_ids", "output_ids", "output_text", "new_tokens", "wall_s", "rounds",
               "loaded_layers", "head_calls", "drafted", "accepted")


def throughput(samples: list[dict]) -> float | None:
    """Tokens per second over the batch: all generated tokens ÷ the wall seconds of decoding them. Batched records
    (`batch`): each session's batch ran from 0 to its last row's end_s, and the sessions' spans add up (a resumed run);
    one prompt at a time: the samples' wall_s add up. None without tokens or time."""
    tokens = sum(s["generated_tokens"] for s in samples)
    spans: dict = {}
    for s in samples:
        if s.get("batch"):
            session = s["batch"]["session"]
            spans[session] = max(spans.get(session, 0.0), s["batch"]["end_s"])
        else:
            spans[("sample", s["sample_id"], s.get("repeat", 0))] = s["wall_s"]
    seconds = sum(spans.values())
    return tokens / seconds if tokens and seconds > 0 else None


def host_reads(samples: list[dict], rounds: list[dict]) -> dict:
    """The host reads (every counted transfer: del_bench/transfer.py) a run made, a round and a generated token: a
    batched run's from its rows' shares of the batch's reads and rounds (SampleRecord.batch: a read carrying n rows'
    values counts 1/n in each), one prompt at a time from its rounds' host_syncs; a prefill counts as a round (round
    0). None where records from before them lack them."""
    tokens = sum(s["generated_tokens"] for s in samples)
    batched = [s["batch"] for s in samples if s.get("batch")]
    if batched and all("reads" in b for b in batched):
        reads, count = sum(b["reads"] for b in batched), sum(b["rounds"] for b in batched)
        if not count:  # a peer's batch: transformers' reads are not ours to count
            return {"host_reads_per_round": None, "host_reads_per_token": None}
    elif not batched and rounds:
        reads, count = sum(r.get("host_syncs", 0) for r in rounds), len(rounds)
    else:
        return {"host_reads_per_round": None, "host_reads_per_token": None}
    return {"host_reads_per_round": reads / count if count else None,
            "host_reads_per_token": reads / tokens if tokens else None}


def batch_etpl(samples: list[dict]) -> float | None:
    """Tokens per layer the batch loaded: all generated tokens ÷ Σ the rows' shares of the batch's loads (a batched
    call of layers [s, e) counted once for all its rows: SampleRecord.batch); one prompt at a time, ÷ Σ loaded_layers
    (the pooled eTPL). None without loads."""
    tokens = sum(s["generated_tokens"] for s in samples)
    layers = sum(s["batch"]["loaded_layers"] if s.get("batch") else s["loaded_layers"] for s in samples)
    return tokens / layers if layers else None
