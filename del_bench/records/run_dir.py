"""A run's directory (`RunDir`): its files written safely (atomic JSON, JSONL appended line by line), what a resume
may change (RESUMABLE_KEYS) and how it picks up: a torn last line and the rounds of unfinished samples dropped, so
nothing is lost or duplicated; the calibrated costs a resume may reuse (`cost_units`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from del_bench.errors import RunConflict
from del_bench.records.identity import run_key_of

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


def drop_experiment(run_dir: str | Path, name: str) -> bool:
    """Record that the sweep `name` no longer covers this run (its config has moved on to other settings; the run stays,
    as data): → whether it did."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return False
    summary = json.loads(path.read_text())
    key = run_key_of(summary, _read_jsonl(Path(run_dir) / "samples.jsonl"))
    if name not in key.experiments:
        return False
    summary["run_key"] = key.without_experiment(name).as_dict()
    write_json(path, summary)
    return True


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
