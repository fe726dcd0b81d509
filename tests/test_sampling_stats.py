"""Speculative sampling keeps the target distribution end to end, for every method: a statistical test of the engine's
sampled outputs against transformers' own conditionals, over long generations (rounds with d ≥ 3 drafts, token trees
with siblings at several depths, AdaDecode's deferred checks), with subtle bugs as negative controls that must fail.

The test. Whatever a method drafts, a lossless sampler emits token t with probability p_t(x) = the target's warped
distribution given the tokens before it — also given anything decided before x_t was drawn (which round it is in,
its index in the round: speculative sampling is exact at every index). So within any group of positions fixed
before their tokens are drawn, the counts O[v] = Σ_t [x_t = v] have mean E[v] = Σ_t p_t(v) and covariance
C = Σ_t diag(p_t) − p_t p_tᵀ (a martingale), and (O − E)ᵀ C⁺ (O − E) is χ² with rank(C) degrees of freedom. Groups:
the token before (contexts of a tiny model differ mostly by it, so a bias keeps its direction within a group) ×
the index in the round, capped at 3 (a bug at the second draft on shows there). The p_t come from one transformers
forward over each output, not from the engine. The seeds fix every draw: each test is deterministic, and the seeds
were not chosen — the correct sampler passes and each bug fails at the first seeds tried (margins in the asserts'
comments)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chi2, norm

from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.methods.adadecode import AdaDecode
from del_bench.methods.clasp import CLaSp
from del_bench.methods.dv import DraftVerify
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.fs import FiniteState
from del_bench.methods.knapspec import KnapSpec
from del_bench.methods.ls import LayerSkip
from del_bench.methods.swift import Swift
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model
from tests.sampling_mutants import MUTANTS
from tests.test_exit_adapters import random_adapters

VOCAB = 6
SAMPLING = Sampling(do_sample=True, temperature=0.9, top_p=0.95)
PROMPT = [1, 2, 3]
MAX_INDEX = 3  # positions at index ≥ 3 of their round share a group


@pytest.fixture(scope="module")
def model():
    model, _ = tiny_model(vocab_size=VOCAB, late_residual_scale=0.6, seed=3)
    return model


@dataclass
class Sample:
    """runs outputs of the same prompt (seeds 0..runs−1) and, per token, what was fixed before it was drawn."""

    outputs: list[list[int]]
    indices: list[list[int]]  # index in its round, capped at MAX_INDEX (AdaDecode: 0, it has no rounds)
    drafted: list[list[bool]]  # a draft existed at the token's position (AdaDecode: True)
    rounds: list  # every generation's rounds, for the tests' guards


def draw(engine, method, n_tokens: int, runs: int) -> Sample:
    sample = Sample([], [], [], [])
    for seed in range(runs):
        gen = engine.generate(PROMPT, method, n_tokens, seed=seed)
        assert len(gen.output_ids) == n_tokens
        sample.outputs.append(gen.output_ids)
        sample.rounds.append(gen.rounds)
        if method.draft_shape == "layer_parallel":
            sample.indices.append([0] * n_tokens)
            sample.drafted.append([True] * n_tokens)
        else:  # round r emits tokens j = 0..emitted−1: drafts 0..k−1 accepted, then the verifier's token
            sample.indices.append([min(j, MAX_INDEX) for r in gen.rounds for j in range(r.emitted)])
            sample.drafted.append([j < r.drafted for r in gen.rounds for j in range(r.emitted)])
    return sample


def p_value(model, sample: Sample) -> float:
    """Two tests of the outputs, Bonferroni-combined: the grouped χ² above, and a focused one that looks where a
    sampler that leans toward its drafts goes wrong: the score f_t(v) = q_t(v) − p_t(v) at positions with a draft,
    with q_t the layer-1 exit's warped distribution (a draft-like model, also from transformers' forward, fixed
    before x_t is drawn). Under the null Σ_t f_t(x_t) − E_p f_t is a martingale with variance Σ_t Var_p f_t, so its
    z-score is N(0, 1)."""
    ids = torch.tensor([PROMPT + out for out in sample.outputs])  # [N, P + n]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        p = SAMPLING.probs(out.logits[:, len(PROMPT) - 1 : -1]).numpy()  # [N, n, V] p_t given x_<t
        early = model.lm_head(model.model.norm(out.hidden_states[1][:, len(PROMPT) - 1 : -1]))
        q = SAMPLING.probs(early).numpy()  # [N, n, V]
    x = np.array(sample.outputs)  # [N, n]
    if (np.take_along_axis(p, x[..., None], -1) == 0).any():
        return 0.0  # a token the target never emits
    grouped = grouped_chi2(p, x, np.array(sample.indices))
    return min(1.0, 2 * min(grouped, focused(p, q - p, x, np.array(sample.drafted))))


def focused(p, f, x, where) -> float:
    """Two-sided p-value of the score test of f over the positions `where` (p, f: [N, n, V]; x, where: [N, n])."""
    mean = (p * f).sum(-1)  # [N, n] E_p f_t
    var = (p * f**2).sum(-1) - mean**2
    score = np.take_along_axis(f, x[..., None], -1)[..., 0] - mean
    z = score[where].sum() / np.sqrt(var[where].sum())
    return float(2 * norm.sf(abs(z)))


def grouped_chi2(p, x, indices) -> float:
    """p-value of Σ over groups of (O − E)ᵀ C⁺ (O − E) (p: [N, n, V]; x, indices: [N, n])."""
    prev = np.concatenate([np.full((len(x), 1), PROMPT[-1]), x[:, :-1]], axis=1)  # [N, n] the token before x_t
    residual, cov, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for (b, t), token in np.ndenumerate(x):
        group = (prev[b, t], indices[b, t])
        residual[group] = residual[group] + np.eye(VOCAB)[token] - p[b, t]
        cov[group] = cov[group] + np.diag(p[b, t]) - np.outer(p[b, t], p[b, t])
        count[group] += 1
    residual, cov = pool_small(residual, count), pool_small(cov, count)
    stat = df = 0.0
    for group, r in residual.items():
        values, vectors = np.linalg.eigh(cov[group])
        keep = values > 1e-9 * values.max()
        stat += float(((vectors[:, keep].T @ r) ** 2 / values[keep]).sum())
        df += int(keep.sum())
    return float(chi2.sf(stat, df))


def pool_small(sums: dict, counts: dict, least: int = 20) -> dict:
    """Groups of fewer than `least` positions merged into one (still fixed before the tokens): the χ² needs counts."""
    pooled = {}
    for group, value in sums.items():
        key = group if counts[group] >= least else "pooled"
        pooled[key] = pooled[key] + value if key in pooled else value
    return pooled


def del_cpu() -> DEL:
    """`method=del_cpu` on a tiny model: measured costs (a head row = 0.5 layer, as set_costs would give), cheap
    shadow tokens, deferred scoring."""
    method = DEL(cost_model="measured", shadow_vocab=4, defer_shadow=True)
    method.head_cost = 0.5
    return method


def swift_tree() -> Swift:
    """2 siblings beside every draft, at every depth, of a poor draft model (layers 2, 3 skipped whole)."""
    return Swift(skip_set={"attn": [1, 2], "mlp": [1, 2]}, confidence=0.0, d_max=3, tree=True, tree_widths=[3, 3],
                 tree_confidences=[0.5])


def knapspec() -> KnapSpec:
    """Full-model drafts in rounds 1-2 (all accepted), then a selection every 2 rounds; a fixed latency model."""
    method = KnapSpec(warmup_rounds=2, window_rounds=1, interval=2, confidence=0.0, gamma=4, prune=0.0,
                      latency_contexts=(8, 64))
    method.set_costs(1.0, 1.0, sublayer_s=[[8, 1.1, 1.0], [64, 1.6, 1.0]])
    return method


# every method and variant, built fresh per test (methods keep state); "+adapters": through exit adapters
METHODS = {
    "ls": lambda: LayerSkip(1, 4),
    "fs": lambda: FiniteState(1, 3),
    "dv": lambda: DraftVerify(1, theta=0.3, d_max=6),
    "del": lambda: DEL(d_max=6),
    "del_e": lambda: DEL(d_max=6, dynamic_draft_exit=False, draft_budget="tpl"),
    "del_gamma": lambda: DEL(d_max=6, exit_layer=1),
    "del_e_lim": lambda: DEL(d_max=6, min_exit_layer=2),
    "del_cpu": del_cpu,
    "swift-chain": lambda: Swift(skip_set={"attn": [1], "mlp": [2]}, confidence=0.3, d_max=5),
    "swift-search": lambda: Swift(context_window=4, bayes_interval=0, scope="prompt", confidence=0.0, d_max=4),
    "swift-tree": swift_tree,
    "clasp": lambda: CLaSp(skip_layers=2, interval=2, confidence=0.0, gamma=4),  # round 1: the full model drafts
    "knapspec": knapspec,
    "del_knapspec": lambda: DEL(min_draft=1, d_max=6, keep_stopped_draft=True, first_exit_layer=1),
    "del-lookahead": lambda: DEL(d_max=6, lookahead=3),  # candidates drafted past a stop draw, then are dropped
    "adadecode": lambda: AdaDecode(gamma=0.3, head_layers=[1, 2], max_outstanding=3),
    "adadecode-early": lambda: AdaDecode(gamma=0.0, head_layers=[1], max_outstanding=3),
    "ls+adapters": lambda: LayerSkip(1, 4),
    "del+adapters": lambda: DEL(d_max=6),
    "adadecode+adapters": lambda: AdaDecode(gamma=0.0, head_layers=[1], max_outstanding=3),
}


def engine_for(model, name: str) -> Engine:
    stack = LayerStack(model)
    if name.endswith("+adapters"):
        stack.set_adapters(random_adapters(stack.norm_weight.shape[0]))
    return Engine(stack, SAMPLING, set())


N_TOKENS, RUNS = 32, 25  # 800 tokens a method, ~1 s


def assert_reaches_the_hard_cases(name: str, sample: Sample) -> None:
    """Guard against a vacuous pass: rounds with d ≥ 3 whose third draft is accepted and whose later positions are
    tested; a tree's siblings (≥ 2 at ≥ 2 depths) taken at several depths; AdaDecode's checks of ≥ 2 early
    predictions in one step, with rejections."""
    rounds = [r for gen in sample.rounds for r in gen[1:]]
    if name.startswith("adadecode"):
        verified = [v for r in rounds for v in r.trace["verified"]]
        assert max(len(r.trace["verified"]) for r in rounds) >= 2
        assert any(kept for *_, kept in verified) and not all(kept for *_, kept in verified)
        return
    assert any(r.drafted >= 3 and r.accepted >= 3 for r in rounds)
    assert sum(i == MAX_INDEX for row in sample.indices for i in row) >= 20  # tokens after three accepted drafts
    if name == "swift-tree":
        assert all(r.trace["tree_siblings"] == 2 * r.drafted for r in rounds if r.drafted)
        leaf_depths = {r.accepted for r in rounds if r.trace.get("tree_leaf_accepted")}  # the sibling's depth
        assert {1, 2} <= leaf_depths


@pytest.mark.parametrize("name", METHODS)
def test_sampling_keeps_the_target_distribution(model, name):
    sample = draw(engine_for(model, name), METHODS[name](), N_TOKENS, RUNS)
    assert_reaches_the_hard_cases(name, sample)
    assert p_value(model, sample) > 1e-3


# (method, bug, runs): each bug on an acceptance path of its own (chain, tree, AdaDecode's checks), with runs enough
# for it to fail at these seeds with a margin (the p-value at the seeds, against the 1e-3 the test fails below)
CONTROLS = [
    ("ls", "over-accept-10%", 200),  # 9e-9: ~0.03 of a token's mass moves, the hardest to see
    ("ls", "residual-from-p-after-first", 90),  # 6e-9
    ("ls", "residual-vs-q-without-x", 30),  # 2e-10
    ("swift-tree", "unnormalised-residual", 30),  # 2e-8
    ("adadecode-early", "residual-from-p-after-first", 100),  # 1e-6
    ("adadecode-early", "residual-vs-q-without-x", 30),  # 3e-6
]


@pytest.mark.parametrize(("name", "bug", "runs"), CONTROLS, ids=[f"{n}-{b}" for n, b, _ in CONTROLS])
def test_subtle_bugs_fail_the_test(model, monkeypatch, name, bug, runs):
    """Negative controls (tests/sampling_mutants.py): each bug fails the test that the right sampler passes."""
    MUTANTS[bug](monkeypatch)
    assert p_value(model, draw(engine_for(model, name), METHODS[name](), N_TOKENS, runs)) < 1e-3
