"""DEL's trace of a run, round by round: its plans, what they predicted and realised, and where rounds lose.

`python -m del_bench bench del-trace RUN_DIR …` reads any DEL run directory (nothing is decoded): rounds.jsonl, DEL's
plan trace flattened into every round, and summary.json, the run's configuration and measured costs. Per round: the
plan TPL chose (E, γ; τ; α_E, the acceptance it estimates at E), the TPL it predicted there (`tpl_predicted`: as
recorded, or in records made before DEL recorded it recomputed — exactly, TPL(E, γ) being a function of α_E, γ, L
and the cost options the run records — or absent where the run's costs cannot be recovered exactly), and the TPL the
round realised: its emitted tokens ÷ its cost in the same units (dynamic_exit.round_cost: its loaded layers under
the paper's cost model; under the measured one its head rows and verification batch priced as TPL prices a plan).

Each round is one class, the first that applies:
  prefill         round 0, the prompt's pass (no plan);
  no draft        TPL chose γ = 0: a plain round (realised = predicted by construction: DEL decodes at Vanilla's
                  rate there, shadow tokens aside — the cost of not drafting is not a miss of its prediction);
  first           the plain pass after the authors' prefill draft (no TPL plan), or a losing round planned before the
                  controller saw a decoded round — round 1 of an output (round 2 after that plain pass): planned on
                  the prompt window's statistics alone, or at a given E (KnapSpec's first_exit_layer);
  no prediction   a drafting round whose predicted TPL is absent (older records whose costs are not recoverable);
  as planned      realised ≥ (1 − margin) × predicted (--margin): the plan held, or did better;
the losing rounds (realised below that):
  output end      the budget was capped by the tokens left, or the round ended its output (EOS, a stop sequence);
  stop cut        drafting stopped on τ with every draft accepted and budget left: the confidence stop, not a
                  rejection, ended the round (the records cannot say whether the next candidate would have matched:
                  this is the stop's share of the loss, an upper bound on what it cost);
  estimate wrong  the rest: drafts rejected where the plan's α_E expected them accepted.
A round's loss = predicted × its cost − its tokens (the tokens TPL expected for what the round spent, less those it
emitted); a class's "eTPL lost" = its rounds' losses ÷ the run's whole cost, so the classes' losses add up to the
predicted eTPL (every planned round at its prediction) less the realised one — both pooled (all tokens ÷ all cost),
not the per-prompt mean the report's eTPL is. By exit layer: α_E against the realised acceptance there, accepted ÷
drafted (the report's α) and accepted ÷ tested (accepted + 1 per round with a rejection: the per-position match rate
that α_E estimates, undiluted by the drafts after a rejection, which are never tested).

Writes, per run, <fig-dir>/<slug>.csv (one row per round) and <slug>.png (E, γ and the drafts; τ, α_E and the rolling
realised acceptance; predicted vs realised TPL × L by class; eTPL lost by class), and --out (the summaries).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from del_bench.bench import harness as h
from del_bench.methods.dynamic_exit import DEL, round_cost, tpl_table
from del_bench.report.collect import load_rounds

CLASSES = ("prefill", "no draft", "first", "no prediction", "as planned", "output end", "stop cut", "estimate wrong")
TRACE = ("chosen_exit_layer", "gamma_tpl", "tau", "alpha_exit", "tpl_predicted", "draft_confidences", "prefill_draft")
OUTPUT = ["sample_id", "repeat", "turn"]  # one output: DEL's statistics restart with each


def run_method(summary: dict) -> tuple[DEL, bool]:
    """The run's DEL as its config built it, its measured costs set → (method, exact): exact when they are the
    costs it planned with (its run key's head_cost_layers and batch_cost agree, one session measured them)."""
    method_cfg = summary["config"]["method"]
    if not str(method_cfg.get("_target_", "")).endswith("dynamic_exit.DEL"):
        raise SystemExit(f"not a DEL run: method {summary.get('method')!r}")
    method = DEL(**method_cfg)
    method.start(summary["config"]["model"]["num_layers"])
    if method.cost_model != "measured":
        return method, True
    costs, recorded = summary.get("measured_costs") or {}, summary["run_key"]["hyperparameters"]
    sessions = sum(bool(s.get("costs_measured")) for s in summary.get("setup") or [])
    if "layer_s" not in costs or sessions > 1:
        return method, False
    method.set_costs(**costs)
    batch = [round(c, 3) for c in method.batch_cost] or None
    return method, method.head_cost == recorded.get("head_cost_layers") and batch == recorded.get("batch_cost")


def predicted(method: DEL, alpha: float, exit_layer: int | None, gamma: int) -> float:
    """TPL(E, γ) as the plan's tpl_table computed it (the same element-wise operations on the same α_E: exact)."""
    L = method.num_layers
    table = tpl_table(np.full(L - 1, alpha), L, method.d_max, method.head_cost, method.stop_head, method.batch_cost)
    return float(table[gamma, (exit_layer or 1) - 1])  # γ = 0: every column is the same plain round


def load(run_dir: Path) -> tuple[pd.DataFrame, DEL, bool]:
    """One row per round (file order) with the trace fields, the round's cost in TPL's units and both TPLs."""
    method, exact = run_method(json.loads((run_dir / "summary.json").read_text()))
    columns = [*OUTPUT, "round", "exit_layer", "budget", "drafted", "accepted", "emitted", "loaded_layers",
               "head_calls", *TRACE]
    df = load_rounds(run_dir)[columns].copy()  # the report's reader: older records' nested trace included
    numeric = ["exit_layer", "chosen_exit_layer", "gamma_tpl", "tau", "alpha_exit", "tpl_predicted"]
    df[numeric] = df[numeric].apply(pd.to_numeric)  # None (a field the round lacks) → NaN
    L = method.num_layers
    h_cost, c = (method.head_cost, method.batch_cost) if exact else (0.0, ())  # not exact: loaded layers alone
    df["cost"] = [round_cost(r.drafted, r.exit_layer, r.loaded_layers, r.head_calls, L, h_cost, c)
                  for r in df.itertuples()]
    df["tpl_realised"] = df["emitted"] / df["cost"]
    df["tpl_source"] = np.where(df["tpl_predicted"].notna(), "recorded", "absent")
    redo = df["tpl_predicted"].isna() & df["gamma_tpl"].notna() & df["alpha_exit"].notna() & exact
    df.loc[redo, "tpl_predicted"] = [predicted(method, r.alpha_exit, _int(r.chosen_exit_layer), int(r.gamma_tpl))
                                     for r in df[redo].itertuples()]
    df.loc[redo, "tpl_source"] = "recomputed"
    if not exact:  # a recorded prediction is in units this run's realised cost cannot be put in
        df["tpl_predicted"], df["tpl_source"] = np.nan, "absent"
    return df, method, exact


def _int(value) -> int | None:
    return None if value is None or value != value else int(value)


def _or_none(value) -> float | None:
    return None if value != value else float(value)  # NaN → null in the result file


def stopped_on_tau(r) -> bool:
    """The τ stop ended drafting: the last candidate read fell below τ (keep_drafting: confidence ≥ τ goes on)."""
    conf, tau = r.draft_confidences, r.tau
    return isinstance(conf, list) and bool(conf) and tau is not None and tau == tau and conf[-1] < tau


def classify(df: pd.DataFrame, method: DEL, margin: float) -> pd.DataFrame:
    """Each round's class (module docstring) and loss in tokens (predicted × cost − emitted; 0 without a
    prediction)."""
    df = df.copy()
    by_output = df.groupby(OUTPUT, sort=False)["round"]
    last = df["round"] == by_output.transform("max")
    plain_first = df["prefill_draft"].eq(True)  # the plain pass after the prefill draft
    after_plain = plain_first.groupby([df[k] for k in OUTPUT], sort=False).shift(1, fill_value=False)
    first = (df["round"] == 1) | ((df["round"] == 2) & after_plain)
    cap = np.where(method.draft_budget == "tpl", df["gamma_tpl"].fillna(0), method.d_max)
    losing = df["tpl_realised"] < (1 - margin) * df["tpl_predicted"]
    df["stopped_on_tau"] = [stopped_on_tau(r) for r in df.itertuples()]
    stop = df["stopped_on_tau"] & (df["accepted"] == df["drafted"]) & (df["drafted"] < df["budget"])
    conditions = [df["round"] == 0, df["gamma_tpl"] == 0, plain_first, df["tpl_predicted"].isna(), ~losing,
                  first, (df["budget"] < cap) | last, stop]
    names = ["prefill", "no draft", "first", "no prediction", "as planned", "first", "output end", "stop cut"]
    df["class"] = np.select(conditions, names, default="estimate wrong")
    df["lost"] = (df["tpl_predicted"] * df["cost"] - df["emitted"]).fillna(0.0)
    return df


def summarise(df: pd.DataFrame, label: str, exact: bool, num_layers: int) -> dict:
    """The run's line: pooled eTPL realised and predicted, and per class its share of rounds and tokens and the eTPL
    lost to it (additive: they sum to predicted − realised)."""
    cost, tokens = df["cost"].sum(), df["emitted"].sum()
    grouped = df.groupby("class")
    classes = {c: {"rounds": int(grouped.size().get(c, 0)),
                   "rounds_share": float(grouped.size().get(c, 0) / len(df)),
                   "tokens_share": float(grouped["emitted"].sum().get(c, 0) / tokens),
                   "etpl_lost": float(grouped["lost"].sum().get(c, 0.0) / cost)} for c in CLASSES}
    return {"run": label, "rounds": len(df), "tokens": int(tokens), "num_layers": num_layers,
            "costs_exact": exact, "etpl": float(tokens / cost),
            "etpl_predicted": float((tokens + df["lost"].sum()) / cost) if df["tpl_predicted"].notna().any() else None,
            "tpl_source": {k: int(v) for k, v in df["tpl_source"][df["round"] > 0].value_counts().items()},
            "classes": classes,
            # of the stop cuts, those where the first candidate already fell below τ: no draft kept, nothing verified
            "stop_cut_before_any_draft": int(((df["class"] == "stop cut") & (df["drafted"] == 0)).sum()),
            "layers": by_layer(df)}


def by_layer(df: pd.DataFrame) -> list[dict]:
    """Per realised exit layer (drafting rounds): α_E as planned against the acceptance realised there."""
    drafting = df[df["drafted"] > 0].assign(tested=lambda d: d["accepted"] + (d["accepted"] < d["drafted"]))
    rows = []
    for layer, g in drafting.groupby("exit_layer"):
        rows.append({"exit_layer": int(layer), "rounds": len(g), "drafted": int(g["drafted"].sum()),
                     "alpha_estimate": float(g["alpha_exit"].mean()),
                     "accepted_per_drafted": float(g["accepted"].sum() / g["drafted"].sum()),
                     "accepted_per_tested": float(g["accepted"].sum() / g["tested"].sum()),
                     "tpl_predicted": _or_none((g["tpl_predicted"] * g["cost"]).sum(min_count=1) / g["cost"].sum()),
                     "tpl_realised": float(g["emitted"].sum() / g["cost"].sum())})
    return rows


COLORS = {"as planned": "tab:green", "first": "tab:purple", "output end": "tab:gray", "stop cut": "tab:orange",
          "estimate wrong": "tab:red", "no draft": "tab:blue", "no prediction": "black", "prefill": "white"}


def figure(df: pd.DataFrame, summary: dict, path: Path, window: int) -> None:
    """Four panels over the run's decoded rounds (file order): plans, statistics, TPLs, losses by class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = df[df["round"] > 0].reset_index(drop=True)
    x, L = np.arange(len(d)), summary["num_layers"]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), gridspec_kw={"height_ratios": [1, 1, 1.2, 0.8]})
    ax = axes[0]
    ax.scatter(x, d["chosen_exit_layer"], s=4, label="chosen E")
    ax.step(x, d["gamma_tpl"], lw=0.8, where="mid", label="γ (TPL)")
    ax.scatter(x, d["drafted"], s=3, marker="x", color="tab:gray", label="drafted")
    ax.set_ylabel("layer / drafts")
    ax = axes[1]
    ax.plot(x, d["tau"], lw=0.8, label="τ_E")
    ax.plot(x, d["alpha_exit"], lw=0.8, label="α_E (estimate)")
    drafts = d[d["drafted"] > 0]  # rolling over drafting rounds only: a plain round tests no draft
    tested = drafts["accepted"] + (drafts["accepted"] < drafts["drafted"])
    for name, over, style in (("accepted ÷ tested", tested, "-"), ("accepted ÷ drafted", drafts["drafted"], ":")):
        rate = drafts["accepted"].rolling(window, min_periods=1).sum() / over.rolling(window, min_periods=1).sum()
        ax.plot(drafts.index, rate, lw=0.8, ls=style, color="black", label=f"{name} (last {window} drafting rounds)")
    ax.set_ylim(0, 1.02)
    ax = axes[2]
    ax.plot(x, L * d["tpl_predicted"], lw=0.8, color="black", label="predicted")
    for cls, g in d.groupby("class"):
        ax.scatter(g.index, L * g["tpl_realised"], s=5, color=COLORS[cls], label=f"realised: {cls}")
    ax.set_ylabel("TPL × L")
    for ax in axes[:3]:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[2].set_xlabel("decoded round (the run's outputs one after another)")
    ax = axes[3]
    names = [c for c in CLASSES if summary["classes"][c]["rounds"]]
    ax.barh(names, [L * summary["classes"][c]["etpl_lost"] for c in names], color=[COLORS[c] for c in names],
            edgecolor="black", lw=0.5)
    ax.set_xlabel("eTPL × L lost vs predicted")
    fig.suptitle(f"DEL trace: {summary['run']}\n{headline(summary)}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=72, metadata={"Software": None})
    plt.close(fig)


def table(df: pd.DataFrame) -> pd.DataFrame:
    """The per-round CSV: every column but the candidates' confidences, of which their count and the last (the one
    that stopped drafting, where one did) stand in."""
    conf = df["draft_confidences"].map(lambda c: c if isinstance(c, list) else [])
    return df.drop(columns=["draft_confidences"]).assign(candidates=conf.map(len),
                                                          last_confidence=conf.map(lambda c: c[-1] if c else None))


def label_of(run_dir: Path) -> str:
    s = json.loads((run_dir / "summary.json").read_text())
    return f"{s['model']}/{s['task']}/{s['method_tag']}"


def _times(L: int, value: float | None) -> float | None:
    return None if value is None else L * value


def headline(summary: dict) -> str:
    L, predicted_etpl = summary["num_layers"], _times(summary["num_layers"], summary["etpl_predicted"])
    return (f"eTPL × L realised {L * summary['etpl']:.3f}, predicted "
            f"{'absent' if predicted_etpl is None else format(predicted_etpl, '.3f')} (pooled)")


def report(summary: dict) -> None:
    L = summary["num_layers"]
    print(f"\n{summary['run']}: {summary['rounds']} rounds, {summary['tokens']} tokens; {headline(summary)}; "
          f"predicted TPL {summary['tpl_source']}{'' if summary['costs_exact'] else ' (costs not recoverable)'}")
    rows = [{"class": c, "rounds": v["rounds"], "% rounds": 100 * v["rounds_share"],
             "% tokens": 100 * v["tokens_share"], "eTPL×L lost": L * v["etpl_lost"]}
            for c, v in summary["classes"].items() if v["rounds"]]
    if summary["stop_cut_before_any_draft"]:
        rows = [{**r, "class": f"{r['class']} ({summary['stop_cut_before_any_draft']} before any draft)"}
                if r["class"] == "stop cut" else r for r in rows]
    h.print_table(rows, [("class", "class", "", 14), ("rounds", "rounds", "d", 6), ("% rounds", "% rounds", ".1f", 8),
                         ("% tokens", "% tokens", ".1f", 8), ("eTPL×L lost", "eTPL×L lost", ".3f", 11)])
    layers = [{**r, "TPL×L pred.": _times(L, r["tpl_predicted"]), "TPL×L real.": L * r["tpl_realised"]}
              for r in summary["layers"]]
    h.print_table(layers, [("E", "exit_layer", "d", 3), ("rounds", "rounds", "d", 6), ("α_E est.", "alpha_estimate",
                           ".3f", 8), ("acc÷tested", "accepted_per_tested", ".3f", 10), ("acc÷drafted",
                           "accepted_per_drafted", ".3f", 11), ("TPL×L pred.", "TPL×L pred.", ".3f", 11),
                           ("TPL×L real.", "TPL×L real.", ".3f", 11)], "by exit layer (drafting rounds)")


def main(argv: list[str]) -> int:
    ap = h.parser("del-trace", __doc__, runs=False)
    ap.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    ap.add_argument("--fig-dir", type=Path, help="where each run's CSV and PNG go (default: --out without .json)")
    ap.add_argument("--margin", type=float, default=0.25, help="a round loses below (1 − margin) × predicted TPL")
    ap.add_argument("--window", type=int, default=20, help="drafting rounds in the rolling realised acceptance")
    args = ap.parse_args(argv)
    fig_dir = args.fig_dir or Path(args.out).with_suffix("")
    fig_dir.mkdir(parents=True, exist_ok=True)
    summaries = []
    for run_dir in args.run_dirs:
        df, method, exact = load(run_dir)
        df = classify(df, method, args.margin)
        summary = summarise(df, label_of(run_dir), exact, method.num_layers)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", summary["run"])
        table(df).to_csv(fig_dir / f"{slug}.csv", index=False, float_format="%.9g")
        figure(df, summary, fig_dir / f"{slug}.png", args.window)
        report(summary)
        summaries.append({**summary, "run_dir": str(run_dir), "csv": str(fig_dir / f"{slug}.csv"),
                          "png": str(fig_dir / f"{slug}.png")})
    settings = {"run_dirs": [str(d) for d in args.run_dirs], "margin": args.margin, "window": args.window}
    h.write_result(args.out, "del-trace", settings, runs=summaries)
    return 0
