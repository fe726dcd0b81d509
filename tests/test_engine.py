"""The engine is lossless: greedy outputs equal transformers' `generate`, sampling keeps the target
distribution, budgets are exact, and the layer accounting follows the paper's cost model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Draws, Sampling
from del_bench.engine.steps import Draft, candidate_of
from del_bench.methods.dv import DraftVerify
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.fs import FiniteState
from del_bench.methods.ls import LayerSkip
from del_bench.methods.vanilla import Vanilla
from del_bench.models.layer_stack import LayerStack
from tests.conftest import DEVICES, tiny_model

PROMPTS = ["def add(a, b):\n", "The quick brown fox", "x"]
PRODUCTS = ["wt_x", "x_wt"]  # the forced product layouts (models/products.py): each keeps the tokens
L = 4
METHODS = (
    [Vanilla()]
    + [LayerSkip(e, g) for e, g in [(1, 1), (1, 4), (2, 3), (L - 1, 1), (L - 1, 2), (2, 50)]]
    + [FiniteState(1, 2), FiniteState(L - 1, 1, floor=0), DraftVerify(1), DraftVerify(2, theta=0.3, d_max=5)]
    + [DEL(), DEL(dynamic_draft_exit=False, draft_budget="tpl"), DEL(exit_layer=2), DEL(min_exit_layer=2, omega=0.5)]
    + [DEL(shadow_every=3, shadow_vocab=50, defer_shadow=True)]  # the lagging-statistics approximation: lossless too
)


def hf_greedy(model, prompt_ids, max_new_tokens, eos=None):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=model.device), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def stack_and_ref():
    model, tok = tiny_model()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    refs = [hf_greedy(model, p, 40) for p in prompts]  # before LayerStack re-lays the weights out
    return LayerStack(model), model, prompts, refs


@pytest.fixture(scope="module", params=PRODUCTS)
def products(request):
    return request.param


@pytest.fixture(scope="module", params=DEVICES)
def stack_and_ref_on(request, products):
    """stack_and_ref on each of DEVICES (the float64 tiny model moved there before LayerStack lays it out), under each
    forced product layout."""
    if request.param == "cpu" and products == "wt_x":  # LayerStack's default
        return request.getfixturevalue("stack_and_ref")
    model, tok = tiny_model()
    model.to(request.param)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    refs = [hf_greedy(model, p, 40) for p in prompts]
    return LayerStack(model, products=products), model, prompts, refs


def assert_greedy_equals_reference(stack_and_ref, method) -> None:
    """Every prompt at budgets 1, 7 and 40 (γ > tokens left is hit near each budget's end): the method's greedy
    output is the reference's (HF generate) prefix, token for token, and no round drafts past the tokens left."""
    stack, _, prompts, refs = stack_and_ref
    engine = Engine(stack, Sampling(), eos_ids=set())
    for prompt, ref in zip(prompts, refs):
        for budget in (1, 7, 40):
            gen = engine.generate(prompt, method, budget, seed=0)
            assert gen.output_ids == ref[:budget]
            assert all(r.drafted <= budget - 1 for r in gen.rounds)  # no round drafts past the tokens left


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.name}{m.describe()}")
def test_greedy_equals_hf_generate(stack_and_ref_on, method):
    assert_greedy_equals_reference(stack_and_ref_on, method)


def test_speculation_really_happens(stack_and_ref):
    """Guard against a vacuous equality test: drafts are both accepted and rejected on this model."""
    stack, _, prompts, _ = stack_and_ref
    gen = Engine(stack, Sampling(), set()).generate(prompts[0], LayerSkip(1, 4), 40, seed=0)
    assert 0 < gen.accepted < gen.drafted


def test_stops_at_eos_like_hf(stack_and_ref):
    stack, model, prompts, refs = stack_and_ref
    eos = refs[0][5]  # a token that greedy decoding emits at step 6
    expected = refs[0][: refs[0].index(eos) + 1]
    engine = Engine(stack, Sampling(), eos_ids={eos})
    for method in METHODS:
        assert engine.generate(prompts[0], method, 40, seed=0).output_ids == expected


def test_accounting_follows_the_cost_model(stack_and_ref):
    stack, _, prompts, _ = stack_and_ref
    engine = Engine(stack, Sampling(), set())
    vanilla = engine.generate(prompts[0], Vanilla(), 25, seed=0)
    assert len(vanilla.output_ids) / vanilla.loaded_layers == 1 / L  # eTPL of vanilla is exactly 1/L
    assert vanilla.head_calls == 25
    gen = engine.generate(prompts[0], LayerSkip(2, 3), 25, seed=0)
    assert gen.loaded_layers == sum(r.drafted * 2 + L if r.drafted else L for r in gen.rounds)
    # draft heads + every verify row (greedy: the head runs over all d + 1 rows in one product, Engine._accept_greedy)
    assert gen.head_calls == sum(2 * r.drafted + 1 for r in gen.rounds)
    assert sum(r.emitted for r in gen.rounds) == len(gen.output_ids) == 25
    assert all(r.accepted <= r.drafted <= r.budget <= 3 for r in gen.rounds)


def test_never_overshoots_the_budget(stack_and_ref):
    stack, _, prompts, _ = stack_and_ref
    engine = Engine(stack, Sampling(do_sample=True, temperature=1.3), set())
    for budget, seed in itertools.product((1, 2, 3, 9), range(5)):
        gen = engine.generate(prompts[1], LayerSkip(1, 18), budget, seed=seed)
        assert len(gen.output_ids) == budget
        assert all(r.drafted <= budget - 1 for r in gen.rounds)


# speculative sampling keeps the target distribution: tests/test_sampling_exact.py (enumerated, exact) and
# tests/test_sampling_stats.py (every method end to end, with subtle bugs as negative controls)


@pytest.mark.parametrize("method", [DEL(), DEL(dynamic_draft_exit=False, draft_budget="tpl"), DEL(exit_layer=2)],
                         ids=["del", "del_e", "del_gamma"])
def test_del_speculates_and_stays_lossless_where_early_layers_agree(method):
    """On the default tiny model DEL mostly (rightly) declines to draft; here it drafts, accepts and rejects."""
    model, tok = tiny_model(late_residual_scale=0.1)
    prompt = tok(PROMPTS[0])["input_ids"]
    ref = hf_greedy(model, prompt, 40)
    gen = Engine(LayerStack(model), Sampling(), set()).generate(prompt, method, 40, seed=0)
    assert gen.output_ids == ref
    assert 0 < gen.accepted < gen.drafted


@pytest.mark.parametrize("method", [Vanilla(), LayerSkip(1, 4), DEL()], ids=["vanilla", "ls", "del"])
def test_a_stop_condition_ends_output_at_the_same_token_for_every_method(stack_and_ref, method):
    stack, _, prompts, refs = stack_and_ref
    target = refs[0][7]  # a token greedy decoding emits at step 8
    engine = Engine(stack, Sampling(), set(), stop=lambda ids: ids[-1] == target)
    gen = engine.generate(prompts[0], method, 40, seed=0)
    assert gen.output_ids == refs[0][: refs[0].index(target) + 1]
    assert sum(r.emitted for r in gen.rounds) == len(gen.output_ids)


def test_restricted_shadow_vocabulary_is_exact_where_it_can_be(stack_and_ref):
    stack = stack_and_ref[0]
    torch.manual_seed(0)
    states = torch.randn(200, stack.head_weight.shape[1], dtype=stack.dtype)
    full_tokens, full_conf = stack.shadow_tokens(states)
    targets = torch.where(torch.rand(200) < 0.5, full_tokens, torch.randint(0, stack.vocab_size, (200,)))
    K = 100
    tokens, conf = stack.shadow_tokens(states, targets, vocab=K)
    scored = (full_tokens < K) | (full_tokens == targets)  # the true argmax was among the scored tokens
    assert scored.sum() > 50 and (~scored).sum() > 10
    assert torch.equal(tokens[scored], full_tokens[scored])
    assert torch.equal(tokens == targets, (full_tokens == targets) | (~scored & (tokens == targets)))
    assert (tokens[full_tokens == targets] == targets[full_tokens == targets]).all()  # matches never missed
    # normalised over fewer tokens: never lower where the argmax was scored
    assert (conf[scored] >= full_conf[scored] - 1e-12).all()


def candidate_confidences(stack, sampling: Sampling, vocab: int | None) -> tuple[torch.Tensor, list[float]]:
    """64 random pre-norm states [N, D], and the confidence DEL(shadow_vocab=vocab) reads for each as a draft
    candidate at E = 1 (steps.candidate_of, on the exit head's logits as the draft shape computes them)."""
    torch.manual_seed(0)
    states = torch.randn(64, stack.head_weight.shape[1], dtype=stack.dtype)
    method = DEL(shadow_vocab=vocab)
    method.start(stack.num_layers)
    engine, rng = Engine(stack, sampling, set()), Draws(torch.Generator().manual_seed(0))
    confidences = []
    for h in states:
        draft = Draft(exit_layer=1)
        _, top, _ = candidate_of(engine, draft, stack.exit_logits(h[None, None], 1)[0, -1], rng, method)  # h: [1, 1, D]
        confidences.append(top.item())
    return states, confidences


@pytest.mark.parametrize("vocab", [None, 50])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(do_sample=True)], ids=["greedy", "sampling"])
def test_a_draft_candidates_confidence_is_scored_as_the_shadow_statistics_are(stack_and_ref, vocab, sampling):
    """DEL stops drafting when a candidate's confidence falls below τ, the mean of shadow confidences, which
    shadow_vocab=K normalises over the first K ids and the row's target. A candidate must be scored on that scale:
    normalised over the first K ids and itself, which is what the statistics record where it is the full model's
    token (a matched position) — not over the whole vocabulary, which K = 50 of 259 puts far below τ. Without K both
    are the whole vocabulary's top probability (DEL as published: unchanged)."""
    stack = stack_and_ref[0]
    states, confidences = candidate_confidences(stack, sampling, vocab)
    tokens, _ = stack.shadow_tokens(states)  # [N] each row's argmax over the whole vocabulary
    assert (tokens < 50).sum() > 5 and (tokens >= 50).sum() > 5  # candidates inside and outside the first K ids
    _, expected = stack.shadow_tokens(states, tokens, vocab)  # [N] the statistics' confidence were each row matched
    assert confidences == pytest.approx(expected.tolist(), rel=1e-12, abs=0)


WARPED = Sampling(do_sample=True, temperature=0.5, top_p=0.8)  # warping that moves every top probability


@pytest.mark.parametrize("vocab", [None, 50])
def test_under_sampling_a_draft_candidates_confidence_is_read_from_the_warped_distribution(stack_and_ref, vocab):
    """As in the authors' code (DEL_speculation_generator.py:172, 183: the drafted token's probability under the
    temperature/top-p warping it is sampled from; docs/design.md §3.5), a candidate's confidence comes from the warped
    draft distribution q — its top probability, on τ's scale with shadow_vocab=K (top_confidence) — not from the raw
    softmax. Temperature 0.5 and top-p 0.8 lift every top probability, so reading the raw one fails here."""
    stack = stack_and_ref[0]
    states, got = candidate_confidences(stack, WARPED, vocab)
    warped, raw = [], []
    for h in states:
        logits = stack.exit_logits(h[None, None], 1)[0, -1]  # [V]
        for probs, out in ((WARPED.probs(logits), warped), (logits.softmax(-1), raw)):
            top, token = probs.max(-1)
            scale = 1.0 if vocab is None else float(probs[:vocab].sum() + (top if token >= vocab else 0.0))
            out.append(float(top) / scale)
    assert got == pytest.approx(warped, rel=1e-12, abs=0)
    assert np.mean(np.subtract(warped, raw)) > 0.05  # the two readings differ by far more than rounding


def test_under_sampling_shadow_tokens_and_their_confidences_come_from_the_raw_logits(stack_and_ref):
    """τ is a mean of shadow confidences; the authors' code scores shadow tokens greedily whatever the sampling
    (DEL.py:190: decode_next_token with sample=False, llama_model_utils.py:122-127: argmax, softmax of the raw logits,
    no temperature, no top-p). So do we: every window DEL observes while decoding with a warped sampler holds each
    layer's raw argmax and its raw softmax probability — recomputed here from the window's states."""
    stack, _, prompts, _ = stack_and_ref
    seen = []

    class Recording(DEL):
        def update(self, shadow, decay=True):
            seen.append(shadow)
            return super().update(shadow, decay)

    engine = Engine(stack, WARPED, set())
    for p in prompts:
        engine.generate(p, Recording(), 24, seed=0)
    assert len(seen) > len(prompts) and sum(s.tokens.shape[1] for s in seen) > 40  # prefill windows and rounds
    lift = []
    for s in seen:
        for i, states in enumerate(s.states):  # [W, D] layer i + 1
            logits = stack.exit_logits(states[None], i + 1)[0]  # [W, V]
            raw = logits.softmax(-1).max(-1)
            assert torch.equal(s.tokens[i], raw.indices)
            assert s.confidence[i].tolist() == pytest.approx(raw.values.tolist(), rel=1e-9, abs=0)
            lift += (WARPED.probs(logits).max(-1).values - raw.values).tolist()
    assert np.mean(lift) > 0.05  # warped confidences would have failed the check above


class CountingDEL(DEL):
    """DEL that counts the rounds whose shadow scoring it let the engine defer."""

    deferred = 0

    def can_defer(self, windows):
        ok = super().can_defer(windows)
        CountingDEL.deferred += ok
        return ok


@pytest.mark.parametrize("head_cost", [0.0, 2.0, 6.0])
def test_deferred_shadow_scoring_changes_nothing(stack_and_ref, head_cost):
    """defer_shadow batches the shadow scoring of rounds while TPL provably keeps d = 0: the rounds, the
    tokens and DEL's final statistics (the held-back tail included) must be those of scoring every round."""
    stack, _, prompts, _ = stack_and_ref
    engine = Engine(stack, Sampling(), set())
    CountingDEL.deferred = 0
    for p in prompts:
        runs = []
        for defer in (False, True):
            method = CountingDEL(defer_shadow=defer, cost_model="measured")
            method.head_cost = head_cost  # what set_costs would give: h layers per head row
            gen = engine.generate(p, method, 40, seed=0)
            runs.append((gen, method))
        (exact, m_exact), (lazy, m_lazy) = runs
        assert lazy.output_ids == exact.output_ids
        assert [(r.exit_layer, r.budget, r.drafted, r.accepted) for r in lazy.rounds] == \
               [(r.exit_layer, r.budget, r.drafted, r.accepted) for r in exact.rounds]
        assert np.allclose(m_lazy.s_match, m_exact.s_match)
        assert m_lazy.s_positions == pytest.approx(m_exact.s_positions)
    if head_cost == 6.0:
        assert CountingDEL.deferred > 0  # the case where drafting does not pay: deferral really happened


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fused_rms_norm_gives_hf_bits(dtype):
    """layer_stack.rms_norm calls torch's fused F.rms_norm on CPU: it must equal LlamaRMSNorm's ops bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from del_bench.models.layer_math import rms_norm

    torch.manual_seed(0)
    for D in (64, 576, 2048):
        hf = LlamaRMSNorm(D, eps=1e-5).to(dtype)
        hf.weight.data = torch.randn(D, dtype=dtype)
        for T, scale in itertools.product((1, 5, 300), (1e-3, 1.0, 40.0)):
            x = (torch.randn(1, T, D) * scale).to(dtype)
            with torch.no_grad():
                assert torch.equal(rms_norm(x, hf.weight, 1e-5), hf(x))


def test_rounds_count_the_shadow_rows_they_score(stack_and_ref):
    """Round.shadow_rows: (L − 1) rows per position of the prefill window and of every round's valid window (the
    accepted drafts + 1); with deferral the same total, counted in the rounds that score them; none for LS."""
    stack, _, prompts, _ = stack_and_ref
    engine = Engine(stack, Sampling(), set())
    p = prompts[0]
    exact = engine.generate(p, DEL(), 30, seed=0)
    windows = min(32, len(p)) + sum(r.accepted + 1 for r in exact.rounds[1:])
    assert sum(r.shadow_rows for r in exact.rounds) == (L - 1) * windows
    assert all(r.shadow_rows == (L - 1) * (r.accepted + 1) for r in exact.rounds[1:])
    method = DEL(defer_shadow=True, cost_model="measured")
    method.head_cost = 6.0  # drafting does not pay: scoring is deferred, then batched
    lazy = engine.generate(p, method, 30, seed=0)
    windows = min(32, len(p)) + sum(r.accepted + 1 for r in lazy.rounds[1:])
    assert sum(r.shadow_rows for r in lazy.rounds) == (L - 1) * windows
    assert any(r.shadow_rows == 0 for r in lazy.rounds[1:])
    assert sum(r.shadow_rows for r in engine.generate(p, LayerSkip(1, 2), 30, seed=0).rounds) == 0
