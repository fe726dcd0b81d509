"""This checkout's decode speed against another commit's, interleaved run by run (batch 1 unchanged by a change?).

The same runs (`python -m del_bench run …`) decoded by this checkout and by a git worktree of --base, alternately,
round after round; each one's decode speed (the run's mean tokens/s over its prompts, from its records, after its
untimed warm-up) compared row by row as the median over rounds of this ÷ base. A row is a model × method; each
round runs every row once on each side, which side goes first alternating, so a drifting machine moves both alike.
Nothing else may run meanwhile (each record keeps the machine's load: busy samples are counted). The base worktree is
made under --work (git worktree add); both sides run with this interpreter, the base's package imported from its
own tree (PYTHONPATH)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
ROWS = ("smollm2-135m:vanilla,smollm2-135m:ls,smollm2-135m:del_cpu,testbed:vanilla,testbed:ls,testbed:del_cpu")
TASKS = {"smollm2-135m": "humaneval", "testbed": "humaneval"}


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m del_bench bench ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--rows", default=ROWS, help="model:method pairs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--limit", type=int, default=4, help="prompts a run")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--work", default=str(ROOT / "results" / "runs" / "ab"), help="runs and the base worktree")
    ap.add_argument("--out", default=None, help="the figures as JSON")
    return ap.parse_args(argv)


def worktree(base: str, work: Path) -> Path:
    """A checkout of `base` (made once; reused while it is at that commit)."""
    tree = work / f"base-{base}"
    if not tree.exists():  # (a worktree whose folder was deleted is still registered until pruned)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), base], check=True)
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    want = subprocess.run(["git", "-C", str(ROOT), "rev-parse", base], capture_output=True, text=True, check=True)
    if head.stdout != want.stdout:
        raise SystemExit(f"{tree} is not at {base}: remove it (git worktree remove) and run again")
    return tree


def decode(tree: Path, model: str, method: str, out: Path, args) -> dict:
    """One run of `tree`'s code → its summary (tokens/s, whether a sample was timed on a busy machine)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "del_bench", "run", f"model={model}", f"method={method}",
           f"task={TASKS.get(model, 'humaneval')}", f"limit={args.limit}", f"max_new_tokens={args.max_new_tokens}",
           f"out_dir={out}", f"data_dir={ROOT.parent / 'shared' / 'data'}"]
    done = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:  # say why: its log's last lines (a run of other settings in `out`: pick another --work)
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"{' '.join(cmd)}\n(in {tree}) exited {done.returncode}:\n{tail}")
    summary = json.loads((out / "summary.json").read_text())
    return {"tokens_per_s": summary["tokens_per_s"], "busy": (summary.get("load") or {}).get("overloaded", 0),
            "etpl": summary["etpl"]}


def interleaved(rows: list[tuple[str, str]], rounds: int, decode) -> dict:
    """decode(side, model, method, round) for every row on both sides ("this", "base"), round after round, the side
    going first alternating → {"model:method": {"this": [results], "base": [results]}}."""
    results: dict = {f"{m}:{meth}": {"this": [], "base": []} for m, meth in rows}
    for k in range(rounds):
        order = ["this", "base"] if k % 2 == 0 else ["base", "this"]
        for model, method in rows:
            for side in order:
                results[f"{model}:{method}"][side].append(decode(side, model, method, k))
        print(f"round {k + 1}/{rounds} done", flush=True)
    return results


def compared(results: dict) -> dict:
    """Per row: the medians of each side's tok/s, this ÷ base per round and its median, whether eTPL agrees in
    every round (the same decisions), the busy samples."""
    table = {}
    for row, by_side in results.items():
        ratios = [t["tokens_per_s"] / b["tokens_per_s"] for t, b in zip(by_side["this"], by_side["base"])]
        table[row] = {"this_tok_s": statistics.median(t["tokens_per_s"] for t in by_side["this"]),
                      "base_tok_s": statistics.median(b["tokens_per_s"] for b in by_side["base"]),
                      "ratio_median": statistics.median(ratios), "ratios": ratios,
                      "etpl_equal": all(t["etpl"] == b["etpl"] for t, b in zip(by_side["this"], by_side["base"])),
                      "busy_samples": sum(r["busy"] for side in by_side.values() for r in side)}
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sides = {"this": ROOT, "base": worktree(args.base, work)}
    rows = [tuple(r.split(":")) for r in args.rows.split(",")]
    table = compared(interleaved(rows, args.rounds, lambda side, model, method, k: decode(
        sides[side], model, method, work / "runs" / side / f"{model}-{method}-{k}", args)))
    for row, r in table.items():
        print(f"{row:28s} this {r['this_tok_s']:7.1f} tok/s  base {r['base_tok_s']:7.1f}  this/base "
              f"{r['ratio_median']:.3f} (rounds {', '.join(f'{x:.3f}' for x in r['ratios'])})  eTPL equal "
              f"{r['etpl_equal']}  busy {r['busy_samples']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"base": args.base, "rounds": args.rounds, "limit": args.limit,
                                              "max_new_tokens": args.max_new_tokens, "rows": table}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
