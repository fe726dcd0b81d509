"""LS grid search over (E, γ) on calibration samples (paper Appendix B.3), and the file other runs read.

`python -m del_bench calibrate model=M task=T [grid.exit_layers=[…]] [grid.gammas=[…]]` runs Vanilla and
LS(E, γ) for every pair of the grid on `calibration.samples` (10) samples with `max_new_tokens` (256). Each
grid point is an ordinary run with its own out_dir under `calibration.dir` (results/calibration/<model>/<task>/
<method tag>/…), so the report can read every point (Figure 1a/1b) and a re-run skips finished points. The
point with the highest mean tokens/s is written under the task's name into `calibration.file`
(results/calibration/<model>.yaml), together with the whole grid. `calibration.use=true` then makes LS, FS,
DV and DEL-γ take their E (and γ) from it (the `${calibrated:…}` resolver in their configs).

The file itself (read, lookup, write_entry) is del_bench/calibration_store.py, which the config resolver reads.

Calibration samples are kept apart from the evaluation: they are drawn (with their own RNG, seeded by `seed`)
from the records outside the evaluation selection (`limit=calibration.eval_limit`, `seed`; null = the task's
`n`, the paper's evaluation set). Where fewer than `calibration.samples` records are left — HumanEval and
AQuA-RAT, which the paper evaluates in full — they are drawn from the whole set, and the file says
`disjoint_from_eval: false` (del_bench/selection.py draws them).
"""

from __future__ import annotations

import copy
import functools
import logging

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from del_bench import calibration_store, session
from del_bench.averages import ratio
from del_bench.config import CONFIG_DIR, validate
from del_bench.errors import CalibrationError, ConfigError
from del_bench.jobs import run_once
from del_bench.records import run_key_of, vanilla_baseline
from del_bench.selection import calibration_samples

log = logging.getLogger(__name__)
CALIBRATE_ONLY_KEYS = ("grid", "grids")  # not part of a grid point's run config


# ---- the grid ---------------------------------------------------------------------------------------------
def grid_of(cfg: DictConfig) -> tuple[list[int], list[int]]:
    try:
        exits, gammas = list(cfg.grid.exit_layers), list(cfg.grid.gammas)
    except Exception as err:  # noqa: BLE001 — an unknown model has no default grid: say what to pass
        raise ConfigError(f"no calibration grid for model {cfg.model.name}: pass grid.exit_layers=[…] grid.gammas=[…] "
                          f"(or add it under `grids` in configs/command/calibrate.yaml) ({err})") from None
    if not exits or not gammas:
        raise ConfigError("grid.exit_layers and grid.gammas must both be non-empty lists")
    return exits, gammas


def point_configs(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """Vanilla, then the method (ls by default) at every (E, γ) of the grid: ordinary run configs."""
    if not {"exit_layer", "gamma"} <= set(cfg.method.keys()):
        raise ConfigError(f"calibrate searches (E, γ): method={cfg.method.name} has no exit_layer/gamma (use ls)")
    exits, gammas = grid_of(cfg)
    base = copy.deepcopy(cfg)
    with open_dict(base):
        for key in CALIBRATE_ONLY_KEYS:
            base.pop(key, None)
        base.calibration.use = False  # the grid's own points are never read from a calibration file
    vanilla = copy.deepcopy(base)
    with open_dict(vanilla):
        vanilla.method = OmegaConf.load(CONFIG_DIR / "method" / "vanilla.yaml")
    points = [("vanilla", vanilla)]
    for exit_layer in exits:
        for gamma in gammas:
            point = copy.deepcopy(base)
            point.method.exit_layer, point.method.gamma = int(exit_layer), int(gamma)
            points.append((f"E{exit_layer}-g{gamma}", point))
    return points


def calibrate(cfg: DictConfig) -> dict:
    """Run every grid point (skipping finished ones), then write the best (E, γ) for this model and task."""
    points = point_configs(cfg)
    for _, point in points:  # every point is checked before any weights load
        validate(point)
    # at most once, only if a point needs decoding
    load = functools.cache(session.loader(cfg))
    results, failed = {}, []
    for name, point in points:
        try:
            status, summary = run_once(point, load=load)
        except Exception as err:  # noqa: BLE001 — recorded in the point's error.json; the grid goes on
            log.error("calibration point %s failed: %s", name, err)
            failed.append(name)
            continue
        results[name] = summary if status != "busy" else None
    if failed or any(v is None for v in results.values()):
        busy = [k for k, v in results.items() if v is None]
        raise CalibrationError(f"{cfg.model.name}/{cfg.task.name}: grid points failed {failed} or busy in another "
                               f"job {busy}; nothing written (a re-run skips the finished points)")
    entry = best_entry(cfg, points, results)
    calibration_store.write_entry(cfg.calibration.file, cfg.task.name, entry)
    log.info("calibration %s/%s: best LS(E%s, γ%s) at %.2f tok/s → %s", cfg.model.name, cfg.task.name,
             entry["exit_layer"], entry["gamma"], entry["tokens_per_s"], cfg.calibration.file)
    return entry


def _disjoint(cfg: DictConfig) -> bool:
    task = instantiate(cfg.task)
    chosen = {s.id for s in calibration_samples(task, cfg.calibration.samples, cfg.seed, cfg.calibration.eval_limit)}
    return not chosen & {s.id for s in task.select(cfg.calibration.eval_limit, cfg.seed)}


def best_entry(cfg: DictConfig, points, results: dict) -> dict:
    """The best grid point by tokens/s, with the whole grid; a point's speedup is against the grid's Vanilla only
    where the two pair (records.vanilla_baseline: the report's rule), else None."""
    vanilla = results["vanilla"]
    vanillas = [(run_key_of(vanilla), vanilla)]
    grid = []
    for name, point in points[1:]:
        s = results[name]
        grid.append({"exit_layer": int(point.method.exit_layer), "gamma": int(point.method.gamma),
                     "tokens_per_s": s["tokens_per_s"], "etpl": s["etpl"], "acceptance_rate": s["acceptance_rate"],
                     "speedup": ratio(s["tokens_per_s"], vanilla_baseline(run_key_of(s), vanillas)),
                     "out_dir": str(point.out_dir)})
    best = max(grid, key=lambda p: p["tokens_per_s"] or 0.0)  # ties: the first in grid order
    exits, gammas = grid_of(cfg)
    prov = vanilla.get("provenance", {})
    return {
        "exit_layer": best["exit_layer"], "gamma": best["gamma"], "tokens_per_s": best["tokens_per_s"],
        "speedup": best["speedup"], "vanilla_tokens_per_s": vanilla["tokens_per_s"], "metric": "tokens_per_s",
        "method": cfg.method.name, "samples": int(cfg.calibration.samples), "eval_limit": cfg.calibration.eval_limit,
        "disjoint_from_eval": _disjoint(cfg), "max_new_tokens": int(cfg.max_new_tokens), "seed": int(cfg.seed),
        "decoding": vanilla["decoding"], "task_version": vanilla["task_version"],
        "grid": {"exit_layers": [int(e) for e in exits], "gammas": [int(g) for g in gammas]},
        "vanilla_out_dir": str(points[0][1].out_dir), "points": grid,
        "device": prov.get("device"), "git_commit": prov.get("git_commit"),
    }


