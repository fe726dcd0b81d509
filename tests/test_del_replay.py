"""DEL replayed independently: Algorithm 1 (paper App. A, docs/design.md §3) written again here from the spec, fed by
transformers' own hidden states, and compared round by round with what the engine did.

Nothing of DEL's internals is used (no tpl_table / best_exit / DEL statistics): the engine runs DEL as configured in
configs/method/*.yaml, and the replay sees only the final sequence (prompt + output), the round records (drafted,
accepted, budget, emitted) and the method's parameters. Why the final sequence is enough: outputs are lossless, so
the tokens at every position of a round's valid window (the pending token and the accepted drafts, positions 0..u)
are the final sequence's, and a causal model's hidden state at a position depends only on the tokens up to it — the
engine's drafted (layers 1..E) and verified (E+1..L−1) states there are the teacher-forced states of one HF forward,
up to float rounding. The replay follows the decisions our implementation documents (dynamic_exit.py's docstring):
n = u + 1 positions per round, 0/0 means 1 (matched) and 0 (mismatched), S(n) = 0 gives α = 0, the stopping candidate
is dropped (del_alg1, del_cpu) or kept and verified (del and its ablations: the authors' code), prefill seeds the
statistics from the last `prefill_window` prompt positions (targets: the full model's tokens there) and plans the
first round — or (prefill_draft, the authors' code) the first token is drafted at the lowest allowed layer with the
prefill: accepted iff that layer's token at the last prompt position is the full model's, then one plain round whose
window joins the prefill's undecayed —, TPL's d = 0 is plain decoding, the budget is d_max or γ (draft_budget), capped
by tokens left, E ranges over [min_exit_layer, L) or is fixed (exit_layer), ties go to the smaller d, then the
smaller ℓ.

Tolerances, and why. α is a ratio of decayed integer match counts: given the same matches it differs from the
engine's only by summation order (the replay sums Σ ω^{r−i−1} a_i directly, the engine keeps S ← ω·S + a), a few ulps:
rel 1e-12. Confidences are not exact: LlamaRMSNorm rounds every norm's output to float32 (in HF and, op for op, in
the engine), and the engine's batches (one draft position, then the d + 1 verified ones) are not HF's one batch of
the whole sequence: a float64 matmul over other shapes may round its last bit differently, and that can push a value
across a float32 rounding boundary (~6e-8 relative) in the next norm. Such a flip moves a logit by ≲ 1e-7 here and a
softmax probability p by at most 2p·|Δlogit|, so confidences, and τ, a weighted mean of them, agree to well inside
TOL_CONF = 1e-6. Measured on this host: ≤ 1e-16 (float64 shadow softmax, 02f5138); 1.4e-8 with the float32 one before.
Decisions are compared exactly, but only where they are robust: a shadow token whose top-2 logits are within
TOL_LOGIT, a TPL maximum within rel 1e-12 of another (E, d), or a confidence within TOL_CONF of τ is a near tie — the
replay accepts either side there and says so (a warning), rather than flake on a host whose rounding differs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.models.layer_stack import LayerStack
from tests.conftest import compose_run, tiny_model

TOL_ALPHA = 1e-12  # relative: summation order only
TOL_CONF = 1e-6  # absolute, confidences and τ: float32 rounding in RMSNorm and in the shadow softmax (docstring)
TOL_LOGIT = 1e-5  # a shadow token whose top-2 logits are closer than this is a near tie
TOL_TPL = 1e-12  # relative: TPL values this close are a near tie

PROMPTS = {  # shorter than the prefill window (32) and longer (the window's start shows); 1–2 positions: 0/0 guards
    "short": "def add(a, b):\n",
    "long": "x = [i * i for i in range(10)]\nprint(sum(x) + len(x) * 3)\n",
    "bos": "",
    "one_byte": "a",
}
L8 = {"num_layers": 8}
L8_AGREEING = {"num_layers": 8, "late_residual_scale": 0.1}  # layers ≥ 4 agree often enough for DEL-E-lim to draft


@dataclass(frozen=True)
class Run:
    model: dict  # tiny_model overrides
    config: str  # configs/method/<config>.yaml
    overrides: dict = field(default_factory=dict)  # on top of the config
    head_cost: float | None = None  # cost_model measured: a head row in layers, as set_costs would measure it
    max_new: int = 60
    eos: tuple[int, ...] = ()
    prompts: tuple[str, ...] = ("short", "long")


RUNS = {
    "L4/del": Run({}, "del", prompts=("short", "long", "one_byte")),  # one_byte: a layer E that never matched
    "L4/del_alg1": Run({}, "del_alg1", prompts=("short", "long", "one_byte")),  # Algorithm 1: the stopped one dropped
    "L8a/del_alg1": Run(L8_AGREEING, "del_alg1"),
    "L8/del": Run(L8, "del"),
    "L8a/del": Run(L8_AGREEING, "del"),
    "L4/del_e": Run({}, "del_e"),
    "L8/del_e": Run(L8, "del_e"),
    "L4/del_gamma": Run({}, "del_gamma"),  # E = the model's default exit layer (1)
    "L8/del_gamma_E3": Run(L8, "del_gamma", {"exit_layer": 3}, prompts=("short", "bos")),
    "L8/del_alg1_E3": Run(L8, "del_alg1", {"exit_layer": 3}, prompts=("short", "bos")),  # bos: never mismatched
    "L8a/del_e_lim": Run(L8_AGREEING, "del_e_lim"),
    "L8/del_w0.8_d5": Run(L8, "del", {"omega": 0.8, "d_max": 5}, max_new=40),  # budgets capped by d_max and tokens
    "L8a/del_cpu": Run(L8_AGREEING, "del_cpu", head_cost=2.0),  # shadow_vocab 1024 ≥ V: the full vocabulary here
    "L8/del_cpu_v50": Run(L8, "del_cpu", {"shadow_vocab": 50}, head_cost=2.0),  # the restricted vocabulary, drafting
    "L8a/del_eos": Run(L8_AGREEING, "del", eos=(251,), prompts=("long",)),  # two drafts end on an EOS
}
CASES = [(run, prompt) for run, spec in RUNS.items() for prompt in spec.prompts]


def method_spec(config: str, overrides: dict) -> dict:
    """The method's parameters as configs/method/<config>.yaml composes them (what the replay reads)."""
    cfg = compose_run("model=tiny-random", f"method={config}")
    return {**OmegaConf.to_container(cfg.method, resolve=True), **overrides}


# ---- what every layer would have drafted, from transformers' own forward ----------------------------------------
@dataclass
class LayerViews:
    """Per layer ℓ = 1..L−1 and position p of the final sequence: the head's greedy token on h_p^ℓ, its softmax
    probability, and the gap between its top two logits; the full model's token at p. Over the scored tokens
    (shadow_vocab) for the statistics; a draft candidate is the whole vocabulary's argmax."""

    tokens: np.ndarray  # [L-1, T] the shadow tokens: the argmax over the scored tokens
    drafts: np.ndarray  # [L-1, T] what the layer drafts: the argmax over the whole vocabulary
    conf: np.ndarray  # [L-1, T] float64, over the scored tokens (shadow_vocab): what the statistics add up
    conf_draft: np.ndarray  # [L-1, T] a draft candidate's confidence: its softmax probability over the scored tokens
    # with the layer's own token for the target (the first K ids and itself), as the statistics score a matched one
    gap: np.ndarray  # [L-1, T] the smaller of the two top-2 gaps (scored tokens, whole vocabulary)
    target: np.ndarray  # [T]
    seq: list[int]  # the final sequence: prompt + output


@torch.no_grad()
def layer_views(model, seq: list[int], vocab: int | None) -> LayerViews:
    """vocab = K (shadow_vocab): only the first K ids and the position's target are scored, the softmax over them."""
    out = model(torch.tensor([seq]), output_hidden_states=True)
    L = model.config.num_hidden_layers
    assert len(out.hidden_states) == L + 1  # embeddings, then the output of each layer (the last one normed)
    target = out.logits[0].argmax(-1)  # [T] the full model's greedy tokens
    h = torch.stack(out.hidden_states[1:L])[:, 0]  # [L-1, T, D] outputs of layers 1..L−1
    full = model.lm_head(model.model.norm(h))  # [L-1, T, V]
    logits = scored_only(full, target.expand(L - 1, -1), vocab)
    top2, top2_full = logits.topk(2, dim=-1), full.topk(2, dim=-1)
    conf = logits.softmax(-1).max(-1).values  # [L-1, T]
    drafts = top2_full.indices[..., 0]  # [L-1, T]
    conf_draft = scored_only(full, drafts, vocab).softmax(-1).max(-1).values  # [L-1, T]
    gap = torch.minimum(top2.values[..., 0] - top2.values[..., 1], top2_full.values[..., 0] - top2_full.values[..., 1])
    return LayerViews(top2.indices[..., 0].numpy(), drafts.numpy(), conf.numpy(), conf_draft.numpy(), gap.numpy(),
                      target.numpy(), seq)


def scored_only(logits: torch.Tensor, targets: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """logits [L-1, T, V] with every token but the first K ids and each row's target ([L-1, T]) at −∞."""
    if vocab is None or vocab >= logits.shape[-1]:
        return logits
    scored = torch.zeros(logits.shape[-1], dtype=torch.bool)
    scored[:vocab] = True
    scored = scored.expand(*logits.shape).clone()  # [L-1, T, V]
    scored.scatter_(-1, targets[..., None], True)
    return logits.masked_fill(~scored, -torch.inf)


# ---- Algorithm 1, from the spec ------------------------------------------------------------------------------
@dataclass
class Choice:
    exit_layer: int  # E of the TPL argmax
    gamma: int  # γ of the TPL argmax (0: plain decoding)
    alternatives: set  # the choice and the (E, γ) within TOL_TPL below the maximum: a near tie when > 1
    alpha: float  # α_E
    guarded: str | None  # "matched" / "mismatched": layer E has no such position yet, a 0/0 guard gives its mean
    conf_matched: float
    conf_mismatched: float

    @property
    def tau(self) -> float:
        return 0.5 * (self.conf_matched + self.conf_mismatched)


@dataclass
class Algorithm1:
    num_layers: int
    omega: float
    d_max: int
    allowed: list[int]  # exit layers TPL may choose
    head_cost: float = 0.0  # a head row in layers (cost_model measured), else 0
    stop_head: bool = False  # the dropped stopping candidate's head row is paid for (measured, with draft exit)
    rounds: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = field(default_factory=list)  # c, tcs, fcs, n

    def observe(self, views: LayerViews, positions: range, join: bool = False) -> None:
        """One round's valid window (prefill: the last prompt positions) into the statistics; join: as part of the
        previous round's window (the plain round after an accepted prefill draft)."""
        p = list(positions)
        matched = views.tokens[:, p] == views.target[p]  # [L-1, n]
        conf = views.conf[:, p]
        terms = (matched.sum(1).astype(float), (conf * matched).sum(1), (conf * ~matched).sum(1), len(p))
        if join:
            terms = tuple(a + b for a, b in zip(self.rounds.pop(), terms))
        self.rounds.append(terms)

    def decayed(self, column: int) -> np.ndarray:
        """S(a) = Σ_i ω^{r−i−1} a_i over the rounds so far."""
        r = len(self.rounds)
        weights = self.omega ** np.arange(r - 1, -1, -1, dtype=np.float64)  # [r]
        return sum(w * np.asarray(rnd[column], dtype=np.float64) for w, rnd in zip(weights, self.rounds))

    def tpl(self, alpha: float, layer: int, d: int) -> float:
        """Expected tokens of a round, Σ_{k≤d} α^k, per layer of cost: d drafts of ℓ layers and a head row,
        verification of L layers and a head row, and (stop_head) the candidate that stops drafting, dropped."""
        tokens = sum(alpha ** k for k in range(d + 1))
        h = self.head_cost
        return tokens / (d * (layer + h) + self.num_layers + h + (h if self.stop_head and d > 0 else 0.0))

    def choose(self) -> Choice:
        c, tcs, fcs, n = (self.decayed(i) for i in range(4))
        alpha = c / n if n > 0 else np.zeros_like(c)
        values = {(layer, d): self.tpl(float(alpha[layer - 1]), layer, d)
                  for d in range(self.d_max + 1) for layer in self.allowed}
        best = max(values.values())
        # exact ties (d = 0 at every ℓ; layers with the same match history) are exact in the engine too: the rule
        # decides them; values within TOL_TPL but not equal are near ties, where summation order may decide
        exact = [key for key, v in values.items() if v == best]
        layer, gamma = min(exact, key=lambda key: (key[1], key[0]))  # ties: the smaller d, then the smaller ℓ
        near = {key for key, v in values.items() if best * (1 - TOL_TPL) <= v < best} | {(layer, gamma)}
        e = layer - 1
        matched_mean = tcs[e] / c[e] if c[e] > 0 else 1.0
        mismatched_mean = fcs[e] / (n - c[e]) if n - c[e] > 0 else 0.0
        guarded = "matched" if c[e] == 0 else "mismatched" if n - c[e] == 0 else None
        return Choice(layer, gamma, near, float(alpha[e]), guarded, float(matched_mean), float(mismatched_mean))


def algorithm_for(spec: dict, num_layers: int, head_cost: float | None) -> Algorithm1:
    if spec["exit_layer"] is not None:
        allowed = [spec["exit_layer"]]
    else:
        allowed = list(range(spec["min_exit_layer"], num_layers))
    measured = spec["cost_model"] == "measured"
    return Algorithm1(num_layers, spec["omega"], spec["d_max"], allowed, head_cost if measured else 0.0,
                      stop_head=measured and spec["dynamic_draft_exit"] and not spec["keep_stopped_draft"])


# ---- the run and its replay ---------------------------------------------------------------------------------
@dataclass
class Tally:
    """What the replay saw across a run (coverage) and the near ties it let through."""

    rounds: int = 0
    stops: dict = field(default_factory=lambda: {"tau": 0, "budget": 0, "tokens_left": 0, "eos": 0, "plain": 0})
    exit_layers: set = field(default_factory=set)
    accepted: int = 0
    rejected: int = 0
    guarded: dict = field(default_factory=lambda: {"matched": 0, "mismatched": 0})  # rounds whose τ_E took a 0/0 guard
    conf_error: float = 0.0  # largest |engine − replay| over confidences, τ and its two means
    near_ties: list = field(default_factory=list)


def near_tie(tally: Tally, what: str) -> None:
    tally.near_ties.append(what)
    warnings.warn(f"DEL replay: near tie, either side accepted: {what}", stacklevel=2)


def run_engine(stack, prompt_ids, spec, head_cost, max_new, eos_ids=()):
    from hydra.utils import instantiate

    method = instantiate({k: v for k, v in spec.items() if k != "tag"})
    if head_cost is not None:
        method.set_costs(layer_s=1.0, head_s=head_cost)  # what a start-up measurement would give, without timing
    return Engine(stack, Sampling(), set(eos_ids)).generate(prompt_ids, method, max_new, seed=0)


def replay(model, prompt_ids: list[int], gen, spec: dict, head_cost: float | None, max_new: int,
           eos_ids=()) -> Tally:
    L = model.config.num_hidden_layers
    seq = prompt_ids + gen.output_ids
    views = layer_views(model, seq, spec["shadow_vocab"])
    algo = algorithm_for(spec, L, head_cost)
    P, tally = len(prompt_ids), Tally()
    window = min(spec["prefill_window"], P)
    check_robust(views, range(P - window, P), tally, "prefill")
    algo.observe(views, range(P - window, P))
    assert views.target[P - 1] == gen.output_ids[0]
    emitted = gen.rounds[0].emitted
    first = algo.allowed[0] - 1  # the prefill draft's layer, 0-based: the lowest TPL may choose (their initial E)
    joins = spec["prefill_draft"] and max_new > 1 and views.tokens[first, P - 1] == views.target[P - 1]
    for r, rnd in enumerate(gen.rounds[1:], start=1):
        n = P + emitted  # the pending token sits at n − 1; the valid window is n − 1 .. n − 1 + accepted
        join = joins and r == 1
        if join:  # the token after the accepted prefill draft: one plain pass
            assert (rnd.budget, rnd.drafted, rnd.trace.get("prefill_draft")) == (0, 0, True), f"round {r}"
        else:
            assert not rnd.trace.get("prefill_draft"), f"round {r}: a prefill draft's round where none was accepted"
            check_round(r, rnd, algo.choose(), views, spec, n, max_new - emitted, eos_ids, tally)
        positions = range(n - 1, n + rnd.accepted)
        check_robust(views, positions, tally, f"round {r}")
        algo.observe(views, positions, join=join)
        emitted += rnd.emitted
    assert emitted == len(gen.output_ids)
    return tally


def check_robust(views: LayerViews, positions: range, tally: Tally, where: str) -> None:
    """Shadow tokens the replay decides with a margin: a top-2 logit gap under TOL_LOGIT is a near tie."""
    gaps = views.gap[:, list(positions)]
    if gaps.min() < TOL_LOGIT:
        near_tie(tally, f"{where}: a shadow token's top-2 logits are {gaps.min():.1e} apart")


def check_round(r: int, rnd, choice: Choice, views: LayerViews, spec: dict, n: int, left: int, eos_ids,
                tally: Tally) -> None:
    trace, deferred = rnd.trace, spec.get("defer_shadow", False)
    tally.rounds += 1
    if choice.guarded:
        tally.guarded[choice.guarded] += 1
    # TPL's choice: exact, or (near tie) any of the tied (E, γ)
    got = (trace["chosen_exit_layer"] or choice.exit_layer, trace["gamma_tpl"])
    if got != (choice.exit_layer, choice.gamma):
        assert got in choice.alternatives, \
            f"round {r}: engine chose (E, γ) = {got}, Algorithm 1 {(choice.exit_layer, choice.gamma)}"
        near_tie(tally, f"round {r}: TPL {got} vs {(choice.exit_layer, choice.gamma)}")
    gamma = trace["gamma_tpl"]
    assert trace["chosen_exit_layer"] == (choice.exit_layer if gamma else None), f"round {r}"
    if gamma or not deferred:  # deferral (del_cpu) lets a d = 0 round's τ/α fields lag, never a drafting round's
        assert trace["alpha_exit"] == pytest.approx(choice.alpha, rel=TOL_ALPHA, abs=1e-300), f"round {r}: α_E"
        for key, want in (("tau", choice.tau), ("conf_matched", choice.conf_matched),
                          ("conf_mismatched", choice.conf_mismatched)):
            assert abs(trace[key] - want) <= TOL_CONF, f"round {r}: {key} {trace[key]} vs {want}"
            tally.conf_error = max(tally.conf_error, abs(trace[key] - want))
    # the budget: d = 0 is plain decoding; else d_max or γ, capped so that the round cannot overshoot
    planned = 0 if gamma == 0 else spec["d_max"] if spec["draft_budget"] == "d_max" else gamma
    assert rnd.budget == (min(planned, left - 1) if gamma else 0), f"round {r}: budget"
    d, k = rnd.drafted, rnd.accepted
    assert rnd.exit_layer == (trace["chosen_exit_layer"] if d else None), f"round {r}: exit layer"
    if d:
        check_acceptance(r, views, trace["chosen_exit_layer"], n, d, k)
        tally.exit_layers.add(rnd.exit_layer)
        tally.accepted, tally.rejected = tally.accepted + k, tally.rejected + (d > k)
    for p in range(n - 1, min(n + k, len(views.seq) - 1)):  # lossless: the window's targets are the output's tokens
        assert views.target[p] == views.seq[p + 1], f"round {r}: the full model's token at {p}"
    tally.stops[stop_reason(r, rnd, choice, views, spec, n, planned, eos_ids, tally)] += 1


def check_acceptance(r: int, views: LayerViews, E: int, n: int, d: int, k: int) -> None:
    """u_r: greedy drafts are layer E's tokens; on the valid window they are the teacher-forced ones, so the
    accepted prefix is where layer E matches the full model, up to the first mismatch (or all d drafts)."""
    layer_e = views.drafts[E - 1, n - 1 : n - 1 + d]
    target = views.target[n - 1 : n - 1 + d]
    first_mismatch = next((i for i in range(d) if layer_e[i] != target[i]), d)
    assert k == first_mismatch, f"round {r}: accepted {k}, layer {E} departs from the full model at {first_mismatch}"


def stop_reason(r: int, rnd, choice: Choice, views: LayerViews, spec: dict, n: int, planned: int, eos_ids,
                tally: Tally) -> str:
    """Why drafting ended, from draft_confidences and the round record, checked against the replay's τ."""
    confs, d, k, E = rnd.trace.get("draft_confidences", []), rnd.drafted, rnd.accepted, rnd.trace["chosen_exit_layer"]
    if rnd.budget == 0:
        assert not confs and d == 0, f"round {r}: a plain-decoding round drafted"
        return "plain"
    if not spec["dynamic_draft_exit"]:
        assert not confs, f"round {r}: DEL-E scored confidences"
        if d == rnd.budget:
            return "tokens_left" if rnd.budget < planned else "budget"
        assert is_eos(views, E, n, d, k, eos_ids), f"round {r}: drafting ended at {d} < budget {rnd.budget}"
        return "eos"
    for j, c in enumerate(confs[: k + 1]):  # candidates from valid states: their confidence is layer E's there
        want = views.conf_draft[E - 1, n - 1 + j]  # on the statistics' scale (shadow_vocab), as τ is
        assert abs(c - want) <= TOL_CONF, f"round {r}: candidate {j}'s confidence {c} vs {want}"
        tally.conf_error = max(tally.conf_error, abs(c - want))
    kept = spec["keep_stopped_draft"]  # the authors' code: the candidate below τ is the round's last draft
    for j, c in enumerate(confs):  # ≥ τ keeps drafting, < τ stops (against the replay's τ, robustly)
        if abs(c - choice.tau) <= TOL_CONF:
            near_tie(tally, f"round {r}: candidate {j}'s confidence {c} vs τ {choice.tau}")
        elif j < d - kept:
            assert c > choice.tau, f"round {r}: drafting went on after candidate {j}, below τ"
    if kept and confs and d < rnd.budget and confs[-1] < rnd.trace["tau"]:
        assert len(confs) == d, f"round {r}: the stopped candidate was not kept"
        if abs(confs[-1] - choice.tau) > TOL_CONF:
            assert confs[-1] < choice.tau, f"round {r}: stopped on a candidate above τ"
        return "tau"
    if len(confs) == d + 1:
        assert confs[d] < rnd.trace["tau"] and d < rnd.budget, f"round {r}: dropped a candidate that passed τ"
        if abs(confs[d] - choice.tau) > TOL_CONF:
            assert confs[d] < choice.tau, f"round {r}: stopped on a candidate above τ"
        return "tau"
    assert len(confs) == d, f"round {r}: {len(confs)} confidences for {d} drafts"
    if d == rnd.budget:
        return "tokens_left" if rnd.budget < planned else "budget"
    assert is_eos(views, E, n, d, k, eos_ids), f"round {r}: drafting ended at {d} < budget {rnd.budget} with no reason"
    return "eos"


def is_eos(views: LayerViews, E: int, n: int, d: int, k: int, eos_ids) -> bool:
    """The last draft was an EOS. When it came from a valid state (k ≥ d − 1) it is layer E's token there, which
    the replay sees; from a later state (k < d − 1, a rejected context) only that an EOS was possible at all."""
    if k >= d - 1:
        return int(views.drafts[E - 1, n - 2 + d]) in eos_ids
    return bool(eos_ids)


# ---- the tests ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    built = {}

    def get(overrides: dict):
        key = tuple(sorted(overrides.items()))
        if key not in built:
            model, tok = tiny_model(**overrides)
            built[key] = (model, tok, LayerStack(model))
        return built[key]

    return get


TALLIES: dict[str, Tally] = {}


@pytest.mark.parametrize(("run", "prompt"), CASES)
def test_engine_rounds_follow_algorithm_1(models, run, prompt):
    spec = RUNS[run]
    model, tok, stack = models(spec.model)
    method = method_spec(spec.config, spec.overrides)
    prompt_ids = tok(PROMPTS[prompt])["input_ids"]
    gen = run_engine(stack, prompt_ids, method, spec.head_cost, spec.max_new, spec.eos)
    TALLIES[f"{run}/{prompt}"] = replay(model, prompt_ids, gen, method, spec.head_cost, spec.max_new, spec.eos)


def test_the_replay_covered_what_matters():
    """Not vacuous: across the runs, every stop reason, several exit layers, accepted and rejected drafts;
    near ties are rare, and the confidences agree far inside TOL_CONF."""
    if len(TALLIES) < len(CASES):
        pytest.skip("needs every replay run (run the whole module)")
    tallies = TALLIES.values()
    stops = {key: sum(t.stops[key] for t in tallies) for key in Tally().stops}
    near = [f"{case}: {what}" for case, t in TALLIES.items() for what in t.near_ties]
    rounds = sum(t.rounds for t in tallies)
    layers = sorted(set().union(*(t.exit_layers for t in tallies)))
    guarded = {key: sum(t.guarded[key] for t in tallies) for key in ("matched", "mismatched")}
    print(f"rounds {rounds}, stops {stops}, 0/0 guards {guarded}, exit layers {layers}, "
          f"accepted {sum(t.accepted for t in tallies)}, rejected {sum(t.rejected for t in tallies)}, "
          f"largest confidence error {max(t.conf_error for t in tallies):.1e}, near ties {len(near)}: {near}")
    assert all(stops[key] > 0 for key in stops)
    assert all(guarded.values())  # both 0/0 guards decided some τ
    assert len(layers) >= 3
    assert sum(t.accepted for t in tallies) > 0 and sum(t.rejected for t in tallies) > 0
    assert len(near) <= rounds // 50  # near ties let through stay rare: the comparisons are mostly exact
