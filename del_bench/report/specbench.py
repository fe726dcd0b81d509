"""The Spec-Bench table: per model, methods × Spec-Bench's 6 groups + overall, computed as Spec-Bench computes them.

    specbench_table(df, adhoc)       a Table (render.py's TableRow/Cell machinery), or None without Spec-Bench runs
    write_specbench(df, out, adhoc)  results/tables/specbench.{md,tex}, only when there are such runs

Runs: task `specbench`, of a `specbench*` experiment (run_key.experiments; runs of no experiment too when adhoc),
plus their Vanilla partners (RunKey.pairs_with, through tables.select_runs). Per run and group (MT-bench = its 8
categories pooled, translation, summarization, QA, math reasoning, RAG; overall = every question), from the
run's samples.jsonl (a question's tokens and seconds are sums over its turns):

    Speedup  Spec-Bench's: the mean over questions of tokens/s ÷ the same mean of the Vanilla partner(s)
             (del_bench.specbench.speed gives the same number from `export specbench` files)
    Pooled   all tokens ÷ all seconds, ÷ the same of the Vanilla partner(s): every token weighs alike, so a few
             short, fast questions cannot lift it (why a higher mean accepted length can go with a lower speedup)
    MAT      Spec-Bench's mean accepted tokens: the mean over all decoding steps of the tokens a step produced
             (accepted drafts + the bonus token; the prefill is a step of 1) = all tokens ÷ all rounds

Several Vanilla partners (repeats): their mean is the baseline. Repeats of one configuration: mean ± std.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pandas as pd

from del_bench.records import vanilla_partners
from del_bench.specbench import GROUP_LABELS, GROUPS, in_group

from . import tables
from .collect import CONFIG_KEYS, read_jsonl
from .render import Cell, Table, TableRow, disambiguate, mark_best, write_table

TASK = "specbench"
COLUMN_GROUPS = [*GROUPS, "overall"]
METRICS = {"speedup": "Speedup", "pooled": "Pooled", "mat": "MAT"}
DIGITS = {"speedup": 2, "pooled": 2, "mat": 2, "tokens_per_s": 2}


def group_numbers(run_dir: str | Path) -> dict[str, dict]:
    """Per group: speed (mean per-question tokens/s), pooled tokens/s, mean accepted tokens, questions."""
    samples = read_jsonl(Path(run_dir) / "samples.jsonl")
    out = {}
    for group in COLUMN_GROUPS:
        rows = [s for s in samples if in_group(s.get("category"), group) and s.get("wall_s")]
        if not rows:
            continue
        tokens, seconds = sum(s["generated_tokens"] for s in rows), sum(s["wall_s"] for s in rows)
        steps = sum(s["rounds"] for s in rows)
        out[group] = {"speed": statistics.fmean(s["generated_tokens"] / s["wall_s"] for s in rows),
                      "pooled": tokens / seconds, "mat": tokens / steps if steps else math.nan,
                      "questions": len(rows)}
    return out


def _runs(df: pd.DataFrame, adhoc: bool) -> pd.DataFrame:
    if df.empty or "task" not in df:
        return df.iloc[0:0]
    if "sample_set" in df:
        df = df[df["sample_set"] != "calibration"]
    df = df[df["task"] == TASK]
    return tables.select_runs(df, TASK, adhoc)


def run_metrics(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per run: CONFIG_KEYS, the lossless counts, and per group speedup / pooled / MAT (NaN where the
    run has no question of the group or no Vanilla partner)."""
    numbers = {r: group_numbers(r) for r in runs["run_dir"]}
    vanillas = [(v["run_key"], numbers[v["run_dir"]]) for _, v in runs[runs["method"] == "vanilla"].iterrows()]
    rows = []
    for _, run in runs.iterrows():
        partners = vanilla_partners(run["run_key"], vanillas)  # the one pairing rule (records)
        row = {k: run[k] for k in CONFIG_KEYS + ["run_dir", "n", "outputs_equal", "outputs_compared"] if k in run}
        row["has_vanilla"] = bool(partners)
        own = numbers[run["run_dir"]]
        row["tokens_per_s"] = own["overall"]["speed"] if "overall" in own else math.nan
        for g in COLUMN_GROUPS:
            mine = own.get(g)
            base = [p[g] for p in partners if g in p]
            row[f"{g}:mat"] = mine["mat"] if mine else math.nan
            for metric, key in (("speedup", "speed"), ("pooled", "pooled")):
                row[f"{g}:{metric}"] = (mine[key] / statistics.fmean(b[key] for b in base)
                                        if mine and base else math.nan)
            row[f"{g}:questions"] = mine["questions"] if mine else 0
        rows.append(row)
    return pd.DataFrame(rows)


def _cell(values: list[float], metric: str, has_vanilla: bool, questions: int) -> Cell:
    digits = DIGITS[metric]
    if not questions:
        return Cell(digits=digits)
    if metric in ("speedup", "pooled") and not has_vanilla:
        return Cell(text="no vanilla")
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return Cell(digits=digits)
    std = statistics.stdev(values) if len(values) > 1 else math.nan
    return Cell(mean=statistics.fmean(values), std=std, runs=len(values), digits=digits)


def specbench_table(df: pd.DataFrame, adhoc: bool = True) -> Table | None:
    runs = _runs(df, adhoc)
    if runs.empty:
        return None
    metrics = run_metrics(runs)
    columns = [(f"{g}:{m}", f"{GROUP_LABELS[g]} {label}") for g in COLUMN_GROUPS for m, label in METRICS.items()]
    columns.append(("overall:tokens_per_s", "Overall tok/s"))
    out = Table("specbench", "Spec-Bench: speedup, pooled speedup and mean accepted tokens (MAT) per category group",
                columns, unranked={"overall:tokens_per_s"})
    # prompt sets of one model/machine/decoding/length are numbered, the largest first (tables.with_variant)
    block_keys = ["model", "machine", "decoding", "max_new_tokens"]
    sets = metrics.groupby(block_keys + ["prompts"], sort=False)["n"].max().reset_index()
    sets = sets.sort_values(["n", "prompts"], ascending=[False, True], kind="stable")
    sets["variant"] = sets.groupby(block_keys, sort=False).cumcount()
    metrics = metrics.merge(sets[block_keys + ["prompts", "variant"]], on=block_keys + ["prompts"])
    keys = CONFIG_KEYS + ["variant"]
    groups = metrics.groupby(keys, sort=False, dropna=False)
    for _, group in sorted(groups, key=lambda kv: tables.row_order(dict(zip(keys, kv[0])))):
        key = dict(zip(keys, group.iloc[0][keys]))
        has_vanilla = bool(group["has_vanilla"].all())
        cells = {}
        for g in COLUMN_GROUPS:
            questions = int(group[f"{g}:questions"].max())
            for m in METRICS:
                cells[f"{g}:{m}"] = _cell(list(group[f"{g}:{m}"]), m, has_vanilla, questions)
        cells["overall:tokens_per_s"] = _cell(list(group["tokens_per_s"]), "tokens_per_s", True, 1)
        label = key["label"] + tables.lossless_note([r for _, r in group.iterrows()])
        block = tuple(key[k] for k in block_keys + ["variant"])
        source = tables.our_source(key["machine"], key["variant"], key["decoding"], key["max_new_tokens"])
        out.rows.append(TableRow(block, key["model"], label, source, cells, ranked=key["method"] != "vanilla",
                            tag=key["method_tag"], family=key["family"], note=key["note"]))
    out.notes += _notes(runs, metrics)
    return mark_best(disambiguate(out))


def _notes(runs: pd.DataFrame, metrics: pd.DataFrame) -> list[str]:
    notes = []
    for model, group in runs.groupby("model", sort=True):
        formats = sorted({s.get("prompt_format") or "?" for d in group["run_dir"]
                          for s in read_jsonl(Path(d) / "samples.jsonl")})
        counts = sorted({int(n) for n in metrics.loc[metrics["model"] == model, "overall:questions"]})
        notes.append(f"{model}: prompt format {', '.join(formats)}; {'/'.join(map(str, counts))} questions per run.")
    notes += [
        "Speedup = Spec-Bench's: the mean over questions of tokens/s (a question's tokens and seconds summed over its "
        "turns) ÷ the same mean of the Vanilla partner; `python -m del_bench export specbench RUN_DIR OUT.jsonl` "
        "writes the run in Spec-Bench's answer layout, and its speed logic (del_bench.specbench.speed) gives the same "
        "number from those files. Pooled = all tokens ÷ all seconds, ÷ Vanilla's: it weighs every token alike, so "
        "it can rank methods differently from the mean of per-question speeds. MAT = Spec-Bench's mean accepted "
        "tokens: tokens per decoding step (accepted drafts + the bonus token; the prefill is a step of 1), over all "
        "steps of the group; Vanilla = 1.",
        "Groups: MT-bench = its 8 categories (writing, roleplay, reasoning, math, coding, extraction, stem, "
        "humanities; two turns each, the second after the model's own first answer); Math = math_reasoning (GSM8K); "
        "Overall = every question. max_new_tokens is per turn (Spec-Bench: 1024).",
    ]
    return notes


def write_specbench(df: pd.DataFrame, out_dir: str | Path = "results/tables", adhoc: bool = True) -> list[Path]:
    """specbench.md and specbench.tex when there are Spec-Bench runs; nothing (no empty file) otherwise."""
    table = specbench_table(df, adhoc)
    return [] if table is None else write_table(table, out_dir)
