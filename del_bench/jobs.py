"""One job of a sweep, made robust: skip it when its out_dir already holds the finished run, never let two
jobs write one out_dir, record a failure where its records would have been, and report a sweep's failures.

    skipped   out_dir holds a finished run with the same settings (summary.json + matching run_config.json,
              same sample selection): nothing is loaded, nothing rewritten
    busy      another job holds out_dir's lock (two sweep points that resolve to the same run)
    ok        decoded (or resumed) and summarised; a stale error.json is removed
    failed    the exception is in out_dir/error.json (type, message, traceback, overrides, config); in a
              multirun the sweep goes on, and the CLI exits non-zero at the end listing the failed jobs

In a multirun each job also writes status.json into its Hydra job dir (<sweep dir>/<job num>/), which the
SweepReport callback (configs/run.yaml: hydra.callbacks) reads when the sweep ends — on any launcher,
since the sweep dir is on the filesystem every job sees.
"""

from __future__ import annotations

import fcntl
import json
import logging
import traceback
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from del_bench import runner
from del_bench.errors import Busy
from del_bench.records import RunDir, add_experiment, write_json
from del_bench.selection import selection

log = logging.getLogger(__name__)
LOCK_NAME = ".lock"
ERROR_NAME = "error.json"
STATUS_NAME = "status.json"
FAILED: list[dict] = []  # the failed jobs of the last multirun in this process (set by SweepReport)


def completed_summary(cfg: DictConfig) -> dict | None:
    """The summary of a finished run of exactly these settings in cfg.out_dir, else None. Cheap: reads two
    small JSON files, loads neither model nor task."""
    run_dir = RunDir(cfg.out_dir)
    if not run_dir.summary_path.is_file():
        return None
    if not run_dir.matches(OmegaConf.to_container(cfg, resolve=True)):
        return None
    try:
        summary = json.loads(run_dir.summary_path.read_text())
    except ValueError:
        return None
    return summary if summary.get("selection") == selection(cfg) and summary.get("n_samples") else None


@contextmanager
def exclusive(out_dir: str | Path):
    """Hold out_dir's lock for the duration (non-blocking: Busy if another job has it)."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / LOCK_NAME, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"{path} is being written by another job") from None
        yield


def run_once(cfg: DictConfig, run: Callable | None = None, **kwargs) -> tuple[str, dict | None]:
    """(status, summary) with status skipped | busy | ok. A failure is written to out_dir/error.json and
    re-raised. `run` defaults to del_bench.runner.run (kwargs are passed on)."""
    if run is None:
        run = runner.run
    done = completed_summary(cfg)
    if done:
        log.info("skipped (finished): %s", cfg.out_dir)
        return _skipped(cfg, done)
    try:
        with exclusive(cfg.out_dir):
            done = completed_summary(cfg)  # finished by another job between the check and the lock
            if done:
                return _skipped(cfg, done)
            summary = run(cfg, **kwargs)
    except Busy as busy:
        log.warning("skipped (busy): %s", busy)
        return "busy", None
    except Exception as err:
        write_error(_out_dir(cfg), err, cfg)
        raise
    (Path(cfg.out_dir) / ERROR_NAME).unlink(missing_ok=True)  # the run is now complete: no stale error
    return "ok", summary


def _skipped(cfg: DictConfig, summary: dict) -> tuple[str, dict]:
    """A finished run this job would have made: the sweep asking for it is recorded as covering it too."""
    add_experiment(cfg.out_dir, cfg.get("experiment_name"))
    return "skipped", summary


def _out_dir(cfg: DictConfig) -> Path | None:
    try:
        return Path(cfg.out_dir)
    except Exception:  # noqa: BLE001 — an out_dir that does not resolve (the error may be that very thing)
        return _hydra_output_dir()


def _hydra_output_dir() -> Path | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 — not inside a Hydra job
        return None


def _config(cfg: DictConfig) -> Any:
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 — unresolvable: keep the interpolations as written
        return OmegaConf.to_container(cfg, resolve=False)


def _overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001
        return []


def write_error(directory: Path | None, err: BaseException, cfg: DictConfig) -> Path | None:
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ERROR_NAME
    write_json(path, {
        "error": str(err), "type": type(err).__name__,
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__)),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "overrides": _overrides(), "config": _config(cfg),
    })
    return path


def _is_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001
        return False


def job(cfg: DictConfig, body: Callable[[], tuple[str, Any]], where: Callable[[], Any]) -> tuple[str, Any]:
    """The body of one Hydra job. In a multirun a failure is logged and recorded (status failed) and the
    sweep goes on; in a single run it propagates. where(): the directory to name in the report."""
    multirun = _is_multirun()
    try:
        status, result = body()
    except Exception as err:
        if not multirun:
            raise
        log.error("job failed (%s): %s — see %s", type(err).__name__, err, _safe(where))
        _write_status(cfg, "failed", _safe(where), f"{type(err).__name__}: {err}")
        return "failed", None
    if multirun:
        _write_status(cfg, status, _safe(where), None)
    return status, result


def _safe(where: Callable[[], Any]) -> str | None:
    try:
        return str(where())
    except Exception:  # noqa: BLE001
        return None


def _write_status(cfg: DictConfig, status: str, directory: str | None, error: str | None) -> None:
    out = _hydra_output_dir()
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / STATUS_NAME, {"status": status, "dir": directory, "error": error, "overrides": _overrides()})


class SweepReport(Callback):
    """After a multirun: one line per failed or busy job; the CLI exits non-zero when any failed."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        FAILED.clear()
        for stale in Path(str(config.hydra.sweep.dir)).glob(f"*/{STATUS_NAME}"):
            stale.unlink(missing_ok=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        statuses = []
        for path in sorted(Path(str(config.hydra.sweep.dir)).glob(f"*/{STATUS_NAME}")):
            try:
                statuses.append({"job": path.parent.name, **json.loads(path.read_text())})
            except ValueError:
                continue
        counts = {s: sum(1 for x in statuses if x["status"] == s) for s in ("ok", "skipped", "busy", "failed")}
        print(f"sweep {config.hydra.sweep.dir}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        for s in statuses:
            if s["status"] in ("failed", "busy"):
                print(f"  {s['status']:<7} job {s['job']}: {' '.join(s['overrides'])}\n"
                      f"          {s['error'] or ''} ({s['dir']})")
        FAILED[:] = [s for s in statuses if s["status"] == "failed"]
