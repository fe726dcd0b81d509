"""Record in finished runs which experiment sweeps cover them (run_key.experiments), decoding nothing.

A run records the sweep that asked for it when it is made, and a later sweep that finds it finished adds its own
name (del_bench.jobs.run_once). This script does the same for records made before run_key existed, or for runs
made outside a sweep: it expands each experiment's sweep (hydra.sweeper.params), composes every job as
`run -m experiment=NAME scale=SCALE` would, and tags the job's out_dir with the name such a run records (table1,
or table1_local at scale=local) when it holds a finished run of the same sample selection. Jobs that cannot be
composed here (e.g. calibration.use=true without its calibration file) are counted and skipped.

`--prune`: when an experiment's config has moved on (e.g. Table 1 at scale=local from 2 prompts × 48 tokens to 4 ×
128), the runs of its old settings still carry its name and the tables would show them beside the new ones; --prune
also takes the name off every run under the records root whose sample selection and max_new_tokens no job of the
sweep has any more (other models' runs and peer rows of the same settings keep it). The runs stay, as data.

    python scripts/tag_experiments.py table1 table3 … [--scale local] [--records-root results/reference] [--prune]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from del_bench.config import CONFIG_DIR
from del_bench.records import add_experiment, drop_experiment
from del_bench.selection import selection


def sweep_jobs(experiment: list[str]) -> list[list[str]]:
    """The override lists of every job of the sweep `experiment` (its overrides: experiment=NAME scale=SCALE) asks
    for, a cartesian product as Hydra's basic sweeper expands it (the axes resolved: a scale changes them)."""
    hydra_cfg = compose(config_name="run", overrides=experiment, return_hydra_config=True).hydra
    params = OmegaConf.to_container(hydra_cfg.sweeper.params, resolve=True) if hydra_cfg.sweeper.params else {}
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
            else [f"{o.get_key_element()}={o.get_value_element_as_str()}"] for o in parsed]
    return [list(job) for job in itertools.product(*axes)]


def tag(name: str, scale: str, records_root: str, prune: bool = False) -> tuple[int, int, int, int]:
    """→ (jobs, tagged, not composable, pruned: runs of settings the sweep no longer has, its name taken off them)."""
    tagged = failed = 0
    settings, recorded = set(), None
    experiment = [f"experiment={name}", f"scale={scale}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        jobs = sweep_jobs(experiment)
        for job in jobs:
            try:
                cfg = compose(config_name="run", overrides=[*experiment, f"records_root={records_root}", *job])
                out_dir, wanted, recorded = Path(cfg.out_dir), selection(cfg), cfg.experiment_name
                settings.add(setting(wanted, cfg.max_new_tokens))
            except Exception:  # noqa: BLE001 — a job this checkout cannot compose is reported, not fatal
                failed += 1
                continue
            summary = out_dir / "summary.json"
            if summary.is_file() and json.loads(summary.read_text()).get("selection") == wanted:
                add_experiment(out_dir, recorded)
                tagged += 1
    pruned = prune_runs(Path(records_root), recorded, settings) if prune and recorded and not failed else 0
    return len(jobs), tagged, failed, pruned


def setting(wanted: dict, max_new_tokens) -> str:
    """A run's settings as a sweep fixes them: its sample selection and max_new_tokens."""
    return json.dumps({**wanted, "max_new_tokens": int(max_new_tokens)}, sort_keys=True)


def prune_runs(records_root: Path, name: str, settings: set[str]) -> int:
    """Take `name` off every run under records_root whose settings are none of `settings`: → how many."""
    pruned = 0
    for path in sorted(records_root.rglob("summary.json")):
        summary = json.loads(path.read_text())
        tokens = (summary.get("run_key") or {}).get("max_new_tokens")
        if setting(summary.get("selection") or {}, tokens or 0) not in settings:
            pruned += drop_experiment(path.parent, name)
    return pruned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiments", nargs="+")
    ap.add_argument("--scale", default="paper", help="paper | local (configs/scale/)")
    ap.add_argument("--records-root", default="results/runs")
    ap.add_argument("--prune", action="store_true",
                    help="also take the name off runs the sweep no longer covers (not when a job cannot be composed)")
    args = ap.parse_args()
    for name in args.experiments:
        jobs, tagged, failed, pruned = tag(name, args.scale, args.records_root, args.prune)
        scale = "" if args.scale == "paper" else f" (scale={args.scale})"
        print(f"{name}{scale}: {jobs} jobs, {tagged} finished runs tagged, {failed} not composable here"
              + (f", {pruned} runs it no longer covers untagged" if args.prune else ""))


if __name__ == "__main__":
    main()
