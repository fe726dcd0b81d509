"""Which samples a run decodes: the evaluation selection (`limit`, `seed`) or, for the grid points of
`python -m del_bench calibrate` (sample_set=calibration), calibration samples kept apart from it.

`selection(cfg)` is what summary.json records under "selection": a finished summary with the same selection
means the job is done (del_bench/jobs.py).
"""

from __future__ import annotations

import logging
import random

from omegaconf import DictConfig

log = logging.getLogger(__name__)


def selection(cfg: DictConfig) -> dict:
    """Which samples the run decodes; a finished summary with the same selection means the job is done."""
    if cfg.get("sample_set", "eval") == "calibration":  # `calibrate`: samples kept apart from the evaluation
        return {"sample_set": "calibration", "count": cfg.calibration.samples,
                "eval_limit": cfg.calibration.eval_limit, "seed": cfg.seed}
    return {"sample_set": "eval", "limit": cfg.limit, "seed": cfg.seed}


def select_samples(task, cfg: DictConfig) -> list:
    if cfg.get("sample_set", "eval") == "calibration":
        return calibration_samples(task, cfg.calibration.samples, cfg.seed, cfg.calibration.eval_limit)
    return task.select(cfg.limit, cfg.seed)


def calibration_samples(task, count: int, seed: int, eval_limit: int | None, avoid: frozenset = frozenset()) -> list:
    """`count` samples outside the evaluation selection when the task has enough records, else from all — then, if
    that draw meets `avoid` (a run's own prompts) and the rest of the records suffice, from the records outside
    `avoid` (a draw that does not meet them stays as it was)."""
    pool = task.load()
    evaluation = {s.id for s in task.select(eval_limit, seed)}
    rest = [s for s in pool if s.id not in evaluation]
    source = rest if len(rest) >= count else pool
    if source is pool:
        log.warning("task %s: only %d records outside the evaluation set; calibration samples overlap it",
                    task.name, len(rest))
    chosen = _draw(source, count, seed)
    apart = [s for s in source if s.id not in avoid]
    if any(s.id in avoid for s in chosen) and len(apart) >= count:
        chosen = _draw(apart, count, seed)
    return chosen


def _draw(source: list, count: int, seed: int) -> list:
    rng = random.Random(f"calibration:{seed}")  # its own stream: not the evaluation's draw
    keep = sorted(rng.sample(range(len(source)), min(count, len(source))))
    return [source[i] for i in keep]
