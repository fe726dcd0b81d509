"""Entry points: write every table and figure from run records (offline, seconds, read-only on records).

    write_report(roots)            tables + figures   (python -m del_bench report [DIRS…])
    write_report(roots, out_figures=None)   tables only   (make tables)
    write_report(roots, out_tables=None)    figures only  (make figures)
    cli(argv) -> exit code         argument handling for `python -m del_bench report`
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable

from .collect import DEFAULT_ROOTS, find_runs, load_runs


def write_report(roots: Iterable[str | Path] = DEFAULT_ROOTS, out_tables: str | Path | None = "results/tables",
                 out_figures: str | Path | None = "results/figures") -> list[Path]:
    """Read the runs under `roots` and write tables (.md + .tex) and figures (.png + .pdf); None skips one.
    Figure files of ours that these records no longer produce are removed from out_figures (see write_figures)."""
    df = load_runs(roots)
    written = []
    if out_tables is not None:
        from .tables import write_tables
        written += write_tables(df, out_tables)
    if out_figures is not None:
        from .figures import write_figures  # matplotlib only when figures are wanted
        written += write_figures(df, out_figures)
    return written


def cli(argv: list[str]) -> int:
    """`report [--tables-only|--figures-only] [--out-tables DIR] [--out-figures DIR] [DIRS…]`."""
    args, roots = list(argv), []
    out_tables, out_figures = "results/tables", "results/figures"
    while args:
        arg = args.pop(0)
        if arg == "--tables-only":
            out_figures = None
        elif arg == "--figures-only":
            out_tables = None
        elif arg in ("--out-tables", "--out-figures") and args:
            value = args.pop(0)
            out_tables, out_figures = (value, out_figures) if arg == "--out-tables" else (out_tables, value)
        elif arg.startswith("-"):
            print(f"report: unknown option {arg}", file=sys.stderr)
            return 2
        else:
            roots.append(arg)
    roots = roots or list(DEFAULT_ROOTS)
    if not find_runs(roots):
        print(f"report: no run records (summary.json) under {', '.join(roots)}", file=sys.stderr)
        return 1
    for path in write_report(roots, out_tables, out_figures):
        print(path)
    return 0
