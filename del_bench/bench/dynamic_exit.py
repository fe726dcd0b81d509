"""DEL and its ablations against Vanilla and grid-searched LS, FS and DV (make bench-del, bench-testbed).

Per task: Vanilla; LS over a small (E, γ) grid (the best one is reported as "LS best"); FS and DV at the best LS exit
layer; DEL and its ablations. FS, DV and DEL need the best LS point, so a task runs in two phases — Vanilla + the
LS grid, then Vanilla again + the rest — each interleaved prompt by prompt; both phases' Vanilla are repeats of one
configuration, so every row's speedup is against their mean (their gap shows the drift). "pred." is the speedup the
loaded layers predict (eTPL × L) and "meas/pred" how much of it the wall clock delivers; "pooled" weighs every token
alike (a few prompts that draft well can lift the means of a method slower in total).

Task `code` (a model trained by `train-layerskip`): code-completion prompts its training held out.
"""

from __future__ import annotations

from del_bench.bench import harness as h

COLUMNS = ["task", "row", "tok/s", "speedup", "eTPL", "pred.", "meas/pred", "pooled", "p.pred", "p.m/p", "α", "ctrl"]


def parse(argv):
    ap = h.parser("del", __doc__, limit=3, max_new_tokens=96)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="humaneval,gsm8k,wmt14_de_en")
    ap.add_argument("--grid", default=None, help="LS (E:γ) pairs (default: the model's calibration grid)")
    ap.add_argument("--del-methods", default="del,del_e,del_gamma,del_e_lim", help="DEL-family method configs")
    ap.add_argument("--del-overrides", nargs="*", default=[], help="extra overrides for the DEL rows but `del`")
    return ap.parse_args(argv)


def bench_task(args, task: str, load) -> list[dict]:
    """One task's two phases → its table rows (speedups against both phases' Vanilla)."""
    root = f"{args.root}/{task}"
    base = [f"model={args.model}", *h.task_overrides(task, args.model, args.root),
            f"max_new_tokens={args.max_new_tokens}", *args.set]

    def row(label, *overrides, suffix=""):
        return h.row(label, root, args.experiment, *base, *overrides, load=load, suffix=suffix)

    grid = h.grid_of(args.grid, args.model)
    first = h.run_rows([row("Vanilla", "method=vanilla"),
                        *(row(f"LS(E{e}-γ{g})", *h.ls_args("ls", e, g)) for e, g in grid)], args.limit)
    best = max(first[1:], key=lambda r: r.summary["tokens_per_s"])
    best.label += " best"
    e, g = grid[first.index(best) - 1]
    rest = [row("Vanilla (phase 2)", "method=vanilla", suffix="-phase2"), row(f"FS(E{e}-γ{g})", *h.ls_args("fs", e, g)),
            row(f"DV(E{e})", "method=dv", f"method.exit_layer={e}")]
    for name in args.del_methods.split(","):
        extra = [f"method.exit_layer={e}"] if name == "del_gamma" else []
        if name == "del":  # the paper's configuration, always as published
            rest.append(row("DEL (paper)", "method=del"))
        else:
            rest.append(row(name.upper().replace("_", "-"), f"method={name}", *extra, *args.del_overrides))
    return h.table(first + h.run_rows(rest, args.limit))


def main(argv: list[str]) -> int:
    args = parse(argv)
    load = h.shared_load(h.compose(f"model={args.model}", *args.set))  # one model for every row of the bench
    rows = [r for task in args.tasks.split(",") for r in bench_task(args, task, load)]
    h.print_table(rows, COLUMNS, f"{args.model}, {args.limit} prompts/task, {args.max_new_tokens} new tokens, greedy; "
                                 "means over prompts (paper B.4), pooled = all tokens ÷ all seconds (or layers)")
    h.write_result(args.out, "del", vars(args), rows=rows)
    return 0
