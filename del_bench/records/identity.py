"""A run's identity: its RunKey — model and weights, task, method and hyperparameters, decoding, prompts, machine,
batch size — read from a summary (`run_key_of`, which also adapts records from before run_key existed), and the one
pairing rule with a Vanilla run (`RunKey.pairs_with`, `vanilla_baseline`)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable

from del_bench.records.labels import MethodEntry, method_entry


def decoding_tag(do_sample, temperature, top_p) -> str:
    """`greedy` or `sample-t<T>-p<top_p>`: run directories, summaries and the report's decoding column."""
    return f"sample-t{temperature}-p{top_p}" if str(do_sample).lower() == "true" else "greedy"


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

    def without_experiment(self, name: str) -> RunKey:
        return replace(self, experiments=tuple(e for e in self.experiments if e != name))

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
