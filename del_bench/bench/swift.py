"""SWIFT (searching, then its found set fixed) beside Vanilla, LS best and DEL (del_cpu), on SmolLM2 and the testbed.

Per model × task, two phases of rows interleaved prompt by prompt:
  1. Vanilla, LS over --grid, DEL (del_cpu), SWIFT searching its set on the fly (the optimiser's passes included);
  2. Vanilla again, SWIFT with the set phase 1 found fixed (`method.skip_set=<its run dir>`: the acceleration phase
     alone, as with the authors' cached sets — found on these same prompts' first tokens), as a chain and with the
     dynamic token tree (`method.tree=true`).
SWIFT's search state (scope: run) is saved with its run after every prompt (method_state.json) and restored by the
next invocation, so the interleaved search row is one search over the prompts, as the authors' code runs it.

Columns beyond bench del's: M = tokens per target forward (rounds, prefill included: the paper's mean generated
length); opt lay. / opt time = the optimiser's share of loaded layers / of wall time (all from rounds.jsonl).
"""

from __future__ import annotations

from pathlib import Path

from del_bench.bench import harness as h
from del_bench.records import RunDir, read_jsonl

TASKS = {"smollm2-135m": "humaneval,cnndm_lm", "testbed": "humaneval,code"}
COLUMNS = ["model", "task", "row", "tok/s", "speedup", "eTPL", "pred.", "meas/pred", "α",
           ("M", "mean_generated_length", ".2f", 5), ("opt lay.", "opt_layer_share", "%", 8),
           ("opt time", "opt_time_share", "%", 8)]


def parse(argv):
    ap = h.parser("swift", __doc__, limit=4, max_new_tokens=96)
    ap.add_argument("--models", default="smollm2-135m:0.2,testbed:0.45", help="model:skip_ratio pairs")
    ap.add_argument("--tasks", default=None, help="tasks for every model (default: per model, see TASKS)")
    ap.add_argument("--grid", default=None, help="LS (E:γ) pairs for every model (default: the model's own)")
    ap.add_argument("--swift-overrides", nargs="*", default=[], help="extra overrides for the SWIFT rows")
    return ap.parse_args(argv)


def swift_columns(row: dict) -> dict:
    """M, the optimiser's share of loaded layers and of wall time, and the set the run ended with."""
    rounds = RunDir(row["out_dir"]).rounds()
    samples = read_jsonl(Path(row["out_dir"]) / "samples.jsonl")
    layers = sum(r["loaded_layers"] for r in rounds)
    row["mean_generated_length"] = sum(s["generated_tokens"] for s in samples) / len(rounds)
    row["opt_layer_share"] = sum(r.get("opt_loaded_layers") or 0 for r in rounds) / layers
    row["opt_time_share"] = sum(r.get("opt_s") or 0 for r in rounds) / sum(s["wall_s"] for s in samples)
    sets = [r["skip_set"] for r in rounds if r.get("skip_set")]
    row["skip_set"] = sets[-1] if sets else None
    return row


def bench_task(args, model: str, ratio: str, task: str, load) -> list[dict]:
    root = f"{args.root}/{model}/{task}"
    base = [f"model={model}", *h.task_overrides(task, model, args.root), f"max_new_tokens={args.max_new_tokens}",
            *args.set]

    def row(label, *overrides, suffix=""):
        return h.row(label, root, args.experiment, *base, *overrides, load=load, suffix=suffix)

    grid = h.grid_of(args.grid, model, whole=False)
    swift = ["method=swift", f"method.skip_ratio={ratio}", *args.swift_overrides]
    ls = [row(f"LS(E{e}-γ{g})", *h.ls_args("ls", e, g)) for e, g in grid]
    first = h.run_rows([row("Vanilla", "method=vanilla"), *ls, row("DEL (del_cpu)", "method=del_cpu"),
                        row(f"SWIFT r{ratio} (search)", *swift)], args.limit)
    max(ls, key=lambda r: r.summary["tokens_per_s"]).label += " best"
    found = [*swift, f"method.skip_set={first[-1].cfg.out_dir}"]
    second = h.run_rows([row("Vanilla (phase 2)", "method=vanilla", suffix="-phase2"),
                         row(f"SWIFT r{ratio} (found set)", *found, f"method.tag=swift-r{ratio}-found"),
                         row(f"SWIFT r{ratio} (found, tree)", *found, "method.tree=true",
                             f"method.tag=swift-r{ratio}-found-tree")], args.limit)
    return [swift_columns(r) for r in h.table(first + second)]


def main(argv: list[str]) -> int:
    args = parse(argv)
    rows = []
    for pair in args.models.split(","):
        model, ratio = pair.split(":")
        load = h.shared_load(h.compose(f"model={model}", *args.set))  # each model loads once for all its rows
        for task in (args.tasks or TASKS.get(model, "humaneval")).split(","):
            rows += bench_task(args, model, ratio, task, load)
    h.print_table(rows, COLUMNS, f"{args.limit} prompts/task, {args.max_new_tokens} new tokens, greedy")
    for r in rows:
        if r["skip_set"]:
            print(f"{r['model']} {r['task']} {r['row']}: set {r['skip_set']}")
    h.write_result(args.out, "swift", vars(args), rows=rows)
    return 0
