"""Spec-Bench's speed table for two answer files (`python -m del_bench export specbench …`): a method and a baseline.

For each of Spec-Bench's selections (mt_bench, translation, summarization, qa, math_reasoning, rag, overall): the
method's and the baseline's tokens/s (means over questions), the speedup and the method's mean accepted tokens,
computed by del_bench.specbench.speed (Spec-Bench's evaluation/speed.py, reconstructed: see that module). Without
--tokenizer the baseline's new_tokens are used (what our report computes); with it (a HF tokenizer directory, e.g.
the model's), the baseline's tokens are recounted from its text as speed.py does.
"""

from __future__ import annotations

from del_bench.bench import harness as h
from del_bench.specbench import speed_table


def main(argv: list[str]) -> int:
    parser = h.parser("specbench-speed", __doc__, runs=False)
    parser.add_argument("method")
    parser.add_argument("baseline")
    parser.add_argument("--tokenizer", help="recount the baseline's tokens from its text with this tokenizer")
    args = parser.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rows = speed_table(args.method, args.baseline, tokenizer)
    print(f"{'task':<16} {'questions':>9} {'tok/s':>8} {'base tok/s':>10} {'speedup':>8} {'MAT':>6}")
    for row in rows:
        if row["speedup"] is None:
            print(f"{row['task']:<16} {row['questions']:>9}  (no questions)")
            continue
        print(f"{row['task']:<16} {row['questions']:>9} {row['tokens_per_s']:>8.3f} "
              f"{row['baseline_tokens_per_s']:>10.3f} {row['speedup']:>8.4f} {row['mean_accepted_tokens']:>6.3f}")
    h.write_result(args.out, "specbench-speed", vars(args), rows=rows)
    return 0
