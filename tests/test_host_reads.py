"""Device-resident greedy rounds (issue 26): how many times a round makes the host wait, counted two ways — by the
engine (Round.host_syncs, every transfer through del_bench/transfer.py) and independently (engine/syncs.py, which
sees every tensor read) — and the same numbers either way."""

from __future__ import annotations

import pytest

from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.engine.syncs import measure
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.ls import LayerSkip
from del_bench.methods.vanilla import Vanilla
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model

METHODS = {"vanilla": Vanilla, "ls": lambda: LayerSkip(2, 4), "del": DEL,
           "del_deferred": lambda: DEL(defer_shadow=True, shadow_every=3)}


@pytest.fixture(scope="module")
def engine_and_prompts():
    model, tok = tiny_model()
    prompts = [tok(p)["input_ids"] for p in ["def add(a, b):\n", "The quick brown fox"]]
    return Engine(LayerStack(model), Sampling(), eos_ids=set()), prompts


@pytest.fixture(scope="module")
def runs(engine_and_prompts):
    """name → (SyncReport, the Generations' rounds)."""
    engine, prompts = engine_and_prompts
    out = {}
    for name, make in METHODS.items():
        report = measure(engine, make(), prompts, 24, warmup=False)
        rounds = [r for p in prompts for r in engine.generate(p, make(), 24, seed=0).rounds]
        out[name] = (report, rounds)
    return out


@pytest.mark.parametrize("name", METHODS)
def test_the_engine_counts_every_sync_the_independent_counter_sees(runs, name):
    report, _ = runs[name]
    assert report.engine_syncs is not None and report.rounds_syncs is not None
    assert report.rounds_syncs == report.engine_syncs, report.sites


@pytest.mark.parametrize("name", ["vanilla", "ls"])
def test_a_greedy_early_exit_round_reads_the_host_once(runs, name):
    """Prefill: the prompt's upload and the first token's read; every round after: one read (drafts, targets)."""
    _, rounds = runs[name]
    assert [r.host_syncs for r in rounds if r.round == 0] == [2, 2]
    assert {r.host_syncs for r in rounds if r.round > 0} == {1}
    assert any(r.drafted for r in rounds) or name == "vanilla"


@pytest.mark.parametrize("name", ["del", "del_deferred"])
def test_del_reads_each_candidate_once_and_its_statistics_once(runs, name):
    """DEL's dynamic draft-exit is a host decision per candidate (its token and confidence in one read), then the
    round's acceptance (one read) and, in the round that scores shadow tokens, the statistics (one read)."""
    _, rounds = runs[name]
    assert any(r.drafted for r in rounds)
    for r in rounds:
        if r.round == 0:  # prompt upload, first token, the prefill window's statistics
            assert r.host_syncs == 3
            continue
        assert r.host_syncs == len(r.trace.get("draft_confidences", [])) + 1 + (r.shadow_rows > 0), r
    if name == "del_deferred":
        assert any(r.shadow_rows == 0 for r in rounds if r.round > 0)
