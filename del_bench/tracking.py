"""Mirror a finished run's records, and the report built from records, to Weights & Biases (logger=wandb). The
records stay the source of truth: tracking never blocks or fails a run or a report — any error becomes a warning,
and the whole mirror (init, logging, finish) runs in a worker thread waited for at most `logger.timeout` seconds.

What a W&B run holds: the resolved config, the summary's scalars (speed, eTPL, α, quality/*, time_split/*,
memory), the per-round traces and the per-sample numbers as tables, summary.json and run_config.json as files,
and any *.png in out_dir (plus `logger.figures` globs, e.g. the report's figures). Runs are grouped by
experiment (group = the experiment's name when one is chosen), job_type = the method tag, and named
model/task/method-tag/decoding.

The report (`python -m del_bench report [DIRS…] logger=wandb`, mirror_report) is one W&B run, job_type `report`:
Tables 1–6 (and Spec-Bench's, where there are runs) as W&B tables, cell for cell as the .md files print them, their
titles and notes in the run's summary (titles/table1, notes/table1), and every figure (the heatmaps of Figures
1a/1b included) as an image. Its group: `logger.group`, else the experiment all its runs share (table1_local: where
the runs' own mirrors are), else `report`.

Mode: online | offline | disabled | auto (online when an API key is available — WANDB_API_KEY or a
`wandb login` netrc entry — else offline). Online without a key, or an online init that fails (no network),
falls back to offline: the local run directory can be uploaded later with `wandb sync`.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from dataclasses import fields
from pathlib import Path

from del_bench.engine.rounds import Round
from del_bench.records import SampleRecord

log = logging.getLogger(__name__)

# the W&B tables' columns come from the record contract: every Round field (a method's trace fields are columns of
# their own; DEL's scalar ones are mirrored) and every numeric SampleRecord field
DEL_TRACE = ("tau", "alpha_exit", "chosen_exit_layer", "gamma_tpl")
ROUND_COLUMNS = ("sample_id", "repeat", *(f.name for f in fields(Round) if f.name != "trace"), *DEL_TRACE)
SAMPLE_COLUMNS = ("sample_id", *(f.name for f in fields(SampleRecord)
                                 if f.type.split(" |")[0] in ("int", "float") and f.name != "sample_id"))
RECORD_FILES = ("summary.json", "run_config.json")


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def resolve_mode(mode: str | None) -> str:
    mode = (mode or "auto").lower()
    if mode == "auto":
        return "online" if has_api_key() else "offline"
    if mode == "online" and not has_api_key():
        return "offline"  # no key: keep a local run directory instead of prompting or failing
    return mode



def logger_settings(overrides: list[str]) -> dict | None:
    """The logger a command line names, as `run` takes it (`logger=wandb logger.mode=offline logger.group=G …`):
    configs/logger/<name>.yaml with the overrides applied and resolved; None for none (or no logger= at all)."""
    from omegaconf import OmegaConf

    from del_bench.config import load_choice

    names = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == "logger"]
    if not names or names[-1] == "none":
        return None
    keys = [o.removeprefix("logger.") for o in overrides if o.startswith("logger.")]
    cfg = OmegaConf.merge(load_choice("logger", names[-1]), OmegaConf.from_dotlist(keys))
    return OmegaConf.to_container(cfg, resolve=True)


def _settings(logger_cfg, group: str | None) -> dict | None:
    """The logger's settings as a dict, its group defaulting to `group`; None when nothing is to be logged."""
    if logger_cfg is None or logger_cfg.get("name", "none") == "none":
        return None
    from omegaconf import DictConfig, OmegaConf

    if isinstance(logger_cfg, DictConfig):
        logger_cfg = OmegaConf.to_container(logger_cfg, resolve=True)
    return {**logger_cfg, "group": logger_cfg.get("group") or group}


def _in_worker(settings: dict, work, what: str) -> None:
    """Run work(timeout) in a daemon thread, waiting at most logger.timeout seconds; failures become warnings."""
    timeout = float(settings.get("timeout") or 60)
    errors: list[BaseException] = []

    def guarded():
        try:
            work(timeout)
        except BaseException as err:  # noqa: BLE001 — a tracker must never cost a run its records
            errors.append(err)

    worker = threading.Thread(target=guarded, name="wandb-mirror", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        log.warning("W&B mirror still busy after %.0f s; left behind (%s)", timeout, what)
    elif errors:
        log.warning("W&B mirror skipped: %s", errors[0])


def mirror(logger_cfg, summary: dict, rounds: list[dict], out_dir: str, samples: list[dict] | None = None) -> None:
    # group = the experiment whose sweep made the run (its config's experiment_name; null for an ad hoc run)
    settings = _settings(logger_cfg, (summary.get("config") or {}).get("experiment_name"))
    if settings is None:
        return
    _in_worker(settings, lambda timeout: _mirror(settings, summary, rounds, samples or [], out_dir, timeout),
               f"the records are in {out_dir}")


def mirror_report(logger_cfg, tables: list[dict], figures: list[str | Path], out_dir: str | Path,
                  group: str | None = None, config: dict | None = None) -> None:
    """One W&B run holding a report: `tables` as W&B tables (each {"name", "title", "columns", "rows", "notes"},
    rows of strings as the .md prints them), `figures` (PNG paths) as images, `config` (roots, runs) as its config.
    Its local files go to logger.dir, else out_dir."""
    settings = _settings(logger_cfg, group or "report")
    if settings is None:
        return
    _in_worker(settings, lambda timeout: _mirror_report(settings, tables, figures, str(out_dir), config or {}, timeout),
               f"the report is in {out_dir}")


def _init(wandb, settings: dict, summary: dict, out_dir: str, timeout: float):
    identity = dict(job_type=settings.get("job_type") or summary["method_tag"],
                    tags=[*(settings.get("tags") or []), summary["model"], summary["task"], summary["method"]],
                    name=f"{summary['model']}/{summary['task']}/{summary['method_tag']}/{summary['decoding']}",
                    config=summary["config"])
    return _start(wandb, settings, identity, out_dir, timeout)


def _start(wandb, settings: dict, identity: dict, out_dir: str, timeout: float):
    """wandb.init in the logger's mode (online without a key, or failing to connect: offline) with `identity`
    (job_type, tags, name, config), grouped by settings["group"]."""
    mode = resolve_mode(settings.get("mode"))
    if mode not in ("online", "offline", "disabled"):
        raise ValueError(f"logger.mode={settings.get('mode')!r}: use online, offline, disabled or auto")
    kwargs = dict(
        project=settings.get("project"), entity=settings.get("entity"), group=settings.get("group"), **identity,
        dir=settings.get("dir") or out_dir, reinit="finish_previous",
        settings=wandb.Settings(init_timeout=max(1.0, timeout / 2)),
    )
    try:
        return wandb.init(mode=mode, **kwargs)
    except Exception as err:  # noqa: BLE001 — no network: keep the mirror locally
        if mode != "online":
            raise
        log.warning("W&B online init failed (%s); writing an offline run instead (`wandb sync` it later)", err)
        return wandb.init(mode="offline", **kwargs)


def _mirror(settings: dict, summary: dict, rounds: list[dict], samples: list[dict], out_dir: str,
            timeout: float) -> None:
    import wandb

    Path(settings.get("dir") or out_dir).mkdir(parents=True, exist_ok=True)
    run = _init(wandb, settings, summary, out_dir, timeout)
    try:
        run.summary.update(_scalars(summary))
        run.log({"rounds": _table(wandb, ROUND_COLUMNS, rounds), "samples": _table(wandb, SAMPLE_COLUMNS, samples)})
        for name in RECORD_FILES:
            if (Path(out_dir) / name).is_file():
                run.save(str(Path(out_dir) / name), base_path=out_dir, policy="now")
        images = _figures(out_dir, settings.get("figures") or [])
        if images:
            run.log({f"figures/{Path(p).stem}": wandb.Image(p) for p in images})
    finally:
        run.finish()


def _mirror_report(settings: dict, tables: list[dict], figures: list[str | Path], out_dir: str, config: dict,
                   timeout: float) -> None:
    import wandb

    Path(settings.get("dir") or out_dir).mkdir(parents=True, exist_ok=True)
    identity = dict(job_type=settings.get("job_type") or "report", tags=[*(settings.get("tags") or []), "report"],
                    name=f"report/{settings['group']}", config=config)
    run = _start(wandb, settings, identity, out_dir, timeout)
    try:
        # one step: the tables, then every figure (W&B keys: tables/table1, figures/fig1a_…)
        logged = {f"tables/{t['name']}": wandb.Table(columns=t["columns"], data=t["rows"]) for t in tables}
        logged.update({f"figures/{Path(p).stem}": wandb.Image(str(p)) for p in figures})
        run.log(logged)
        run.summary.update({f"titles/{t['name']}": t["title"] for t in tables})
        run.summary.update({f"notes/{t['name']}": "\n".join(t["notes"]) for t in tables})
    finally:
        run.finish()


def _scalars(summary: dict) -> dict:
    scalars = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    scalars.update({f"quality/{k}": v for k, v in (summary.get("quality") or {}).items()})
    scalars.update({f"time_split/{k}": v for k, v in (summary.get("time_split") or {}).items() if v is not None})
    return scalars


def _table(wandb, wanted: tuple[str, ...], rows: list[dict]):
    columns = [c for c in wanted if any(c in r for r in rows)] or ["sample_id"]
    return wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])


def _figures(out_dir: str, patterns: list[str]) -> list[str]:
    found = sorted(glob.glob(str(Path(out_dir) / "*.png")))
    for pattern in patterns:
        found += sorted(glob.glob(pattern))
    return found
