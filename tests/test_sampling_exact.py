"""Speculative sampling is exact, shown by enumeration rather than by sampling: every random draw of the real
acceptance code (chain with d = 3, a token tree with 2 siblings at 2 depths, AdaDecode's deferred checks through the
whole engine) takes each of its outcomes with that outcome's exact probability, and the output distribution summed
over all branches equals the target's to 1e-12 (float64 throughout)."""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict

import pytest
import torch

from del_bench.engine import sampling, skipping
from del_bench.engine.decode import Draft, Engine
from del_bench.engine.sampling import Draws, Sampling, Siblings
from del_bench.methods.adadecode import AdaDecode
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model
from tests.sampling_mutants import MUTANTS

EXACT = 1e-12


class Enumerating(Draws):
    """Draws that follow a script of branch choices (one per draw; a new draw takes branch 0) and multiply each
    chosen branch's exact probability into `weight`. Only branches of positive probability exist, so replaying every
    script (outcomes) visits each possible run once, with its exact probability."""

    def __init__(self, script: list[int]):
        super().__init__(generator=None)
        self.script, self.widths, self.weight = script, [], 1.0

    def _branch(self, probs: list[float]) -> int:
        at = len(self.widths)
        if at == len(self.script):
            self.script.append(0)
        self.widths.append(len(probs))
        self.weight *= probs[self.script[at]]
        return self.script[at]

    def below(self, num, den) -> bool:
        p_true = min(1.0, float(num) / float(den)) if den > 0 else float(num > 0)  # P(u·den < num), u ~ U[0, 1)
        sides = [(side, p) for side, p in ((True, p_true), (False, 1 - p_true)) if p > 0]
        return sides[self._branch([p for _, p in sides])][0]

    def categorical(self, weights) -> int:
        support = torch.nonzero(weights > 0).flatten().tolist()
        total = float(weights.sum())
        return support[self._branch([float(weights[i]) / total for i in support])]

    def without_replacement(self, weights, count) -> list[int]:
        weights, drawn = weights.clone(), []
        for _ in range(count):
            drawn.append(self.categorical(weights))
            weights[drawn[-1]] = 0
        return drawn

    def below_each(self, num, den) -> torch.Tensor:
        return torch.tensor([self.below(a, b) for a, b in zip(num, den)], dtype=torch.bool)

    def sample(self, weights) -> torch.Tensor:
        return torch.tensor([self.categorical(weights)])


def outcomes(run) -> dict:
    """run(draws) → a hashable outcome, replayed over every branch: {outcome: exact probability}."""
    dist, script = defaultdict(float), []
    while True:
        draws = Enumerating(script)
        dist[run(draws)] += draws.weight
        script, widths = draws.script[: len(draws.widths)], draws.widths
        while script and script[-1] + 1 == widths[len(script) - 1]:  # odometer: the last draw with a branch left
            script.pop()
        if not script:
            return dict(dist)
        script[-1] += 1


# ---- the acceptance rules on fixed p/q tables ------------------------------------------------------------------
V = 4
WARP = Sampling(do_sample=True, temperature=0.9, top_p=0.85)  # top-p zeros: tokens the draft has and p lacks


@functools.cache
def logits_of(kind: int, prefix: tuple[int, ...]) -> torch.Tensor:
    """Fixed pseudo-random logits [V] per (model kind, prefix): 0 = target, 1 = draft (cached: never written to)."""
    seed = 1 + kind * 1_000_003 + sum((t + 1) * 7**i for i, t in enumerate(prefix))
    return 2.0 * torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def p_of(prefix) -> torch.Tensor:
    return _p(tuple(prefix))


@functools.cache
def _p(prefix) -> torch.Tensor:
    return WARP.probs(logits_of(0, prefix))


@functools.cache
def _q(prefix) -> torch.Tensor:
    return (logits_of(1, prefix) / 0.9).softmax(-1)


def q_of(prefix) -> torch.Tensor:
    """The draft: full support (2 siblings always exist), so it proposes tokens the target's top-p removed."""
    return _q(tuple(prefix))


def target_joint(n: int) -> dict[tuple[int, ...], float]:
    """P(x1..xn) under the target, by the chain rule."""
    joint = {(): 1.0}
    for _ in range(n):
        joint = {s + (x,): w * float(p_of(s)[x]) for s, w in joint.items() for x in range(V)}
    return joint


def completed(emitted: dict[tuple[int, ...], float], n: int) -> dict[tuple[int, ...], float]:
    """The distribution of n tokens when a round's emitted tokens are continued by the target itself: a round is
    exact iff this equals the target's joint (whatever the round's length distribution)."""
    out = defaultdict(float)
    for seq, w in emitted.items():
        for tail in itertools.product(range(V), repeat=n - len(seq)):
            out[seq + tail] += w * conditional(seq, tail)
    return out


def conditional(prefix, tail) -> float:
    w = 1.0
    for t in tail:
        w *= float(p_of(prefix)[t])
        prefix = prefix + (t,)
    return w


def max_error(emitted: dict, n: int) -> float:
    got, want = completed(emitted, n), target_joint(n)
    return max(abs(got.get(s, 0.0) - w) for s, w in want.items())


def chain_round(d: int):
    """One round on the tables: d drafts from q (drawn on the device, as the engine's), then accept_sampling over all
    d + 1 target rows at once. → the emitted tokens."""

    def run(draws: Draws) -> tuple[int, ...]:
        drafts, qs = [], []
        for _ in range(d):
            qs.append(q_of(drafts))
            drafts.append(int(draws.sample(qs[-1])))
        targets = torch.stack([logits_of(0, tuple(drafts[:i])) for i in range(d + 1)])  # [d+1, V]
        k, token = sampling.accept_sampling(torch.tensor(drafts), torch.stack(qs), targets, WARP, draws)
        return (*drafts[: int(k)], int(token))

    return run


def tree_round(d: int, width: int, leaves: dict | None = None):
    """One round of a token tree on the tables: d chain drafts, `width` − 1 siblings beside each drawn by the engine's
    own sibling step (skipping.siblings: from q without replacement after the chain token), then accept_sampling_tree.
    The verifier's rows: 0..d the chain's prefixes, then one per sibling (its prefix: the chain before it + it).
    leaves: if given, counts the runs that accepted a sibling, by depth."""

    def run(draws: Draws) -> tuple[int, ...]:
        draft = Draft()
        for _ in range(d):
            draft.draft_probs.append(q_of(draft.drafts))
            draft.drafts.append(draws.categorical(draft.draft_probs[-1]))
            draft.siblings.append(skipping.siblings(draft, width - 1, draws))
        prefixes = [tuple(draft.drafts[:i]) for i in range(d + 1)]
        rows = []
        for i, level in enumerate(draft.siblings):
            rows.append(list(range(len(prefixes), len(prefixes) + len(level))))
            prefixes += [(*draft.drafts[:i], s) for s in level]
        k, j, token = sampling.accept_sampling_tree(draft.drafts, draft.draft_probs, Siblings(draft.siblings, rows),
                                                    lambda row: logits_of(0, prefixes[row]), WARP, draws)
        if leaves is not None and j is not None:
            leaves[k + 1] = leaves.get(k + 1, 0) + 1
        return (*draft.drafts[:k], *([] if j is None else [draft.siblings[k][j]]), token)

    return run


def test_the_tables_have_rejections_and_top_p_zeros():
    """Guard against a vacuous comparison: the target removes tokens the draft proposes, and drafts get rejected."""
    assert any((p_of(s) == 0).any() for s in itertools.product(range(V), repeat=2))
    emitted = outcomes(chain_round(3))
    lengths = defaultdict(float)
    for seq, w in emitted.items():
        lengths[len(seq)] += w
    assert all(0.05 < lengths[n] for n in (1, 2, 3, 4)), lengths  # every k = 0..3 is reached


def test_chain_of_three_drafts_is_exact():
    emitted = outcomes(chain_round(3))
    assert sum(emitted.values()) == pytest.approx(1, abs=EXACT)
    assert max_error(emitted, 4) < EXACT


def test_tree_with_two_siblings_at_two_depths_is_exact():
    leaves = {}
    emitted = outcomes(tree_round(2, width=3, leaves=leaves))
    assert sum(emitted.values()) == pytest.approx(1, abs=EXACT)
    assert max_error(emitted, 3) < EXACT
    assert leaves[1] > 0 and leaves[2] > 0  # paths that leave the chain for a sibling, at both depths


# (mutant, rule) pairs where the bug changes nothing: a draw normalises a residual that is only drawn from, and
# a chain has no sibling proposals (tests/sampling_mutants.py)
EQUIVALENT = {("unnormalised-residual", "chain"), ("unnormalised-proposal", "chain")}


@pytest.mark.parametrize("rule", ["chain", "tree"])
@pytest.mark.parametrize("mutant", MUTANTS)
def test_every_subtle_mutant_breaks_exactness(monkeypatch, mutant, rule):
    """Negative controls: each bug moves the enumerated distribution by ≥ 1e-3 (10⁹ × the tolerance), or is proved
    harmless by the same enumeration."""
    MUTANTS[mutant](monkeypatch)
    error = max_error(outcomes(chain_round(3)), 4) if rule == "chain" else max_error(outcomes(tree_round(2, 3)), 3)
    assert error < EXACT if (mutant, rule) in EQUIVALENT else error > 1e-3


# ---- AdaDecode's deferred checks, through the whole engine -----------------------------------------------------
ADA_V = 3
ADA_SAMPLING = Sampling(do_sample=True, temperature=0.9, top_p=0.9)


@pytest.fixture(scope="module")
def ada_model():
    model, _ = tiny_model(vocab_size=ADA_V, late_residual_scale=0.6, seed=3)
    return model


def model_joint(model, prompt, n) -> dict[tuple[int, ...], float]:
    """P(x1..xn | prompt) from transformers' own forward, warped as the engine warps."""
    joint = {(): 1.0}
    for _ in range(n):
        seqs = list(joint)
        with torch.no_grad():
            p = ADA_SAMPLING.probs(model(torch.tensor([list(prompt) + list(s) for s in seqs])).logits[:, -1])
        joint = {s + (x,): joint[s] * float(p[b, x]) for b, s in enumerate(seqs) for x in range(ADA_V)}
    return joint


def test_adadecode_deferred_checks_are_exact(ada_model):
    """Three early predictions outstanding (head at layer 1, γ = 0), all checked at once by the flush that the token
    limit forces: a rejection at any of them replaces it, drops the later ones, rolls the cache back and resumes."""
    engine = Engine(LayerStack(ada_model), ADA_SAMPLING, set())
    method = AdaDecode(gamma=0.0, head_layers=[1], max_outstanding=3)
    prompt, n = [1, 2, 0], 4
    checked = []

    def run(draws):
        gen = engine.generate(prompt, method, n, seed=0, draws=draws)
        checked.append(max(len(r.trace["verified"]) for r in gen.rounds[1:]))
        return tuple(gen.output_ids)

    emitted = outcomes(run)
    assert max(checked) == 3 and min(checked) >= 1  # three deferred checks in one step
    want = model_joint(ada_model, prompt, n)
    assert sum(emitted.values()) == pytest.approx(1, abs=EXACT)
    assert max(abs(emitted.get(s, 0.0) - w) for s, w in want.items()) < EXACT


# ---- the device draws themselves ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_device_draw_is_multinomials(dtype):
    """Draws.sample (the exponential race, no read) gives torch.multinomial(w, 1)'s index from the same generator
    state, draw after draw — so its distribution is multinomial's, and a sampled run's stream matches one that used it.
    below_each's d uniforms are d calls of below's: the same numbers in the same order."""
    weights = torch.rand(50, generator=torch.Generator().manual_seed(0), dtype=dtype)
    ours, torchs = Draws(torch.Generator().manual_seed(3)), torch.Generator().manual_seed(3)
    assert [int(ours.sample(weights)) for _ in range(200)] == [
        int(torch.multinomial(weights, 1, generator=torchs)) for _ in range(200)]
    num, den = torch.rand(5, dtype=dtype), torch.ones(5, dtype=dtype)
    each, one = Draws(torch.Generator().manual_seed(4)), Draws(torch.Generator().manual_seed(4))
    assert each.below_each(num, den).tolist() == [one.below(num[i], den[i]) for i in range(5)]
