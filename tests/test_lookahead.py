"""DEL's stop decisions read K candidates at a time (`method.lookahead`, early_exit.draft_ahead): the same drafts,
decisions and greedy tokens as reading each candidate, one host read per K candidates, and the passes drafted past a
stop paid for in the accounting. (Sampling: tests/test_sampling_stats.py's `del-lookahead` — the extra candidates
draw from the generator, so the outputs are other draws of the same distribution.)"""

from __future__ import annotations

import copy

import pytest

from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.methods.dynamic_exit import DEL
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model

PROMPTS = ["def add(a, b):\n", "The quick brown fox", "import os\nimport sys\n"]
TOKENS = 40


@pytest.fixture(scope="module")
def stack_and_prompts():
    model, tok = tiny_model()
    return LayerStack(model), [tok(p)["input_ids"] for p in PROMPTS]


def generations(stack, prompts, method):
    engine = Engine(stack, Sampling(), set())
    with stack.counting() as work:
        gens = [engine.generate(p, copy.deepcopy(method), TOKENS, seed=0) for p in prompts]
    return gens, work


@pytest.mark.parametrize("k", [2, 3, 18])
@pytest.mark.parametrize("variant", [{}, {"keep_stopped_draft": True}], ids=["drop", "keep"])
def test_the_same_decisions_in_fewer_reads_with_the_waste_counted(stack_and_prompts, k, variant):
    stack, prompts = stack_and_prompts
    one, _ = generations(stack, prompts, DEL(**variant))
    ahead, work = generations(stack, prompts, DEL(lookahead=k, **variant))
    assert [g.output_ids for g in ahead] == [g.output_ids for g in one]
    for a, b in zip(ahead, one):
        assert [(r.exit_layer, r.drafted, r.accepted, r.trace.get("draft_confidences")) for r in a.rounds] == \
            [(r.exit_layer, r.drafted, r.accepted, r.trace.get("draft_confidences")) for r in b.rounds]
        for r in a.rounds[1:]:
            wasted = r.trace.get("lookahead_wasted", 0)
            E = r.trace["chosen_exit_layer"] or 0  # the round's exit layer, also where it kept no draft
            assert r.loaded_layers == (r.drafted + wasted) * E + stack.num_layers
    # every pass that ran is counted where it ran (the stack's counter) and in the rounds
    assert work.layers == sum(r.loaded_layers for g in ahead for r in g.rounds)
    assert work.head_rows == sum(r.head_calls for g in ahead for r in g.rounds)
    drafting = [r for g in ahead for r in g.rounds if r.drafted]
    assert sum(r.host_syncs for r in drafting) < sum(r.host_syncs for g in one for r in g.rounds if r.drafted)
    if k == 18:  # every candidate of a round in one read: the window's and the acceptance's (+ CPU statistics)
        assert all(r.host_syncs <= 3 for r in drafting)
    if k > 2 or not variant:  # a stop inside a window (k = 2 keeping the stopped draft wastes only a head row)
        assert any(r.trace.get("lookahead_wasted") for g in ahead for r in g.rounds)


def test_lookahead_is_validated():
    assert DEL.problems({"lookahead": 2}, 4) == []
    assert DEL.problems({"lookahead": 0}, 4)[0].startswith("method.lookahead=0: must be an integer ≥ 1")
    assert DEL().describe().get("lookahead") is None and DEL(lookahead=4).describe()["lookahead"] == 4
