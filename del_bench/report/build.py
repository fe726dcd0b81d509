"""Entry points: write every table and figure from run records (offline, seconds, read-only on records).

    write_report(roots)            tables + figures   (python -m del_bench report [DIRS…])
    write_report(roots, out_figures=None)   tables only   (make tables)
    write_report(roots, out_tables=None)    figures only  (make figures)
    cli(argv) -> exit code         argument handling for `python -m del_bench report`
    log_report(logger, roots, …)   the same tables and figures into one W&B run (`report … logger=wandb`)

The Spec-Bench table (report/specbench.py) is written only where there are Spec-Bench runs; the GPU table
(report/gpu.py: results/reference/gpu's bench beside the paper's Table 1) only with the committed tables.
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
                 exclude_busy: bool = False, exclude_unsteady: bool = False) -> list[Path]:
    """Read the runs under `roots` and write tables (.md + .tex) and figures (.png + .pdf); None skips one.
    adhoc: runs of no experiment join the tables too (the CLI leaves them out of the reference build). Figure
    files of ours that these records no longer produce are removed from out_figures (see write_figures).
    exclude_busy: runs timed on an overloaded machine are left out (else they are marked ‡: collect, tables);
    exclude_unsteady: runs not timed at steady state (else marked ¶)."""
    roots = list(roots)
    df = load_runs(roots, exclude_busy=exclude_busy, exclude_unsteady=exclude_unsteady)
    written = []
    if out_tables is not None:
        from .gpu import write_gpu
        from .specbench import write_specbench
        from .tables import write_tables
        written += write_tables(df, out_tables, adhoc)
        written += write_specbench(df, out_tables, adhoc)  # only where there are Spec-Bench runs
        if [str(r) for r in roots] == [str(r) for r in DEFAULT_ROOTS]:  # the reference build: its GPU figures too
            written += write_gpu(out_tables)
    if out_figures is not None:
        from .figures import write_figures  # matplotlib only when figures are wanted
        written += write_figures(df, out_figures)
    return written


def cli(argv: list[str]) -> int:
    """`report [--tables-only|--figures-only] [--ad-hoc] [--exclude-busy] [--exclude-unsteady] [--out-tables DIR]
    [--out-figures DIR] [DIRS…]`."""
    args, roots = list(argv), []
    outs: dict[str, str | None] = {}
    only, adhoc, exclude = None, False, {"exclude_busy": False, "exclude_unsteady": False}
    logger: list[str] = []
    while args:
        arg = args.pop(0)
        if arg in ("--tables-only", "--figures-only"):
            only = arg
        elif arg == "--ad-hoc":
            adhoc = True
        elif arg.partition("=")[0].partition(".")[0] == "logger":  # logger=wandb logger.mode=offline …, as `run`
            logger.append(arg)
        elif arg in ("--exclude-busy", "--exclude-unsteady"):
            exclude[arg[2:].replace("-", "_")] = True
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
    written = write_report(roots, out_tables, out_figures, adhoc, **exclude)
    for path in written:
        print(path)
    if logger:
        log_report(logger, roots, adhoc, written, **exclude)
    return 0


def log_report(logger: list[str], roots: Iterable[str | Path], adhoc: bool, written: list[Path], **load) -> None:
    """Mirror the report to the tracker `logger` names (tracking.logger_settings: `logger=wandb logger.mode=…`): the
    tables as build_tables makes them for the .md files (Spec-Bench's too, where there are runs) and the PNGs among
    `written`; the local W&B files go beside the tables (their parent directory), or to logger.dir."""
    from del_bench import tracking

    from .specbench import specbench_table
    from .tables import build_tables

    settings = tracking.logger_settings(logger)
    if settings is None:
        return
    df = load_runs(roots, **load)
    tables = [*build_tables(df, adhoc), specbench_table(df, adhoc)]
    figures = [p for p in written if p.suffix == ".png"]
    out_dir = Path(written[0]).parent.parent if written else Path(WORKING[0]).parent
    config = {"roots": [str(r) for r in roots], "runs": len(df), "adhoc": adhoc}
    tracking.mirror_report(settings, [wandb_table(t) for t in tables if t is not None], figures, out_dir,
                           shared_experiment(df), config)


def wandb_table(table) -> dict:
    """A report Table as tracking.mirror_report takes it: the .md's header and cells (best/second marked ** and
    <u></u> as there; every cell a string, as printed), its title and notes."""
    from .render import notes

    mark = {"best": "**{}**", "second": "<u>{}</u>", "": "{}"}  # as to_markdown marks them
    rows = [[r.model, r.label, r.source] + [mark[r.cell(k).mark].format(r.cell(k).render()) for k, _ in table.columns]
            for r in table.rows]
    return {"name": table.name, "title": table.title, "columns": ["Model", "Method", "Source"] +
            [h for _, h in table.columns], "rows": rows, "notes": notes(table)}


def shared_experiment(df) -> str | None:
    """The experiment every run of the report belongs to (run_key.experiments), e.g. table1_local; None when the
    runs share none (then the report's W&B group is logger.group or `report`)."""
    if df.empty or "experiments" not in df:
        return None
    shared = set.intersection(*(set(e or ()) for e in df["experiments"]))
    return min(shared) if shared else None
