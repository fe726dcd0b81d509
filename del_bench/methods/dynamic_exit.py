"""DEL: context-aware dynamic exit layer (paper §4, Algorithm 1) and its ablations.

Per round, from shadow tokens of the valid window (positions 0..u_r, see the engine):
  c_r^ℓ = matches of layer ℓ with the full model, n_r = positions in the window (u_r + 1),
  tcs/fcs_r^ℓ = confidence sums over matched / mismatched positions,
  decayed sums S(a) = Σ_i ω^{r−i−1} a[i] (kept incrementally: S ← ω·S + a_r),
  α_ℓ = S(c^ℓ) / S(n),  τ_ℓ = ½ (S(tcs^ℓ)/S(c^ℓ) + S(fcs^ℓ)/S(n − c^ℓ)),
  (E, γ) = argmax over ℓ ∈ [1, L), d ∈ [0, d_max] of TPL(ℓ, d) = Σ_{k≤d} α_ℓ^k / (d·ℓ + L).
Statistics are seeded at prefill from the last prompt positions (`prefill_window`) and restart with every prompt.

Decisions where the paper, its Algorithm 1 and the authors' code differ (docs/design.md §3.5), all config:
- Denominator: the paper divides by S(u) while c counts u + 1 positions; we count positions
  consistently (n = u + 1), which is the authors' match / (match + mismatch).
- Draft budget (`draft_budget`): `d_max` (Algorithm 1 and the authors' code: draft up to d_max, stop
  on τ) or `tpl` (cap at the TPL-chosen γ). Either way a TPL choice of d = 0 means "do not speculate":
  the round is plain decoding, so a model whose early layers never agree falls back to Vanilla.
- Stopping (`dynamic_draft_exit`): stop when a candidate's confidence < τ_E; the candidate is kept and verified
  (`keep_stopped_draft: true`, method=del: the authors' code appends it before the test) or dropped (method=del_alg1:
  Algorithm 1 breaks before appending it).
- First round (`prefill_draft`, method=del): as the authors' first call, one draft of the first token at the lowest
  allowed E merged with the prefill — accepted iff that layer's shadow token at the last prompt position is the full
  model's, then one plain round for the token after it, its window joining the prefill's (the last 33 prompt
  positions: `prefill_window`) undecayed; method=del_alg1: from the prefill statistics of the last 32 (paper).
- Sampling, as the authors' code: shadow tokens and their confidences (so τ) from the raw logits' softmax, a draft
  candidate's confidence from the warped (temperature/top-p) draft distribution q — its top probability, which the
  drawn token does not move (the authors read the drawn token's own).
- 0/0: with no matched position yet the matched mean is taken as 1, with no mismatched one the
  mismatched mean as 0 (the extremes a confidence can take), so τ is always defined; S(n) = 0 gives α = 0.
Beyond the paper (`cost_model: measured`): the TPL cost counts an LM-head row as h layers, h measured at
start-up (SmolLM2 on CPU: h ≈ 5), including the row of the candidate that stops drafting (scored, then
dropped), and a verification batch of d + 1 positions through layers ℓ+1..L as c(d+1) single positions, c measured
at start-up too (a batch is not free on a CPU; without it DEL with exit adapters drafted where drafting loses:
0.81× Vanilla on SmolLM2 HumanEval); the default `layers` keeps the paper's d·ℓ + L so its numbers reproduce.
Beyond the paper (`shadow_vocab: K`): shadow tokens scored over the first K token ids + the position's target
(LayerStack.shadow_tokens), ~V/K times cheaper; their confidences are normalised over those ids only, which lifts
them above the whole vocabulary's (on a tiny 8-layer model with K = 50 of 259 ids τ sat above every candidate). So a
draft candidate is scored on the same scale: its top probability normalised over the first K ids and itself
(layer_math.top_confidence) — what the statistics record where it is the full model's token, so τ, a mean of such
confidences, and the candidates it stops are like with like. The other way round (τ from whole-vocabulary
confidences) would need the whole head over every shadow row, the cost K removes; scoring the candidate so costs
nothing (its head row is whole anyway: the candidate is the whole vocabulary's argmax). Without K both are the whole
vocabulary's top probability, as published.
Beyond the paper (`defer_shadow: true`): while TPL provably keeps d = 0 whatever the pending rounds'
shadow tokens are (`can_defer`), their scoring is batched — same statistics and decisions, fewer head passes.
Beyond the paper, an approximation (`shadow_every: R`, default 1 = exact): shadow tokens are scored every R rounds,
R rounds in one head pass (a batched row costs ~0.6 of a lone one on a CPU, and the per-round ops go), and TPL
plans on statistics up to R − 1 rounds old; the statistics themselves end up the same. `make bench-controller`
measures how often the plan (E, γ) differs from the exact one's on the same rounds.
Beyond the paper, engine-side (`lookahead: K`, default 1): the stop decision on τ is read K candidates at a time
(EarlyExit.draft) — identical drafts and decisions, one host read per K candidates (a read drains a GPU's
queue), the passes of candidates drafted past the stop counted in loaded layers (so eTPL says what it cost). On
CUDA graphs, greedy, at lookahead 1, the engine drafts the whole round on the device instead (engine/draft_chain.py:
the stop `confidence ≥ τ` decided there, stopped candidates skipped, one read a round with the acceptance).
Ablations: DEL-E = no dynamic draft-exiting, γ from TPL; DEL-γ = fixed E (`exit_layer`), τ on;
DEL-E-lim = E restricted to 3 < ℓ < L (`min_exit_layer: 4`).
DEL as the KnapSpec authors' code runs it (`del_knapspec`, a peer's reading, not the paper; docs/design.md §3.8):
`min_draft: 1` (TPL chooses among d ≥ 1: a round always drafts, d = 0 is never plain decoding), `d_max: 10` (drafts
capped at 10),
`keep_stopped_draft: true` (the candidate that fell below τ is kept, not dropped) and `first_exit_layer: 1` (the
first round of a prompt drafts at E = 1, stopping on τ_1 from the prefill statistics, before TPL chooses).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

from del_bench.methods.base import (
    EARLY_EXIT,
    MAX_DEFERRED,
    Method,
    MethodConfig,
    Plan,
    RoundEvidence,
    Shadow,
    StaticShape,
    exit_layer_key,
)
from del_bench.schema import LAYERS, key

DEFAULT_OMEGA = 0.95  # configs/method/del.yaml's ω: a label names ω only when a run's differs
# the ablations' config names and labels, in the tables' order (DEL itself last)
LABELS = {"del_gamma": "DEL-γ", "del_e": "DEL-E", "del_e_lim": "DEL-E-lim", "del": "DEL"}
# the settings that make a run DEL as its authors' code runs it (variant ""), as the paper's numbers were measured
AUTHORS_READING = {"keep_stopped_draft": True, "prefill_draft": True}
# DEL's variants by the settings that make them (variant()), in the tables' order, with their labels
VARIANT_LABELS = {"": "DEL", "Alg1": "DEL (Alg. 1)", "CPU": "DEL-CPU", "KnapSpec": "DEL (KnapSpec's)"}
VARIANT_NOTE = ("DEL = as its authors' code runs it (configs/method/del.yaml: the candidate below τ kept and "
                "verified, the first token drafted at E = 1 with the prefill); DEL (Alg. 1) = Algorithm 1 as printed "
                "(configs/method/del_alg1.yaml: that candidate dropped, the first round from the prefill's statistics; "
                "records made before DEL followed its authors' code are this); DEL-CPU = Algorithm 1 as we run it on "
                "a CPU (configs/method/del_cpu.yaml: a head row costs its measured time in layers, shadow tokens over "
                "1,024 ids + the target, batched while d = 0); DEL (KnapSpec's) = as the KnapSpec authors' code runs "
                "it (configs/method/del_knapspec.yaml). All are lossless.")


def variant(hyperparameters: dict) -> str:
    """Which DEL a run is, by the settings that make it so: "" = as its authors' code runs it (configs/method/del.yaml:
    the stopped candidate kept, the first token drafted with the prefill), "Alg1" = Algorithm 1 as printed
    (del_alg1: the stopped candidate dropped; every record made before DEL's default followed the authors' code),
    "CPU" = measured costs (del_cpu: a head row costs h layers, cheap shadow tokens), "KnapSpec" = as the KnapSpec
    authors run it (del_knapspec: the stopped candidate kept, round 1 at E = 1 stopping on τ). Other settings that
    differ (a `method.d_max=` override) keep their reading's label, and the tables add the run's tag where two rows
    coincide."""
    if hyperparameters.get("keep_stopped_draft") and not hyperparameters.get("prefill_draft"):
        return "KnapSpec"
    if hyperparameters.get("cost_model") == "measured":
        return "CPU"
    return "" if hyperparameters.get("prefill_draft") else "Alg1"


def tpl_table(alpha, num_layers: int, d_max: int, head_cost: float = 0.0, stop_head: bool = False,
              batch_cost: tuple[float, ...] = ()) -> np.ndarray:
    """TPL(ℓ, d) for ℓ = 1..len(alpha), d = 0..d_max → [d_max+1, len(alpha)] (float64).

    Σ_{k=0..d} α^k instead of (1 − α^{d+1}) / (1 − α): exact at α = 1. Cost in layer units:
    d·ℓ + L (paper), or with head_cost h > 0 (the calibrated model: one LM-head row costs h layers)
    d·(ℓ + h) + L + h — a draft is ℓ layers plus a head row, verification L layers plus a head row —
    and with `stop_head` one more head row for any d > 0: the candidate whose confidence stops drafting
    is scored and dropped (Algorithm 1), so a round that drafts pays d + 1 draft rows.
    `batch_cost` (measured; empty = 1 throughout, the paper's model): c[T − 1] = one layer's cost for T positions
    at once ÷ for one. Verification runs layers ℓ+1..L over the d + 1 positions, so L becomes ℓ + (L − ℓ)·c(d+1):
    on a CPU a batch is not free (SmolLM2, measured: 2 positions cost ~1.5 single ones, 4–8 about 2).
    NumPy, not torch: on a [19, 30] table torch's per-op overhead is ~10× the arithmetic, every round."""
    alpha = np.asarray(alpha, dtype=np.float64)
    drafts, cost = _round_costs(num_layers, len(alpha), d_max, head_cost, stop_head, tuple(batch_cost))
    expected_tokens = (alpha[None, :] ** drafts).cumsum(0)  # [d_max+1, ℓ]
    return expected_tokens / cost


def batch_factors(batch_s: list, rows: int) -> tuple[float, ...]:
    """c(T) for T = 1..rows: the measured seconds of T positions through every layer ÷ of one (costs.measure_costs'
    batch_s: [[T, seconds], …]), linear in T between measured sizes and beyond the largest along the last segment's
    slope, at least 1. On a CPU a batch is not free (SmolLM2: c(2) ≈ 1.5, c(4..8) ≈ 2); on a GPU, where a layer's
    weights stream once for every row, c stays near 1 — whatever the device measured."""
    sizes, seconds = np.array(batch_s, dtype=np.float64).T
    wanted = np.arange(1, rows + 1)
    slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 else 0.0
    total = np.where(wanted <= sizes[-1], np.interp(wanted, sizes, seconds), seconds[-1] + slope * (wanted - sizes[-1]))
    return tuple(float(c) for c in np.maximum(total / seconds[0], 1.0))


def round_cost(drafted: int, exit_layer: int | None, loaded_layers: float, head_rows: int, num_layers: int,
               head_cost: float, batch_cost: tuple[float, ...]) -> float:
    """A recorded round's cost in one-position layers, priced as tpl_table prices a plan: the layers it loaded one
    position at a time, but the verification's layers over the d + 1 positions at c(d + 1) each (early exit: layers
    E+1..L; a skipping draft, exit_layer None with d > 0: all L), and every head row h except the verification's,
    whose d + 1 rows are one product priced as one row. A round's policy passes (SWIFT's optimiser, a selection)
    count at one position a layer. For rounds.jsonl fields: (drafted, exit_layer, loaded_layers, head_calls)."""
    L, d = num_layers, drafted
    batched = 0 if d == 0 else L - exit_layer if exit_layer is not None else L  # layers verified over d + 1 rows
    c = batch_cost[d] if batch_cost else 1.0
    return loaded_layers - batched + batched * c + head_cost * (head_rows - d)


@lru_cache(maxsize=64)
def _round_costs(num_layers: int, n: int, d_max: int, head_cost: float, stop_head: bool,
                 batch_cost: tuple[float, ...] = ()):
    """→ (d [d_max+1, 1], cost of a round in layer units [d_max+1, n]) for tpl_table; read-only, cached."""
    layers = np.arange(1, n + 1, dtype=np.float64)
    drafts = np.arange(d_max + 1, dtype=np.float64)[:, None]
    cost = drafts * (layers[None, :] + head_cost) + num_layers + head_cost
    if batch_cost:  # the late layers' batch of d + 1 positions costs c(d+1) single-position layers, not 1
        if len(batch_cost) < d_max + 1:
            raise ValueError(f"batch_cost covers {len(batch_cost)} batch sizes; d_max={d_max} needs {d_max + 1}")
        c = np.asarray(batch_cost[: d_max + 1], dtype=np.float64)[:, None]  # [d_max+1, 1]
        cost = cost + (num_layers - layers[None, :]) * (c - 1.0)
    if stop_head:
        cost = cost + head_cost * (drafts > 0)
    drafts.flags.writeable = cost.flags.writeable = False
    return drafts, cost


def best_exit(alpha, num_layers: int, d_max: int, allowed, head_cost: float = 0.0,
              stop_head: bool = False, batch_cost: tuple[float, ...] = (), min_draft: int = 0) -> tuple[int, int]:
    """(E, γ) maximising TPL over allowed layers ([L-1] bool) and d ≥ min_draft. Ties go to the smaller d, then the
    smaller ℓ (argmax returns the first maximum of the d-major flattening)."""
    return best_plan(alpha, num_layers, d_max, allowed, head_cost, stop_head, batch_cost, min_draft)[:2]


def best_plan(alpha, num_layers: int, d_max: int, allowed, head_cost: float = 0.0, stop_head: bool = False,
              batch_cost: tuple[float, ...] = (), min_draft: int = 0) -> tuple[int, int, float]:
    """best_exit's (E, γ) and the TPL it predicts there, TPL(E, γ): one read of the table it argmaxes (DEL's trace,
    `tpl_predicted`, so a round's realised tokens per layer can be held against what its plan expected)."""
    table = tpl_table(alpha, num_layers, d_max, head_cost, stop_head, batch_cost)
    table[:, ~np.asarray(allowed, dtype=bool)] = -1.0
    table[:min_draft] = -1.0
    flat = int(table.argmax())
    d, layer = divmod(flat, len(alpha))
    return layer + 1, d, float(table[d, layer])


@lru_cache(maxsize=64)
def drafting_alpha(num_layers: int, d_max: int, head_cost: float = 0.0, stop_head: bool = False,
                   batch_cost: tuple[float, ...] = ()) -> np.ndarray:
    """[L-1] per layer ℓ, an α below which no d ≥ 1 beats d = 0 at ℓ (TPL(ℓ, d) ≤ TPL(·, 0); ties go to d = 0),
    found by bisection and lowered by 1e-9 so that float rounding cannot make it unsound; 2 where drafting at ℓ
    never wins. TPL(·, 0) is the same for every ℓ, so "α_ℓ below it at every allowed ℓ" means TPL picks d = 0."""
    def drafting_wins(alpha: np.ndarray) -> np.ndarray:  # [L-1] bool
        table = tpl_table(alpha, num_layers, d_max, head_cost, stop_head, batch_cost)
        return (table[1:] > table[:1]).any(0)

    n = num_layers - 1
    lo, hi = np.zeros(n), np.ones(n)
    never = ~drafting_wins(hi)
    for _ in range(60):  # invariant: drafting does not win at lo
        mid = (lo + hi) / 2
        wins = drafting_wins(mid)
        lo, hi = np.where(wins, lo, mid), np.where(wins, mid, hi)
    out = np.where(never, 2.0, lo - 1e-9)
    out.flags.writeable = False
    return out


@dataclass(kw_only=True)
class DELConfig(MethodConfig):
    omega: float = key(0.95, "ω: the decay of the per-round statistics", ge=0, le=1)
    d_max: int = key(18, "the longest draft a round", ge=1)
    dynamic_draft_exit: bool = key(True, "stop drafting when a candidate's confidence < τ_E")
    draft_budget: Literal["d_max", "tpl"] = key("d_max", "d_max: Algorithm 1; tpl: drafts capped at TPL's γ")
    exit_layer: int | None = exit_layer_key(None, "null: E chosen by TPL every round; an integer fixes it (DEL-γ)")
    min_exit_layer: int = key(1, "the lowest E TPL may choose (4: DEL-E-lim)", ge=1, lt=LAYERS)
    prefill_window: int = key(32, "prompt positions whose shadow tokens seed α and τ", ge=1)
    cost_model: Literal["layers", "measured"] = key("layers", "layers: d·ℓ + L (paper); measured: timed costs")
    shadow_vocab: int | None = key(None, "null: exact shadow tokens; K: scored over the first K token ids", ge=1)
    defer_shadow: bool = key(False, "batch shadow scoring while TPL provably keeps d = 0")
    shadow_every: int = key(1, "score shadow tokens every R rounds (1: exact)", ge=1, le=MAX_DEFERRED)
    min_draft: Literal[0, 1] = key(0, "0: d = 0 decodes plainly (paper); 1: every round drafts (KnapSpec's DEL)")
    keep_stopped_draft: bool = key(False, "keep the candidate that fell below τ (Algorithm 1 drops it)")
    first_exit_layer: int | None = exit_layer_key(None, "the first round's E (null: from the prefill statistics)")
    prefill_draft: bool = key(False, "one draft of the first token merged with the prefill (the authors' code)")
    lookahead: int = key(1, "draft candidates read at once for the τ stop (1: each before the next)", ge=1)


class DEL(Method):
    name = "del"
    aliases = ("del_gamma", "del_e", "del_e_lim")  # the ablations: configs/method/del_*.yaml
    label, family, order = "DEL", EARLY_EXIT, 70
    label_hyperparameters = (("exit_layer", "E"), ("omega", "ω", DEFAULT_OMEGA))
    wants_shadow = True
    stops_at_threshold = True  # confidence ≥ τ of the round's E
    config = DELConfig

    def __init__(self, omega: float = 0.95, d_max: int = 18, dynamic_draft_exit: bool = True,
                 draft_budget: str = "d_max", exit_layer: int | None = None, min_exit_layer: int = 1,
                 prefill_window: int = 32, cost_model: str = "layers", shadow_vocab: int | None = None,
                 defer_shadow: bool = False, shadow_every: int = 1, min_draft: int = 0,
                 keep_stopped_draft: bool = False, first_exit_layer: int | None = None, prefill_draft: bool = False,
                 lookahead: int = 1, **_):
        self.omega, self.d_max = omega, d_max
        self.dynamic_draft_exit, self.draft_budget = dynamic_draft_exit, draft_budget
        self.fixed_exit_layer, self.min_exit_layer = exit_layer, min_exit_layer
        self.prefill_window = prefill_window
        self.cost_model = cost_model
        self.shadow_vocab = shadow_vocab
        self.defer_shadow = defer_shadow
        self.shadow_every = shadow_every
        self.wants_costs = cost_model == "measured"
        self.head_cost = 0.0  # LM-head row in layer units; set by set_costs under cost_model=measured
        self.batch_cost: tuple[float, ...] = ()  # c(T), T = 1..d_max+1 (tpl_table); set by set_costs, measured
        self.wants_confidence = dynamic_draft_exit
        self.min_draft, self.keep_stopped_draft, self.first_exit_layer = min_draft, keep_stopped_draft, first_exit_layer
        self.drop_stopped_draft = not keep_stopped_draft
        self.prefill_draft = prefill_draft
        # TPL prices the head row of the candidate that stops drafting only where it is dropped (kept, it is a draft)
        self.stop_head = dynamic_draft_exit and self.drop_stopped_draft
        self.lookahead = lookahead  # candidates drafted before one read of their confidences (engine: draft_ahead)

    def validate(self, num_layers: int) -> None:
        if self.min_draft and (self.defer_shadow or self.shadow_every != 1):
            raise ValueError("method.min_draft=1 drafts every round, so shadow scoring cannot be deferred: set "
                             "defer_shadow=false and shadow_every=1")

    def set_costs(self, layer_s: float, head_s: float, batch_s: list | None = None, **_) -> None:
        """Measured once per model/device at start-up (cost_model=measured). batch_s: [[T, seconds of T
        positions through every layer], …] (engine/costs.measure_costs), interpolated for T = 1..d_max+1; absent
        in costs measured before it existed (then a batch costs what one position does, as before)."""
        self.head_cost = head_s / layer_s
        self.batch_cost = batch_factors(batch_s, self.d_max + 1) if batch_s else ()

    # ---- statistics ---------------------------------------------------------------------------
    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        n = num_layers - 1
        # the three decayed sums as rows of one array, updated in place every round (no allocation per round)
        self._sums = np.zeros((3, n))  # [3, L-1] float64
        self.s_match = self._sums[0]  # S(c^ℓ): views, so readers see the in-place updates
        self.s_true_conf = self._sums[1]  # S(tcs^ℓ)
        self.s_false_conf = self._sums[2]  # S(fcs^ℓ)
        self.s_positions = 0.0  # S(n)
        self.allowed = np.arange(1, num_layers) >= self.min_exit_layer
        if self.fixed_exit_layer is not None:
            self.allowed = np.arange(1, num_layers) == self.fixed_exit_layer
        # the KnapSpec reading: round 1 drafts at a fixed E (the authors' prefill draft takes that place)
        self._first_round = self.first_exit_layer is not None and not self.prefill_draft
        self._plain_first = False  # the prefill's draft was accepted: the next round is the plain pass after it
        self._merge_next = False  # the next round's window joins the prefill's (no decay between)
        self._changed()

    def update(self, shadow: Shadow, decay: bool = True) -> np.ndarray:
        """One round's evidence into the decayed sums (shadow covers exactly the valid window) → its [2, L-1, W]
        matches and confidences as read. decay=False adds them to the last update's sums as one window with it
        (the authors' prefill draft: the plain round after it belongs to the prefill's window)."""
        L1, W = shadow.tokens.shape
        terms = np.empty((3, L1, W))  # [match, conf·match, conf·(1 − match)]: S ← ω·S + Σ_positions terms
        read = shadow.matches_and_confidence()  # [2, L-1, W]: one host read, or none if the engine batched it
        terms[0] = read[0]
        conf = read[1]
        np.multiply(conf, terms[0], out=terms[1])
        np.multiply(conf, 1 - terms[0], out=terms[2])
        if decay:
            self._sums *= self.omega  # the same two roundings per element as ω·S + x
        self._sums += terms.sum(2)
        self.s_positions = (self.omega * self.s_positions if decay else self.s_positions) + W
        self._changed()
        return read

    @property
    def alpha(self) -> np.ndarray:
        if self.s_positions == 0:
            return np.zeros_like(self.s_match)
        return self.s_match / self.s_positions

    @property
    def confidence_means(self) -> tuple[np.ndarray, np.ndarray]:
        """Decayed mean confidence over matched and over mismatched positions, per layer (0/0: 1 and 0)."""
        s_mismatch = self.s_positions - self.s_match
        true_mean = np.where(self.s_match > 0, self.s_true_conf / np.maximum(self.s_match, 1e-300), 1.0)
        false_mean = np.where(s_mismatch > 0, self.s_false_conf / np.maximum(s_mismatch, 1e-300), 0.0)
        return true_mean, false_mean

    @property
    def tau(self) -> np.ndarray:
        true_mean, false_mean = self.confidence_means
        return 0.5 * (true_mean + false_mean)

    def _changed(self) -> None:
        """The statistics moved: forget the cached choice and plan (recomputed when read, so folding in a
        batch of deferred rounds chooses once, not once per round)."""
        self._choice: dict | None = None
        self._plan: Plan | None = None

    def _chosen(self) -> dict:
        """The TPL argmax (E, γ) and the chosen layer's statistics, computed once per change of the statistics
        (plain floats for layer E alone: the per-round path stays off array ops, which cost µs each)."""
        if self._choice is None:
            if self._first_round:  # E is given, not chosen; τ, α and the TPL it predicts are that layer's
                exit_layer, gamma = self.first_exit_layer, self.d_max
                tpl = float(tpl_table(self.alpha, self.num_layers, self.d_max, self.head_cost, self.stop_head,
                                      self.batch_cost)[gamma, exit_layer - 1])
            else:
                exit_layer, gamma, tpl = best_plan(self.alpha, self.num_layers, self.d_max, self.allowed,
                                                   self.head_cost, stop_head=self.stop_head,
                                                   batch_cost=self.batch_cost, min_draft=self.min_draft)
            e = exit_layer - 1
            match, positions = float(self.s_match[e]), self.s_positions
            matched = self.s_true_conf[e] / match if match > 0 else 1.0  # 0/0 as in confidence_means
            mismatched = self.s_false_conf[e] / (positions - match) if positions - match > 0 else 0.0
            self._choice = {"exit_layer": exit_layer, "gamma": gamma, "tau": float(0.5 * (matched + mismatched)),
                            "alpha_exit": match / positions if positions else 0.0, "tpl_predicted": tpl,
                            "conf_matched": float(matched), "conf_mismatched": float(mismatched)}
        return self._choice

    @property
    def prefill_draft_layer(self) -> int:
        """E of the draft merged with the prefill (prefill_draft): first_exit_layer, else the authors' initial E,
        the lowest layer TPL may choose (1; DEL-E-lim's 4; DEL-γ's fixed E)."""
        if self.first_exit_layer is not None:
            return self.first_exit_layer
        return int(np.argmax(self.allowed)) + 1

    @property
    def exit_layer(self) -> int:
        """E of the TPL argmax under the current statistics."""
        return self._chosen()["exit_layer"]

    @property
    def gamma(self) -> int:
        """γ of the TPL argmax (0 = do not speculate)."""
        return self._chosen()["gamma"]

    @property
    def threshold(self) -> float:
        """τ of the chosen exit layer."""
        return self._chosen()["tau"]

    # ---- policy -------------------------------------------------------------------------------
    def observe_prefill(self, shadow: Shadow) -> None:
        read = self.update(shadow)
        if self.prefill_draft:  # the authors' draft of the first token at E_1: their verification accepts it iff
            # layer E_1's token at the last prompt position is the full model's (the prefill's window ends there)
            self._plain_first = bool(read[0, self.prefill_draft_layer - 1, -1] == 1)

    def observe(self, evidence: RoundEvidence) -> None:
        if self._first_round:
            self._first_round = False
            self._changed()
        if evidence.shadow is not None:
            self.update(evidence.shadow, decay=not self._merge_next)
        self._merge_next = False

    def can_defer(self, windows: list[int]) -> bool:
        """True when even if every layer matched at every pending position, TPL would still choose d = 0.
        TPL(ℓ, d > 0) rises with α and TPL(·, 0) does not depend on it, and the all-match α bounds the true
        one from above (also the α without the pending rounds, which the next plan reads), so the next
        plan is "no draft" whatever the pending shadow tokens are. Their statistics are folded in later,
        in order, as if scored now (a batched matmul may round differently in the last bit); only the τ/α
        fields of these rounds' traces lag behind. Answering False is always safe (the engine scores now).
        With shadow_every = R > 1 (an approximation) the rounds are also held back until R of them are pending."""
        if len(windows) < self.shadow_every:
            return True
        if not self.defer_shadow:
            return False
        added = 0.0  # what the pending windows add to S(c^ℓ) (all matched) and to S(n): the same decayed sum
        for w in windows:
            added = self.omega * added + w
        decay = self.omega ** len(windows)
        alpha_bound = (decay * self.s_match + added) / (decay * self.s_positions + added)  # [L-1]
        below = alpha_bound < drafting_alpha(self.num_layers, self.d_max, self.head_cost, self.stop_head,
                                             self.batch_cost)
        return bool(below[self.allowed].all())

    def plan(self) -> Plan:
        if self._plain_first:  # the token after an accepted prefill draft: one plain pass, its window the prefill's
            self._plain_first, self._merge_next = False, True
            return Plan(exit_layer=None, max_draft=0, trace={"prefill_draft": True, "chosen_exit_layer": None})
        if self._plan is None:  # the same statistics give the same plan (rounds while scoring is deferred)
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> Plan:
        c = self._chosen()
        trace = {"gamma_tpl": c["gamma"], "tau": c["tau"], "alpha_exit": c["alpha_exit"],
                 "tpl_predicted": c["tpl_predicted"],  # TPL(E, γ) of the chosen plan, in tpl_table's cost units
                 "conf_matched": c["conf_matched"], "conf_mismatched": c["conf_mismatched"]}  # τ = their mean
        if c["gamma"] == 0:  # TPL says drafting does not pay: plain decoding this round
            return Plan(exit_layer=None, max_draft=0, trace={**trace, "chosen_exit_layer": None})
        budget = self.d_max if self.draft_budget == "d_max" else c["gamma"]
        return Plan(exit_layer=c["exit_layer"], max_draft=budget, trace={**trace, "chosen_exit_layer": c["exit_layer"]})

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return confidence >= self.stop_threshold()

    def stop_threshold(self) -> float:
        return self.threshold

    @classmethod
    def table_label(cls, name: str, hyperparameters: dict) -> str:
        """DEL, its variant (DEL (Alg. 1), DEL-CPU, DEL (KnapSpec's): variant()) or its ablation (DEL-γ, DEL-E,
        DEL-E-lim; "(Alg. 1)" after it when run as Algorithm 1 prints DEL), with a fixed E and an ω other than 0.95:
        DEL-γ(E24), DEL(ω0.9)."""
        if name == "del":
            base = VARIANT_LABELS[variant(hyperparameters)]
        else:  # an ablation run as Algorithm 1 prints DEL (its records from before the default changed) says so
            base = LABELS.get(name, name) + (" (Alg. 1)" if variant(hyperparameters) == "Alg1" else "")
        return cls.labelled(base, hyperparameters)

    @classmethod
    def table_order(cls, name: str, hyperparameters: dict) -> tuple:
        """The ablations, then DEL; DEL's variants in VARIANT_LABELS' order."""
        kind = list(LABELS).index(name) if name in LABELS else len(LABELS)
        return (cls.order, kind, list(VARIANT_LABELS).index(variant(hyperparameters)) if name == "del" else 0)

    @classmethod
    def table_note(cls, name: str, hyperparameters: dict) -> str | None:
        return VARIANT_NOTE if name == "del" else None

    def static_shape(self) -> StaticShape:
        """Up to d_max drafts a round, at DEL-γ's fixed E; DEL chooses E every round (exit_layer None)."""
        return StaticShape(self.fixed_exit_layer, self.d_max)

    def describe(self) -> dict:
        return {"omega": self.omega, "d_max": self.d_max, "dynamic_draft_exit": self.dynamic_draft_exit,
                "draft_budget": self.draft_budget, "exit_layer": self.fixed_exit_layer,
                "min_exit_layer": self.min_exit_layer, "cost_model": self.cost_model,
                "head_cost_layers": self.head_cost, "shadow_vocab": self.shadow_vocab,
                "batch_cost": [round(c, 3) for c in self.batch_cost] or None,
                "defer_shadow": self.defer_shadow,
                **({"shadow_every": self.shadow_every} if self.shadow_every != 1 else {}),  # old keys stay as they were
                **({"min_draft": self.min_draft} if self.min_draft else {}),
                **({"keep_stopped_draft": True} if self.keep_stopped_draft else {}),
                **({"first_exit_layer": self.first_exit_layer} if self.first_exit_layer is not None else {}),
                **({"prefill_draft": True} if self.prefill_draft else {}),
                **({"prefill_window": self.prefill_window} if self.prefill_window != 32 else {}),
                **({"lookahead": self.lookahead} if self.lookahead != 1 else {})}
