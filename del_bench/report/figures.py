"""Figures 3a (ablation speedups) and 4a/4c (DEL's τ, exit layer and α over SD rounds) from run records.

Each figure function returns a matplotlib Figure (so tests can check axes and labels); write_figures()
saves them as PNG + PDF. The Agg backend keeps this headless and offline.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import pandas as pd  # noqa: E402

from .collect import read_jsonl  # noqa: E402
from .tables import METHOD_LABELS, TABLE3_TASKS, TASK_LABELS  # noqa: E402

ABLATIONS = ["del", "del_e", "del_gamma", "del_e_lim"]
MAX_SAMPLES_4A = 3  # lines per τ plot: more than a few prompts is unreadable


def fig3a(df: pd.DataFrame, model: str, machine: str) -> plt.Figure | None:
    """Grouped bars: speedup of DEL and its ablations per task (mean over repeats, ± std as error bars)."""
    sel = df[(df.model == model) & (df.machine == machine) & df.method.isin(ABLATIONS) & df.has_vanilla]
    if sel.empty:
        return None
    stats = sel.groupby(["task", "method"])["speedup"].agg(["mean", "std"]).reset_index()
    tasks = [t for t in TABLE3_TASKS if t in set(stats.task)] + sorted(set(stats.task) - set(TABLE3_TASKS))
    methods = [m for m in ABLATIONS if m in set(stats.method)]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(tasks), 3.2))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        rows = stats[stats.method == method].set_index("task").reindex(tasks)
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(tasks))]
        ax.bar(xs, rows["mean"], width, yerr=rows["std"].fillna(0), label=METHOD_LABELS[method], capsize=2)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(tasks)), [TASK_LABELS.get(t, t) for t in tasks])
    ax.set_xlabel("Task")
    ax.set_ylabel("Speedup over Vanilla (×)")
    ax.set_title(f"Figure 3a: DEL ablations\n{model} ({machine})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _trace(rnd: dict, name: str):
    """DEL's per-round statistics live at the top level of a round record, and also under trace."""
    value = rnd.get(name)
    return value if value is not None else (rnd.get("trace") or {}).get(name)


def load_rounds(run_dir: str | Path) -> pd.DataFrame:
    rows = [{"sample_id": r["sample_id"], "repeat": r.get("repeat", 0), "round": r["round"],
             "tau": _trace(r, "tau"), "chosen_exit_layer": _trace(r, "chosen_exit_layer"),
             "alpha_exit": _trace(r, "alpha_exit")} for r in read_jsonl(Path(run_dir) / "rounds.jsonl")]
    return pd.DataFrame(rows, columns=["sample_id", "repeat", "round", "tau", "chosen_exit_layer", "alpha_exit"])


def fig4a(rounds: pd.DataFrame, title: str) -> plt.Figure | None:
    """τ (the draft-exit confidence threshold) over SD rounds, one line per prompt (first few)."""
    rounds = rounds.dropna(subset=["tau"])
    if rounds.empty:
        return None
    fig, ax = plt.subplots(figsize=(5, 3))
    for (sid, rep), g in list(rounds.groupby(["sample_id", "repeat"], sort=False))[:MAX_SAMPLES_4A]:
        ax.plot(g["round"], g["tau"], lw=1, label=f"{sid}" + (f" #{rep}" if rep else ""))
    ax.set_xlabel("SD round")
    ax.set_ylabel("τ (draft-exit threshold)")
    ax.set_title(f"Figure 4a: τ over rounds\n{title}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def fig4c(rounds: pd.DataFrame, title: str) -> plt.Figure | None:
    """Chosen exit layer (left axis) and its acceptance estimate α (right axis) over the first prompt's rounds."""
    rounds = rounds.dropna(subset=["chosen_exit_layer"])
    if rounds.empty:
        return None
    first = rounds[(rounds.sample_id == rounds.sample_id.iloc[0]) & (rounds.repeat == rounds.repeat.iloc[0])]
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


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_")


def build_figures(df: pd.DataFrame) -> dict[str, plt.Figure]:
    """name → Figure for every figure the records allow (Figure 3a per model/machine, 4a/4c per DEL run)."""
    figures = {}
    for (model, machine), _ in df.groupby(["model", "machine"]) if not df.empty else []:
        fig = fig3a(df, model, machine)
        if fig:
            figures[_slug(f"fig3a_{model}_{machine}")] = fig
    for _, run in df[df.method == "del"].iterrows() if not df.empty else []:
        rounds = load_rounds(run.run_dir)
        title = f"{run.model} {TASK_LABELS.get(run.task, run.task)} {run.method_tag}"
        stem = _slug(f"{run.model}_{run.task}_{run.method_tag}_{Path(run.run_dir).name}")
        for name, fn in (("fig4a", fig4a), ("fig4c", fig4c)):
            fig = fn(rounds, title)
            if fig:
                figures[f"{name}_{stem}"] = fig
    return figures


def write_figures(df: pd.DataFrame, out_dir: str | Path = "results/figures") -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in build_figures(df).items():
        for suffix in (".png", ".pdf"):
            path = out_dir / f"{name}{suffix}"
            fig.savefig(path, dpi=150)
            written.append(path)
        plt.close(fig)
    return written
