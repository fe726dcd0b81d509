"""Finished runs' tok/s prompt by prompt, in decode order, and the first timed prompt ÷ the median of the rest (far
below 1: the untimed warm-up left decoding short of steady state).

    python scripts/per_prompt.py RUN_DIR [RUN_DIR …] [--out FILE.json]      (any runs' per-prompt speeds)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from del_bench.bench.harness import per_prompt_speed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/per_prompt.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (their samples.jsonl)")
    ap.add_argument("--out", default=None, help="also write the figures here as JSON")
    args = ap.parse_args(argv)
    runs = {}
    for run in args.runs:
        if not (Path(run) / "samples.jsonl").is_file():
            ap.error(f"{run}: no samples.jsonl (not a run directory, or nothing decoded yet)")
        runs[run] = speed = per_prompt_speed(run)
        ratio = "-" if speed["first_over_rest"] is None else f"{speed['first_over_rest']:.2f}"
        print(f"{run}: tok/s " + " ".join(f"{v:.1f}" for v in speed["per_prompt"]) + f"; first ÷ median(rest) {ratio}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
