"""A run's records in its out_dir, and resuming them safely.

    run_config.json   the settings that define the run (resume refuses a different one)
    costs.json        measured layer/head costs of a calibrated run (reused on resume)
    samples.jsonl     one line per generated output (written after its rounds)
    rounds.jsonl      one line per round
    summary.json      written atomically at the end, recomputed from samples.jsonl

A sample counts as finished once its samples.jsonl line is complete. On resume, a torn last line and
the rounds of unfinished samples are dropped, so nothing is lost or duplicated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

Key = tuple[str, int]  # (sample_id, repeat)

# settings that may change between invocations of the same run without changing its results
# (data_dir, calibration and rows only feed other keys — task paths, method E/γ — which are compared resolved)
RESUMABLE_KEYS = ("limit", "out_dir", "logger", "threads", "warmup_tokens", "data_dir", "calibration", "rows")
# task settings of how outputs are scored, not of what the scores are (HumanEval's sandbox and its pool)
RESUMABLE_TASK_KEYS = ("score_workers", "sandbox")


def decoding_tag(do_sample, temperature, top_p) -> str:
    """`greedy` or `sample-t<T>-p<top_p>`: run directories, summaries and the report's decoding column."""
    return f"sample-t{temperature}-p{top_p}" if str(do_sample).lower() == "true" else "greedy"


class RunConflict(RuntimeError):
    pass


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


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


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

    @staticmethod
    def fingerprint(run_config: dict) -> dict:
        """The settings that define a run's results (what run_config.json holds)."""
        fingerprint = {k: v for k, v in run_config.items() if k not in RESUMABLE_KEYS}
        if isinstance(fingerprint.get("task"), dict):
            fingerprint["task"] = {k: v for k, v in fingerprint["task"].items() if k not in RESUMABLE_TASK_KEYS}
        return fingerprint

    def matches(self, run_config: dict) -> bool:
        """True when the directory holds a run made with these settings."""
        return self.config_path.exists() and json.loads(self.config_path.read_text()) == self.fingerprint(run_config)

    def claim(self, run_config: dict) -> None:
        """Create the directory, or check that what it holds was produced by the same settings."""
        self.path.mkdir(parents=True, exist_ok=True)
        fingerprint = self.fingerprint(run_config)
        if self.config_path.exists():
            previous = json.loads(self.config_path.read_text())
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
        """Measured per-layer / per-head-row seconds of a calibrated run, if any."""
        return json.loads(self.costs_path.read_text()) if self.costs_path.exists() else None

    def write_costs(self, costs: dict) -> None:
        write_json(self.costs_path, costs)
