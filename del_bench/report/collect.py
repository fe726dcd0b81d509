"""Read run records (summary.json + samples.jsonl) into pandas, and pair every run with its Vanilla run.

The report only reads records: it never decodes, never writes into a run directory (so it does not use
records.RunDir, whose reader trims torn lines in place), and never guesses a missing Vanilla partner.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Iterable

import pandas as pd

DEFAULT_ROOTS = ("results/runs",)

# a Vanilla partner must match on all of these: same model, task, decoding, prompts and machine
PAIR_KEYS = ["model", "task", "decoding", "prompts", "machine"]
# runs sharing all of these are repeats of one configuration (averaged as mean ± std)
CONFIG_KEYS = PAIR_KEYS + ["method", "method_tag", "exit_layer", "gamma", "omega"]


def find_runs(roots: Iterable[str | Path] = DEFAULT_ROOTS) -> list[Path]:
    """Every directory holding a summary.json under the roots (a root may itself be a run directory)."""
    found = set()
    for root in map(Path, roots):
        if (root / "summary.json").is_file():
            found.add(root)
        if root.is_dir():
            found.update(p.parent for p in root.rglob("summary.json"))
    return sorted(found)


def read_jsonl(path: Path) -> list[dict]:
    """Complete lines only (a torn last line of an interrupted run is skipped, not repaired)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _mean(values: list) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else math.nan


def _prompts_id(samples: list[dict], summary: dict) -> str:
    """Short fingerprint of the prompt set: runs are only comparable on the same sample ids."""
    ids = sorted({str(s["sample_id"]) for s in samples})
    if not ids:  # no samples file: fall back to what the summary says about the prompt set
        cfg = summary.get("config", {})
        ids = [f"limit={cfg.get('limit')}", f"n={summary.get('n_samples')}"]
    text = f"{summary.get('task_version')}|" + "\n".join(ids)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def _machine(summary: dict) -> str:
    prov = summary.get("provenance", {})
    return f"{prov.get('device', '?')}/{prov.get('cpu', '?')}"


def load_run(run_dir: str | Path) -> dict:
    """One row: the run's identity, its speed/eTPL (means over samples, as in the summary) and quality."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = read_jsonl(run_dir / "samples.jsonl")
    method_cfg = summary.get("config", {}).get("method", {})
    # paper B.4: speed and eTPL are means over samples; recomputed from samples when present
    tps = _mean([s.get("tokens_per_s") for s in samples]) if samples else summary.get("tokens_per_s")
    etpl = _mean([s.get("etpl") for s in samples]) if samples else summary.get("etpl")
    row = {
        "run_dir": str(run_dir),
        "model": summary["model"],
        "task": summary["task"],
        "method": summary["method"],
        "method_tag": summary.get("method_tag", summary["method"]),
        "exit_layer": method_cfg.get("exit_layer"),
        "gamma": method_cfg.get("gamma"),
        "omega": method_cfg.get("omega"),
        "decoding": summary.get("decoding", "greedy"),
        "n": summary.get("n_samples", len(samples)),
        "tokens_per_s": math.nan if tps is None else float(tps),
        "etpl": math.nan if etpl is None else float(etpl),
        "acceptance": summary.get("acceptance_rate"),
        "machine": _machine(summary),
        "prompts": _prompts_id(samples, summary),
        "seed": summary.get("config", {}).get("seed"),
    }
    for name, value in (summary.get("quality") or {}).items():
        row[f"q_{name}"] = value
    return row


def load_runs(roots: Iterable[str | Path] = DEFAULT_ROOTS) -> pd.DataFrame:
    """All runs under the roots, one row each, with `speedup` and `vanilla_tps` filled where paired."""
    rows = [load_run(d) for d in find_runs(roots)]
    df = pd.DataFrame(rows, columns=None if rows else ["run_dir"] + CONFIG_KEYS + ["tokens_per_s", "etpl"])
    # None in the key columns (Vanilla has no E/γ/ω) would make groupby drop rows; use "" instead
    for col in ("exit_layer", "gamma", "omega"):
        df[col] = df[col].astype(object).where(df[col].notna(), "")
    return add_speedup(df)


def add_speedup(df: pd.DataFrame) -> pd.DataFrame:
    """speedup = tokens/s ÷ the Vanilla tokens/s of the same model, task, decoding, prompts, machine.

    Several Vanilla runs with the same key (repeats) are averaged. No partner → NaN and has_vanilla False.
    """
    df = df.copy()
    vanilla = (df[df["method"] == "vanilla"].groupby(PAIR_KEYS)["tokens_per_s"].mean()
               .rename("vanilla_tps").reset_index())
    df = df.drop(columns=["vanilla_tps"], errors="ignore").merge(vanilla, on=PAIR_KEYS, how="left")
    df["has_vanilla"] = df["vanilla_tps"].notna()
    df["speedup"] = df["tokens_per_s"] / df["vanilla_tps"]
    return df


def aggregate(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: mean, std and count of eTPL, tokens/s and speedup over its repeats."""
    metrics = ["etpl", "tokens_per_s", "speedup"]
    grouped = df.groupby(CONFIG_KEYS, dropna=False, sort=False)
    out = grouped[metrics].agg(["mean", "std"])
    out.columns = [f"{m}_{stat}" for m, stat in out.columns]
    out["runs"] = grouped.size()
    out["n"] = grouped["n"].max()
    out["has_vanilla"] = grouped["has_vanilla"].all()
    out["vanilla_tps"] = grouped["vanilla_tps"].mean()  # the same partner for every repeat
    return out.reset_index()
