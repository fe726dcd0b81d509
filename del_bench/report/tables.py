"""Tables 1, 3 and 6 of the paper, regenerated from run records, with the paper's numbers beside ours.

Every table is built as a `Table` (rows of `Cell`s) and rendered to Markdown and LaTeX from that one
structure, so both outputs always agree. Best/second-best marks are computed from our numbers (per model
block and column, Vanilla excluded, on the values as displayed); paper rows are printed as in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pandas as pd

from .collect import aggregate

PAPER_CSV = Path(__file__).with_name("paper_values.csv")

TASK_LABELS = {"aqua_rat": "AQuA", "cnndm_lm": "CNN/DM-LM", "cnndm_sum": "CNN/DM-Sum", "xsum": "XSUM",
               "gsm8k": "GSM8K", "humaneval": "HumanEval", "wmt14_de_en": "WMT14"}
TABLE1_TASKS = ["aqua_rat", "cnndm_lm", "cnndm_sum", "xsum"]
TABLE3_TASKS = ["aqua_rat", "cnndm_lm", "cnndm_sum", "gsm8k", "humaneval", "xsum", "wmt14_de_en"]
METHOD_ORDER = ["vanilla", "ls", "fs", "dv", "swift", "del_gamma", "del_e", "del_e_lim", "del"]
METHOD_LABELS = {"vanilla": "Vanilla", "ls": "LS", "fs": "FS", "dv": "DV", "swift": "SWIFT", "del": "DEL",
                 "del_e": "DEL-E", "del_gamma": "DEL-γ", "del_e_lim": "DEL-E-lim"}
DEFAULT_OMEGA = 0.95
DIGITS = {"etpl": 3, "tokens_per_s": 2, "speedup": 2}
METRIC_LABELS = {"etpl": "eTPL", "tokens_per_s": "Speed", "speedup": "Speedup"}

# paper §B: hardware per model (LLaMA-3-8B's is not stated in the paper)
PAPER_HARDWARE = {"llama3.2-1b": "1× A100-40GB", "llama2-7b": "1× A100-40GB", "llama2-13b": "1× A100-40GB",
                  "codellama-7b": "1× A100-40GB", "codellama-34b": "2× A100-40GB",
                  "llama2-70b": "2× H100-80GB", "llama3-8b": "GPU not stated"}


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
class Row:
    block: tuple  # rows of one block are ranked together (one model on one machine)
    model: str
    label: str
    source: str  # "ours: <machine>" or "paper: <hardware>"
    cells: dict[str, Cell]
    ranked: bool = False  # takes part in best/second marking
    tag: str = ""  # the run's method_tag, shown when two rows would otherwise look the same


@dataclass
class Table:
    name: str
    title: str
    columns: list[tuple[str, str]]  # (key, header)
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- labels and paper values

def _num(value) -> float | None:
    if value in ("", None) or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def method_label(method: str, exit_layer="", gamma="", omega="") -> str:
    """Labels as in the paper: LS(E8-γ6), FS(E8-γ6), DV(E8); DEL's ω only when not the default."""
    base = METHOD_LABELS.get(method, method)
    e, g, w = _num(exit_layer), _num(gamma), _num(omega)
    parts = []
    if e is not None and method != "vanilla":
        parts.append(f"E{e:g}")
    if g is not None and method in ("ls", "fs"):
        parts.append(f"γ{g:g}")
    if w is not None and w != DEFAULT_OMEGA and method.startswith("del"):
        parts.append(f"ω{w:g}")
    return f"{base}({'-'.join(parts)})" if parts else base


@lru_cache(maxsize=1)
def paper_values() -> pd.DataFrame:
    return pd.read_csv(PAPER_CSV, dtype=str, keep_default_na=False)


def paper_cell(table: int, model: str, task: str, method: str, exit_layer="", gamma="", metric="",
               setting: str = "") -> Cell | None:
    """The paper's printed value for one cell, or None when the paper has no such cell."""
    pv = paper_values()
    e, g = _num(exit_layer), _num(gamma)
    hit = pv[(pv.table == str(table)) & (pv.model == model) & (pv.task == task) & (pv.method == method)
             & (pv.exit_layer == ("" if e is None else f"{e:g}")) & (pv.gamma == ("" if g is None else f"{g:g}"))
             & (pv.metric == metric) & (pv.setting == setting)]
    return Cell(text=hit.value.iloc[0]) if len(hit) else None


def paper_source(model: str) -> str:
    return f"paper: {PAPER_HARDWARE.get(model, 'GPU')}"


# ---------------------------------------------------------------- building

ROW_KEYS = ["model", "machine", "decoding", "method", "method_tag", "exit_layer", "gamma", "omega"]


def _sort_key(key: dict):
    method = key["method"]
    rank = METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)
    nums = [(_num(key[k]) if _num(key[k]) is not None else -1) for k in ("exit_layer", "gamma", "omega")]
    return (key["model"], key["machine"], key["decoding"], key.get("variant", 0), rank, *nums, key["method_tag"])


def _ours(machine: str, variant: int = 0) -> str:
    return f"ours: {machine}" + (f" (other prompt set #{variant})" if variant else "")


def _with_variant(agg: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Runs of one config and task on different prompt sets are different experiments: number them
    (0 = the largest prompt set) so they land on separate rows instead of overwriting each other."""
    agg = agg.sort_values(["n", "prompts"], ascending=[False, True], kind="stable")
    return agg.assign(variant=agg.groupby(keys, sort=False).cumcount())


def _cell(rec: pd.Series | None, metric: str) -> Cell:
    if rec is None:
        return Cell(digits=DIGITS[metric])
    if metric == "speedup" and not rec["has_vanilla"]:
        return Cell(text="no vanilla")
    return Cell(mean=rec[f"{metric}_mean"], std=rec[f"{metric}_std"], runs=int(rec["runs"]),
                digits=DIGITS[metric])


def _overall(recs: dict, tasks: list[str]) -> dict[str, Cell]:
    """Paper Table 1 'Overall': mean speed over the tasks, and that ÷ the Vanilla partners' mean speed."""
    if any(recs.get(t) is None for t in tasks):
        return {"overall:tokens_per_s": Cell(text="incomplete"), "overall:speedup": Cell(text="incomplete")}
    speed = sum(recs[t]["tokens_per_s_mean"] for t in tasks) / len(tasks)
    cells = {"overall:tokens_per_s": Cell(mean=speed, digits=2)}
    if all(recs[t]["has_vanilla"] for t in tasks):
        base = sum(recs[t]["vanilla_tps"] for t in tasks) / len(tasks)
        cells["overall:speedup"] = Cell(mean=speed / base, digits=2)
    else:
        cells["overall:speedup"] = Cell(text="no vanilla")
    return cells


def wide_table(df: pd.DataFrame, table: int, tasks: list[str], metrics: list[str], overall: bool,
               title: str) -> Table:
    """One row per (model, machine, method config); columns task × metric (+ overall), paper rows beside."""
    columns = [(f"{t}:{m}", f"{TASK_LABELS[t]} {METRIC_LABELS[m]}") for t in tasks for m in metrics]
    if overall:
        columns += [("overall:tokens_per_s", "Overall Speed"), ("overall:speedup", "Overall Speedup")]
    out = Table(f"table{table}", title, columns)
    agg = aggregate(df[df["task"].isin(tasks)])
    if agg.empty:
        out.notes.append("No runs of these tasks were found.")
        return out
    keys = ROW_KEYS + ["variant"]
    agg = _with_variant(agg, ROW_KEYS + ["task"])
    for _, group in sorted(agg.groupby(keys, sort=False), key=lambda kv: _sort_key(dict(zip(keys, kv[0])))):
        key = dict(zip(keys, group.iloc[0][keys]))
        by_task = {rec["task"]: rec for _, rec in group.iterrows()}
        cells = {f"{t}:{m}": _cell(by_task.get(t), m) for t in tasks for m in metrics}
        if overall:
            cells.update(_overall(by_task, tasks))
        label = method_label(key["method"], key["exit_layer"], key["gamma"], key["omega"])
        block = (key["model"], key["machine"], key["decoding"], key["variant"])
        out.rows.append(Row(block, key["model"], label, _ours(key["machine"], key["variant"]), cells,
                            ranked=key["method"] != "vanilla", tag=key["method_tag"]))
        paper = _paper_row(table, key, tasks, metrics, overall, block, label)
        if paper:
            out.rows.append(paper)
    return out


def _paper_row(table, key, tasks, metrics, overall, block, label) -> Row | None:
    """The paper's row for the same model and method config (DEL only at the paper's ω = 0.95)."""
    if key["method"] == "del" and _num(key["omega"]) not in (None, DEFAULT_OMEGA):
        return None
    cols = [(t, m) for t in tasks for m in metrics] + ([("overall", "tokens_per_s"), ("overall", "speedup")]
                                                       if overall else [])
    cells = {}
    for t, m in cols:
        cell = paper_cell(table, key["model"], t, key["method"], key["exit_layer"], key["gamma"], m)
        cells[f"{t}:{m}"] = cell or Cell(text="–")
    if all(c.text == "–" for c in cells.values()):
        return None
    return Row(block, key["model"], label, paper_source(key["model"]), cells)


def table1(df: pd.DataFrame) -> Table:
    t = wide_table(df, 1, TABLE1_TASKS, ["etpl", "speedup"], overall=True,
                   title="Table 1: eTPL and speedup per task; overall speed (tokens/s) and speedup")
    t.notes.append("Overall = mean over the four tasks (speedup: overall speed ÷ the Vanilla partners' "
                   "overall speed); 'incomplete' when a task is missing.")
    return t


def table3(df: pd.DataFrame) -> Table:
    return wide_table(df, 3, TABLE3_TASKS, ["tokens_per_s", "speedup"], overall=False,
                      title="Table 3: speed (tokens/s) and speedup on all seven tasks")


def table6(df: pd.DataFrame) -> Table:
    """ω sensitivity: one block per (model, task, machine); Vanilla and each DEL ω as rows."""
    columns = [("etpl", "eTPL"), ("tokens_per_s", "Speed"), ("speedup", "Speedup")]
    out = Table("table6", "Table 6: sensitivity of DEL to the decay ω", columns)
    agg = aggregate(df[df["method"].isin(["vanilla", "del"])])
    # a block = one model, task, decoding, machine and prompt set; Vanilla rows only from that prompt set
    bkeys = ["model", "task", "machine", "decoding", "prompts"]
    blocks = _with_variant(agg[agg["method"] == "del"].drop_duplicates(bkeys), bkeys[:-1])
    for _, b in blocks.sort_values(bkeys[:-1] + ["variant"]).iterrows():
        sel = agg[(agg.model == b.model) & (agg.task == b.task) & (agg.machine == b.machine)
                  & (agg.decoding == b.decoding) & (agg.prompts == b.prompts)]
        sel = sel.assign(_w=[_num(w) if _num(w) is not None else -1 for w in sel.omega])
        sel = sel.sort_values(["_w", "method_tag"], kind="stable")
        block = (b.model, b.task, b.machine, b.decoding, b.prompts)
        for _, rec in sel.iterrows():
            is_del = rec["method"] == "del"
            label = f"{TASK_LABELS.get(b.task, b.task)} " + (f"ω={_num(rec.omega):g}" if is_del else "ω=- (Vanilla)")
            cells = {m: _cell(rec, m) for m, _ in columns}
            out.rows.append(Row(block, b.model, label, _ours(b.machine, b.variant), cells, ranked=is_del,
                                tag=rec["method_tag"]))
            setting = f"omega={_num(rec.omega):g}" if is_del else ""
            paper = {m: paper_cell(6, b.model, b.task, rec["method"], metric=m, setting=setting) for m, _ in columns}
            if any(paper.values()):
                out.rows.append(Row(block, b.model, label, paper_source(b.model),
                                    {m: c or Cell(text="–") for m, c in paper.items()}))
    if not out.rows:
        out.notes.append("No DEL runs were found.")
    return out


# ---------------------------------------------------------------- marking and rendering

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
    blocks = {r.block for r in table.rows}
    for block in blocks:
        rows = [r for r in table.rows if r.block == block and r.ranked]
        if len(rows) < 2:
            continue
        for key, _ in table.columns:
            values = sorted({v for r in rows if (v := r.cells[key].number()) is not None}, reverse=True)
            for r in rows:
                v = r.cells[key].number()
                if v is not None and v == values[0]:
                    r.cells[key].mark = "best"
                elif v is not None and len(values) > 1 and v == values[1]:
                    r.cells[key].mark = "second"
    return table


def _notes(table: Table) -> list[str]:
    return table.notes + [
        "Bold = best, underline = second best among our runs of the same model and machine "
        "(Vanilla excluded), computed from the numbers; paper rows are printed as in the paper.",
        "Mean ± std over repeats where a configuration was run more than once. Speedup is paired with the "
        "Vanilla run of the same model, task, prompts, decoding and machine; 'no vanilla' = no such run.",
    ]


def to_markdown(table: Table) -> str:
    mark = {"best": "**{}**", "second": "<u>{}</u>", "": "{}"}
    head = ["Model", "Method", "Source"] + [h for _, h in table.columns]
    lines = [f"## {table.title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.rows:
        cells = [mark[r.cells[k].mark].format(r.cells[k].render()) for k, _ in table.columns]
        lines.append("| " + " | ".join([r.model, r.label, r.source] + cells) + " |")
    lines.append("")
    lines += [f"- {n}" for n in _notes(table)]
    return "\n".join(lines) + "\n"


_TEX = {"\\": r"\textbackslash{}", "_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#", "±": r"$\pm$",
        "γ": r"$\gamma$", "ω": r"$\omega$", "×": r"$\times$", "–": "--"}


def tex_escape(text: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in text)


def to_latex(table: Table) -> str:
    mark = {"best": r"\textbf{%s}", "second": r"\underline{%s}", "": "%s"}
    head = ["Model", "Method", "Source"] + [h for _, h in table.columns]
    lines = [r"\begin{table}[t]", r"\centering", r"\small",
             r"\begin{tabular}{lll" + "r" * len(table.columns) + "}", r"\toprule",
             " & ".join(tex_escape(h) for h in head) + r" \\", r"\midrule"]
    for r in table.rows:
        cells = [mark[r.cells[k].mark] % tex_escape(r.cells[k].render()) for k, _ in table.columns]
        lines.append(" & ".join([tex_escape(r.model), tex_escape(r.label), tex_escape(r.source)] + cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}",
              r"\caption{" + tex_escape(table.title + ". " + " ".join(_notes(table))) + "}",
              r"\end{table}"]
    return "\n".join(lines) + "\n"


def build_tables(df: pd.DataFrame) -> list[Table]:
    return [mark_best(disambiguate(t)) for t in (table1(df), table3(df), table6(df))]


def write_tables(df: pd.DataFrame, out_dir: str | Path = "results/tables") -> list[Path]:
    """tableN.md and tableN.tex for every table; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for table in build_tables(df):
        for suffix, render in ((".md", to_markdown), (".tex", to_latex)):
            path = out_dir / f"{table.name}{suffix}"
            path.write_text(render(table))
            written.append(path)
    return written
