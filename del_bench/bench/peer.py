"""Peers as rows: our Vanilla and LS(E, γ) beside HF generate, its forward loop and assistant_early_exit.

Every row is a run with records (peers.py: transformers decodes a peer row, its work counted by hooks), interleaved
prompt by prompt after the runner's untimed warm-up, on one loaded model. Speedups are against our Vanilla (the
peers pair with it: RunKey.pairs_with); "= generate" counts the outputs equal to HF generate's (greedy: every row
must give generate's tokens in float32/float64). assistant_early_exit drafts exactly γ tokens a round (confidence
threshold 0, constant schedule), as LS(E, γ). Rows marked † are peers.
"""

from __future__ import annotations

from del_bench.bench import harness as h
from del_bench.methods.peers import peer_method
from del_bench.records import is_peer

COLUMNS = ["row", "tok/s", "speedup", "eTPL", "α", ("= generate", "equal_generate", "", 10)]


def parse(argv):
    ap = h.parser("peer", __doc__, limit=4, max_new_tokens=96)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="humaneval")
    ap.add_argument("--configs", default=None, help="comma-separated E:γ pairs (default: the model's own LS)")
    return ap.parse_args(argv)


def peer_rows(args, row) -> list[h.BenchRow]:
    """Our Vanilla, the two plain peers, then per (E, γ) our LS beside assistant_early_exit."""
    rows = [row("Vanilla", "method=vanilla"), row("HF generate †", method=peer_method("hf_generate")),
            row("HF forward loop †", method=peer_method("hf_forward_loop"))]
    for e, g in h.grid_of(args.configs, args.model, whole=False):
        rows += [row(f"LS(E{e}-γ{g})", *h.ls_args("ls", e, g)),
                 row(f"HF assistant_early_exit(E{e}-γ{g}) †",
                     method=peer_method("hf_assistant_early_exit", exit_layer=e, gamma=g))]
    return rows


def main(argv: list[str]) -> int:
    args = parse(argv)
    base = [f"model={args.model}", f"task={args.task}", f"max_new_tokens={args.max_new_tokens}", *args.set]
    load = h.shared_load(h.compose(*base))  # one copy of the weights: transformers runs on the model we load

    def row(label, *overrides, method=None):
        return h.row(label, args.root, args.experiment, *base, *overrides, load=load, method=method)

    table = h.table(h.run_rows(peer_rows(args, row), args.limit))
    generate = next(r["out_dir"] for r in table if r["method"] == "hf_generate")
    for r in table:
        r["peer"] = is_peer(r["method"])
        equal, n = h.outputs_equal(r["out_dir"], generate)
        r["equal_generate"] = f"{equal}/{n}"
    h.print_table(table, COLUMNS, f"{args.model}, {args.task}, {args.limit} prompts, {args.max_new_tokens} new tokens, "
                                  "greedy († a peer: transformers' own decoding, its records written as ours)")
    h.write_result(args.out, "peer", vars(args), rows=table)
    return 0
