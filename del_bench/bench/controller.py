"""DEL's controller: its shadow-token cost (rows with records) and how often approximations change decisions.

1. Agreement (no clock): DEL decodes with exact shadow tokens while a twin DEL is fed the same rounds through the
   restricted head (shadow_vocab=K); per round the twins' plans (E, γ) and thresholds τ_E are compared, and per layer
   how often the restricted head's shadow token matches the full model's where the whole vocabulary's does not (a
   false match: the target beats the first K ids while the true argmax lies beyond them) and the converse (a missed
   match; none by construction, as the target is always scored), over the same states. Likewise
   `shadow_every: R` (--every): a twin folds the same shadow tokens in only every R rounds; per round the decisions
   that act (the exit layer when either drafts, and whether it drafts) are compared. The result file keeps every
   round's pair, so the fractions printed are recomputable from it.
2. Cost: Vanilla, DEL as published, DEL with measured costs (exact shadow), with shadow_vocab=K, and `del_cpu`, as
   runs with records, interleaved prompt by prompt (ctrl = policy time ÷ decode time, from rounds.jsonl).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import torch

from del_bench import session
from del_bench.bench import harness as h
from del_bench.methods.base import Shadow
from del_bench.methods.dynamic_exit import DEL
from del_bench.records import RunDir, read_jsonl

VOCAB_COUNTS = ("positions", "full_matches", "false_matches", "missed_matches")  # vocab_matches' rows, per layer
COLUMNS = ["row", "tok/s", "speedup", "eTPL", "α", "ctrl", ("= Vanilla", "equal_vanilla", "", 9)]


def parse(argv):
    ap = h.parser("controller", __doc__, limit=3, max_new_tokens=96)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="humaneval")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--every", default="2,4", help="shadow_every values whose decision agreement to measure")
    return ap.parse_args(argv)


class _Twinned(DEL):
    """Exact DEL (it drives the decode) with a second DEL, self.twin, started and costed alongside it."""

    twin: DEL

    def start(self, num_layers):
        super().start(num_layers)
        self.twin.start(num_layers)

    def set_costs(self, **costs):
        super().set_costs(**costs)
        self.twin.set_costs(**costs)


class Twin(_Twinned):
    """Exact DEL that also feeds a restricted-vocabulary copy; keeps both plans of every round."""

    def __init__(self, stack, vocab: int, **kwargs):
        super().__init__(**kwargs)
        self.stack, self.twin, self.vocab, self.pairs = stack, DEL(shadow_vocab=vocab, **kwargs), vocab, []
        self.counts: np.ndarray | None = None  # [len(VOCAB_COUNTS), L-1] summed over every scored window

    def _approx(self, shadow: Shadow) -> Shadow:
        L1, W, D = shadow.states.shape
        tokens, conf = self.stack.shadow_tokens(shadow.states.reshape(-1, D), shadow.target.repeat(L1), self.vocab)
        approx = Shadow(tokens.view(L1, W), conf.view(L1, W), shadow.target)
        counts = vocab_matches(shadow.tokens, approx.tokens, shadow.target)
        self.counts = counts if self.counts is None else self.counts + counts
        return approx

    def _compare(self):
        self.pairs.append({"plan": [self.exit_layer, self.gamma], "twin": [self.twin.exit_layer, self.twin.gamma],
                           "tau_gap": abs(self.threshold - float(self.twin.tau[self.exit_layer - 1]))})

    def observe_prefill(self, shadow):
        super().observe_prefill(shadow)
        self.twin.update(self._approx(shadow))
        self._compare()

    def observe(self, evidence):
        super().observe(evidence)
        if evidence.shadow is not None:
            self.twin.update(self._approx(evidence.shadow))
            self._compare()


class Lagging(_Twinned):
    """Exact DEL (it drives the decode) with a twin that folds the same shadow tokens in every R rounds only;
    keeps both acting decisions (E when drafting, or no draft) of every round."""

    def __init__(self, every: int, **kwargs):
        super().__init__(**kwargs)
        self.every, self.twin, self.pairs = every, DEL(**kwargs), []

    def start(self, num_layers):
        super().start(num_layers)
        self.pending = []

    def observe_prefill(self, shadow):
        super().observe_prefill(shadow)
        self.twin.observe_prefill(shadow)

    def observe(self, evidence):
        super().observe(evidence)
        self.pending.append(evidence.shadow)
        if len(self.pending) >= self.every:
            for shadow in self.pending:
                self.twin.update(shadow)
            self.pending = []
        self.pairs.append({"plan": acting(self), "twin": acting(self.twin)})


def vocab_matches(full: torch.Tensor, restricted: torch.Tensor, target: torch.Tensor) -> np.ndarray:
    """full, restricted: [L-1, W] shadow tokens of the same states over the whole vocabulary and over the first K ids
    + the target; target [W] → [len(VOCAB_COUNTS), L-1] int64 per layer: positions, matches of the full head, false
    matches (restricted = target ≠ full) and missed ones (full = target ≠ restricted)."""
    full_match, restricted_match = full == target[None, :], restricted == target[None, :]
    rows = [torch.ones_like(full_match), full_match, restricted_match & ~full_match, full_match & ~restricted_match]
    return torch.stack(rows).sum(-1).cpu().numpy().astype(np.int64)


def false_match_summary(counts: np.ndarray) -> dict:
    """vocab_matches summed → per layer and overall: false matches ÷ positions, ÷ the restricted head's matches
    (the share of the matches it reports that the whole vocabulary would not), and missed matches."""
    positions, full, false, missed = counts.astype(np.float64)
    reported = full + false - missed  # the restricted head's matches
    per_layer = [{"layer": i + 1, "positions": int(positions[i]), "false_matches": int(false[i]),
                  "missed_matches": int(missed[i]), "rate": false[i] / positions[i] if positions[i] else None,
                  "of_reported": false[i] / reported[i] if reported[i] else None} for i in range(len(positions))]
    return {"positions": int(positions.sum()), "false_matches": int(false.sum()), "missed_matches": int(missed.sum()),
            "rate": false.sum() / positions.sum() if positions.sum() else None,
            "of_reported": false.sum() / reported.sum() if reported.sum() else None, "layers": per_layer}


def acting(method: DEL) -> list:
    """What a plan does under draft_budget=d_max: the exit layer if it drafts, else nothing."""
    return [method.exit_layer if method.gamma else None, bool(method.gamma)]


def agreement(args, cfg, load, prompts: list[list[int]], costs_dir: str) -> tuple[dict, dict]:
    """Every round's pair of decisions of each twin, decoding the prompts (untimed) set up as the rows were
    (session.build on the rows' run config `cfg`: their task's sampling and stop strings), and each restricted-
    vocabulary twin's false_match_summary; costs_dir: a measured-cost row's out_dir, whose costs a measured-cost twin
    plans on, as that row did."""
    _, stack = load()
    twins = {f"vocab {args.vocab}, cost_model={c}": Twin(stack, args.vocab, cost_model=c)
             for c in ("layers", "measured")}
    twins.update({f"shadow_every {r}": Lagging(int(r), cost_model="measured", shadow_vocab=args.vocab)
                  for r in args.every.split(",") if r})
    for twin in twins.values():
        ready = session.build(cfg, load, method=twin, run_dir=RunDir(costs_dir))
        for p in prompts:
            ready.engine.generate(p, twin, args.max_new_tokens, seed=0)
    pairs = {name: twin.pairs for name, twin in twins.items()}
    counted = {name: t.counts for name, t in twins.items() if isinstance(t, Twin) and t.counts is not None}
    return pairs, {name: false_match_summary(counts) for name, counts in counted.items()}


def print_false_matches(name: str, summary: dict) -> None:
    """One twin's false-match line, then its worst layers."""
    rate, of_reported = h.fmt(summary["rate"], ".2%"), h.fmt(summary["of_reported"], ".2%")
    print(f"{name}: false matches (restricted x^ℓ = x^L, the whole vocabulary's ≠) {summary['false_matches']} of "
          f"{summary['positions']} layer-positions = {rate} ({of_reported} of the matches it reports); missed matches "
          f"{summary['missed_matches']}")
    worst = sorted((x for x in summary["layers"] if x["false_matches"]), key=lambda x: -x["rate"])[:5]
    if worst:
        print("  worst layers: " + ", ".join(f"ℓ{x['layer']} {h.fmt(x['rate'], '.2%')} ({x['false_matches']}/"
                                             f"{x['positions']})" for x in worst))


def main(argv: list[str]) -> int:
    args = parse(argv)
    base = [f"model={args.model}", f"task={args.task}", f"max_new_tokens={args.max_new_tokens}", *args.set]
    cfg = h.compose(*base)
    load = h.shared_load(cfg)
    measured = ["method=del", "method.cost_model=measured"]
    rows = [h.row(label, args.root, args.experiment, *base, *overrides, load=load) for label, overrides in (
        ("Vanilla", ["method=vanilla"]), ("DEL (paper: layer costs, exact shadow)", ["method=del"]),
        ("DEL measured costs, exact shadow", measured),
        (f"DEL measured costs, shadow_vocab={args.vocab}", [*measured, f"method.shadow_vocab={args.vocab}"]),
        (f"del_cpu (shadow_vocab={args.vocab}, deferred)", ["method=del_cpu", f"method.shadow_vocab={args.vocab}"]))]
    table = h.table(h.run_rows(rows, args.limit))
    for r in table:
        r["equal_vanilla"] = "{}/{}".format(*h.outputs_equal(r["out_dir"], table[0]["out_dir"]))
    prompts = [s["prompt_ids"] for s in read_jsonl(Path(table[0]["out_dir"]) / "samples.jsonl")]
    costs_dir = next(r["out_dir"] for r in table if RunDir(r["out_dir"]).costs() is not None)  # a measured-cost row
    pairs, vocab = agreement(args, cfg, load, prompts, costs_dir)
    print(f"\n{args.model}, {args.task}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy\n")
    for name, rounds in pairs.items():
        same = statistics.fmean(p["plan"] == p["twin"] for p in rounds) if rounds else None
        gaps = [p["tau_gap"] for p in rounds if "tau_gap" in p]
        print(f"{name}: the same decision as exact DEL in {h.fmt(same, '%')} of {len(rounds)} rounds"
              + (f"; mean |Δτ_E| = {statistics.fmean(gaps):.4f}" if gaps else ""))
    for name, summary in vocab.items():
        print_false_matches(name, summary)
    h.print_table(table, COLUMNS)
    h.write_result(args.out, "controller", vars(args), rows=table, agreement=pairs, vocab_matches=vocab)
    return 0
