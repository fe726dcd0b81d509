"""`python -m del_bench bench NAME [ARGS]`: the benchmarks, each one short module on the harness (harness.py).
Bare `bench` lists them, one line each (the first line of the module's docstring); `bench NAME --help` says more."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

BENCHES = {  # name: module of this package (a module's `main(argv)` runs it)
    "del": "dynamic_exit",
    "engine": "engine",
    "swift": "swift",
    "adapters": "adapters",
    "peer": "peer",
    "gpu": "gpu",
    "controller": "controller",
    "memory": "memory",
    "parts": "parts",
    "compile": "compile",
    "sandbox": "sandbox",
    "half-lossless": "half_lossless",
    "profile": "profile",
    "specbench-speed": "specbench_speed",
    "batch": "batch",
    "ab": "ab",
    "del-trace": "del_trace",
    "segments": "segments",
    "del-stop": "del_stop",
    "graph-reads": "graph_reads",
}


def summary_line(name: str) -> str:
    """The first line of a bench module's docstring, read without importing it (torch loads slowly)."""
    source = (Path(__file__).parent / f"{BENCHES[name]}.py").read_text()
    return (ast.get_docstring(ast.parse(source)) or "").splitlines()[0]


def listing() -> str:
    width = max(map(len, BENCHES))
    return "\n".join(f"  {name:<{width}}  {summary_line(name)}" for name in BENCHES)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        unknown = f"unknown bench {argv[0]!r}\n" if argv and not argv[0].startswith("-") else ""
        print(f"{unknown}python -m del_bench bench NAME [ARGS] (NAME --help for its arguments):\n{listing()}")
        return 2 if unknown else 0
    module = importlib.import_module(f"{__name__}.{BENCHES[argv[0]]}")
    return module.main(argv[1:]) or 0
