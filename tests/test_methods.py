"""Policies on scripted rounds, with hand-computed values."""

import pytest

from del_bench.methods.base import RoundEvidence
from del_bench.methods.dv import DraftVerify
from del_bench.methods.fs import FiniteState


def rounds(method, outcomes):
    """Feed (drafted, accepted) rounds; return the plans seen before each round."""
    plans = []
    for drafted, accepted in outcomes:
        plans.append(method.plan().max_draft)
        method.observe(RoundEvidence(exit_layer=method.exit_layer, drafted=drafted, accepted=accepted))
    return plans


def test_fs_grows_on_full_acceptance_and_shrinks_to_the_floor():
    fs = FiniteState(exit_layer=3, gamma=2)
    fs.start(8)
    assert rounds(fs, [(2, 2), (3, 3), (4, 1), (3, 0), (2, 0), (1, 0)]) == [2, 3, 4, 3, 2, 1]
    assert fs.plan().max_draft == 1  # floor 1
    fs.start(8)
    assert fs.plan().max_draft == 2  # reset per prompt


def test_fs_without_floor_counts_an_empty_round_as_all_accepted():
    fs = FiniteState(exit_layer=3, gamma=1, floor=0)
    fs.start(8)
    assert rounds(fs, [(1, 0), (0, 0), (1, 1)]) == [1, 0, 1]
    assert fs.plan().max_draft == 2


def test_fs_ignores_the_budget_capped_last_round():
    fs = FiniteState(exit_layer=3, gamma=4)
    fs.start(8)
    fs.observe(RoundEvidence(exit_layer=3, drafted=1, accepted=0, budget_capped=True))
    assert fs.plan().max_draft == 4


def test_dv_threshold_update_by_hand():
    dv = DraftVerify(exit_layer=2, acceptance="round")
    dv.start(8)
    assert dv.keep_drafting(0, 0.6) and not dv.keep_drafting(0, 0.59)
    dv.observe(RoundEvidence(exit_layer=2, drafted=4, accepted=1))
    # AR = 0.5·0 + 0.5·0.25 = 0.125 < 0.8 → θ̃ = 0.61; θ = 0.9·0.6 + 0.1·0.61 = 0.601
    assert dv.ar == pytest.approx(0.125) and dv.theta == pytest.approx(0.601)
    dv.observe(RoundEvidence(exit_layer=2, drafted=2, accepted=2))
    # AR = 0.5·0.125 + 0.5·1 = 0.5625 < 0.8 → θ̃ = 0.611; θ = 0.9·0.601 + 0.1·0.611 = 0.602
    assert dv.theta == pytest.approx(0.602)


def test_dv_cumulative_acceptance_and_reset():
    dv = DraftVerify(exit_layer=2, acceptance="cumulative", target_acceptance=0.3)
    dv.start(8)
    dv.observe(RoundEvidence(exit_layer=2, drafted=4, accepted=1))  # cum 0.25 → AR 0.125 < 0.3
    dv.observe(RoundEvidence(exit_layer=2, drafted=4, accepted=4))  # cum 5/8 → AR 0.375 ≥ 0.3 → θ − ε
    assert dv.ar == pytest.approx(0.375)
    assert dv.theta == pytest.approx(0.9 * 0.601 + 0.1 * 0.591)
    dv.start(8)
    assert (dv.theta, dv.ar) == (0.6, 0.0)
    keep = DraftVerify(exit_layer=2, reset_per_prompt=False)
    keep.start(8)
    keep.observe(RoundEvidence(exit_layer=2, drafted=4, accepted=0))
    keep.start(8)
    assert keep.theta != 0.6  # carried across prompts, as the authors' code does
