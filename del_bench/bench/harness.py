"""The one harness every bench runs on: rows are ordinary runs (records and all), composed offline, decoded
interleaved prompt by prompt, paired with Vanilla through the record contract, and printed from their records.

A bench is a list of `BenchRow`s (a label and a composed run config, optionally its own model loader). `run_rows`
grows every row's run one prompt at a time (each row decodes prompt i before any decodes prompt i + 1), so the
drift of a shared machine over the minutes of a bench hits every row alike; the runner warms each up untimed and
resumes what it already decoded. `table` turns the finished rows' summary.json into table rows — every number
there is recomputable from the run directory it names (`out_dir`) — with each row's speedup against the mean of
the Vanilla runs it pairs with (records.RunKey.pairs_with). `write_result` writes the bench's result JSON.

Micro-benchmarks that time a part of the engine directly (bench parts, compile, the bandwidth probe of bench
engine) use `timings`, and write the raw seconds they print a median of.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from del_bench.averages import ratio
from del_bench.config import CONFIG_DIR, check_overrides, ls_grid, ls_setting, resolve_aliases
from del_bench.models.layer_math import seconds_of
from del_bench.records import (
    DRIFT_LIMIT,
    STEADY_SLOWDOWN,
    drifted,
    machine_probe,
    read_jsonl,
    run_key_of,
    unsteady,
    vanilla_baseline,
    vanilla_partners,
)

log = logging.getLogger(__name__)
RESULTS = "results/runs/bench"  # where a bench writes by default (gitignored); make's RECORDS= moves it


def compose(*overrides: str) -> DictConfig:
    """A run config as `python -m del_bench run` composes it (aliases resolved, `task=cnndm` → cnndm_sum; unknown
    names refused with a suggestion), with the offline task data (the `data` group's `local`: ../shared/data, or
    DEL_BENCH_DATA) unless an override names another source."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    overrides = resolve_aliases(list(overrides))
    check_overrides(overrides)
    data = [] if any(o.startswith("data=") for o in overrides) else ["data=local"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="run", overrides=[*data, *overrides])


def grid_of(text: str | None, model: str, whole: bool = True) -> list[tuple[int, int]]:
    """'24:2,27:3' → [(24, 2), (27, 3)]: LS (E, γ) points; none given: the grid `calibrate` searches on the model
    (whole), or LS's own (E, γ) there (config.ls_setting: the model config's) — never a bench's constant."""
    if text:
        return [tuple(int(x) for x in pair.split(":")) for pair in text.split(",")]
    return ls_grid(model) if whole else [ls_setting(model)]


def ls_args(method: str, e: int, g: int) -> list[str]:
    """The overrides of an early-exit method (ls, fs) at (E, γ)."""
    return [f"method={method}", f"method.exit_layer={e}", f"method.gamma={g}"]


def model_config(name: str, *overrides: str) -> DictConfig:
    """configs/model/<name>.yaml with `key=value` overrides (a tiny-random model of another shape)."""
    return compose(f"model={name}", *(f"model.{o}" for o in overrides)).model


def shared_load(cfg: DictConfig) -> Callable:
    """A loader for `runner.run` that loads the run config's model (and layer loop) once for every row sharing it."""
    from del_bench.session import loader

    return functools.cache(loader(cfg))


def parser(name: str, doc: str, runs: bool = True, limit: int | None = None,
           max_new_tokens: int | None = None) -> argparse.ArgumentParser:
    """A bench's argument parser with the options every bench shares: --out (its result file) and, for a bench
    of runs, --root (their directories), --experiment (recorded in their run keys) and --set (overrides for every
    row, e.g. layers=eager threads=1); --limit (prompts per row) and --max-new-tokens where given a default."""
    ap = argparse.ArgumentParser(prog=f"python -m del_bench bench {name}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=f"{RESULTS}/{name}.json", help="the result file")
    if limit is not None:
        ap.add_argument("--limit", type=int, default=limit, help="prompts per row")
    if max_new_tokens is not None:
        ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    if runs:
        ap.add_argument("--root", default=f"{RESULTS}/{name}_runs", help="the rows' run directories")
        ap.add_argument("--experiment", default=f"bench-{name}", help="recorded in every row's run_key.experiments")
        ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides for every row's run (e.g. layers=eager threads=1)")
    return ap


def prompts_task(path: Path, rows: list[dict]) -> list[str]:
    """Overrides for a `prompts` task over `rows` ({"id", "prompt"}), written to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["task=prompts", f"task.data_files={path.resolve()}"]


def code_prompts(model: str, root: str, n: int = 16) -> list[str]:
    """Overrides for task `code` (a model trained by `train-layerskip`): held-out prompts of its training run."""
    from del_bench.models.loading import local_dir
    from del_bench.train.data import heldout_prompts

    train_cfg = OmegaConf.load(local_dir(model_config(model)) / "train_config.yaml")
    return prompts_task(Path(root) / "code_prompts.jsonl", heldout_prompts(OmegaConf.to_container(train_cfg), n))


def task_overrides(task: str, model: str, root: str) -> list[str]:
    """`task=<task>` (its data from the `data` group), or the held-out code prompts for task `code`."""
    return code_prompts(model, root) if task == "code" else [f"task={task}"]


@dataclass
class BenchRow:
    label: str
    cfg: DictConfig
    load: Callable | None = None  # (Loaded, LayerStack); None: the runner loads the model itself
    summary: dict = field(default_factory=dict)
    may_fail: bool = False  # a row that may be refused (bench gpu's graph-captured rows: compile=on where it cannot)
    failure: str | None = None  # why it stopped ("ExceptionType: message"); the other rows go on without it


def row(label: str, root: str, experiment: str, *overrides: str, load=None, suffix: str = "",
        method: dict | None = None, may_fail: bool = False) -> BenchRow:
    """A row: the run `overrides` compose, in <root>/<method tag><suffix> (a re-run resumes it), recording
    `experiment` in its run key (so a bench's runs reach no paper table); `method`: a method config composed in
    code instead of the method group's (a peer: peers.peer_method); `may_fail`: an error in its run ends the row,
    not the bench (BenchRow.failure says why)."""
    cfg = compose(*overrides)
    if method is not None:
        cfg.method = method
    cfg.out_dir = f"{root}/{cfg.method.tag}{suffix}"
    cfg.experiment_name = experiment
    return BenchRow(label, cfg, load, may_fail=may_fail)


def run_rows(rows: list[BenchRow], limit: int, before_prompt: Callable | None = None, step: int = 1) -> list[BenchRow]:
    """Every row's run grown one prompt at a time across all rows (`limit` is resumable: a run with limit i + 1
    decodes only what limit i did not); `before_prompt()` runs before each prompt's rows. Fills each row's
    summary (summary.json of its finished run). step: prompts a row decodes at a time (a batched row: its batch's
    worth, so its slots fill), every row taking the same prompts before any takes the next. A row that may fail and
    does is left with its `failure` (its summary emptied: `finished` leaves it out of tables) and skipped from then
    on; any other error ends the bench."""
    from del_bench.runner import run

    for i in range(step, limit + step, step):
        if before_prompt is not None:
            before_prompt()
        for r in rows:
            if r.failure:
                continue
            r.cfg.limit = min(i, limit)
            try:
                r.summary = run(r.cfg, r.load)
            except Exception as err:
                if not r.may_fail:
                    raise
                r.failure, r.summary = f"{type(err).__name__}: {err}", {}
                log.warning("row %s stopped at prompt %d: %s", r.label, i, r.failure)
    return rows


def finished(rows: list[BenchRow]) -> list[BenchRow]:
    """The rows that ran to the end (no failure): what `table` takes."""
    return [r for r in rows if not r.failure]


def table(rows: list[BenchRow]) -> list[dict]:
    """One table row per finished BenchRow, from its summary.json alone: tok/s and eTPL are means over prompts (paper
    B.4); pooled = all tokens ÷ all seconds (or loaded layers), every token weighed alike; pred. = eTPL × L (Vanilla
    loads L layers a token); speedups against the mean of the paired Vanilla rows."""
    out = []
    for r in rows:
        s = r.summary
        L = r.cfg.model.num_layers
        pooled_etpl = ratio(s["generated_tokens"], s["loaded_layers"])
        out.append({"row": r.label, "method": s["method"], "method_tag": s["method_tag"], "model": s["model"],
                    "task": s["task"], "n": s["n_samples"], "tokens_per_s": s["tokens_per_s"], "etpl": s["etpl"],
                    "predicted_speedup": s["etpl"] * L if s["etpl"] is not None else None,
                    "pooled_tokens_per_s": ratio(s["generated_tokens"], s["wall_s"]), "pooled_etpl": pooled_etpl,
                    "pooled_predicted_speedup": pooled_etpl * L if pooled_etpl is not None else None,
                    "acceptance": s["acceptance_rate"], "controller_share": s["time_split"]["policy"],
                    "busy_samples": (s.get("load") or {}).get("overloaded", 0),
                    "unsteady": unsteady(s.get("steady_state")), "first_slowdown": first_slowdown(s),
                    "lead_slowdown": (s.get("steady_state") or {}).get("lead_slowdown"),
                    "out_dir": r.cfg.out_dir})
    keys = [run_key_of(r.summary) for r in rows]
    runs = list(zip(keys, out))
    probes = {id(t): machine_probe(r.summary.get("setup") or []) for r, t in zip(rows, out)}
    for key, t in runs:
        for name, of in (("speedup", "tokens_per_s"), ("pooled_speedup", "pooled_tokens_per_s")):
            t[name] = ratio(t[of], vanilla_baseline(key, runs, of))
        t["drifted"] = drifted(probes[id(t)], [probes[id(p)] for p in vanilla_partners(key, runs)])
        t["measured_over_predicted"] = ratio(t["speedup"], t["predicted_speedup"])
        t["pooled_measured_over_predicted"] = ratio(t["pooled_speedup"], t["pooled_predicted_speedup"])
    return out


def per_prompt_speed(out_dir: str) -> dict:
    """A run's tok/s prompt by prompt in the order they were decoded (samples.jsonl) and its first timed prompt
    against the rest: `first`, `rest_median` (the median of the others) and `first_over_rest` (None with one
    prompt). Far below 1, it says the untimed warm-up left decoding short of steady state."""
    speeds = [s["tokens_per_s"] for s in read_jsonl(Path(out_dir) / "samples.jsonl")]
    rest = statistics.median(speeds[1:]) if len(speeds) > 1 else None
    return {"per_prompt": speeds, "first": speeds[0] if speeds else None, "rest_median": rest,
            "first_over_rest": ratio(speeds[0], rest) if speeds else None}


def lossless_vs(out_dir: str, reference_dir: str, reference: str = "Vanilla") -> dict:
    """A run's greedy outputs against a reference run's for the same samples, by the half-precision rule
    (numerics.compare, judged by the reference's recorded top2_gap_ulps; DESIGN §2): outputs_equal of
    outputs_compared, and the first-departure positions of the others, near_tie_at (allowed) and departs_at (real
    departures; in full precision, where no gaps are recorded, every departure is one); `note`, the report's words
    for it (tables.lossless_note, naming `reference`); `cell`, the table's: 'k/n' or 'k/n (j near-tie, r real)'."""
    from del_bench.numerics import compare
    from del_bench.report.tables import lossless_note

    def by_key(path):
        return {(s["sample_id"], s["repeat"]): s for s in read_jsonl(Path(path) / "samples.jsonl")}

    ours, ref = by_key(out_dir), by_key(reference_dir)
    judged = [compare(s["output_ids"], ref[k]["output_ids"], ref[k].get("top2_gap_ulps"))
              for k, s in ours.items() if k in ref]
    result = {"outputs_equal": sum(d.kind == "equal" for d in judged), "outputs_compared": len(judged),
              "near_tie_at": sorted(d.position for d in judged if d.kind == "near_tie"),
              "departs_at": sorted(d.position for d in judged if not d.lossless)}
    extra = [f"{len(result[k])} {word}" for k, word in (("near_tie_at", "near-tie"), ("departs_at", "real"))
             if result[k]]
    result["cell"] = f"{result['outputs_equal']}/{result['outputs_compared']}" + (f" ({', '.join(extra)})"
                                                                                   if extra else "")
    result["note"] = lossless_note([result], reference).strip(" ()")
    return result


def first_slowdown(summary: dict) -> float | None:
    """The run's first timed sample's decode seconds per loaded layer ÷ the others' median (records.steady_state)."""
    return (summary.get("steady_state") or {}).get("first_slowdown")


def outputs_equal(out_dir: str, reference_dir: str) -> tuple[int, int]:
    """(outputs equal to the reference run's for the same sample, outputs compared), from samples.jsonl."""
    reference = {(s["sample_id"], s["repeat"]): s["output_ids"] for s in read_jsonl(Path(reference_dir) /
                                                                                      "samples.jsonl")}
    mine = [s for s in read_jsonl(Path(out_dir) / "samples.jsonl") if (s["sample_id"], s["repeat"]) in reference]
    return sum(s["output_ids"] == reference[s["sample_id"], s["repeat"]] for s in mine), len(mine)


# ---------------------------------------------------------------- printing and writing

def fmt(value, spec: str) -> str:
    """A table cell: '-' for a missing value; spec 'x' = a ratio (2 decimals + 'x'), '%' = a share."""
    if value is None:
        return "-"
    if spec == "x":
        return f"{value:.2f}x"
    if spec == "%":
        return f"{value:.1%}"
    return format(value, spec)


# (header, key, spec, width): the columns most benches print
COLUMNS = {
    "row": ("row", "row", "", 26), "model": ("model", "model", "", 13), "task": ("task", "task", "", 11),
    "tok/s": ("tok/s", "tokens_per_s", ".2f", 7), "speedup": ("speedup", "speedup", "x", 8),
    "eTPL": ("eTPL", "etpl", ".3f", 6), "pred.": ("pred.", "predicted_speedup", "x", 6),
    "meas/pred": ("meas/pred", "measured_over_predicted", ".2f", 9),
    "pooled": ("pooled", "pooled_speedup", "x", 7), "p.pred": ("p.pred", "pooled_predicted_speedup", "x", 6),
    "p.m/p": ("p.m/p", "pooled_measured_over_predicted", ".2f", 6), "α": ("α", "acceptance", ".2f", 5),
    "ctrl": ("ctrl", "controller_share", "%", 6),
}


def print_table(rows: list[dict], columns: list, title: str = "") -> None:
    """rows under `columns` (names of COLUMNS, or (header, key, spec, width) tuples); text left, numbers right; a row
    timed on a busy machine (records.overloaded around some sample) marked * with a note, one not timed at steady
    state (records.steady_state) ~ with a note, one whose speedup pairs two machine states (records.drifted) § with a
    note."""
    rows = [{**r, "row": f"{r['row']} {marks}"} if (marks := _marks(r)) and "row" in r else r for r in rows]
    cols = [COLUMNS[c] if isinstance(c, str) else c for c in columns]
    cols = [(hd, k, spec, w if spec else max([w, *(len(str(r.get(k, ""))) for r in rows)])) for hd, k, spec, w in cols]
    if title:
        print(f"\n{title}\n")
    print(" ".join(f"{h:<{w}}" if not spec else f"{h:>{w}}" for h, _, spec, w in cols))
    for r in rows:
        print(" ".join(f"{str(r.get(k, '')):<{w}}" if not spec else f"{fmt(r.get(k), spec):>{w}}"
                       for _, k, spec, w in cols))
    if any(r.get("busy_samples") for r in rows):
        print("* timed on a busy machine: other processes kept more CPUs busy than torch's threads left free around "
              "some of its samples (records.overloaded); its speed and speedups are not to be trusted")
    if any(r.get("unsteady") for r in rows):
        print("~ not timed at steady state: its warm-up did not converge, or one of its first two timed samples took "
              f"more than {STEADY_SLOWDOWN:g}× the median decode time per loaded layer of the samples after it "
              "(records.steady_state; the result file's first_slowdown and lead_slowdown); its speed and speedups are "
              "not to be trusted (rerun with --set warmup=steady)")
    if any(r.get("drifted") for r in rows):
        print(f"§ its speedup pairs two states of the machine: the matrix products' probe (records.machine_probe) took "
              f"more than {DRIFT_LIMIT:g}× as long in it as in its Vanilla partners; re-measure them together")


def _marks(row: dict) -> str:
    return "*" * bool(row.get("busy_samples")) + "~" * bool(row.get("unsteady")) + "§" * bool(row.get("drifted"))


def write_result(path: str | Path, bench: str, settings: dict, **payload) -> Path:
    """The bench's result file: its settings, what it printed (rows name their run directories) and provenance."""
    from del_bench.runner import provenance

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bench": bench, "settings": settings, **payload, "provenance": provenance()},
                               indent=2) + "\n")
    print(f"written: {path}")
    return path


def timings(fn: Callable, reps: int = 20, warmup: int = 3) -> list[float]:
    """Wall seconds of `reps` calls of fn() after `warmup` untimed ones (a micro-benchmark's raw timings), the
    accelerator synchronised around each: a bench times the work, not its launch."""
    return seconds_of(fn, reps, warmup, _synchronize_accelerator)


def _synchronize_accelerator() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # every GPU (a device_map spreads a model)
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)


def median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)
