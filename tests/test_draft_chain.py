"""engine/draft_chain.py: a round's whole early-exit draft as one captured graph whose candidates run inside
conditional nodes, the stop `confidence ≥ τ` decided on the device, one read a draft — replayed on the CPU by the
CUDA-graph runner's stand-in (tests/test_compiled.Replayed: each capture recorded and run again on replay, a
conditional node's flag tested by the host outside the read counter, no other host read inside a replay).

Against the same graphs drafting on the host's loop (a read per candidate): the same rounds — exit layer, budget,
drafts, acceptance, loaded layers, head rows, the confidences the method decided on — and the eager engine's tokens,
with one read a drafting round for the draft and one for the acceptance."""

from __future__ import annotations

import copy

import pytest
import torch

from del_bench.engine import path_choice
from del_bench.engine.decode import Engine
from del_bench.engine.layer_path import LayerPath
from del_bench.engine.sampling import Sampling
from del_bench.methods.dv import DraftVerify
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.ls import LayerSkip
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model
from tests.test_compiled import PROMPT, Replayed

TOKENS = 32
METHODS = {  # each stops on a threshold; on the tiny model each drafts several candidates in some round
    "del": DEL(keep_stopped_draft=True, prefill_draft=True),  # as its authors run it: the candidate below τ kept
    "del-alg1": DEL(),  # Algorithm 1: the candidate below τ dropped
    "del-vocab": DEL(keep_stopped_draft=True, prefill_draft=True, shadow_vocab=40),  # confidences over 40 ids
    "dv": DraftVerify(exit_layer=2, theta=0.02),  # a fixed E; its budget (18) drafted whole in one round
}


@pytest.fixture(scope="module")
def stack_and_prompt():
    model, tok = tiny_model()
    return LayerStack(model), tok(PROMPT)["input_ids"]


_MADE: dict = {}  # (stack, method, runner) → graphs and the setup line: made once for the module's tests


def graphs_for(stack, prompt, method, runner=Replayed):
    key = (id(stack), repr(sorted(method.describe().items())), type(method).__name__, runner)
    if key not in _MADE:
        # the steps' eager kernels captured (compile=graphs): test_compiled replays DEL's chains on the fused ones
        _MADE[key] = (stack, path_choice.make_graphs(stack, "graphs", method, TOKENS, len(prompt) + TOKENS + 1,
                                                     capture=True, runner=runner))
    return _MADE[key][1]


def generate(stack, prompt, method, graphs=None, eos=frozenset()):
    """As on CUDA: DEL's statistics ride on the acceptance read (shadow_with_acceptance). The work the stack counted
    (layers, head and adapter rows) rides along as gen.work."""
    engine = Engine(stack, Sampling(), set(eos), path=LayerPath(stack, graphs), shadow_with_acceptance=True)
    with stack.counting() as work:
        gen = engine.generate(prompt, copy.deepcopy(method), TOKENS, seed=0)
    gen.work = dict(vars(work))
    return gen


def on_the_hosts_loop(stack, prompt, method, graphs, eos=frozenset()):
    """The same graphs with their draft chains set aside: the host's loop drafts, reading each candidate."""
    chain, graphs.chain = graphs.chain, None
    try:
        return generate(stack, prompt, method, graphs, eos)
    finally:
        graphs.chain = chain


def what_it_decided(rounds) -> list[tuple]:
    return [(r.exit_layer, r.budget, r.drafted, r.accepted, r.emitted, r.loaded_layers, r.adapter_rows,
             r.trace.get("draft_confidences")) for r in rounds]


def padded_rows(rounds) -> int:
    """The rows a chain's verification computes past the draft's: it verifies the budget's width (the host does not
    know the draft's length before the round's read), so budget − drafted rows more than the loop's — head rows,
    and for DEL shadow rows of every layer below the last."""
    return sum(r.budget - r.drafted for r in rounds)


@pytest.mark.parametrize("name", list(METHODS))
def test_a_draft_chain_drafts_what_the_hosts_loop_drafts_in_one_read(stack_and_prompt, name):
    stack, prompt = stack_and_prompt
    method = METHODS[name]
    reference = generate(stack, prompt, method).output_ids  # the eager engine's
    graphs, info = graphs_for(stack, prompt, method)
    exits = 1 if method.static_shape().exit_layer else stack.num_layers - 1
    assert info["draft_chains"] == exits  # one per exit layer (one attended length: 256 slots)
    chained, looped = generate(stack, prompt, method, graphs), on_the_hosts_loop(stack, prompt, method, graphs)
    assert chained.output_ids == looped.output_ids == reference
    assert what_it_decided(chained.rounds) == what_it_decided(looped.rounds)
    for a, b in zip(chained.rounds, looped.rounds):
        assert a.head_calls == b.head_calls + padded_rows([a])
    padded, L = padded_rows(chained.rounds), stack.num_layers
    shadow = (L - 1) * padded if method.wants_shadow else 0  # DEL scores the window verified, with the acceptance
    assert chained.work == {**looped.work, "head_rows": looped.work["head_rows"] + padded,
                            "shadow_rows": looped.work["shadow_rows"] + shadow}
    assert chained.work["layers"] == sum(r.loaded_layers for r in chained.rounds)
    drafting = [r for r in chained.rounds if r.round > 0 and r.budget > 0]
    assert max(r.drafted for r in drafting) >= 2  # several candidates decided on the device in a round
    assert any(0 < r.drafted < r.budget for r in drafting)  # and a stop below τ before the budget
    for a, b in zip(chained.rounds[1:], looped.rounds[1:]):  # a drafting round: its draft's read, its acceptance's
        candidates = len(b.trace.get("draft_confidences", []))  # the loop read each (a dropped one too)
        assert (a.host_syncs, b.host_syncs) == ((1, 1 + candidates) if a.budget else (1, 1)), (a, b)


def test_an_eos_drafted_ends_the_draft_on_the_host(stack_and_prompt):
    """An EOS candidate ends the draft where the host reads it (the device drafts on past it: `wasted` passes,
    counted in loaded layers) — the same drafts and tokens as the host's loop."""
    stack, prompt = stack_and_prompt
    method = METHODS["dv"]
    graphs, _ = graphs_for(stack, prompt, method)
    first = generate(stack, prompt, method, graphs)
    eos = {first.output_ids[3]}  # drafted in the first round's long draft, then emitted
    chained = generate(stack, prompt, method, graphs, eos)
    looped = on_the_hosts_loop(stack, prompt, method, graphs, eos)
    assert chained.output_ids == looped.output_ids == generate(stack, prompt, method, eos=eos).output_ids
    assert chained.stopped and [(r.drafted, r.accepted) for r in chained.rounds] == \
        [(r.drafted, r.accepted) for r in looped.rounds]
    wasted = [r.trace.get("lookahead_wasted", 0) for r in chained.rounds]
    assert sum(wasted) > 0
    L, E = stack.num_layers, method.exit_layer
    for r, w in zip(chained.rounds[1:], wasted[1:]):
        assert r.loaded_layers == (r.drafted + w) * E + L  # the passes past the EOS paid for


BUDGET_ONLY = {"ls": LayerSkip(exit_layer=2, gamma=4), "del-e": DEL(dynamic_draft_exit=False)}


@pytest.mark.parametrize("name", list(BUDGET_ONLY))
def test_a_chain_stopped_by_the_budget_alone_drafts_as_the_loop_in_two_replays(stack_and_prompt, name):
    """LS and DEL-E draft by id to the round's budget (no confidence read): their chain has no stop test. The same
    rounds, work and tokens as the host's loop on the same graphs; a drafting round is two replays — its draft, its
    verification with the head inside it (graph_runners.TokenTail) — and one read, where the loop replays a pass per
    token drafted."""
    stack, prompt = stack_and_prompt
    method = BUDGET_ONLY[name]
    graphs, info = graphs_for(stack, prompt, method)
    exits = 1 if method.static_shape().exit_layer else stack.num_layers - 1
    assert info["draft_chains"] == exits
    before = Replayed.replays
    chained = generate(stack, prompt, method, graphs)
    replays = Replayed.replays - before
    looped = on_the_hosts_loop(stack, prompt, method, graphs)
    assert chained.output_ids == looped.output_ids == generate(stack, prompt, method).output_ids
    assert what_it_decided(chained.rounds) == what_it_decided(looped.rounds)
    assert chained.work == looped.work  # the budget's width either way: nothing padded
    drafting = [r for r in chained.rounds[1:] if r.budget > 0]
    assert drafting and all(r.drafted == r.budget for r in drafting)
    assert all(r.host_syncs == 1 for r in chained.rounds[1:])
    assert replays == sum(1 + (r.budget > 0) for r in chained.rounds[1:])


class WithoutConditionalNodes(Replayed):
    """A CUDA-graph runner where capturing a conditional node fails (CUDA < 12.4, an older torch)."""

    @staticmethod
    def when(flag, body):
        raise RuntimeError("conditional nodes are not supported here")


def test_where_chains_cannot_be_captured_the_host_reads_each_candidate(stack_and_prompt, caplog):
    stack, prompt = stack_and_prompt
    method = METHODS["del"]
    graphs, info = graphs_for(stack, prompt, method, runner=WithoutConditionalNodes)
    assert "conditional nodes are not supported" in info["draft_chain_error"] and "draft_chains" not in info
    assert graphs.chain is None and not any(key[0][0] == "chain" for key in graphs.runner.made)
    gen = generate(stack, prompt, method, graphs)
    assert gen.output_ids == generate(stack, prompt, method).output_ids
    assert any(r.host_syncs > 2 for r in gen.rounds[1:])  # a candidate read at a time


def test_the_chain_is_for_greedy_threshold_or_budget_stops_at_batch_one(stack_and_prompt):
    """Sampling and a batch draft on the host's loop; the shapes say which methods get chains: early-exit drafts
    stopped by a threshold (confident) or by the budget alone, not a stop the host decides (CLaSp's, SWIFT's)."""
    from del_bench.engine.compiled import StepShapes
    from del_bench.methods.clasp import CLaSp

    assert StepShapes.of(METHODS["del"], TOKENS).chains and StepShapes.of(METHODS["dv"], TOKENS).chains
    assert StepShapes.of(METHODS["del"], TOKENS).confident
    budget_only = [StepShapes.of(m, TOKENS) for m in (LayerSkip(1, 4), DEL(dynamic_draft_exit=False))]  # LS, DEL-E
    assert all(shape.chains and not shape.confident for shape in budget_only)
    assert not StepShapes.of(CLaSp(), TOKENS).chains
    stack, prompt = stack_and_prompt
    method = METHODS["dv"]
    graphs, _ = graphs_for(stack, prompt, method)
    engine = Engine(stack, Sampling(do_sample=True, temperature=0.7), set(), path=LayerPath(stack, graphs),
                    shadow_with_acceptance=True)
    replays = Replayed.replays
    gen = engine.generate(prompt, copy.deepcopy(method), 8, seed=0)
    chain_rounds = [r for r in gen.rounds[1:] if r.budget > 0]
    assert chain_rounds and all(r.host_syncs == 1 + len(r.trace.get("draft_confidences", [])) for r in chain_rounds)
    assert Replayed.replays - replays > len(gen.rounds)  # a replay a pass, not a chain a round


def test_in_half_precision_the_chain_decides_as_the_loop(stack_and_prompt):
    """bfloat16: the chain's candidates and confidences are the loop's bits (the same ops: steps.greedy_candidate,
    confidences widened to float32), so the same decisions and tokens; making the graphs checked them against
    `generate` by the near-tie rule."""
    model, tok = tiny_model(torch.bfloat16)
    stack, prompt = LayerStack(model), stack_and_prompt[1]
    method = METHODS["del"]
    graphs, info = graphs_for(stack, prompt, method)
    assert info["draft_chains"] == stack.num_layers - 1
    chained, looped = generate(stack, prompt, method, graphs), on_the_hosts_loop(stack, prompt, method, graphs)
    assert chained.output_ids == looped.output_ids
    assert what_it_decided(chained.rounds) == what_it_decided(looped.rounds)
    assert any(r.drafted for r in chained.rounds)
