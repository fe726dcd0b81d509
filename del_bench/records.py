"""A run's records in its out_dir, and resuming them safely.

    run_config.json   the settings that define the run (resume refuses a different one)
    costs.json        measured layer/head costs of a calibrated run and the device they were measured on (reused
                      by a resume on that device only)
    method_state.json what a method carries across prompts (Method.state: SWIFT's search with scope run, DV
                      without reset), as it stood after the `samples` finished samples, and the one before it
                      (`previous`): written before a sample's records, so a resume finds the one that matches
    samples.jsonl     one line per generated output (written after its rounds)
    rounds.jsonl      one line per round
    summary.json      written atomically at the end, recomputed from samples.jsonl; its `run_key` says
                      which run this is (RunKey) and so which Vanilla run it pairs with

This module is the record contract every reader shares: the per-round line (`Round`, defined beside the engine
that fills it: del_bench/engine/rounds.py), the per-sample line (`SampleRecord`), the run's identity (`RunKey`)
and the one pairing rule (`RunKey.pairs_with`), and the two rules of whether a run's timing can be trusted
(`overloaded`: a busy machine; `steady_state`: a cold start). The runner writes them; `show`, `report`, `calibrate`
and the bench scripts read them through `run_key_of`, which also adapts records written before run_key existed.

A sample counts as finished once its samples.jsonl line is complete. On resume, a torn last line and
the rounds of unfinished samples are dropped, so nothing is lost or duplicated.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from statistics import median
from typing import Any, Iterable

from del_bench.errors import RunConflict

Key = tuple[str, int]  # (sample_id, repeat)

# settings that may change between invocations of the same run without changing its results (data_dir, calibration,
# rows, records_root and scale only feed other keys — task paths, method E/γ compared resolved; out_dir and
# experiment_name, which says which sweep asked for the run: one run serves several)
RESUMABLE_KEYS = ("limit", "out_dir", "logger", "threads", "warmup", "warmup_tokens", "warmup_passes",
                  "warmup_tolerance", "data_dir", "calibration", "rows", "records_root", "scale", "experiment_name",
                  "layers", "products", "compile")
# task settings of how outputs are scored, not of what the scores are (HumanEval's sandbox and its pool)
RESUMABLE_TASK_KEYS = ("score_workers", "sandbox")
# options added later, at the value meaning "as before" (exit_adapters null: the own head; batch_size 1: one prompt)
ADDED_MODEL_OPTIONS, ADDED_RUN_OPTIONS = {"exit_adapters": None}, {"batch_size": 1}

# model options that only feed other keys: the LS defaults reach a run as method.exit_layer / method.gamma, compared
# resolved, so moving them (to a newly measured best) leaves Vanilla's, DEL's and every other run resumable
RESUMABLE_MODEL_KEYS = ("default_exit_layer", "default_gamma")


def decoding_tag(do_sample, temperature, top_p) -> str:
    """`greedy` or `sample-t<T>-p<top_p>`: run directories, summaries and the report's decoding column."""
    return f"sample-t{temperature}-p{top_p}" if str(do_sample).lower() == "true" else "greedy"


# ---------------------------------------------------------------- the contract

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
    # batch size B > 1 only (else None; engine/lockstep.py, engine/batch.py): {"size": B, "path" (lockstep | threads),
    # "slot", "session" (the decoding session: the run's setup line), "start_s", "end_s" (when its generation began and
    # ended, seconds after its session's batch began: its latency is wall_s, waiting for the batch included),
    # "loaded_layers", "head_passes" (its share of the layers and head passes the batch loaded: a batched call's loads
    # ÷ the rows running it; the shares sum to the batch's), "idle_layers" (sublayers computed in its slot for nothing,
    # ½ each: idle, masked, in lockstep), "reads", "rounds" (its shares of the batch's host reads and rounds: a read
    # carrying n rows' values 1/n each; a prefill its own)}
    batch: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# one entry of SampleRecord.turns; that turn's rounds are the rounds.jsonl lines with the same `turn`
TURN_FIELDS = ("turn", "user", "prompt", "prompt_ids", "output_ids", "output_text", "new_tokens", "wall_s", "rounds",
               "loaded_layers", "head_calls", "drafted", "accepted")


# ---------------------------------------------------------------- the machine's load (SampleRecord.load)

# CPUs other processes may keep busy beyond the free ones (cores − torch threads) before a sample is flagged:
# /proc/stat counts in 10 ms ticks and a daemon's blip is no contention, while one other busy process is a whole core
LOAD_TOLERANCE_CORES = 0.5
# below this interval /proc/stat's ticks are too coarse to tell our CPU time from others' (20 ticks a CPU at 100 Hz):
# such a sample is judged by the load average instead
MIN_TICKS_INTERVAL_S = 0.2


def free_cores(load: dict) -> int:
    """The cores torch's threads leave to everything else."""
    return load["cores"] - load["torch_threads"]


def other_cores(load: dict | None) -> float | None:
    """CPUs other processes kept busy around a sample: the busy CPUs less our own over the interval (/proc/stat);
    for a short interval or off Linux, the larger load average less torch's threads (ours while decoding, which
    the load average counts too); None when nothing was recorded."""
    if not load:
        return None
    busy, own = load.get("busy_cores"), load.get("own_cores")
    if busy is not None and own is not None and load["interval_s"] >= MIN_TICKS_INTERVAL_S:
        return max(0.0, busy - own)
    averages = [a for a in (load.get("loadavg_before"), load.get("loadavg_after")) if a is not None]
    return max(0.0, max(averages) - load["torch_threads"]) if averages else None


def overloaded(load: dict | None) -> bool:
    """True when other processes kept more CPUs busy than torch's threads left free (by more than
    LOAD_TOLERANCE_CORES): the sample was timed on a machine it shared, its speed is not to be trusted. False when
    no load was recorded (older records)."""
    other = other_cores(load)
    return other is not None and other > free_cores(load) + LOAD_TOLERANCE_CORES


def load_summary(samples: list[dict]) -> dict | None:
    """A run's load, from its samples: how many recorded one, how many were overloaded (a run with any is flagged:
    speed is a mean over samples, and one slowed sample moves it), the most CPUs others kept busy around one, and
    the fewest free cores; None when no sample recorded its load (older records)."""
    loads = [s["load"] for s in samples if s.get("load")]
    if not loads:
        return None
    others = [o for o in map(other_cores, loads) if o is not None]
    return {"samples": len(loads), "overloaded": sum(map(overloaded, loads)),
            "max_other_cores": max(others) if others else None, "free_cores": min(map(free_cores, loads))}


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


# ---------------------------------------------------------------- steady state (summary's steady_state)

# the run's first timed sample may take up to this many times the median decode seconds per loaded layer of its other
# samples before the run is flagged as not timed at steady state. On the committed CPU reference records (2-core CPU,
# 0.1–0.3 s samples, other jobs beside them) the ratio reaches 1.72 (99th percentile 1.47 over the 569 runs of two or
# more samples); the failure it is for (issue 36: the first prompts on a GPU after a 16-token warm-up) was 7
STEADY_SLOWDOWN = 2.0


def _seconds(round_: dict) -> float:
    return round_["draft_s"] + round_["verify_s"] + round_["policy_s"]


def decode_seconds_per_layer(sample: dict, rounds: list[dict]) -> float | None:
    """A sample's decode seconds per loaded layer: its rounds after the prefill (round 0 of every turn: a prefill's
    cost grows with the prompt) ÷ the layers they loaded; for a sample without round lines (a peer's: transformers
    decodes), its wall seconds ÷ loaded layers. None when nothing was decoded after the prefill.

    Per loaded layer, not per token: a token's time depends on how many drafts were accepted, a layer's much less —
    on the reference records the first sample's ratio to the rest spreads 0.90–1.27 (5th–95th percentile) per layer
    against 0.76–1.41 per token."""
    if not rounds:
        layers = sample.get("loaded_layers")
        return sample["wall_s"] / layers if layers and sample.get("wall_s") else None
    decode = [r for r in rounds if r["round"] > 0]
    layers = sum(r["loaded_layers"] for r in decode)
    return sum(map(_seconds, decode)) / layers if layers else None


def steady_state(samples: list[dict], rounds: list[dict], setup: list[dict] = ()) -> dict | None:
    """Whether a run's samples were timed at steady state — the one rule `show`, the report and the benches apply,
    from the records alone (samples.jsonl in decoding order, rounds.jsonl, setup.jsonl). A run is not at steady
    state when
    - a session's warm-up did not converge (its setup line's warmup.converged is false: `warmup: steady` decoded its
      cap of passes without two in a row agreeing on their per-token time), or
    - one of its first two timed samples took more than STEADY_SLOWDOWN times the median decode seconds per loaded
      layer of the samples after it (decode_seconds_per_layer): a cold start that the warm-up did not absorb. Only
      slower counts (a faster first sample is no warm-up's failure); the median keeps half of the later samples slow
      from hiding it, and the second sample's own check keeps two slow samples of three from hiding each other.
    Returns {"first_slowdown": the first sample's ratio, "lead_slowdown": the larger of the first two samples'
    (None with fewer than two timed samples), "warmups_unconverged": sessions, "steady": bool}, or None when there
    is nothing to judge (one sample and no warm-up recorded)."""
    by_sample: dict[Key, list[dict]] = {}
    for r in rounds:
        by_sample.setdefault(key_of(r), []).append(r)
    per_layer = [decode_seconds_per_layer(s, by_sample.get(key_of(s), [])) for s in samples]
    per_layer = [v for v in per_layer if v]
    leading = [per_layer[i] / median(per_layer[i + 1 :]) for i in range(min(2, len(per_layer) - 1))]
    slowdown = leading[0] if leading else None
    lead = max(leading) if leading else None
    warmups = [line["warmup"] for line in setup if isinstance(line.get("warmup"), dict)]
    unconverged = sum(w.get("converged") is False for w in warmups)
    if slowdown is None and not warmups:
        return None
    return {"first_slowdown": slowdown, "lead_slowdown": lead, "warmups_unconverged": unconverged,
            "steady": not unconverged and (lead is None or lead <= STEADY_SLOWDOWN)}


def unsteady(state: dict | None) -> bool:
    """A run's steady_state says it was not timed at steady state (False for None: nothing to judge)."""
    return bool(state) and not state["steady"]


# A run and its Vanilla partner must have been timed on the machine in one state: a VM's host can make the same matrix
# products several times slower from one day to the next (this 2-core VM: the SmolLM2 layer products' one-row time,
# median 2.0 ms over one day's 116 runs, 6.0 ms another day, with nothing else running), which no load sampling sees.
# A speedup whose run and partner differ by more than this factor in machine_probe is marked (the report's §).
DRIFT_LIMIT = 1.5
# Below this a probe is call overhead and timer noise, not the machine: the testbed's (11.5M parameters, ~1 ms) ranged
# 0.3–1.5 ms between runs minutes apart; SmolLM2's is ~18 ms, a 7B model's in bf16 on one H100/H200 ~3–4 ms.
MIN_PROBE_S = 2e-3


def machine_probe(setup: list[dict]) -> float | None:
    """Seconds the model's matrix products took for one token when the run set up — a probe of the machine's state
    taken on every run: the sum over shape classes of the one-row time of HF's layout (x_wt) that `products: auto`
    measured on the model's own matrices (the seconds under a setup.jsonl line's products), the median over the run's
    sessions. None where nothing was timed (a forced layout, records from before; half precision before its one-row
    times were taken)."""
    probes = []
    for line in setup:
        seconds = (line.get("products") or {}).get("seconds") or {}
        one_row = [by_rows.get("1", {}).get("x_wt") for shape, by_rows in seconds.items()
                   if not shape.startswith("rows_")]  # rows_B: a batch's widths (products.for_rows)
        if one_row and all(isinstance(t, (int, float)) and t > 0 for t in one_row):
            probes.append(math.fsum(one_row))
    return median(probes) if probes else None


def drifted(probe: float | None, partner_probes: Iterable[float | None]) -> bool:
    """A run's machine_probe and its Vanilla partners' differ by more than DRIFT_LIMIT either way (False where either
    side has none, or one too short to tell: MIN_PROBE_S): its speedup compares two states of the machine, not two
    methods."""
    partners = [p for p in partner_probes if p and p >= MIN_PROBE_S]
    if not probe or probe < MIN_PROBE_S or not partners:
        return False
    ratio = probe / (math.fsum(partners) / len(partners))
    return max(ratio, 1 / ratio) > DRIFT_LIMIT


def machine_of(provenance: dict) -> str:
    """device/CPU (+ torch threads on CPU, which change speed as much as the hardware does; + the layer loop unless
    eager, see SampleRecord.layer_path): the runs a speedup may pair must share it. The CPU is its model as the kernel
    names it where the records say (Intel Xeon …, AMD EPYC …; older records: the architecture), so an Intel and an AMD
    host of one architecture do not pair; the provenance holds no host name, so two hosts of one CPU model look
    alike (their `host_kind` says more)."""
    machine = f"{provenance.get('device', '?')}/{provenance.get('cpu_model') or provenance.get('cpu', '?')}"
    threads = provenance.get("torch_threads")
    extra = [f"{threads} threads"] if provenance.get("device") == "cpu" and threads else []
    if provenance.get("layer_path") not in (None, "eager"):
        extra.append(f"{provenance['layer_path']} layers")
    return machine + (f" ({', '.join(extra)})" if extra else "")


def prompts_fingerprint(task_version, sample_ids: Iterable) -> str:
    """Short fingerprint of a prompt set (the task's version and its sample ids): runs compare only on one set."""
    text = f"{task_version}|" + "\n".join(sorted({str(i) for i in sample_ids}))
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def prompt_digest(samples: Iterable[dict], stop_strings: Iterable[str] = ()) -> str:
    """Short digest of what the model saw, from the sample records: each sample's prompt_ids (system prompt, shots and
    template included), a multi-turn sample's later user turns and how turns were rendered (prompt_format), and the
    task's stop strings (they end outputs). Runs of one task version and sample ids whose prompts differ (a
    `task.n_shot=0` variant) get different digests; repeats of a sample count once."""
    def seen(s: dict) -> tuple:
        users = [t["user"] for t in (s.get("turns") or [])[1:]]
        return str(s["sample_id"]), s["prompt_ids"], users, s.get("prompt_format")

    text = json.dumps([sorted({json.dumps(seen(s)) for s in samples}), sorted(stop_strings)])
    return hashlib.sha1(text.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class RunKey:
    """Which run this is. Every reader pairs, groups and selects runs through it.

    Two runs pair (a speedup is one's tokens/s ÷ the other's) when they share PAIR_FIELDS: the same model and
    weights, task and task version, decoding, generation length, prompt set and machine. Runs that also share
    the method and its hyperparameters are repeats of one configuration (other seeds, or repeated runs).
    `experiments` lists the sweeps (configs/experiment) that asked for the run: one run can serve several
    (Tables 1 and 3 share theirs); it is membership, not identity."""

    model: str
    weights: str  # digest of a local model's weight files ("" for hub checkpoints)
    task: str
    task_version: str
    method: str
    method_tag: str
    hyperparameters: tuple[tuple[str, Any], ...]  # Method.describe(), sorted by name
    decoding: str  # greedy | sample-t<T>-p<top_p>
    max_new_tokens: int
    prompts: str  # prompts_fingerprint of the selected samples
    machine: str  # machine_of(provenance)
    experiments: tuple[str, ...] = field(default=(), compare=False)
    # prompt_digest of the samples' records: what the model saw ("" in records from before it was kept, which so
    # pair among themselves only)
    prompt_digest: str = ""
    # prompts decoded together (run.yaml batch_size; 1 in records from before it existed): a row's speed and latency
    # depend on it, so runs of different batch sizes never pair
    batch_size: int = 1

    PAIR_FIELDS = ("model", "weights", "task", "task_version", "decoding", "max_new_tokens", "prompts", "prompt_digest",
                   "machine", "batch_size")

    def pair_id(self) -> tuple:
        return tuple(getattr(self, f) for f in self.PAIR_FIELDS)

    def pairs_with(self, vanilla: RunKey) -> bool:
        """True when `vanilla` is a Vanilla run this run's speedup may be computed against."""
        return vanilla.method == "vanilla" and self.pair_id() == vanilla.pair_id()

    def hyperparameter(self, name: str, default=None):
        return dict(self.hyperparameters).get(name, default)

    def label(self) -> str:
        """The method as the tables name it (method_label: `DEL`, `LS(E4-γ4)`, and ` B=8` for a batched run); the
        full tag stays method_tag."""
        return self.entry().label + batch_label(self.batch_size)

    def entry(self) -> MethodEntry:
        """The run's method as its class presents it: label, family, order, note (method_entry)."""
        return method_entry(self.method, dict(self.hyperparameters))

    def with_experiment(self, name: str | None) -> RunKey:
        if not name or name in self.experiments:
            return self
        return replace(self, experiments=tuple(sorted({*self.experiments, name})))

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hyperparameters"] = dict(self.hyperparameters)
        out["experiments"] = list(self.experiments)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> RunKey:
        data = dict(data)
        data["hyperparameters"] = tuple(sorted((data.get("hyperparameters") or {}).items()))
        data["experiments"] = tuple(data.get("experiments") or ())
        data["max_new_tokens"] = int(data["max_new_tokens"])
        data["batch_size"] = int(data.get("batch_size", 1))
        return cls(**data)


def batch_label(batch_size: int) -> str:
    """" B=8" after a batched run's label (show, the tables); "" at batch size 1."""
    return "" if int(batch_size) == 1 else f" B={batch_size}"


def vanilla_partners(key: RunKey, runs: Iterable[tuple[RunKey, Any]]) -> list:
    """The runs (of `runs`: (RunKey, run) pairs, any run object) that are the Vanilla `key`'s speedup is computed
    against (RunKey.pairs_with), in the order given. show, the report, calibration and the benches all ask here."""
    return [run for other, run in runs if key.pairs_with(other)]


def vanilla_baseline(key: RunKey, runs: Iterable[tuple[RunKey, dict]], metric: str = "tokens_per_s") -> float | None:
    """The mean `metric` (tokens/s by default) of the Vanilla runs `key` pairs with, over those that recorded it (a
    number, not NaN): a speedup's denominator. None when there is no such partner."""
    values = [run.get(metric) for run in vanilla_partners(key, runs)]
    values = [v for v in values if v is not None and v == v]  # v != v: NaN (pandas rows)
    return math.fsum(values) / len(values) if values else None


# ---------------------------------------------------------------- how tables, show and the benches name methods

# a peer's label (transformers' own decoding beside ours: del_bench/bench/peers.py) carries PEER_MARK wherever a
# method is named (show, the tables), with PEER_NOTE under a table that has one
PEER_MARK = "†"
PEER_NOTE = (f"{PEER_MARK} = a peer: transformers' own decoding (generate, a plain loop over its forward, "
             "assistant_early_exit: LayerSkip's self-speculation in transformers) on the same weights and prompts, "
             "written as records like ours (work counted by hooks where it runs; del_bench/bench/peers.py).")


@dataclass(frozen=True)
class MethodEntry:
    """A run's method as tables and `show` present it, as its class declares it (Method.table_label, family,
    table_order, table_note): read from the run's name and hyperparameters alone."""

    label: str  # LS(E4-γ4), DEL-CPU, HF generate†
    family: str  # methods.base.FAMILIES
    order: tuple  # its place among a block's rows (compared with other entries' orders)
    note: str | None = None  # a note under any table with this row


def method_entry(method: str, hyperparameters: dict | None = None) -> MethodEntry:
    """What the class of `method` (a config name, RunKey.method) says of a run of it with these hyperparameters (its
    describe(), as records keep it; e.g. {"exit_layer": 24, "gamma": 4}). A name no class declares (a method whose
    module this process cannot import, or has not: a peer's, whose readers import the bench's peers) keeps its name,
    after every declared method."""
    from del_bench.methods import method_class
    from del_bench.methods.base import OTHER, PEER, Method

    cls, hyperparameters = method_class(method), hyperparameters or {}
    if cls is None:
        return MethodEntry(method, OTHER, (Method.order,))
    label = cls.table_label(method, hyperparameters) + (PEER_MARK if cls.family == PEER else "")
    return MethodEntry(label, cls.family, cls.table_order(method, hyperparameters),
                       cls.table_note(method, hyperparameters))


def method_label(method: str, hyperparameters: dict | None = None) -> str:
    """Labels as in the paper, as each method's class declares them (method_entry): LS(E8-γ6), FS(E8-γ6), DV(E8),
    DEL's variant (DEL-CPU) and its ω only when not the default; a peer's marked: HF assistant_early_exit(E8-γ6)†."""
    return method_entry(method, hyperparameters).label


def is_peer(method: str) -> bool:
    """True for a peer's run (transformers decoded it, not our engine: del_bench/bench/peers.py)."""
    from del_bench.methods.base import PEER

    return method_entry(method).family == PEER


def run_key_of(summary: dict, samples: list[dict] | None = None) -> RunKey:
    """The RunKey a summary.json records; for records written before run_key existed, the same key rebuilt
    from the summary (the one adapter for older records): its config, provenance and sample ids."""
    if summary.get("run_key"):
        return RunKey.from_dict(summary["run_key"])
    cfg = summary.get("config") or {}
    method_cfg = {k: v for k, v in (cfg.get("method") or {}).items()
                  if k not in ("name", "tag") and not k.startswith("_")}
    ids = [s["sample_id"] for s in samples or []]
    if not ids:  # no samples file: what the summary says about the prompt set
        ids = [f"limit={cfg.get('limit')}", f"n={summary.get('n_samples')}"]
    return RunKey(
        model=summary["model"], weights=(cfg.get("model") or {}).get("weights") or "", task=summary["task"],
        task_version=str(summary.get("task_version")), method=summary["method"],
        method_tag=summary.get("method_tag", summary["method"]),
        hyperparameters=tuple(sorted(method_cfg.items())), decoding=_decoding_of(summary),
        max_new_tokens=int(cfg.get("max_new_tokens", 0)), prompts=prompts_fingerprint(summary.get("task_version"), ids),
        machine=machine_of(summary.get("provenance") or {}), batch_size=int(cfg.get("batch_size", 1)))


def _decoding_of(summary: dict) -> str:
    """The decoding the run really used: the task's own generation settings (HumanEval pass@10 samples at
    T = 0.6) override the run's, as in the runner."""
    cfg = summary.get("config") or {}
    gen = dict(cfg.get("generation") or {})
    gen.update((cfg.get("task") or {}).get("generation") or {})
    if not gen:
        return summary.get("decoding", "greedy")
    return decoding_tag(gen.get("do_sample"), gen.get("temperature", 1.0), gen.get("top_p", 1.0))


def add_experiment(run_dir: str | Path, name: str | None) -> None:
    """Record that the sweep `name` covers this finished run (a job skipped because the run already exists)."""
    path = Path(run_dir) / "summary.json"
    if not name or not path.is_file():
        return
    summary = json.loads(path.read_text())
    key = run_key_of(summary, _read_jsonl(Path(run_dir) / "samples.jsonl"))
    if name not in key.experiments:
        summary["run_key"] = key.with_experiment(name).as_dict()
        write_json(path, summary)


def _read_jsonl(path: Path) -> list[dict]:
    """Complete lines only; a torn trailing line (interrupted write) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """Complete lines only, for readers (report, show, export): a torn last line of an interrupted run is
    skipped, not repaired (only RunDir, which owns the run, trims it)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


# what a method's set_costs takes of a costs.json: the measured seconds (its `device` says where they were measured)
COST_UNITS = ("layer_s", "head_s", "batch_s", "sublayer_s")


def cost_units(costs: dict) -> dict:
    return {k: costs[k] for k in COST_UNITS if k in costs}


def key_of(record: dict) -> Key:
    return record["sample_id"], record.get("repeat", 0)


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.samples_path = self.path / "samples.jsonl"
        self.rounds_path = self.path / "rounds.jsonl"
        self.summary_path = self.path / "summary.json"
        self.config_path = self.path / "run_config.json"
        self.costs_path = self.path / "costs.json"
        self.method_state_path = self.path / "method_state.json"
        self.setup_path = self.path / "setup.jsonl"

    @staticmethod
    def fingerprint(run_config: dict) -> dict:
        """The settings that define a run's results (what run_config.json holds). Options added after records
        were written are left out at the value that means "as before" (ADDED_MODEL_OPTIONS, ADDED_RUN_OPTIONS), so those
        still resume. Idempotent: a stored run_config.json (written before a key became resumable) is compared through
        it too."""
        fingerprint = {k: v for k, v in run_config.items()
                       if k not in RESUMABLE_KEYS and ADDED_RUN_OPTIONS.get(k, ...) != v}
        if isinstance(fingerprint.get("model"), dict):
            fingerprint["model"] = {k: v for k, v in fingerprint["model"].items()
                                    if k not in RESUMABLE_MODEL_KEYS and ADDED_MODEL_OPTIONS.get(k, ...) != v}
        if isinstance(fingerprint.get("task"), dict):
            fingerprint["task"] = {k: v for k, v in fingerprint["task"].items() if k not in RESUMABLE_TASK_KEYS}
        return fingerprint

    def matches(self, run_config: dict) -> bool:
        """True when the directory holds a run made with these settings."""
        return self.config_path.exists() and self._stored() == self.fingerprint(run_config)

    def _stored(self) -> dict:
        """run_config.json's settings, as fingerprint compares them today."""
        return self.fingerprint(json.loads(self.config_path.read_text()))

    def claim(self, run_config: dict) -> None:
        """Create the directory, or check that what it holds was produced by the same settings."""
        self.path.mkdir(parents=True, exist_ok=True)
        fingerprint = self.fingerprint(run_config)
        if self.config_path.exists():
            previous = self._stored()
            changed = sorted(k for k in set(previous) | set(fingerprint) if previous.get(k) != fingerprint.get(k))
            if changed:
                raise RunConflict(
                    f"{self.path} holds a run made with different settings ({', '.join(changed)} differ); "
                    "resume only continues the same run: pick another out_dir= or remove that directory")
        else:
            write_json(self.config_path, fingerprint)

    def finished(self) -> list[dict]:
        """Finished sample records; drops rounds of samples that never finished."""
        samples = _read_jsonl(self.samples_path)
        done = {key_of(s) for s in samples}
        rounds = _read_jsonl(self.rounds_path)
        kept = [r for r in rounds if key_of(r) in done]
        if len(kept) != len(rounds):
            _write_jsonl(self.rounds_path, kept)
        return samples

    def append(self, sample: dict, rounds: list[dict]) -> None:
        """Rounds first, then the sample line that marks them finished; each flushed to disk."""
        for path, rows in ((self.rounds_path, rounds), (self.samples_path, [sample])):
            with open(path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
                f.flush()
                os.fsync(f.fileno())

    def set_scores(self, fields: dict[Key, dict]) -> None:
        """Merge `fields` ({(sample_id, repeat): {"scores": …, …}}) into the finished sample records; one atomic
        rewrite of samples.jsonl (the runner scores a batch-scoring task's outputs after generating them)."""
        rows = _read_jsonl(self.samples_path)
        for row in rows:
            row.update(fields.get(key_of(row), {}))
        _write_jsonl(self.samples_path, rows)

    def rounds(self) -> list[dict]:
        return _read_jsonl(self.rounds_path)

    def costs(self) -> dict | None:
        """Measured per-layer / per-head-row seconds of a calibrated run (engine/costs.measure_costs), with the
        `device` they were measured on (absent in costs measured before it was kept), if any."""
        return json.loads(self.costs_path.read_text()) if self.costs_path.exists() else None

    def write_costs(self, costs: dict) -> None:
        write_json(self.costs_path, costs)

    def setup(self) -> list[dict]:
        """One line per decoding session (a resume adds one): what was spent before the first timed sample, in
        seconds (model load, building/checking the layer loop, measuring costs, the warm-up), and the layer loop."""
        return _read_jsonl(self.setup_path)

    def append_setup(self, line: dict) -> None:
        with open(self.setup_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def method_state(self, samples: int) -> dict | None:
        """{"samples": n, "state": Method.state() after n finished samples}: the saved state for `samples`
        finished samples (the last one, or the one before it when a kill came between writing the state and
        appending its sample), else the last one saved (records written before states were kept in pairs), or
        None if none was saved."""
        if not self.method_state_path.exists():
            return None
        saved = json.loads(self.method_state_path.read_text())
        previous = saved.get("previous")
        return previous if previous and previous["samples"] == samples and saved["samples"] != samples else saved

    def write_method_state(self, state: dict | None, samples: int) -> None:
        """Before a sample's records are appended, the state after it (`samples` counting it), keeping the state
        saved before it as `previous`: however a kill falls around the append, a resume finds the state that
        matches the finished samples."""
        if state is None:
            return
        last = self.method_state(samples - 1)
        if last and last["samples"] != samples - 1:
            last = None
        previous = last and {"samples": last["samples"], "state": last["state"]}
        write_json(self.method_state_path, {"samples": samples, "state": state, "previous": previous})
