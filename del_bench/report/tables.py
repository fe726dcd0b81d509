"""Tables 1–6 of the paper, regenerated from run records, with the paper's numbers beside ours.

Every table is built as a `Table` (rows of `Cell`s) and rendered to Markdown and LaTeX from that one
structure (del_bench/report/render.py), so both outputs always agree. Best/second-best marks are computed from our
numbers (per model block and column, Vanilla excluded, on the values as displayed); paper rows are printed as in the
paper.

    Table 1  eTPL + speedup on AQuA, CNN/DM-LM, CNN/DM-Sum, XSUM; overall speed and speedup
    Table 2  HumanEval pass@1 (greedy) eTPL + speedup, pass@10 (sampled) eTPL + speedup + ROUGE-2
    Table 3  speed + speedup on all seven tasks
    Table 4  DEL's gain over LS vs SWIFT's gain over Vanilla (HumanEval, CNN/DM-LM); the paper's rows always
    Table 5  peak memory and overhead vs Vanilla (six tasks + overall); the paper's rows always
    Table 6  DEL's sensitivity to ω

Each table shows the runs of its own experiments (configs/experiment/tableN*.yaml: a run records the sweeps that
asked for it in run_key.experiments), plus the Vanilla partners of those runs; other sweeps (the ω and d_max
sweeps, the memory runs, the benchmarks) reach only their own artefacts. Runs of no experiment (ad hoc `run`s)
join every table only when asked (`report DIRS…` or --ad-hoc). A greedy row whose outputs are not all
token-identical to its Vanilla partner's says so in its label ("outputs = Vanilla k/n").
Deterministic: no timestamps, no absolute paths, stable row order — reruns on the same records are identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pandas as pd

from del_bench.methods.base import LAYER_SKIPPING
from del_bench.methods.dynamic_exit import AUTHORS_READING
from del_bench.records import batch_label, method_entry, method_label, vanilla_partners

from .collect import aggregate
from .render import (
    BUSY_MARK,
    DRIFT_MARK,
    LOSSLESS,
    LOSSLESS_COLUMN,
    UNSTEADY_MARK,
    Cell,
    Table,
    TableRow,
    disambiguate,
    mark_best,
    write_table,
)

PAPER_CSV = Path(__file__).with_name("paper_values.csv")

TASK_LABELS = {"aqua_rat": "AQuA", "cnndm_lm": "CNN/DM-LM", "cnndm_sum": "CNN/DM-Sum", "xsum": "XSUM",
               "gsm8k": "GSM8K", "humaneval": "HumanEval", "wmt14_de_en": "WMT14",
               "humaneval_pass10": "HumanEval pass@10"}
TABLE1_TASKS = ["aqua_rat", "cnndm_lm", "cnndm_sum", "xsum"]
TABLE3_TASKS = ["aqua_rat", "cnndm_lm", "cnndm_sum", "gsm8k", "humaneval", "xsum", "wmt14_de_en"]
TABLE2_TASKS = {"humaneval": "pass@1", "humaneval_pass10": "pass@10"}  # our task → the paper's setting
TABLE4_TASKS = ["humaneval", "cnndm_lm"]
TABLE5_TASKS = ["humaneval", "cnndm_lm", "cnndm_sum", "xsum", "gsm8k", "aqua_rat"]
DIGITS = {"etpl": 3, "tokens_per_s": 2, "speedup": 2, "gain": 2, "q_rouge2": 3, "peak_memory_gib": 3,
          "memory_overhead_pct": 2}
METRIC_LABELS = {"etpl": "eTPL", "tokens_per_s": "Speed", "speedup": "Speedup", "q_rouge2": "ROUGE-2",
                 "gain": "Gain", "peak_memory_gib": "Memory (GiB)", "memory_overhead_pct": "Overhead (%)"}
PAPER_METRIC = {"q_rouge2": "rouge2", "peak_memory_gib": "memory_gb"}  # ours → paper_values.csv metric

# paper §B: hardware per model (LLaMA-3-8B's is not stated in the paper)
PAPER_HARDWARE = {"llama3.2-1b": "1× A100-40GB", "llama2-7b": "1× A100-40GB", "llama2-13b": "1× A100-40GB",
                  "codellama-7b": "1× A100-40GB", "codellama-34b": "2× A100-40GB",
                  "llama2-70b": "2× H100-80GB", "llama3-8b": "GPU not stated"}


@dataclass(frozen=True)
class Col:
    """One numeric column: our (task, metric) and where the paper keeps the same cell."""

    key: str
    header: str
    task: str  # our task name; "overall" = computed from the row's other tasks
    metric: str
    paper_task: str = ""  # default: task
    paper_setting: str = ""

    def paper(self) -> tuple[str, str, str]:
        return self.paper_task or self.task, self.paper_setting, PAPER_METRIC.get(self.metric, self.metric)


def task_cols(tasks: list[str], metrics: list[str]) -> list[Col]:
    return [Col(f"{t}:{m}", f"{TASK_LABELS[t]} {METRIC_LABELS[m]}", t, m) for t in tasks for m in metrics]


# ---------------------------------------------------------------- labels and paper values

def _num(value) -> float | None:
    if value in ("", None) or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


@lru_cache(maxsize=1)
def paper_values() -> pd.DataFrame:
    return pd.read_csv(PAPER_CSV, dtype=str, keep_default_na=False)


def paper_cell(table: int, model: str, task: str, method: str, exit_layer="", gamma="", metric="",
               setting: str = "") -> Cell | None:
    """The paper's printed value for one cell, or None when the paper has no such cell."""
    e, g = _num(exit_layer), _num(gamma)
    key = (str(table), model, task, setting, method, "" if e is None else f"{e:g}", "" if g is None else f"{g:g}",
           metric)
    value = _paper_index().get(key)
    return None if value is None else Cell(text=value)


@lru_cache(maxsize=1)
def _paper_index() -> dict[tuple, str]:
    """(table, model, task, setting, method, exit_layer, gamma, metric) → the printed value (a cell's identity)."""
    keys = ["table", "model", "task", "setting", "method", "exit_layer", "gamma", "metric"]
    pv = paper_values()
    return dict(zip(pv[keys].itertuples(index=False, name=None), pv["value"]))


def paper_source(model: str) -> str:
    return f"paper: {PAPER_HARDWARE.get(model, 'GPU')}"


# ---------------------------------------------------------------- building

# label, family, order, note: as the method's class presents the run (records.method_entry, load_run's columns)
ROW_KEYS = ["model", "machine", "decoding", "max_new_tokens", "method", "method_tag", "label", "family", "order",
            "note", "exit_layer", "gamma", "omega", "batch_size"]
PAPER_MAX_NEW_TOKENS = "512"


def row_order(key: dict):
    """Rows of a block in the methods' declared order (Method.table_order), then by E, γ, ω and tag."""
    nums = [(_num(key[k]) if _num(key[k]) is not None else -1) for k in ("exit_layer", "gamma", "omega")]
    return (key["model"], key["machine"], key.get("decoding", ""), _num(key.get("max_new_tokens")) or 0,
            key.get("variant", 0), key["order"], *nums, int(key.get("batch_size", 1)), key["method_tag"])


def our_source(machine: str, variant: int = 0, decoding: str = "greedy", max_new_tokens: str = "") -> str:
    """'ours: <device>/<cpu>' + the decoding when not greedy + max_new_tokens when not the paper's 512."""
    out = f"ours: {machine}"
    if decoding and decoding != "greedy":
        out += f", {decoding}"
    if max_new_tokens not in ("", PAPER_MAX_NEW_TOKENS):
        out += f", max_new_tokens={max_new_tokens}"
    return out + (f" (other prompt set #{variant})" if variant else "")


def with_variant(agg: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Runs of one config and task on different prompt sets are different experiments: number them
    (0 = the largest prompt set) so they land on separate rows instead of overwriting each other."""
    agg = agg.sort_values(["n", "prompts"], ascending=[False, True], kind="stable")
    return agg.assign(variant=agg.groupby(keys, sort=False).cumcount())


def _cell(rec: pd.Series | None, metric: str) -> Cell:
    digits = DIGITS.get(metric, 3)
    if rec is None:
        return Cell(digits=digits)
    if metric == "speedup" and not rec["has_vanilla"]:
        return Cell(text="no vanilla")
    if metric == "peak_memory_gib" and not rec["memory_runs"]:
        return Cell(text="n/a")  # the run exists but recorded no peak memory
    if metric == "memory_overhead_pct":
        if rec["method"] == "vanilla":
            return Cell(text="–")  # as in the paper
        if not rec["memory_runs"]:
            return Cell(text="n/a")
        if not rec["has_vanilla"]:
            return Cell(text="no vanilla")
        if math.isnan(rec["vanilla_memory_gib"]):
            return Cell(text="n/a")
    if f"{metric}_mean" not in rec:
        return Cell(digits=digits)
    return Cell(mean=rec[f"{metric}_mean"], std=rec[f"{metric}_std"], runs=int(rec["runs"]), digits=digits)


def lossless_cell(recs) -> Cell:
    """'k/n': of the greedy outputs these aggregated runs share with their Vanilla partners, k are token-identical
    (summed over the runs); '–' where nothing was compared (Vanilla, sampling runs, no partner). Not ranked."""
    equal, compared = lossless_counts(recs)
    return Cell(text=f"{equal}/{compared}" if compared else "–")


def lossless_counts(recs) -> tuple[int, int]:
    """(k, n) summed over these aggregated runs: n greedy outputs compared with their Vanilla partner's, k of them
    token-identical (collect.add_lossless; runs with nothing to compare add nothing)."""
    equal = sum(r["outputs_equal"] for r in recs if not _isnan(r.get("outputs_equal")))
    compared = sum(r["outputs_compared"] for r in recs if not _isnan(r.get("outputs_compared")))
    return int(equal), int(compared)


def lossless_note(recs, reference: str = "Vanilla") -> str:
    """' (outputs = Vanilla k/n)' when some greedy outputs of these aggregated runs differ from their Vanilla
    partner's (summed over the runs); '' when all that could be compared are equal. Where the partner recorded its
    top-2 gaps (half precision), the note says how many of the others first depart at a near-tie (allowed) and how
    many really depart, and at which tokens: ' (outputs = Vanilla 22/24; near-tie departures 2 at tokens 16, 63)'.
    `reference` names the partner (bench gpu: 'generate')."""
    equal, compared = lossless_counts(recs)
    if equal >= compared:
        return ""
    parts = [f"outputs = {reference} {equal}/{compared}"]
    for label, column in (("near-tie departures", "near_tie_at"), ("real departures", "departs_at")):
        at = sorted(p for r in recs for p in (r.get(column) or []))
        if at:
            parts.append(f"{label} {len(at)} at tokens {', '.join(map(str, at))}")
    return f" ({'; '.join(parts)})"




def busy_mark(recs) -> str:
    """' ‡' when a run behind these aggregated cells, or a Vanilla partner of one, was timed on an overloaded
    machine (collect: busy_runs, busy_vanilla); ' ¶' when one was not timed at steady state (unsteady_runs,
    unsteady_vanilla); ' §' when one was timed in another machine state than its partner (drifted_runs); each
    that applies; '' otherwise, and for records from before the load was kept."""
    recs = list(recs)
    busy = any(r.get("busy_runs", 0) or r.get("busy_vanilla", False) for r in recs)
    unsteady = any(r.get("unsteady_runs", 0) or r.get("unsteady_vanilla", False) for r in recs)
    drift = any(r.get("drifted_runs", 0) for r in recs)
    return BUSY_MARK * busy + UNSTEADY_MARK * unsteady + DRIFT_MARK * drift


def _isnan(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


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


def wide_table(df: pd.DataFrame, table: int, cols: list[Col], title: str, overall=None,
               row_keys: list[str] = ROW_KEYS, paper_rows: bool = True) -> Table:
    """One row per (model, machine, [decoding,] method config, prompt-set variant); one column per Col;
    columns of task "overall" are filled by overall(recs_by_task). The paper's row for the same model and
    method config follows ours when paper_rows."""
    out = Table(f"table{table}", title, [(c.key, c.header) for c in cols] + [LOSSLESS_COLUMN], unranked={LOSSLESS})
    tasks = sorted({c.task for c in cols} - {"overall"})
    agg = aggregate(df[df["task"].isin(tasks)])
    if agg.empty:
        out.notes.append("No runs of these tasks were found.")
        return out
    keys = row_keys + ["variant"]
    agg = with_variant(agg, row_keys + ["task"])
    for _, group in sorted(agg.groupby(keys, sort=False), key=lambda kv: row_order(dict(zip(keys, kv[0])))):
        key = dict(zip(keys, group.iloc[0][keys]))
        by_task = {rec["task"]: rec for _, rec in group.iterrows()}
        cells = {c.key: _cell(by_task.get(c.task), c.metric) for c in cols if c.task != "overall"}
        if overall:
            cells.update(overall(by_task))
        cells[LOSSLESS] = lossless_cell(by_task.values())
        label = key["label"] + batch_label(key.get("batch_size", 1)) + lossless_note(by_task.values())
        block = tuple(key[k] for k in ("model", "machine", "decoding", "max_new_tokens", "variant") if k in key)
        source = our_source(key["machine"], key["variant"], key.get("decoding", ""), key["max_new_tokens"])
        out.rows.append(TableRow(block, key["model"], label + busy_mark(by_task.values()), source, cells,
                            ranked=key["method"] != "vanilla", tag=key["method_tag"], family=key["family"],
                            note=key["note"]))
        batched = int(key.get("batch_size", 1)) != 1  # the paper decoded one prompt at a time: its row follows B = 1
        paper = _paper_row(table, key, cols, block, label) if paper_rows and not batched else None
        if paper:
            out.rows.append(paper)
    return out


def _paper_row(table, key, cols: list[Col], block, label) -> TableRow | None:
    """The paper's row for the same model and method config: one the paper prints under our row's label (so DEL only
    in the paper's configuration, at ω = 0.95: DEL-CPU and DEL(ω0.9) have none)."""
    if paper_label(key["method"], key["exit_layer"], key["gamma"]) != key["label"]:
        return None
    cells = {}
    for c in cols:
        task, setting, metric = c.paper()
        cell = paper_cell(table, key["model"], task, key["method"], key["exit_layer"], key["gamma"], metric,
                          setting)
        cells[c.key] = cell or Cell(text="–")
    if all(c.text == "–" for c in cells.values()):
        return None
    return TableRow(block, key["model"], label, paper_source(key["model"]), cells)


def paper_block(table: int, model: str, cols: list[Col]) -> list[TableRow]:
    """Every row the paper prints for `model` in `table` (Tables 4 and 5: shown whatever we ran)."""
    pv = paper_values()
    pv = pv[(pv.table == str(table)) & (pv.model == model)]
    configs = pv[["method", "exit_layer", "gamma"]].drop_duplicates().itertuples(index=False)
    order = sorted(configs, key=lambda c: (method_entry(c.method).order, _num(c.exit_layer) or 0, _num(c.gamma) or 0))
    rows = []
    for method, e, g in order:
        cells = {}
        for c in cols:
            task, setting, metric = c.paper()
            cells[c.key] = paper_cell(table, model, task, method, e, g, metric, setting) or Cell(text="–")
        rows.append(TableRow(("paper", model), model, paper_label(method, e, g), paper_source(model), cells))
    return rows


def paper_label(method: str, exit_layer, gamma) -> str:
    """The label of a paper row: the method at the paper's (E, γ), DEL as its authors' code ran the paper's numbers
    (so beside our DEL, not DEL (Alg. 1))."""
    return method_label(method, {"exit_layer": exit_layer, "gamma": gamma, **AUTHORS_READING})


def table1(df: pd.DataFrame) -> Table:
    cols = task_cols(TABLE1_TASKS, ["etpl", "speedup"])
    cols += [Col("overall:tokens_per_s", "Overall Speed", "overall", "tokens_per_s"),
             Col("overall:speedup", "Overall Speedup", "overall", "speedup")]
    t = wide_table(df, 1, cols, "Table 1: eTPL and speedup per task; overall speed (tokens/s) and speedup",
                   overall=lambda recs: _overall(recs, TABLE1_TASKS))
    t.notes.append("Overall = mean over the four tasks (speedup: overall speed ÷ the Vanilla partners' "
                   "overall speed); 'incomplete' when a task is missing.")
    return t


def table2(df: pd.DataFrame) -> Table:
    """HumanEval: pass@1 = task humaneval (greedy), pass@10 = task humaneval_pass10 (sampled, T 0.6, top-p
    0.95); one row per method config across both (their decodings differ, so decoding is not a row key)."""
    cols = []
    for task, setting in TABLE2_TASKS.items():
        metrics = ["etpl", "speedup"] + (["q_rouge2"] if setting == "pass@10" else [])
        cols += [Col(f"{task}:{m}", f"{setting} {METRIC_LABELS[m]}", task, m, "humaneval", setting)
                 for m in metrics]
    t = wide_table(df, 2, cols, "Table 2: HumanEval pass@1 (greedy) and pass@10 (sampling): eTPL, speedup, "
                   "ROUGE-2", row_keys=[k for k in ROW_KEYS if k != "decoding"])
    t.unranked = {c.key for c in cols if c.metric.startswith("q_")}
    t.notes.append("pass@1 columns: runs of task humaneval (greedy); pass@10 columns: runs of task "
                   "humaneval_pass10 (speculative sampling, T 0.6, top-p 0.95, several samples per problem). "
                   "ROUGE-2 (vs the canonical solution) is not ranked.")
    return t


def table3(df: pd.DataFrame) -> Table:
    return wide_table(df, 3, task_cols(TABLE3_TASKS, ["tokens_per_s", "speedup"]),
                      "Table 3: speed (tokens/s) and speedup on all seven tasks")


def _by_model(ours: list[TableRow], paper_models: list[str], paper_rows) -> list[TableRow]:
    """Our rows grouped by model, each model's paper block after its own rows; paper-only models last."""
    rows: list[TableRow] = []
    models = sorted({r.model for r in ours})
    for model in models + [m for m in paper_models if m not in models]:
        rows += [r for r in ours if r.model == model]
        if model in paper_models:
            rows += paper_rows(model)
    return rows


def _paper_models(table: int) -> list[str]:
    pv = paper_values()
    return sorted(set(pv[pv.table == str(table)].model))


def table4(df: pd.DataFrame) -> Table:
    """Gain = DEL speedup − LS speedup (DEL runs on LayerSkip) and SWIFT speedup − 1 (SWIFT runs on plain
    decoding; so does every method of the layer-skipping family, CLaSp and KnapSpec after DEL, shown beside it: a
    method says its family, Method.family). Our LS base per block
    = the LS config with the best mean speedup over the tasks it covers (most tasks first); our SWIFT row says
    "no SWIFT runs" until a `swift` method has records."""
    cols = []
    for t in TABLE4_TASKS:
        cols += [Col(f"{t}:speedup", f"{TASK_LABELS[t]} Speedup", t, "speedup"),
                 Col(f"{t}:gain", f"{TASK_LABELS[t]} Gain", t, "gain")]
    speed_cols = [c for c in cols if c.metric == "speedup"]
    shown = df["method"].isin(["vanilla", "ls", "del"]) | (df["family"] == LAYER_SKIPPING)
    base = wide_table(df[shown], 4, speed_cols, "", paper_rows=False)
    out = Table("table4", "Table 4: DEL's gain over LS vs SWIFT's gain over Vanilla",
                [(c.key, c.header) for c in cols] + [LOSSLESS_COLUMN], notes=base.notes, marked=False)
    ours: list[TableRow] = []
    blocks = list(dict.fromkeys(r.block for r in base.rows))
    for block in blocks:
        rows = [r for r in base.rows if r.block == block]
        for r in rows:
            r.ranked = False
        skipping = [r for r in rows if r.family == LAYER_SKIPPING]
        if not skipping and not any(r.label.startswith(("LS", "DEL")) for r in rows):
            continue  # a Vanilla run alone says nothing about gains
        pick = [r for r in rows if r.label.startswith("LS")]
        ls = max(pick, key=_ls_score, default=None)
        if not any(r.label.startswith("SWIFT") for r in skipping):
            cells = {c.key: Cell(text="no SWIFT runs" if c.metric == "speedup" else "–") for c in cols}
            skipping.insert(0, TableRow(block, rows[0].model, "SWIFT", rows[0].source, cells))
        for r in rows:
            for t in TABLE4_TASKS:
                if r.family == LAYER_SKIPPING:
                    r.cells[f"{t}:gain"] = _gain(r.cells[f"{t}:speedup"], r.label, Cell(mean=1.0))
                else:
                    against = ls if r.label.startswith("DEL") else None
                    r.cells[f"{t}:gain"] = _gain(r.cells[f"{t}:speedup"], r.label, against.cells[f"{t}:speedup"]
                                                 if against else None)
        ordered = [r for r in rows if r.label == "Vanilla"] + skipping + ([ls] if ls else [])
        ordered += [r for r in rows if r.label.startswith("DEL")]
        ours += ordered
    out.rows = _by_model(ours, _paper_models(4), lambda m: paper_block(4, m, cols))
    out.notes += ["Gain: DEL speedup − LS speedup (DEL runs on top of LayerSkip), SWIFT (CLaSp, KnapSpec) speedup "
                  "− 1 (they run on plain decoding); a difference of mean speedups. Our LS row is the LS config with "
                  "the highest mean speedup over these tasks among our runs (the paper's LS configs are its own).",
                  "The paper's Table 4 rows are always shown; its CNN/DM column is language modelling (cnndm_lm)."]
    return out


def _ls_score(row: TableRow) -> tuple:
    values = [c.number() for k, c in row.cells.items() if k.endswith(":speedup") and c.number() is not None]
    return (len(values), sum(values) / len(values) if values else 0.0, row.label)


def _gain(speedup: Cell, label: str, against: Cell | None) -> Cell:
    if label == "Vanilla" or label.startswith("LS"):
        return Cell(text="–")
    if against is None:
        return Cell(text="no LS run")
    if speedup.text or against.text or math.isnan(speedup.mean) or math.isnan(against.mean):
        return Cell(text=speedup.text or against.text or "–")
    return Cell(mean=speedup.mean - against.mean, digits=2)


def _overall_memory(recs: dict) -> dict[str, Cell]:
    """Paper Table 5 'Overall': mean peak memory over the six tasks; overhead = that ÷ the Vanilla partners'
    mean − 1 (the paper's overall overheads 0.91 % and 1.54 % are this ratio of its printed overall memories;
    the mean of its per-task overheads would give 0.90 % for LS)."""
    keys = ("overall:peak_memory_gib", "overall:memory_overhead_pct")
    if any(recs.get(t) is None for t in TABLE5_TASKS):
        return {k: Cell(text="incomplete") for k in keys}
    vanilla = next(iter(recs.values()))["method"] == "vanilla"
    if not all(recs[t]["memory_runs"] for t in TABLE5_TASKS):
        return {keys[0]: Cell(text="n/a"), keys[1]: Cell(text="–" if vanilla else "n/a")}
    memory = sum(recs[t]["peak_memory_gib_mean"] for t in TABLE5_TASKS) / len(TABLE5_TASKS)
    cells = {keys[0]: Cell(mean=memory, digits=3)}
    if vanilla:
        cells[keys[1]] = Cell(text="–")
    elif not all(recs[t]["has_vanilla"] for t in TABLE5_TASKS):
        cells[keys[1]] = Cell(text="no vanilla")
    else:
        base = sum(recs[t]["vanilla_memory_gib"] for t in TABLE5_TASKS) / len(TABLE5_TASKS)
        cells[keys[1]] = Cell(mean=(memory / base - 1) * 100, digits=2) if not math.isnan(base) else Cell(text="n/a")
    return cells


def table5(df: pd.DataFrame) -> Table:
    """Peak memory of each run (summary.json `peak_memory_bytes`, GiB) and overhead vs its Vanilla partner."""
    metrics = ["peak_memory_gib", "memory_overhead_pct"]
    cols = task_cols(TABLE5_TASKS, metrics)
    cols += [Col(f"overall:{m}", f"Overall {METRIC_LABELS[m]}", "overall", m) for m in metrics]
    base = wide_table(df, 5, cols, "", overall=_overall_memory, paper_rows=False)
    for r in base.rows:
        r.ranked = False
    out = Table("table5", "Table 5: peak memory (GiB) and overhead vs Vanilla (%)", base.columns, notes=base.notes,
                marked=False)
    out.rows = _by_model(base.rows, _paper_models(5), lambda m: paper_block(5, m, cols))
    sub = aggregate(df[df["task"].isin(TABLE5_TASKS)]) if not df.empty else None
    if sub is not None and not sub.empty:
        measures = sorted({(mc, m) for mc, ms in zip(sub.machine, sub.memory_measure) for m in ms.split(", ") if m})
        for machine, measure in measures:
            out.notes.append(f"Memory on {machine}: {measure}.")
        weights = sub.dropna(subset=["model_gib"]).groupby("model")["model_gib"].mean()
        for model, gib in weights.items():
            out.notes.append(f"{model} weights: {gib:.3f} GiB.")
    out.notes += ["Peak memory = the run's `peak_memory_bytes` (summary.json; GPU: torch.cuda.max_memory_allocated; "
                  "CPU: the measure named above), in GiB (2^30 bytes); 'n/a' = the run recorded none. Overhead = "
                  "peak ÷ the Vanilla partner's peak − 1. Overall = mean over the six tasks.",
                  "The paper's Table 5 rows (max allocated GPU memory, one random prompt per task) are always shown."]
    return out


def table6(df: pd.DataFrame) -> Table:
    """ω sensitivity: one block per (model, task, machine, decoding, length, prompt set) where DEL ran at two
    or more ω (a sweep; single-ω DEL runs are in Tables 1–3); Vanilla and each DEL ω as rows."""
    columns = [("etpl", "eTPL"), ("tokens_per_s", "Speed"), ("speedup", "Speedup")]
    out = Table("table6", "Table 6: sensitivity of DEL to the decay ω", columns + [LOSSLESS_COLUMN],
                unranked={LOSSLESS})
    agg = aggregate(df[df["method"].isin(["vanilla", "del"])])
    # a block = one model, task, decoding, machine and prompt set; Vanilla rows only from that prompt set
    bkeys = ["model", "task", "machine", "decoding", "max_new_tokens", "prompts"]
    dels = agg[agg["method"] == "del"]
    sweeps = dels.groupby(bkeys)["omega"].transform(lambda w: len({_num(x) for x in w})) >= 2
    blocks = with_variant(dels[sweeps].drop_duplicates(bkeys), bkeys[:-1])
    for _, b in blocks.sort_values(bkeys[:-1] + ["variant"]).iterrows():
        sel = agg[(agg.model == b.model) & (agg.task == b.task) & (agg.machine == b.machine)
                  & (agg.decoding == b.decoding) & (agg.max_new_tokens == b.max_new_tokens)
                  & (agg.prompts == b.prompts)]
        sel = sel.assign(_w=[_num(w) if _num(w) is not None else -1 for w in sel.omega])
        sel = sel.sort_values(["_w", "method_tag"], kind="stable")
        block = (b.model, b.task, b.machine, b.decoding, b.max_new_tokens, b.prompts)
        for _, rec in sel.iterrows():
            is_del = rec["method"] == "del"
            label = f"{TASK_LABELS.get(b.task, b.task)} " + (f"ω={_num(rec.omega):g}" if is_del else "ω=- (Vanilla)")
            reading = rec["label"].split("(ω")[0]  # DEL's reading (DEL, DEL (Alg. 1), DEL-CPU…) without its ω
            if is_del and reading != "DEL":
                label += f", {reading}"
            label += lossless_note([rec])
            cells = {m: _cell(rec, m) for m, _ in columns} | {LOSSLESS: lossless_cell([rec])}
            out.rows.append(TableRow(block, b.model, label + busy_mark([rec]),
                                our_source(b.machine, b.variant, b.decoding, b.max_new_tokens), cells, ranked=is_del,
                                tag=rec["method_tag"]))
            setting = f"omega={_num(rec.omega):g}" if is_del else ""
            paper = {m: paper_cell(6, b.model, b.task, rec["method"], metric=m, setting=setting) for m, _ in columns}
            if any(paper.values()) and (not is_del or reading == "DEL"):  # the paper's ω rows: its authors' code
                out.rows.append(TableRow(block, b.model, label, paper_source(b.model),
                                    {m: c or Cell(text="–") for m, c in paper.items()}))
    if not out.rows:
        out.notes.append("No DEL runs at two or more ω were found.")
    return out



def in_experiment(experiments, table: str) -> bool:
    """A run belongs to table N when one of its sweeps is `tableN` or a variant of it (`tableN_local`, …)."""
    return any(e.split("_")[0] == table for e in experiments or ())


def select_runs(df: pd.DataFrame, table: str, adhoc: bool) -> pd.DataFrame:
    """The runs `table` shows: its experiments' runs (+ runs of no experiment when adhoc) and their Vanilla
    partners (the baseline row of a sweep that did not run Vanilla itself, e.g. Table 6's ω sweep)."""
    if "experiments" not in df:
        return df
    own = df["experiments"].map(lambda e: in_experiment(e, table))
    if adhoc:
        own |= df["experiments"].map(lambda e: not e)
    vanillas = list(zip(df["run_key"], df.index))
    partners = {i for key in df.loc[own, "run_key"] for i in vanilla_partners(key, vanillas)}
    return df[own | df.index.isin(partners)]


def build_tables(df: pd.DataFrame, adhoc: bool = True) -> list[Table]:
    """Tables 1–6, each from the runs select_runs gives it; the grid points of `calibrate`
    (sample_set=calibration) are left out (they choose LS's (E, γ); Figures 1a and 1b draw them)."""
    if "sample_set" in df:
        df = df[df["sample_set"] != "calibration"]
    builders = (table1, table2, table3, table4, table5, table6)
    return [mark_best(disambiguate(build(select_runs(df, build.__name__, adhoc)))) for build in builders]


def write_tables(df: pd.DataFrame, out_dir: str | Path = "results/tables", adhoc: bool = True) -> list[Path]:
    """tableN.md and tableN.tex for every table; returns the files written."""
    return [path for table in build_tables(df, adhoc) for path in write_table(table, out_dir)]
