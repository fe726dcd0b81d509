"""SWIFT beside Vanilla, LS (best of a small grid) and DEL (del_cpu), through the normal run machinery.

Per model × task, two phases of interleaved rows (each row decodes prompt i before any decodes prompt i + 1, so
drift of a shared machine hits every row alike; bench_del.run_interleaved):
  1. Vanilla, LS over --grid, DEL (del_cpu), SWIFT searching its set on the fly (the optimiser's passes included);
  2. Vanilla again, SWIFT with the set phase 1 found fixed (`method.skip_set=<its run dir>`: the acceleration phase
     alone, as with the authors' cached sets — found on these same prompts' first tokens), as a chain and with
     the dynamic token tree (`method.tree=true`).
Every row is an ordinary run directory under --root recording the bench as its experiment; each row's speedup is
against the mean of the Vanilla runs it pairs with (records.RunKey.pairs_with, both phases).
Interleaving decodes one prompt per `run` invocation; SWIFT's search state (scope: run, the default) is saved with
its run after every prompt (method_state.json) and restored by the next invocation, so the search row is one search
over the prompts, as the authors' code runs it; the found-set rows start from its frozen set.

Columns: tok/s and speedup (means over prompts, paper B.4); eTPL and the speedup it predicts (eTPL × L, Vanilla
loading L layers a token; a skipped sublayer counts ½ layer, the optimiser's passes count in full) and
measured ÷ predicted; α = accepted ÷ drafted; M = tokens per target forward (rounds, prefill included: the paper's
mean generated length); opt layers / opt time = the optimiser's share of loaded layers / of wall time.

    python scripts/bench_swift.py [--models smollm2-135m:0.2,testbed:0.45] [--tasks humaneval,cnndm_lm]
                                  [--limit 4] [--max-new-tokens 96] [--grid 24:2,27:2] [--swift-overrides K=V …]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_del import OFFLINE, add_speedups, code_prompts, compose, run_interleaved, table_row  # noqa: E402

from del_bench.records import RunDir  # noqa: E402
from del_bench.runner import load_model, provenance  # noqa: E402

GRIDS = {"smollm2-135m": "24:2,27:2", "testbed": "3:4,4:4"}  # LS (E:γ): bench-del's / bench-testbed's best region
TASKS = {"smollm2-135m": "humaneval,cnndm_lm", "testbed": "humaneval,code"}


def swift_columns(row: dict) -> dict:
    """M, the optimiser's share of loaded layers and of wall time, and the set the run ended with."""
    rounds = RunDir(row["out_dir"]).rounds()
    samples = [json.loads(line) for line in (Path(row["out_dir"]) / "samples.jsonl").read_text().splitlines()]
    tokens = sum(s["generated_tokens"] for s in samples)
    layers = sum(r["loaded_layers"] for r in rounds)
    wall = sum(s["wall_s"] for s in samples)
    row["mean_generated_length"] = tokens / len(rounds)
    row["opt_layer_share"] = sum(r.get("opt_loaded_layers") or 0 for r in rounds) / layers
    row["opt_time_share"] = sum(r.get("opt_s") or 0 for r in rounds) / wall
    row["opt_steps"] = sum(1 for r in rounds if r.get("opt_kind"))
    sets = [r["skip_set"] for r in rounds if r.get("skip_set")]
    row["skip_set"] = sets[-1] if sets else None
    best = [r["opt_best"] for r in rounds if r.get("opt_best") is not None]
    row["opt_best_matchness"] = max(best) if best else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m:0.2,testbed:0.45", help="model:skip_ratio pairs")
    ap.add_argument("--tasks", default=None, help="tasks for every model (default: per model, see TASKS)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--grid", default=None, help="LS (E:γ) pairs for every model (default: per model, GRIDS)")
    ap.add_argument("--swift-overrides", nargs="*", default=[], help="extra overrides for the SWIFT rows")
    ap.add_argument("--root", default="results/runs/bench/swift_runs")
    ap.add_argument("--out", default="results/runs/bench/swift.json")
    ap.add_argument("--experiment", default="bench-swift", help="recorded in every row's run_key.experiments")
    args = ap.parse_args()
    started = time.perf_counter()
    table = []
    for pair in args.models.split(","):
        model, ratio = pair.split(":")
        loaded = []

        def load(model=model, loaded=loaded):  # each model loads once for all its rows
            if not loaded:
                loaded.append(load_model(compose(f"model={model}").model))
            return loaded[0]

        grid = [tuple(int(x) for x in p.split(":")) for p in (args.grid or GRIDS.get(model, "24:2")).split(",")]
        for task in (args.tasks or TASKS.get(model, "humaneval")).split(","):
            data = code_prompts(model, args.root) if task == "code" else OFFLINE[task]
            base = [f"model={model}", f"task={task}", f"max_new_tokens={args.max_new_tokens}", *data]

            def spec(label, *overrides, suffix="", task=task, base=base, model=model):
                cfg = compose(*base, *overrides)
                cfg.out_dir = f"{args.root}/{model}/{task}/{cfg.method.tag}{suffix}"
                cfg.experiment_name = args.experiment
                return label, cfg

            def phase(specs, task=task, model=model):
                done = [{"model": model, **table_row(task, label, cfg, summary)}
                        for label, cfg, summary in run_interleaved(specs, args.limit, load)]
                table.extend(done)
                return done

            swift = ["method=swift", f"method.skip_ratio={ratio}", *args.swift_overrides]
            first = phase([spec("Vanilla", "method=vanilla"),
                           *(spec(f"LS(E{e}-γ{g})", "method=ls", f"method.exit_layer={e}", f"method.gamma={g}")
                             for e, g in grid),
                           spec("DEL (del_cpu)", "method=del_cpu"),
                           spec(f"SWIFT r{ratio} (search)", *swift)])
            ls_rows = [r for r in first if r["row"].startswith("LS")]
            best = max(ls_rows, key=lambda r: r["tokens_per_s"])
            best["row"] += " best"
            searched = first[-1]
            found = [*swift, f"method.skip_set={searched['out_dir']}"]
            phase([spec("Vanilla (phase 2)", "method=vanilla", suffix="-phase2"),
                   spec(f"SWIFT r{ratio} (found set)", *found, f"method.tag=swift-r{ratio}-found"),
                   spec(f"SWIFT r{ratio} (found, tree)", *found, "method.tree=true",
                        f"method.tag=swift-r{ratio}-found-tree")])
            add_speedups([r for r in table if r["task"] == task and r["model"] == model])
    for r in table:
        swift_columns(r)
    minutes = (time.perf_counter() - started) / 60

    print(f"\n{args.limit} prompts/task, {args.max_new_tokens} new tokens, greedy; {minutes:.1f} min\n")
    print(f"{'model':<13} {'task':<10} {'row':<26} {'tok/s':>7} {'speedup':>8} {'eTPL':>6} {'pred.':>6} "
          f"{'meas/pred':>9} {'α':>5} {'M':>5} {'opt lay.':>8} {'opt time':>8}")
    for r in table:
        def pct(key, r=r):
            return f"{r[key]:.1%}" if r.get(key) is not None else "-"
        alpha = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        m = f"{r['mean_generated_length']:.2f}" if r.get("mean_generated_length") else "-"
        print(f"{r['model']:<13} {r['task']:<10} {r['row']:<26} {r['tokens_per_s']:>7.2f} {r['speedup']:>7.2f}x "
              f"{r['etpl']:>6.3f} {r['predicted_speedup']:>5.2f}x {r['measured_over_predicted']:>9.2f} {alpha:>5} "
              f"{m:>5} {pct('opt_layer_share'):>8} {pct('opt_time_share'):>8}")
    for r in table:
        if r.get("skip_set"):
            print(f"{r['model']} {r['task']} {r['row']}: set {r['skip_set']} (best matchness "
                  f"{r['opt_best_matchness'] if r['opt_best_matchness'] is not None else '-'}, "
                  f"{r['opt_steps']} optimiser steps)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{k: v for k, v in r.items() if k != "_key"} for r in table]
    out.write_text(json.dumps({"settings": vars(args), "minutes": minutes, "rows": rows, "provenance": provenance()},
                              indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
