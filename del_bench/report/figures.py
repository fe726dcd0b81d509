"""The paper's figures from run records: 1a, 1b, 3a, 3b, 4a, 4b, 4c.

    1a  speedup of each task's best LS(E, γ) (highest tokens/s among that task's calibration grid points, or
        its LS runs) on every task (evaluation runs of that config where they exist, else its grid point)
    1b  tokens/s heatmaps over the LS (E, γ) grid (calibration grid points when the task has them), per
        64-token segment of a prompt, from rounds.jsonl: the first 2 prompts (sorted ids) every grid run
        decoded, first 3 segments; a round's time split evenly over its emitted tokens (segment_speeds)
    3a  speedup of DEL and its ablations per task
    3b  mean time per round split into draft / verify / controller, by the round's γ (DEL runs pooled per E
        setting: a fixed E, as the paper's E = 8, or DEL's own choice)
    4a  τ over the first 200 SD rounds, one line per DEL run (first prompt) of a machine
    4b  τ of one prompt with the matched (top) / mismatched (bottom) confidence band (rounds' conf_matched /
        conf_mismatched) and each draft candidate's confidence, accepted vs rejected (draft_confidences);
        records from before these fields existed get τ alone and a note saying so
    4c  chosen exit layer and its α over one prompt's rounds
    batch  throughput (tokens/s over the batch) and its speedup over Vanilla at the same batch size, against the
        batch size, per method: for a model/machine/task/length block with runs at two or more batch sizes

Each figure function returns a matplotlib Figure (so tests can check axes and labels) or None when the
records do not allow it; write_figures() saves them as PNG + PDF with fixed metadata (no creation date,
no software stamp), so the same records give byte-identical files. The Agg backend keeps this headless.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:  # headless everywhere, except that a notebook keeps its inline backend
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from del_bench.methods.dynamic_exit import DEFAULT_OMEGA, VARIANT_LABELS  # noqa: E402
from del_bench.records import method_label  # noqa: E402

from .collect import aggregate, load_rounds, segment_speeds  # noqa: E402,F401  (load_rounds: re-exported)
from .tables import TABLE3_TASKS, TASK_LABELS, in_experiment  # noqa: E402

ABLATIONS = ["del", "del_e", "del_gamma", "del_e_lim"]
DEL_READINGS = (VARIANT_LABELS[""], VARIANT_LABELS["Alg1"])  # DEL as its authors' code runs it; Algorithm 1 as printed
MAX_ROUNDS_4A = 200  # the paper's Figure 4a: τ over 200 SD rounds
MAX_LINES_4A = 10  # runs per τ plot: more lines are unreadable
SEGMENT_TOKENS = 64  # Figure 1b: the paper's segment length
MAX_PROMPTS_1B = 2  # rows of Figure 1b (the paper: two prompts)
MAX_SEGMENTS_1B = 3  # columns of Figure 1b (the paper: three segments per prompt)
# matplotlib writes its version and the time into files by default: both off, so reruns are byte-identical
SAVE_METADATA = {".png": {"Software": None}, ".pdf": {"CreationDate": None}}
BLOCK_KEYS = ["model", "machine", "decoding", "max_new_tokens"]  # runs comparable within one figure


def _tasks_in_order(tasks) -> list[str]:
    tasks = set(tasks)
    return [t for t in TABLE3_TASKS if t in tasks] + sorted(tasks - set(TABLE3_TASKS))


def _block_title(model, machine, decoding="greedy", max_new_tokens="") -> str:
    extra = [d for d in (decoding if decoding != "greedy" else "", f"max {max_new_tokens}" if max_new_tokens else "")
             if d]
    return f"{model} ({machine}{', ' + ', '.join(extra) if extra else ''})"


# ---------------------------------------------------------------- Figure 1a

def _largest(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (task, E, γ) one aggregated row: the largest prompt set, then the longest generation."""
    rows = rows.assign(_len=pd.to_numeric(rows.max_new_tokens, errors="coerce").fillna(0))
    rows = rows.sort_values(["n", "_len", "prompts"], ascending=[False, False, True], kind="stable")
    return rows.drop_duplicates(["task", "exit_layer", "gamma"]).drop(columns="_len")


def _ls_grid(df: pd.DataFrame) -> pd.DataFrame:
    """LS runs aggregated over repeats (with their sample_set: calibration grid points or evaluation)."""
    return aggregate(df[(df.method == "ls") & (df.exit_layer != "") & (df.gamma != "")])


def _ls_label(cfg: tuple[float, float]) -> str:
    """LS(E-γ) of an (E, γ) pair, as the tables label it."""
    return method_label("ls", {"exit_layer": cfg[0], "gamma": cfg[1]})


def best_ls_configs(agg: pd.DataFrame) -> dict[str, tuple[float, float]]:
    """task → (E, γ) with the highest mean tokens/s among that task's LS runs — its calibration grid points
    (`calibrate`, sample_set=calibration) when it has any, else all its LS runs. Ties: smaller E, then γ."""
    best = {}
    for task in _tasks_in_order(agg.task):
        rows = agg[agg.task == task]
        if (rows.sample_set == "calibration").any():
            rows = rows[rows.sample_set == "calibration"]
        rows = _largest(rows).assign(_e=lambda d: d.exit_layer.astype(float), _g=lambda d: d.gamma.astype(float))
        rows = rows.sort_values(["tokens_per_s_mean", "_e", "_g"], ascending=[False, True, True], kind="stable")
        best[task] = (float(rows.iloc[0]._e), float(rows.iloc[0]._g))
    return best


def fig1a(df: pd.DataFrame, title: str = "") -> plt.Figure | None:
    """Bars: for each task's best LS(E, γ) (one colour per config, the colour of the task it was tuned on),
    its speedup on every task — from evaluation runs of that config where they exist, else from the
    calibration grid point (hatched). `df`: the runs of one model/machine/decoding; needs LS on ≥ 2 tasks."""
    agg = _ls_grid(df)
    if agg.empty or agg.task.nunique() < 2:
        return None
    tasks = _tasks_in_order(agg.task)
    best = best_ls_configs(agg)
    evals, calib = _largest(agg[agg.sample_set != "calibration"]), _largest(agg[agg.sample_set == "calibration"])
    configs: dict[tuple, list[str]] = {}
    for task, cfg in best.items():
        configs.setdefault(cfg, []).append(task)
    colours = {t: f"C{i % 10}" for i, t in enumerate(tasks)}
    fig, ax = plt.subplots(figsize=(3.8 + 1.3 * len(tasks), 3.6))
    width = 0.8 / len(configs)
    missing, hatched = [], False
    for i, (cfg, tuned) in enumerate(configs.items()):
        label = f"{_ls_label(cfg)}: best on {', '.join(TASK_LABELS.get(t, t) for t in tuned)}"
        for j, task in enumerate(tasks):
            rec = None
            for rows in (evals, calib):
                hit = rows[(rows.task == task) & (rows.exit_layer.astype(float) == cfg[0])
                           & (rows.gamma.astype(float) == cfg[1])]
                if not hit.empty:
                    rec = hit.iloc[0]
                    break
            if rec is None or not rec.has_vanilla:
                missing.append(f"{_ls_label(cfg)} on {TASK_LABELS.get(task, task)}"
                               + (" (no vanilla)" if rec is not None else ""))
                continue
            x = j + (i - (len(configs) - 1) / 2) * width
            from_calib = rec.sample_set == "calibration"
            hatched |= from_calib
            std = rec.speedup_std
            ax.bar(x, rec.speedup_mean, width, yerr=0 if np.isnan(std) else std, capsize=2,
                   color=colours[tuned[0]], edgecolor="black", linewidth=0.4, hatch="//" if from_calib else None,
                   label=label)
            label = None  # one legend entry per config
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(tasks)), [TASK_LABELS.get(t, t) for t in tasks])
    for tick, task in zip(ax.get_xticklabels(), tasks):
        tick.set_color(colours[task])
    ax.set_xlabel("Task")
    ax.set_ylabel("Speedup over Vanilla (×)")
    ax.set_title(f"Figure 1a: each task's best LS(E, γ) on every task\n{title}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    notes = ["Best (E, γ) of a task: highest tokens/s among its calibration runs (else among its LS runs)."]
    if hatched:
        notes.append("Hatched: no evaluation run of that config, speedup of the calibration grid point.")
    if missing:
        notes.append("No bar: " + "; ".join(missing) + ".")
    fig.text(0.01, 0.01, " ".join(notes), fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * len(notes), 1, 1))
    return fig


# ---------------------------------------------------------------- Figure 1b

def grid_segments(runs: pd.DataFrame, size: int = SEGMENT_TOKENS, max_prompts: int = MAX_PROMPTS_1B,
                  rounds_of=load_rounds) -> pd.DataFrame:
    """Segment tokens/s of the first `max_prompts` prompts (sorted ids) that every LS run in `runs` decoded.

    `runs`: run rows (load_runs) of one model/task/machine/decoding; repeated runs of one (E, γ) are
    averaged per segment. Only repeat 0 of each prompt is used. Columns: exit_layer, gamma, sample_id,
    segment, start, end, tokens_per_s."""
    per_run = {}
    for run in runs.itertuples():
        rounds = rounds_of(run.run_dir)
        per_run[run.run_dir] = (float(run.exit_layer), float(run.gamma), rounds[rounds.repeat == 0])
    if not per_run:
        return pd.DataFrame(columns=["exit_layer", "gamma", "sample_id", "segment", "start", "end", "tokens_per_s"])
    shared = set.intersection(*(set(r.sample_id) for _, _, r in per_run.values()))
    prompts = sorted(shared)[:max_prompts]
    rows = []
    for e, g, rounds in per_run.values():
        for sid in prompts:
            for seg in segment_speeds(rounds[rounds.sample_id == sid], size).itertuples():
                rows.append({"exit_layer": e, "gamma": g, "sample_id": sid, "segment": seg.segment,
                             "start": seg.start, "end": seg.end, "tokens_per_s": seg.tokens_per_s})
    out = pd.DataFrame(rows, columns=["exit_layer", "gamma", "sample_id", "segment", "start", "end", "tokens_per_s"])
    return (out.groupby(["sample_id", "segment", "exit_layer", "gamma"], as_index=False)
            .agg(start=("start", "min"), end=("end", "max"), tokens_per_s=("tokens_per_s", "mean")))


def fig1b(segments: pd.DataFrame, title: str = "", max_segments: int = MAX_SEGMENTS_1B) -> plt.Figure | None:
    """Heatmaps of segment tokens/s over the (E, γ) grid: one row per prompt, one column per segment; the
    best cell of each heatmap is boxed. Needs ≥ 2 grid points."""
    if segments.empty or len(segments[["exit_layer", "gamma"]].drop_duplicates()) < 2:
        return None
    es = sorted(segments.exit_layer.unique())
    gs = sorted(segments.gamma.unique())
    prompts = sorted(segments.sample_id.unique())
    ncols = min(max_segments, int(segments.segment.max()) + 1)
    fig, axes = plt.subplots(len(prompts), ncols, figsize=(max(5.5, 0.6 + 2.5 * ncols), 1.3 + 2.3 * len(prompts)),
                             squeeze=False)
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    for r, sid in enumerate(prompts):
        for c in range(ncols):
            ax = axes[r][c]
            seg = segments[(segments.sample_id == sid) & (segments.segment == c)]
            grid = np.full((len(es), len(gs)), np.nan)
            for row in seg.itertuples():
                grid[es.index(row.exit_layer), gs.index(row.gamma)] = row.tokens_per_s
            image = ax.imshow(np.ma.masked_invalid(grid), origin="lower", aspect="auto", cmap=cmap)
            for i in range(len(es)):
                for j in range(len(gs)):
                    if not np.isnan(grid[i, j]):  # dark text on the bright end of the colour map
                        bright = image.norm(grid[i, j]) > 0.6
                        ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=6,
                                color="black" if bright else "white")
            if not np.isnan(grid).all():
                i, j = np.unravel_index(np.nanargmax(grid), grid.shape)
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.5))
            span = f"tokens {int(seg.start.min())}–{int(seg.end.max()) - 1}" if not seg.empty else "no tokens"
            ax.set_title(f"{sid}\n{span}", fontsize=7)
            ax.set_xticks(range(len(gs)), [f"{g:g}" for g in gs], fontsize=7)
            ax.set_yticks(range(len(es)), [f"{e:g}" for e in es], fontsize=7)
            ax.set_xlabel("γ (draft length)", fontsize=7)
            ax.set_ylabel("Exit layer E", fontsize=7)
    fig.suptitle(f"Figure 1b: tokens/s per {SEGMENT_TOKENS}-token segment, LS (E, γ) grid\n{title}", fontsize=8)
    fig.text(0.01, 0.01, "Segment tokens/s = its tokens ÷ the time of the rounds that produced them (a round's "
             "draft + verify + policy time split evenly over its emitted tokens; prefill counts for token 0). "
             "Red box = best; grey = no run or no tokens.", fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ---------------------------------------------------------------- Figure 3a

def fig3a(df: pd.DataFrame, model: str, machine: str, title: str = "") -> plt.Figure | None:
    """Grouped bars: speedup of DEL and its ablations per task (mean over repeats, ± std as error bars)."""
    sel = df[(df.model == model) & (df.machine == machine) & df.method.isin(ABLATIONS) & df.has_vanilla]
    # DEL's two readings at their own settings (not DEL-CPU, DEL (KnapSpec's), another ω or a fixed E: other figures')
    sel = sel[(sel.method != "del") | sel.label.isin(DEL_READINGS)]
    if sel.empty:
        return None
    # one bar a label: DEL beside DEL (Alg. 1), its other reading (methods.dynamic_exit.variant), in the tables' order
    stats = sel.groupby(["task", "label"])["speedup"].agg(["mean", "std"]).reset_index()
    tasks = _tasks_in_order(stats.task)
    labels = list(dict.fromkeys(sel.sort_values(["order", "label"], kind="stable").label))
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(tasks), 3.2))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        rows = stats[stats.label == label].set_index("task").reindex(tasks)
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(tasks))]
        ax.bar(xs, rows["mean"], width, yerr=rows["std"].fillna(0), label=label, capsize=2)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(tasks)), [TASK_LABELS.get(t, t) for t in tasks])
    ax.set_xlabel("Task")
    ax.set_ylabel("Speedup over Vanilla (×)")
    ax.set_title(f"Figure 3a: DEL ablations\n{title or f'{model} ({machine})'}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- batched decoding

def fig_batch(block: pd.DataFrame, title: str) -> plt.Figure | None:
    """Two panels against the batch size (one block: a model, machine, decoding, length and task), one line per
    method config (mean over repeats): throughput — all tokens ÷ the batch's wall seconds (records.throughput) — and
    its speedup over Vanilla's at the same batch size. None unless the block has runs at two or more batch sizes."""
    runs = block[block.throughput.notna()]
    if runs.batch_size.nunique() < 2:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    for (label, _), lines in runs.groupby(["label", "method_tag"], sort=True):  # label: the method's own (records)
        points = lines.groupby("batch_size")[["throughput", "throughput_speedup"]].mean().sort_index()
        left.plot(points.index, points.throughput, marker="o", label=label)
        right.plot(points.index, points.throughput_speedup, marker="o", label=label)
    for ax, ylabel in ((left, "Throughput (tokens/s over the batch)"), (right, "Speedup over Vanilla at the same B")):
        sizes = sorted(runs.batch_size.unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("Batch size B")
        ax.set_ylabel(ylabel, fontsize=8)
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.legend(fontsize=7)
    fig.suptitle(f"Batched decoding: {title}", fontsize=9)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- Figure 3b

def fig3b(rounds: pd.DataFrame, title: str, note: str = "") -> plt.Figure | None:
    """Stacked bars by the round's γ (tokens actually drafted; 0 = a round the method chose not to draft):
    mean draft, verify and controller (policy_s: the method's own time, DEL's shadow tokens included) time
    per round. The prefill round is left out. `rounds`: one run's rounds or several runs' concatenated."""
    r = rounds[(rounds["round"] > 0)].dropna(subset=["drafted"])
    if r.empty:
        return None
    stats = r.groupby("drafted")[["draft_s", "verify_s", "policy_s"]].mean() * 1000
    counts = r.groupby("drafted").size()
    gammas = [int(x) for x in stats.index]
    xs = np.arange(len(gammas))  # categorical: γ values can be sparse (DEL: 0 and 18 only, say)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 + 0.4 * len(xs)), 3.4))
    bottom = np.zeros(len(xs))
    for col, label in (("draft_s", "Draft"), ("verify_s", "Verify"), ("policy_s", "Controller (policy)")):
        ax.bar(xs, stats[col].to_numpy(), 0.7, bottom=bottom, label=label)
        bottom += stats[col].to_numpy()
    for x, top, n in zip(xs, bottom, counts):
        ax.text(x, top, f"{n}", ha="center", va="bottom", fontsize=6)
    exits = sorted({int(e) for e in r.loc[r.drafted > 0, "exit_layer"].dropna()})
    where = (f"E = {exits[0]}" if len(exits) == 1 else f"E {exits[0]}–{exits[-1]} pooled") if exits else "no drafts"
    ax.set_xticks(xs, [str(g) for g in gammas])
    ax.set_xlabel("γ (tokens drafted in the round)")
    ax.set_ylabel("Mean time per round (ms)")
    ax.set_title(f"Figure 3b: runtime breakdown by γ, {where}\n{title}", fontsize=8)
    ax.legend(fontsize=7)
    ax.margins(y=0.1)
    if len(xs) < 3:  # a lone bar would fill the axes
        ax.set_xlim(-1.5, len(xs) + 0.5)
    fig.text(0.01, 0.01, (note + " " if note else "") + "Number above a bar = rounds averaged. Controller = the "
             "method's own time (plan, keep-drafting checks, observe; DEL's shadow tokens).", fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


# ---------------------------------------------------------------- Figures 4a–4c

def _first_output(rounds: pd.DataFrame) -> pd.DataFrame:
    return rounds[(rounds.sample_id == rounds.sample_id.iloc[0]) & (rounds.repeat == rounds.repeat.iloc[0])]


def fig4a(lines: dict[str, pd.DataFrame], title: str, max_rounds: int = MAX_ROUNDS_4A) -> plt.Figure | None:
    """τ (the draft-exit confidence threshold) over the first `max_rounds` SD rounds, one line per entry of
    `lines` (label → one run's rounds; its first prompt is drawn), as the paper's "across models and
    datasets"."""
    lines = {label: r.dropna(subset=["tau"]) for label, r in lines.items()}
    lines = {label: _first_output(r) for label, r in lines.items() if not r.empty}
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    for label, first in list(lines.items())[:MAX_LINES_4A]:
        first = first[first["round"] <= max_rounds]
        ax.plot(first["round"], first["tau"], lw=1, label=label)
    ax.set_xlabel("SD round")
    ax.set_ylabel("τ (draft-exit threshold)")
    ax.set_title(f"Figure 4a: τ over the first {max_rounds} rounds (first prompt of each run)\n{title}", fontsize=8)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if len(lines) > MAX_LINES_4A:
        fig.text(0.01, 0.01, f"{len(lines) - MAX_LINES_4A} more run(s) not drawn.", fontsize=6)
    fig.tight_layout()
    return fig


BAND_MISSING = ("no confidence band: the records lack conf_matched / conf_mismatched (DEL's decayed mean "
                "confidence of matched / mismatched shadow tokens at E) and draft_confidences")


def fig4b(rounds: pd.DataFrame, title: str) -> plt.Figure | None:
    """τ over the first prompt's rounds with the range between the mean confidence of matched (top) and
    mismatched (bottom) shadow tokens at the chosen exit layer (τ is their midpoint) when the rounds
    record conf_matched / conf_mismatched; each draft's confidence, accepted vs rejected, when they record
    draft_confidences. Without either, τ alone with a note saying what is missing."""
    rounds = rounds.dropna(subset=["tau"])
    if rounds.empty:
        return None
    first = _first_output(rounds)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    shown = []
    band = first.dropna(subset=["conf_matched", "conf_mismatched"])
    if not band.empty:
        ax.fill_between(band["round"], band["conf_mismatched"], band["conf_matched"], color="lightblue", alpha=0.6,
                        lw=0, label="matched (top) – mismatched (bottom) confidence")
        shown.append("band")
    drafts = first.dropna(subset=["draft_confidences"])
    if not drafts.empty:
        acc_x, acc_y, rej_x, rej_y = [], [], [], []
        for rnd in drafts.itertuples():
            for i, conf in enumerate(rnd.draft_confidences):
                (acc_x if i < rnd.accepted else rej_x).append(rnd.round)
                (acc_y if i < rnd.accepted else rej_y).append(conf)
        ax.scatter(acc_x, acc_y, s=4, color="C2", label="accepted draft")
        ax.scatter(rej_x, rej_y, s=4, color="C3", label="rejected / dropped draft")
        shown.append("drafts")
    ax.plot(first["round"], first["tau"], color="C0", lw=1.2, label="τ at the chosen E")
    ax.set_xlabel("SD round")
    ax.set_ylabel("Confidence / τ")
    ax.set_title(f"Figure 4b: τ and the confidence range\n{title} ({first.sample_id.iloc[0]})", fontsize=9)
    ax.legend(fontsize=7)
    if not shown:
        fig.text(0.01, 0.01, BAND_MISSING, fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0 if shown else 0.08, 1, 1))
    return fig


def fig4c(rounds: pd.DataFrame, title: str) -> plt.Figure | None:
    """Chosen exit layer (left axis) and its acceptance estimate α (right axis) over the first prompt's rounds."""
    rounds = rounds.dropna(subset=["chosen_exit_layer"])
    if rounds.empty:
        return None
    first = _first_output(rounds)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.step(first["round"], first["chosen_exit_layer"], where="post", color="C0", lw=1)
    ax.set_xlabel("SD round")
    ax.set_ylabel("Chosen exit layer E", color="C0")
    right = ax.twinx()
    right.plot(first["round"], first["alpha_exit"], color="C1", lw=1)
    right.set_ylabel("α at the chosen exit layer", color="C1")
    ax.set_title(f"Figure 4c: exit layer and α\n{title} ({first.sample_id.iloc[0]})", fontsize=9)
    ax.yaxis.get_major_locator().set_params(integer=True)  # layers are whole numbers
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- all figures

def default_del_runs(df: pd.DataFrame) -> pd.DataFrame:
    """DEL runs at the paper's ω (0.95), one per configuration and task (the first run directory of
    repeats): the runs Figures 4a–4c are drawn for (ω variants belong to Table 6)."""
    runs = df[(df.method == "del") & (df.omega.map(lambda w: w == "" or float(w) == DEFAULT_OMEGA))]
    keys = ["model", "machine", "decoding", "max_new_tokens", "task", "method_tag"]
    return runs.sort_values(keys + ["run_dir"]).drop_duplicates(keys)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_")


def _spec_bench_only(experiments) -> bool:
    return bool(experiments) and all(in_experiment([e], "specbench") for e in experiments)


def iter_figures(df: pd.DataFrame):
    """(name, Figure) for every figure the records allow, in a stable order: 1a per model/machine/decoding;
    3a, 3b (per E setting) per model/machine/decoding/length block; 1b per block and task; 4a per machine;
    4b/4c per default DEL run. One at a time, so a caller can save and close each before the next is drawn.
    Runs of Spec-Bench sweeps only (run_key.experiments all specbench*) have their own table, not these figures.
    The paper's figures draw runs at batch size 1 (as the paper decoded); runs at other batch sizes draw the batch
    figure, per block and task, beside those at batch size 1."""
    if "experiments" in df:
        df = df[~df["experiments"].map(_spec_bench_only)]
    if df.empty:
        return
    taken: set[str] = set()
    if "batch_size" in df and "throughput" in df:
        for key, block in df.groupby(BLOCK_KEYS, sort=True):
            for task, runs in block.groupby("task", sort=True):
                fig = fig_batch(runs, f"{TASK_LABELS.get(task, task)}, {_block_title(*key)}")
                if fig:
                    yield _unique(taken, f"batch_{_slug(f'{key[0]}_{key[1]}_{key[2]}_max{key[3]}')}_{_slug(task)}"), fig
        df = df[df["batch_size"].astype(int) == 1]
        if df.empty:
            return
    cache: dict[str, pd.DataFrame] = {}

    def rounds_of(run_dir: str) -> pd.DataFrame:
        if run_dir not in cache:
            cache[run_dir] = load_rounds(run_dir)
        return cache[run_dir]

    for (model, machine, decoding), group in df.groupby(["model", "machine", "decoding"], sort=True):
        # 1a across generation lengths: calibration grid points (256 tokens in the paper) choose the configs
        fig = fig1a(group, _block_title(model, machine, decoding))
        if fig:
            yield _unique(taken, f"fig1a_{_slug(f'{model}_{machine}_{decoding}')}"), fig
    for key, block in df.groupby(BLOCK_KEYS, sort=True):
        model, machine, decoding, max_new = key
        title = _block_title(model, machine, decoding, max_new)
        stem = _slug(f"{model}_{machine}_{decoding}_max{max_new}")
        fig = fig3a(block, model, machine, title)
        if fig:
            yield _unique(taken, f"fig3a_{stem}"), fig
        dels = block[block.method == "del"].sort_values("run_dir")
        for exit_layer, runs in dels.groupby(dels.exit_layer.astype(str), sort=True):
            # 3b: the rounds of every DEL run with one E setting (a fixed E, as the paper's E = 8, or DEL's own)
            tasks = ", ".join(TASK_LABELS.get(t, t) for t in _tasks_in_order(runs.task))
            fig = fig3b(pd.concat([rounds_of(d) for d in runs.run_dir], ignore_index=True), title,
                        f"Rounds of {len(runs)} DEL run(s) pooled ({tasks}"
                        + (f"; E fixed at {float(exit_layer):g})." if exit_layer else "; E chosen by DEL)."))
            if fig:
                yield _unique(taken, f"fig3b_{stem}" + (f"_E{float(exit_layer):g}" if exit_layer else "")), fig
        ls = block[(block.method == "ls") & (block.exit_layer != "") & (block.gamma != "")]
        for task, runs in ls.groupby("task", sort=True):
            calibrated = df[(df.model == model) & (df.machine == machine) & (df.decoding == decoding)
                            & (df.task == task) & (df.method == "ls") & (df.sample_set == "calibration")]
            if not calibrated.empty:  # the grid search's points are the heatmap's grid (paper §3)
                runs = runs[runs.sample_set == "calibration"]
            fig = fig1b(grid_segments(runs.sort_values("run_dir"), rounds_of=rounds_of),
                        f"{TASK_LABELS.get(task, task)}, {title}")
            if fig:
                yield _unique(taken, f"fig1b_{stem}_{_slug(task)}"), fig
    runs = default_del_runs(df)
    for machine, group in runs.groupby("machine", sort=True):
        labels = [f"{r.model} {TASK_LABELS.get(r.task, r.task)}" + ("" if r.decoding == "greedy" else f" {r.decoding}")
                  + ("" if r.max_new_tokens in ("", "512") else f" max {r.max_new_tokens}") for r in group.itertuples()]
        tagged = [lab if labels.count(lab) == 1 else f"{lab} [{tag}]" for lab, tag in zip(labels, group.method_tag)]
        fig = fig4a(dict(zip(tagged, (rounds_of(d) for d in group.run_dir))), machine)
        if fig:
            yield _unique(taken, f"fig4a_{_slug(machine)}"), fig
    for run in runs.itertuples():
        rounds = rounds_of(run.run_dir)
        title = f"{run.model} {TASK_LABELS.get(run.task, run.task)} {run.method_tag}"
        stem = _slug(f"{run.model}_{run.task}_{run.method_tag}_{Path(run.run_dir).name}")
        for name, fn in (("fig4b", fig4b), ("fig4c", fig4c)):
            fig = fn(rounds, title)
            if fig:
                yield _unique(taken, f"{name}_{stem}"), fig


def build_figures(df: pd.DataFrame) -> dict[str, plt.Figure]:
    """name → Figure for every figure the records allow (all open at once: for tests and notebooks)."""
    return dict(iter_figures(df))


def _unique(taken: set, name: str) -> str:
    """Two runs with the same model, task, tag and directory name (under different roots) get _2, _3, …"""
    out, k = name, 1
    while out in taken:
        k += 1
        out = f"{name}_{k}"
    taken.add(out)
    return out


def save_figure(fig: plt.Figure, path: Path) -> None:
    fig.savefig(path, dpi=150, metadata=SAVE_METADATA.get(path.suffix))


FIGURE_FILES = re.compile(r"(fig(1a|1b|3a|3b|4a|4b|4c)|batch)_.+\.(png|pdf)")


def write_figures(df: pd.DataFrame, out_dir: str | Path = "results/figures", prune: bool = True) -> list[Path]:
    """Save every figure as PNG + PDF. prune: remove figure files of ours (fig1a_…, …, fig4c_….png/pdf) that
    this run did not write — left over from records that are gone — so the directory matches the records."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in iter_figures(df):
        for suffix in (".png", ".pdf"):
            path = out_dir / f"{name}{suffix}"
            save_figure(fig, path)
            written.append(path)
        plt.close(fig)
    if prune:
        for path in sorted(out_dir.iterdir()):
            if FIGURE_FILES.fullmatch(path.name) and path not in written:
                path.unlink()
    return written
