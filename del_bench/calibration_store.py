"""The calibration file (results/calibration/<model>.yaml): per task, the best LS (E, γ) of a grid search.

`python -m del_bench calibrate` (del_bench/calibration.py) writes entries; the `${calibrated:…}` config
resolver (del_bench/config.py) reads them when calibration.use=true. Kept apart from the grid search so the
config layer can read the file without reaching up to the orchestrator.
"""

from __future__ import annotations

import copy
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

import yaml

from del_bench.errors import ConfigError

_READ: dict[Path, tuple[int, dict]] = {}  # path → (mtime_ns, entries): a sweep resolves the file once per job


def read(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        return {}
    mtime = path.stat().st_mtime_ns
    if path not in _READ or _READ[path][0] != mtime:
        _READ[path] = (mtime, yaml.safe_load(path.read_text()) or {})
    return copy.deepcopy(_READ[path][1])


def lookup(path: str | Path, task: str) -> dict:
    """The calibrated entry of `task` in `path`; a ConfigError that says how to make it when missing."""
    entry = read(path).get(task)
    if not entry:
        raise ConfigError(f"calibration.use=true but {path} has no entry for task {task!r}; run "
                          f"`python -m del_bench calibrate model=… task={task}` first (or calibration.use=false)")
    return entry


@contextmanager
def _locked(path: Path):
    """Several calibrations (one per task) may update one model's file at once: serialise the rewrite."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_entry(path: str | Path, task: str, entry: dict) -> None:
    path = Path(path)
    with _locked(path):
        data = read(path)
        data[task] = entry
        tmp = path.with_name(path.name + ".tmp")
        header = "# written by `python -m del_bench calibrate`: per task, the LS (E, γ) with the highest tokens/s\n"
        tmp.write_text(header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
        os.replace(tmp, path)
