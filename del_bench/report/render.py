"""A report table as one structure — rows of cells — rendered to Markdown and LaTeX, so that both always agree.

`Table`, `TableRow` and `Cell` are what del_bench/report/tables.py (Tables 1–6) and specbench.py build; here they are
marked (best / second best per block and column, on the values as displayed), disambiguated (rows that would look
the same get their method_tag) and rendered, each with the notes that belong under it: what the marks in its labels
mean (`BUSY_MARK` and the others, set where the rows are built), what its methods say of their rows, and how to read
its cells. Deterministic: the same table renders to the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from del_bench.records import DRIFT_LIMIT, PEER_MARK, PEER_NOTE, STEADY_SLOWDOWN


@dataclass
class Cell:
    mean: float = math.nan
    std: float = math.nan
    runs: int = 0
    digits: int = 2
    text: str = ""  # overrides the number: paper strings as printed, "no vanilla", "incomplete"
    mark: str = ""  # "best" | "second", set by mark_best()

    def number(self) -> float | None:
        """The value as displayed (rounded), for ranking; None when the cell holds no number of ours."""
        if self.text or math.isnan(self.mean):
            return None
        return round(self.mean, self.digits)

    def render(self) -> str:
        if self.text:
            return self.text
        if math.isnan(self.mean):
            return "–"
        out = f"{self.mean:.{self.digits}f}"
        if self.runs > 1 and not math.isnan(self.std):
            out += f" ± {self.std:.{self.digits}f}"
        return out


@dataclass
class TableRow:
    block: tuple  # rows of one block are ranked together (one model on one machine)
    model: str
    label: str
    source: str  # "ours: <machine>" or "paper: <hardware>"
    cells: dict[str, Cell]
    ranked: bool = False  # takes part in best/second marking
    tag: str = ""  # the run's method_tag, shown when two rows would otherwise look the same
    family: str = ""  # the method's family (methods.base.FAMILIES); "" on paper rows
    note: str = ""  # what the method says under a table with this row (Method.table_note)

    def cell(self, key: str) -> Cell:
        """The row's cell of column `key`; '–' where the row has none (a paper row in the = Vanilla column)."""
        return self.cells.get(key) or Cell(text="–")


@dataclass
class Table:
    name: str
    title: str
    columns: list[tuple[str, str]]  # (key, header)
    rows: list[TableRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unranked: set[str] = field(default_factory=set)  # columns left out of best/second marking
    marked: bool = True  # False: a table without best/second marks (Tables 4 and 5, as in the paper)



LOSSLESS = "lossless"
LOSSLESS_COLUMN = (LOSSLESS, "= Vanilla")
LOSSLESS_NOTE = ("= Vanilla: of the greedy outputs a row shares with its Vanilla partners (all its tasks), how many "
                 "are token-identical to the partner's, from the records (RunKey pairing; Spec-Bench's check); '–' = "
                 "none to compare (Vanilla itself, sampling, no partner). In half precision an output may first depart "
                 "at a near-tie of the partner's logits (docs/design.md §2.8): the row's label then says where.")


BUSY_MARK = " ‡"
BUSY_NOTE = ("‡ = timed on a busy machine: other processes kept more CPUs busy than torch's threads left free around "
             "some of the run's samples, or its Vanilla partner's (records.overloaded); its speed or speedup is not to "
             "be trusted. `report --exclude-busy` leaves such runs out.")


UNSTEADY_MARK = " ¶"
UNSTEADY_NOTE = ("¶ = not timed at steady state: a warm-up that did not converge, or one of the first two timed "
                 f"samples slower than {STEADY_SLOWDOWN:g}× the later ones' median per loaded layer, in the run or its "
                 "Vanilla partner (records.steady_state); its speed or speedup is not to be trusted. "
                 "`report --exclude-unsteady` leaves such runs out.")


DRIFT_MARK = " §"
DRIFT_NOTE = (f"§ = paired across machine states: the matrix products of one token, timed as each run set up "
              f"(records.machine_probe), took more than {DRIFT_LIMIT:g}× as long in the run as in its Vanilla partner "
              "or the other way round (a VM's host slows or speeds up between days); its speedup compares the "
              "machine's states, not only the methods. Re-measure the row and its Vanilla together.")

def disambiguate(table: Table) -> Table:
    """Our rows of one block with the same label (e.g. a custom tag=) get their method_tag appended."""
    seen: dict[tuple, int] = {}
    for r in table.rows:
        if r.tag:
            seen[(r.block, r.label, r.source)] = seen.get((r.block, r.label, r.source), 0) + 1
    for r in table.rows:
        if r.tag and seen[(r.block, r.label, r.source)] > 1:
            r.label = f"{r.label} [{r.tag}]"
    return table


def mark_best(table: Table) -> Table:
    """Bold = best, underline = second best: per block and column, over ranked rows, on displayed values."""
    if not table.marked:
        return table
    blocks = {r.block for r in table.rows}
    for block in blocks:
        rows = [r for r in table.rows if r.block == block and r.ranked]
        if len(rows) < 2:
            continue
        for key, _ in table.columns:
            if key in table.unranked:
                continue
            values = sorted({v for r in rows if (v := r.cells[key].number()) is not None}, reverse=True)
            for r in rows:
                v = r.cells[key].number()
                if v is not None and v == values[0]:
                    r.cells[key].mark = "best"
                elif v is not None and len(values) > 1 and v == values[1]:
                    r.cells[key].mark = "second"
    return table


def notes(table: Table) -> list[str]:
    """What a table says under itself: its own notes, what the marks in its labels mean, what its methods say of
    their rows, how to read its cells."""
    marks = ["Bold = best, underline = second best among our runs of the same model and machine "
             "(Vanilla excluded), computed from the numbers; paper rows are printed as in the paper."]
    busy = [BUSY_NOTE] if any(BUSY_MARK in r.label for r in table.rows) else []
    busy += [UNSTEADY_NOTE] if any(UNSTEADY_MARK in r.label for r in table.rows) else []
    busy += [DRIFT_NOTE] if any(DRIFT_MARK in r.label for r in table.rows) else []
    busy += [PEER_NOTE] if any(PEER_MARK in r.label for r in table.rows) else []
    busy += list(dict.fromkeys(r.note for r in table.rows if r.note))  # what the methods say of their rows
    busy += [LOSSLESS_NOTE] if any(k == LOSSLESS for k, _ in table.columns) else []
    return table.notes + busy + (marks if table.marked else []) + [
        "Mean ± std over repeats where a configuration was run more than once (other seeds or repeated runs "
        "on the same prompts). Speedup is paired with the Vanilla run of the same model, task, prompts, "
        "decoding, max_new_tokens and machine; 'no vanilla' = no such run. '–' = no run (ours) or no such "
        "cell (paper). Ours: the machine's device/CPU (and torch threads); paper: its GPUs (paper §B.2). "
        "Calibration grid runs (`calibrate`) are not in the tables. Rows: this table's experiment runs and their "
        "Vanilla partners; '(outputs = Vanilla k/n)' = only k of n greedy outputs equal the partner's.",
    ]


def to_markdown(table: Table) -> str:
    mark = {"best": "**{}**", "second": "<u>{}</u>", "": "{}"}
    head = ["Model", "Method", "Source"] + [h for _, h in table.columns]
    lines = [f"## {table.title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.rows:
        cells = [mark[r.cell(k).mark].format(r.cell(k).render()) for k, _ in table.columns]
        lines.append("| " + " | ".join([r.model, r.label, r.source] + cells) + " |")
    lines.append("")
    lines += [f"- {n}" for n in notes(table)]
    return "\n".join(lines) + "\n"


_TEX = {"\\": r"\textbackslash{}", "_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#", "±": r"$\pm$",
        "γ": r"$\gamma$", "ω": r"$\omega$", "×": r"$\times$", "–": "--", "α": r"$\alpha$",
        "τ": r"$\tau$", "÷": r"$\div$", "−": "-", "≥": r"$\geq$", "^": r"\^{}", "$": r"\$",
        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "§": r"\S{}", "‡": r"$\ddagger$", "¶": r"\P{}"}


def tex_escape(text: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in text)


def to_latex(table: Table) -> str:
    mark = {"best": r"\textbf{%s}", "second": r"\underline{%s}", "": "%s"}
    head = ["Model", "Method", "Source"] + [h for _, h in table.columns]
    lines = [r"\begin{table}[t]", r"\centering", r"\small",
             r"\begin{tabular}{lll" + "r" * len(table.columns) + "}", r"\toprule",
             " & ".join(tex_escape(h) for h in head) + r" \\", r"\midrule"]
    for r in table.rows:
        cells = [mark[r.cell(k).mark] % tex_escape(r.cell(k).render()) for k, _ in table.columns]
        lines.append(" & ".join([tex_escape(r.model), tex_escape(r.label), tex_escape(r.source)] + cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}",
              r"\caption{" + tex_escape(table.title + ". " + " ".join(notes(table))) + "}",
              r"\end{table}"]
    return "\n".join(lines) + "\n"


def write_table(table: Table, out_dir) -> list[Path]:
    """table.name + .md and .tex under out_dir (made if missing): the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, render in ((".md", to_markdown), (".tex", to_latex)):
        written.append(out_dir / f"{table.name}{suffix}")
        written[-1].write_text(render(table))
    return written
