"""Entry points: write every table and figure from run records (offline, seconds, read-only on records).

    write_report(roots)            tables + figures   (python -m del_bench report [DIRS…])
    write_report(roots, out_figures=None)   tables only   (make tables)
    write_report(roots, out_tables=None)    figures only  (make figures)
    cli(argv) -> exit code         argument handling for `python -m del_bench report`

The Spec-Bench table (report/specbench.py) is written only where there are Spec-Bench runs.
`report` alone reads the committed reference records (results/reference) and rewrites the committed
results/tables and results/figures: on a fresh clone, byte for byte what is committed. `report DIRS…` reads
your own runs (runs of no experiment included: you asked for them) and writes to results/runs/report/, so it
never overwrites the committed files unless you name them with --out-tables / --out-figures.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable

from .collect import DEFAULT_ROOTS, find_runs, load_runs

COMMITTED = ("results/tables", "results/figures")  # built from DEFAULT_ROOTS (the reference records)
WORKING = ("results/runs/report/tables", "results/runs/report/figures")  # built from a user's DIRS


def write_report(roots: Iterable[str | Path] = DEFAULT_ROOTS, out_tables: str | Path | None = COMMITTED[0],
                 out_figures: str | Path | None = COMMITTED[1], adhoc: bool = True,
                 exclude_busy: bool = False) -> list[Path]:
    """Read the runs under `roots` and write tables (.md + .tex) and figures (.png + .pdf); None skips one.
    adhoc: runs of no experiment join the tables too (the CLI leaves them out of the reference build). Figure
    files of ours that these records no longer produce are removed from out_figures (see write_figures).
    exclude_busy: runs timed on an overloaded machine are left out (else they are marked ‡: collect, tables)."""
    df = load_runs(roots, exclude_busy=exclude_busy)
    written = []
    if out_tables is not None:
        from .specbench import write_specbench
        from .tables import write_tables
        written += write_tables(df, out_tables, adhoc)
        written += write_specbench(df, out_tables, adhoc)  # only where there are Spec-Bench runs
    if out_figures is not None:
        from .figures import write_figures  # matplotlib only when figures are wanted
        written += write_figures(df, out_figures)
    return written


def cli(argv: list[str]) -> int:
    """`report [--tables-only|--figures-only] [--ad-hoc] [--exclude-busy] [--out-tables DIR] [--out-figures DIR]
    [DIRS…]`."""
    args, roots = list(argv), []
    outs: dict[str, str | None] = {}
    only, adhoc, exclude_busy = None, False, False
    while args:
        arg = args.pop(0)
        if arg in ("--tables-only", "--figures-only"):
            only = arg
        elif arg == "--ad-hoc":
            adhoc = True
        elif arg == "--exclude-busy":
            exclude_busy = True
        elif arg in ("--out-tables", "--out-figures") and args:
            outs[arg] = args.pop(0)
        elif arg.startswith("-"):
            print(f"report: unknown option {arg}", file=sys.stderr)
            return 2
        else:
            roots.append(arg)
    defaults = WORKING if roots else COMMITTED
    out_tables = outs.get("--out-tables", defaults[0]) if only != "--figures-only" else None
    out_figures = outs.get("--out-figures", defaults[1]) if only != "--tables-only" else None
    adhoc = adhoc or bool(roots)
    roots = roots or list(DEFAULT_ROOTS)
    if not find_runs(roots):
        print(f"report: no run records (summary.json) under {', '.join(roots)}", file=sys.stderr)
        return 1
    for path in write_report(roots, out_tables, out_figures, adhoc, exclude_busy):
        print(path)
    return 0
