"""Read run records (summary.json + samples.jsonl + rounds.jsonl) into pandas; pair runs with Vanilla.

The report only reads records: it never decodes, never writes into a run directory (so it does not use
records.RunDir, whose reader trims torn lines in place), and never guesses a missing Vanilla partner.

    load_runs(roots)      one row per run (speed, eTPL, throughput over the batch, quality, memory), `speedup` vs
                          its Vanilla partners
                          (records.vanilla_baseline: the one pairing rule) and, for greedy runs, how many
                          outputs equal that partner's token for token (`outputs_equal` of `outputs_compared`);
                          `busy_samples`: samples timed on an overloaded machine (records.overloaded), which
                          exclude_busy=True leaves out; `unsteady`: not timed at steady state
                          (records.steady_state), which exclude_unsteady=True leaves out
    aggregate(df)         one row per configuration: mean/std/count over repeats (seeds or repeated runs)
    load_rounds(run_dir)  one row per SD round (timings, DEL's τ/E/α trace) for the figures
    segment_speeds(...)   tokens/s per fixed-length segment of one output, from its rounds (Figure 1b)
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Iterable

import pandas as pd

from del_bench.averages import mean
from del_bench.numerics import compare
from del_bench.records import (
    RunKey,
    batch_etpl,
    drifted,
    load_summary,
    machine_probe,
    read_jsonl,
    run_key_of,
    steady_state,
    throughput,
    unsteady,
    vanilla_baseline,
    vanilla_partners,
)

# the committed reference records behind results/tables and results/figures (working runs: results/runs)
REFERENCE_ROOT = "results/reference"
DEFAULT_ROOTS = (REFERENCE_ROOT,)

# a Vanilla partner must match on all of these (RunKey.PAIR_FIELDS: the one pairing rule)
PAIR_KEYS = list(RunKey.PAIR_FIELDS)
# runs sharing all of these are repeats of one configuration (averaged as mean ± std); the seed is not a key,
# so runs that differ only in seed (same prompts) or repeated runs into other out_dirs are repeats. label, family,
# order and note are what the method's class says of the run (records.method_entry), functions of its hyperparameters
CONFIG_KEYS = PAIR_KEYS + ["method", "method_tag", "label", "family", "order", "note", "exit_layer", "gamma", "omega"]
GIB = 2**30  # memory is reported in GiB, as torch.cuda.max_memory_allocated figures usually are


def find_runs(roots: Iterable[str | Path] = DEFAULT_ROOTS) -> list[Path]:
    """Every directory holding a summary.json under the roots (a root may itself be a run directory)."""
    found = set()
    for root in map(Path, roots):
        if (root / "summary.json").is_file():
            found.add(root)
        if root.is_dir():
            found.update(p.parent for p in root.rglob("summary.json"))
    return sorted(found)


def _float(value) -> float:
    return math.nan if value is None else float(value)


def load_run(run_dir: str | Path) -> dict:
    """One row: the run's identity (its RunKey), speed/eTPL (means over samples, as in the summary), quality,
    memory, and a digest of each output (for the lossless check against its Vanilla partner)."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = read_jsonl(run_dir / "samples.jsonl")
    key = run_key_of(summary, samples)
    # paper B.4: speed and eTPL are means over samples; recomputed from samples when present
    tps = mean([s.get("tokens_per_s") for s in samples], math.nan) if samples else summary.get("tokens_per_s")
    etpl = mean([s.get("etpl") for s in samples], math.nan) if samples else summary.get("etpl")
    load = load_summary(samples) or {}
    setup = read_jsonl(run_dir / "setup.jsonl")
    entry = key.entry()
    row = {
        "run_dir": str(run_dir),
        "run_key": key,
        **{f: getattr(key, f) for f in PAIR_KEYS},
        "max_new_tokens": str(key.max_new_tokens),
        "method": key.method,
        "method_tag": key.method_tag,
        "label": entry.label,  # as the method's class names the run: LS(E4-γ4), DEL-CPU (records.method_entry)
        "family": entry.family,
        "order": entry.order,
        "note": entry.note or "",
        "exit_layer": key.hyperparameter("exit_layer"),
        "gamma": key.hyperparameter("gamma"),
        "omega": key.hyperparameter("omega"),
        "experiments": key.experiments,
        "n": summary.get("n_samples", len(samples)),
        "tokens_per_s": _float(tps),
        "etpl": _float(etpl),
        # over the batch (all tokens ÷ the batch's wall seconds, ÷ the layers it loaded): records.throughput,
        # records.batch_etpl; at batch size 1 the pooled speed and eTPL
        "throughput": _float(throughput(samples) if samples else summary.get("throughput")),
        "batch_etpl": _float(batch_etpl(samples) if samples else summary.get("batch_etpl")),
        "acceptance": summary.get("acceptance_rate"),
        "seed": summary.get("config", {}).get("seed"),
        # "calibration" for the LS grid points of `python -m del_bench calibrate` (paper B.3), else "eval"
        "sample_set": (summary.get("selection") or {}).get("sample_set", "eval"),
        # written by newer runners only: peak memory of the run (CUDA max-allocated on GPU; on CPU the
        # measure named in memory_measure), and the bytes of the model's weights
        "peak_memory_gib": _float(summary.get("peak_memory_bytes")) / GIB,
        "memory_measure": summary.get("memory_measure") or "",
        "model_gib": _float(summary.get("model_bytes")) / GIB,
        "outputs": {(str(s["sample_id"]), s.get("repeat", 0)): _digest(s.get("output_ids")) for s in samples},
        "busy_samples": load.get("overloaded", 0),  # timed on an overloaded machine (0: none, or not recorded)
        # not timed at steady state (records.steady_state: judged from the records, today's rule)
        "unsteady": unsteady(steady_state(samples, read_jsonl(run_dir / "rounds.jsonl"), setup)),
        "probe_s": machine_probe(setup),  # the machine's state when it ran (records.machine_probe)
    }
    for name, value in (summary.get("quality") or {}).items():
        row[f"q_{name}"] = value
    return row


def _digest(output_ids) -> str:
    return hashlib.sha1(json.dumps(output_ids).encode()).hexdigest()


def load_runs(roots: Iterable[str | Path] = DEFAULT_ROOTS, exclude_busy: bool = False,
              exclude_unsteady: bool = False) -> pd.DataFrame:
    """All runs under the roots, one row each, with `speedup` and `vanilla_tps` filled where paired. exclude_busy:
    runs timed on an overloaded machine (busy_samples > 0) are left out before pairing, so none is a baseline;
    exclude_unsteady: so are runs not timed at steady state."""
    rows = [load_run(d) for d in find_runs(roots)]
    if exclude_busy:
        rows = [r for r in rows if not r["busy_samples"]]
    if exclude_unsteady:
        rows = [r for r in rows if not r["unsteady"]]
    empty = ["run_dir", "run_key"] + CONFIG_KEYS + ["n", "tokens_per_s", "etpl", "sample_set", "peak_memory_gib",
                                                    "memory_measure", "model_gib", "experiments", "outputs",
                                                    "busy_samples", "unsteady"]
    df = pd.DataFrame(rows, columns=None if rows else empty)
    # None in the key columns (Vanilla has no E/γ/ω) would make groupby drop rows; use "" instead
    for col in ("exit_layer", "gamma", "omega"):
        df[col] = df[col].astype(object).where(df[col].notna(), "")
    return add_lossless(add_speedup(df))


def add_lossless(df: pd.DataFrame) -> pd.DataFrame:
    """outputs_equal / outputs_compared: of a greedy run's outputs that its Vanilla partner also decoded, how many
    are token-identical to the partner's (Spec-Bench's equality check, from records alone). NaN where there is
    nothing to compare: Vanilla itself, sampling runs, no partner. With several partner runs (repeats), the first
    by run_dir is the reference: greedy Vanilla repeats on one machine decode the same tokens.
    near_tie_at / departs_at: where the outputs that differ first depart (token index), split by the partner's recorded
    top-2 gap there (half precision, del_bench/numerics.py): a near-tie is allowed, a real departure is not. Empty
    where the partner recorded no gaps (full precision: there any departure is a real one)."""
    vanillas = [(v["run_key"], (v["run_dir"], v["outputs"]))
                for _, v in df[df["method"] == "vanilla"].sort_values("run_dir").iterrows()]
    equal, compared, near_tie_at, departs_at = [], [], [], []
    for _, r in df.iterrows():
        base_dir, base = (vanilla_partners(r["run_key"], vanillas) or [(None, None)])[0]
        near, real = [], []
        near_tie_at.append(near)
        departs_at.append(real)
        if r["method"] == "vanilla" or r["decoding"] != "greedy" or base is None:
            equal.append(math.nan)
            compared.append(math.nan)
            continue
        common = [k for k in r["outputs"] if k in base]
        differ = {k for k in common if r["outputs"][k] != base[k]}
        equal.append(len(common) - len(differ))
        compared.append(len(common))
        if differ:
            near[:], real[:] = departures(r["run_dir"], base_dir, differ)
    return df.assign(outputs_equal=equal, outputs_compared=compared, near_tie_at=near_tie_at, departs_at=departs_at)


def departures(run_dir: str, reference_dir: str, keys: set) -> tuple[list[int], list[int]]:
    """(near-tie, real) first-departure positions of run_dir's outputs `keys` ((sample_id, repeat)) from
    reference_dir's, judged by the reference's recorded top-2 gaps; outputs whose reference has none are left out.
    Read from samples.jsonl only for runs whose outputs differ (load_run keeps digests, not tokens)."""
    def by_key(path):
        return {(str(s["sample_id"]), s.get("repeat", 0)): s for s in read_jsonl(Path(path) / "samples.jsonl")}

    ours, ref = by_key(run_dir), by_key(reference_dir)
    near, real = [], []
    for key in sorted(keys):
        gaps = ref[key].get("top2_gap_ulps")
        if gaps is not None:
            d = compare(ours[key]["output_ids"], ref[key]["output_ids"], gaps)
            (near if d.kind == "near_tie" else real).append(d.position)
    return sorted(near), sorted(real)


def tell_weights_apart(df: pd.DataFrame) -> pd.DataFrame:
    """Runs of one model name made with different weights (a testbed retrained at the same path) are runs of
    different models: such names become `name@<digest>`, so they are neither paired nor averaged together."""
    df = df.copy()
    if "weights" not in df or df.empty:
        return df
    clash = df.groupby("model")["weights"].transform("nunique") > 1
    df.loc[clash, "model"] = df.loc[clash, "model"] + "@" + df.loc[clash, "weights"].str[:8]
    return df


def add_speedup(df: pd.DataFrame) -> pd.DataFrame:
    """speedup = tokens/s ÷ the mean Vanilla tokens/s of its partners (records.vanilla_baseline: the same model,
    task, decoding, length, prompts, machine); memory_overhead_pct = peak memory ÷ that Vanilla's peak memory − 1,
    in percent (Table 5); busy_vanilla / unsteady_vanilla: some partner was timed on an overloaded machine / not at
    steady state; drifted: the run's machine state (records.machine_probe) differs from its partners' by more than
    records.DRIFT_LIMIT.

    Several Vanilla runs with the same key (repeats) are averaged. No partner → NaN and has_vanilla False.
    """
    df = tell_weights_apart(df).reset_index(drop=True)
    for column, default in (("peak_memory_gib", math.nan), ("busy_samples", 0), ("unsteady", False),
                            ("probe_s", None)):
        if column not in df:
            df[column] = default
    vanillas = [(r["run_key"], r) for r in df[df["method"] == "vanilla"].to_dict("records")]

    def baseline(metric: str) -> list[float]:
        return [_float(vanilla_baseline(key, vanillas, metric)) for key in df["run_key"]]

    df["vanilla_tps"], df["vanilla_memory_gib"] = baseline("tokens_per_s"), baseline("peak_memory_gib")
    if "throughput" in df:  # over the batch, against Vanilla at the same batch size (the figure of speedup vs B)
        df["throughput_speedup"] = df["throughput"] / pd.Series(baseline("throughput"), index=df.index, dtype=float)
    partners = [vanilla_partners(key, vanillas) for key in df["run_key"]]
    df["busy_vanilla"] = [any(v["busy_samples"] for v in theirs) for theirs in partners]
    df["unsteady_vanilla"] = [any(v["unsteady"] for v in theirs) for theirs in partners]
    df["drifted"] = [drifted(probe, [v["probe_s"] for v in theirs]) for probe, theirs in zip(df["probe_s"], partners)]
    df["has_vanilla"] = df["vanilla_tps"].notna()
    df["speedup"] = df["tokens_per_s"] / df["vanilla_tps"]
    df["memory_overhead_pct"] = (df["peak_memory_gib"] / df["vanilla_memory_gib"] - 1) * 100
    return df


def aggregate(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: mean, std and count of eTPL, tokens/s, speedup, memory and each quality
    metric (q_*) over its repeats (runs with the same CONFIG_KEYS: other seeds, or repeated runs)."""
    optional = {"peak_memory_gib": math.nan, "vanilla_memory_gib": math.nan, "memory_overhead_pct": math.nan,
                "memory_measure": "", "model_gib": math.nan, "sample_set": "eval", "outputs_equal": math.nan,
                "outputs_compared": math.nan, "busy_samples": 0, "busy_vanilla": False, "unsteady": False,
                "unsteady_vanilla": False, "drifted": False}
    df = df.assign(**{k: v for k, v in optional.items() if k not in df})  # frames built by older code
    metrics = ["etpl", "tokens_per_s", "speedup", "peak_memory_gib", "memory_overhead_pct"]
    metrics += sorted(c for c in df.columns if c.startswith("q_"))
    grouped = df.groupby(CONFIG_KEYS, dropna=False, sort=False)
    out = grouped[metrics].agg(["mean", "std"])
    out.columns = [f"{m}_{stat}" for m, stat in out.columns]
    out["runs"] = grouped.size()
    out["n"] = grouped["n"].max()
    out["has_vanilla"] = grouped["has_vanilla"].all()
    out["vanilla_tps"] = grouped["vanilla_tps"].mean()  # the same partner for every repeat
    out["vanilla_memory_gib"] = grouped["vanilla_memory_gib"].mean()
    out["memory_runs"] = grouped["peak_memory_gib"].count()  # repeats that recorded their peak memory
    out["memory_measure"] = grouped["memory_measure"].agg(lambda v: ", ".join(sorted({m for m in v if m})))
    out["model_gib"] = grouped["model_gib"].mean()
    out["sample_set"] = grouped["sample_set"].first()  # the prompt set decides it: one per configuration
    out["outputs_equal"] = grouped["outputs_equal"].sum(min_count=1)  # over repeats; NaN: nothing compared
    out["outputs_compared"] = grouped["outputs_compared"].sum(min_count=1)
    # repeats timed on an overloaded machine, or paired with a Vanilla that was (records.overloaded)
    out["busy_runs"] = grouped["busy_samples"].agg(lambda v: int((v > 0).sum()))
    out["busy_vanilla"] = grouped["busy_vanilla"].any()
    # repeats not timed at steady state, or paired with a Vanilla that was not (records.steady_state)
    out["unsteady_runs"] = grouped["unsteady"].agg(lambda v: int(v.astype(bool).sum()))
    out["unsteady_vanilla"] = grouped["unsteady_vanilla"].any()
    # repeats whose machine state differed from their Vanilla partners' (records.drifted)
    out["drifted_runs"] = grouped["drifted"].agg(lambda v: int(v.astype(bool).sum()))
    if "near_tie_at" in df:  # first-departure positions, pooled over repeats (lists: summed = concatenated)
        for column in ("near_tie_at", "departs_at"):
            out[column] = grouped[column].agg(lambda lists: sorted(p for at in lists for p in at))
    return out.reset_index()


# ---------------------------------------------------------------- rounds (figures)

ROUND_FIELDS = ["exit_layer", "budget", "drafted", "accepted", "emitted", "loaded_layers", "head_calls", "draft_s",
                "verify_s", "policy_s"]
# per-round fields a method may add (Plan.trace: flattened into the round line by the engine, nested under
# "trace" in older records). DEL writes tau, alpha_exit, chosen_exit_layer, gamma_tpl, tpl_predicted; conf_matched /
# conf_mismatched (the decayed mean confidence of matched / mismatched shadow tokens at the chosen exit
# layer, whose midpoint is τ) and draft_confidences (each draft candidate's top probability) are read when
# a method records them (Figure 4b's band); prefill_draft marks the plain round after DEL's prefill draft.
TRACE_FIELDS = ["tau", "chosen_exit_layer", "alpha_exit", "gamma_tpl", "tpl_predicted", "conf_matched",
                "conf_mismatched", "draft_confidences", "prefill_draft"]
ROUND_COLUMNS = ["sample_id", "repeat", "turn", "round"] + ROUND_FIELDS + TRACE_FIELDS


def _trace(rnd: dict, name: str):
    value = rnd.get(name)
    return value if value is not None else (rnd.get("trace") or {}).get(name)


def load_rounds(run_dir: str | Path) -> pd.DataFrame:
    """rounds.jsonl of one run, one row per round (round 0 = prefill), in file order; absent fields → None."""
    rows = [{"sample_id": str(r["sample_id"]), "repeat": r.get("repeat", 0), "turn": r.get("turn", 0),
             "round": r["round"],
             **{k: r.get(k) for k in ROUND_FIELDS}, **{k: _trace(r, k) for k in TRACE_FIELDS}}
            for r in read_jsonl(Path(run_dir) / "rounds.jsonl")]
    return pd.DataFrame(rows, columns=ROUND_COLUMNS)


def segment_speeds(rounds: pd.DataFrame, size: int = 64) -> pd.DataFrame:
    """Tokens/s per `size`-token segment of ONE output (the rounds of one sample_id and repeat).

    A round's time is draft_s + verify_s + policy_s (the decode loop minus bookkeeping between rounds; the
    prefill round's time goes to token 0, as speed includes prefill). A round whose emitted tokens straddle
    a segment boundary is split proportionally: each of its tokens carries time ÷ emitted. A segment's
    tokens/s = its tokens ÷ the time its tokens carry. Columns: segment, start, end (exclusive), tokens,
    seconds, tokens_per_s; the last segment may be shorter than `size`.
    """
    seconds: dict[int, float] = {}
    tokens: dict[int, int] = {}
    pos = 0
    for rnd in rounds.sort_values("round").itertuples():
        emitted = int(rnd.emitted or 0)
        spent = float(rnd.draft_s or 0) + float(rnd.verify_s or 0) + float(rnd.policy_s or 0)
        if emitted == 0:  # cannot happen in the engine (a round emits ≥ 1); keep its time with the next token
            seconds[pos // size] = seconds.get(pos // size, 0.0) + spent
            continue
        for i in range(pos, pos + emitted):
            seconds[i // size] = seconds.get(i // size, 0.0) + spent / emitted
            tokens[i // size] = tokens.get(i // size, 0) + 1
        pos += emitted
    rows = [{"segment": k, "start": k * size, "end": k * size + tokens[k], "tokens": tokens[k],
             "seconds": seconds[k], "tokens_per_s": tokens[k] / seconds[k] if seconds[k] > 0 else math.nan}
            for k in sorted(tokens)]
    return pd.DataFrame(rows, columns=["segment", "start", "end", "tokens", "seconds", "tokens_per_s"])
