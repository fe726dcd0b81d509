"""Mirror a finished run's records to Weights & Biases (logger=wandb). The records in out_dir stay the
source of truth: tracking never blocks or fails a run — any error becomes a warning."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ROUND_COLUMNS = ("sample_id", "repeat", "round", "exit_layer", "budget", "drafted", "accepted", "emitted",
                 "loaded_layers", "head_calls", "draft_s", "verify_s", "policy_s", "tau", "alpha_exit")


def mirror(logger_cfg, summary: dict, rounds: list[dict], out_dir: str) -> None:
    if logger_cfg is None or logger_cfg.get("name", "none") == "none":
        return
    try:
        import wandb

        mode = logger_cfg.get("mode") or "offline"
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            mode = "offline"  # no key: keep a local run directory instead of prompting or failing
        run = wandb.init(
            project=logger_cfg.get("project"), entity=logger_cfg.get("entity"), group=logger_cfg.get("group"),
            tags=list(logger_cfg.get("tags") or []),
            name=f"{summary['model']}/{summary['task']}/{summary['method_tag']}",
            config=summary["config"], dir=out_dir, mode=mode, reinit="finish_previous",
        )
        scalars = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        scalars.update({f"quality/{k}": v for k, v in summary.get("quality", {}).items()})
        scalars.update({f"time_split/{k}": v for k, v in summary.get("time_split", {}).items() if v is not None})
        run.summary.update(scalars)
        columns = [c for c in ROUND_COLUMNS if any(c in r for r in rounds)]
        run.log({"rounds": wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rounds])})
        run.finish()
    except Exception as err:  # noqa: BLE001 — a tracker must never cost a run its records
        log.warning("W&B mirror skipped: %s", err)
