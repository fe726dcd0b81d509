"""CLaSp and KnapSpec (layer skipping chosen from the model's own states) and DEL as the KnapSpec authors run it:
greedy = HF generate in float64 (sampling: tests/test_sampling_stats.py), the selections follow their DPs as
docs/design.md §4.8–4.9 state them (checked against hand-built states), their cost is in the round's accounting, and
their config errors surface before any weights load."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from del_bench import runner, session
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.errors import ConfigError
from del_bench.methods.base import SkipSet
from del_bench.methods.clasp import CLaSp, skipped_layers
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.knapspec import KnapSpec, knapsack_sets, tokens_per_time
from del_bench.methods.swift import parse_skip_set
from tests.test_engine import L, assert_greedy_equals_reference, stack_and_ref  # noqa: F401 (fixtures)

CONTEXTS = (8, 32, 64)  # the latency model's context lengths on tiny models


def knapspec(**kwargs) -> KnapSpec:
    """KnapSpec with its schedule shortened to tiny generations; latency model t_mlp 1, t_attn(n) = 0.01·n + 1."""
    method = KnapSpec(**{"warmup_rounds": 3, "window_rounds": 2, "interval": 4, "latency_contexts": CONTEXTS,
                         **kwargs})
    method.set_costs(1.0, 1.0, sublayer_s=[[n, 0.01 * n + 1, 1.0] for n in CONTEXTS])
    return method


METHODS = [
    CLaSp(skip_layers=1, interval=3),
    CLaSp(skip_layers=2, interval=2, confidence=0.0, gamma=6),  # drafts hit the token limit
    CLaSp(skip_layers=L - 1, interval=1, confidence=0.0),  # only one layer left: drafts mostly rejected
    knapspec(),
    knapspec(confidence=0.0, gamma=5, prune=0.0),  # nothing pruned: every weight's set is a candidate
    knapspec(prune=1.0),  # everything pruned: KnapSpec skips nothing
    DEL(min_draft=1, d_max=10, keep_stopped_draft=True, first_exit_layer=1),  # del_knapspec
]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.name}{m.describe()}")
def test_greedy_equals_hf_generate(stack_and_ref, method):  # noqa: F811
    method.validate(L)
    assert_greedy_equals_reference(stack_and_ref, method)


def test_clasp_selects_m_layers_and_counts_the_selection(stack_and_ref):  # noqa: F811
    stack, _, prompts, _ = stack_and_ref
    gen = Engine(stack, Sampling(), set()).generate(prompts[0], CLaSp(skip_layers=2, interval=3, confidence=0.0), 40, 0)
    selections = [r for r in gen.rounds if "sel_loaded_layers" in r.trace]
    assert [r.round for r in selections] == list(range(1, len(gen.rounds), 3))  # round 1, then every 3rd
    assert all(r.trace["sel_loaded_layers"] == L - 1 and r.trace["sel_head_calls"] == 0 for r in selections)
    skip = SkipSet()
    for r in gen.rounds[1:]:
        if "skip_set" in r.trace:  # the set this round drafts with (round 1: nothing skipped)
            skip = parse_skip_set(r.trace["skip_set"])
            assert skip.attn == skip.mlp and len(skip.attn) == (0 if r.round == 1 else 2)  # whole layers, M of them
        assert r.loaded_layers == r.drafted * (L - len(skip.attn)) + L + r.trace.get("sel_loaded_layers", 0)
    assert 0 < gen.accepted < gen.drafted


# ---- CLaSp's DP on hand-built states --------------------------------------------------------------------------
def additive_layers(effects: list[float], dim: int = 12):
    """Layer i adds effects[i]·e_i (orthogonal directions) to any state: x_i = x_0 + Σ_{l<i} effects[l]·e_l.
    Skipping layer i costs in proportion to |effects[i]|, so the best M skips are the M smallest effects."""
    x0 = torch.ones(dim, dtype=torch.float64)
    basis = torch.eye(dim, dtype=torch.float64)
    deltas = [e * basis[i] for i, e in enumerate(effects)]
    xs = [x0]
    for d in deltas:
        xs.append(xs[-1] + d)
    calls = []

    def run_layer(i, h):
        calls.append((i, h.shape[0]))
        return h + deltas[i]

    return torch.stack(xs), run_layer, calls


def test_clasp_dp_skips_the_layers_that_matter_least():
    x, run_layer, calls = additive_layers([3.0, 0.1, 2.0, 0.2, 2.5, 0.05, 1.5, 4.0])
    assert skipped_layers(x, 3, run_layer) == (1, 3, 5)
    # one batch per layer i−1 for i = 2..L, each of min(i−1, M) branches: L − 1 layer loads
    assert calls == [(i - 1, min(i - 1, 3)) for i in range(2, 9)]
    x, run_layer, _ = additive_layers([0.5, 3.0, 2.0])
    assert skipped_layers(x, 2, run_layer) == (0, 2)  # the first layer may be skipped too


def test_clasp_dp_ties_go_to_skip():
    """Layers without effect: exec and skip give the same state (a tie), and the DP skips — even where a later
    layer could have been skipped instead."""
    x, run_layer, _ = additive_layers([0.0, 0.0, 1.0, 0.0])
    assert skipped_layers(x, 1, run_layer) == (3,)  # backtracking from the last layer: its tie is a skip
    assert skipped_layers(x, 3, run_layer) == (0, 1, 3)


# ---- KnapSpec's DP on hand-built states ----------------------------------------------------------------------
def additive_sublayers(effects: dict[int, float], L: int = 4, r: int = 3, dim: int = 16):
    """Sublayer s adds effects.get(s, 0)·e_s to every window token's state: x[s+1] = x[s] + effect·e_s."""
    basis = torch.eye(dim, dtype=torch.float64)
    x = [torch.ones(r, dim, dtype=torch.float64) + torch.arange(r, dtype=torch.float64)[:, None] * basis[-1]]
    for s in range(2 * L):
        x.append(x[-1] + effects.get(s, 0.0) * basis[s])
    calls = []

    def run_sublayer(s, h):
        calls.append((s, h.shape[0]))
        return h + effects.get(s, 0.0) * basis[s]

    return torch.stack(x), run_sublayer, calls


def test_knapspec_dp_by_hand():
    """L = 4: items attn1 (s 2), mlp1 (3), attn2 (4), mlp2 (5); w_attn 1, w_mlp 2, capacity 3.
    attn1 has no effect; mlp1 is large (a state without it falls below the prune line); attn2 small, mlp2 large.
    By hand: s 2 — exec j0 = x3; skip → j1 = x2 (= x3: a tie, but j1 has no exec rival). s 3 — exec keeps j0, j1;
    skipping mlp1 (→ j2, j3) is pruned. s 4 — exec j0, j1; skip attn2 from j0 → j1 rivals exec j1 (perfect) and
    loses; from j1 → j2 survives. s 5 — exec j0, j1, j2; skipping mlp2 pruned. Result: j0 = {}, j1 = {attn1},
    j2 = {attn1, attn2}."""
    x, run, calls = additive_sublayers({3: 20.0, 4: 0.3, 5: 60.0})
    sets = knapsack_sets(x, 1, 2, 3, 0.5, run)
    assert {j: (s.attn, s.mlp) for j, (s, _) in sets.items()} == {0: ((), ()), 1: ((1,), ()), 2: ((1, 2), ())}
    assert [s for s, _ in calls] == [2, 3, 4, 5]  # one batch per item, layers 0 and L−1 never items
    assert torch.allclose(sets[2][1], x[6] - (x[5] - x[4]), rtol=0, atol=1e-12)  # j2: all but attn1, attn2 ran


def test_knapspec_dp_ties_go_to_exec_and_everything_pruned_skips_nothing():
    x, run, _ = additive_sublayers({})  # no sublayer has an effect: every skip ties with exec
    sets = knapsack_sets(x, 1, 1, 10, 0.5, run)
    # ties → exec: a skip enters weight j only where j is still empty, so j holds the first j items skipped
    assert [sets[j][0] for j in range(5)] == [SkipSet(), SkipSet(attn=[1]), SkipSet(attn=[1], mlp=[1]),
                                              SkipSet(attn=[1, 2], mlp=[1]), SkipSet(attn=[1, 2], mlp=[1, 2])]
    assert knapsack_sets(x, 1, 1, 10, 1.5, run) == {}  # every state pruned: the caller skips nothing


def test_knapspec_keeps_a_state_exactly_on_the_prune_floor():
    """A state whose mean cosine over the window is exactly `prune` survives (score / r ≥ prune, as the authors prune).
    L = 3: the items are layer 1's attention (s 2) and MLP (s 3). Every token's state before s 2 is a multiple of e0
    and s 2 adds as much again along e1 + e2 + e3, so a state that skipped it has cos(e0, e0 + e1 + e2 + e3) = 1/2 to
    the full model's, exactly (norms 1 and 2); s 3 does nothing. By hand (weights 1, capacity 2): s 2 — exec j0,
    skip → j1 at 1/2 (kept); s 3 — exec j0, j1; skip from j0 → j1 (cos 1 beats 1/2), from j1 → j2 at 1/2 (kept)."""
    basis = torch.eye(4, dtype=torch.float64)
    scale = torch.tensor([[1.0], [3.0]], dtype=torch.float64)  # [r, 1]: two window tokens
    adds = {2: basis[1] + basis[2] + basis[3]}  # sublayer → what it adds (per unit of a token's scale)

    def run(s, h):  # h [B, r, D]
        return h + scale * adds.get(s, torch.zeros(4, dtype=torch.float64))

    x = [scale * basis[0]]  # [r, D]
    for s in range(6):
        x.append(run(s, x[-1][None])[0])
    x = torch.stack(x)  # [2L+1, r, D]
    def kept(prune: float) -> dict:
        return {j: (skip.attn, skip.mlp) for j, (skip, _) in knapsack_sets(x, 1, 1, 2, prune, run).items()}

    assert kept(0.5) == {0: ((), ()), 1: ((), (1,)), 2: ((1,), (1,))}
    assert kept(math.nextafter(0.5, 1.0)) == {0: ((), ()), 1: ((), (1,))}  # a floor one ulp higher prunes the halves


def test_knapspec_weights_and_tokens_per_time():
    method = knapspec()
    method.start(8)
    assert method.latencies(100) == pytest.approx((1.0, 2.0))  # t_mlp = c1, t_attn = 0.01·100 + 1
    assert method.weights(100) == (2, 1, 12)  # MLP cheaper: weighs 1, attention round(2/1) = 2; ⌊3·8/2⌋
    assert method.weights(1000) == (5, 1, 24)  # ratio 11 capped at 5
    assert method.weights(0) == (1, 1, 8)
    # α = 0.5, one draft: (1 + 0.5) / [t_a·(n_a + L) + t_m·(n_m + L)] beats d = 0's 1 / [L·(t_a + t_m)]
    assert tokens_per_time(0.5, 2, 3, 4, 1.0, 1.0, 17) == pytest.approx(max(1 / 8, 1.5 / 13, 1.75 / 18, 1.875 / 23))
    assert tokens_per_time(0.0, 2, 3, 4, 1.0, 1.0, 17) == pytest.approx(1 / 8)


def test_knapspec_selects_after_its_warmup_and_counts_it(stack_and_ref):  # noqa: F811
    stack, _, prompts, _ = stack_and_ref
    method = knapspec(confidence=0.0, prune=0.0)
    gen = Engine(stack, Sampling(), set()).generate(prompts[0], method, 40, 0)
    selections = [r for r in gen.rounds if "sel_capacity" in r.trace]
    assert [r.round for r in selections] == list(range(3, len(gen.rounds), 4))
    for r in gen.rounds[1:4]:
        assert r.loaded_layers == r.drafted * L + L + r.trace.get("sel_loaded_layers", 0)  # full-model drafts
    for r in selections:  # 2(L−2) items at ½ a layer + the last layer: L − 1 loads; window × (candidates + 1) heads
        window = sum(q.accepted + 1 for q in gen.rounds[r.round - 1 : r.round + 1])  # window_rounds = 2
        assert r.trace["sel_loaded_layers"] == L - 1
        assert r.trace["sel_head_calls"] % window == 0 and r.trace["sel_head_calls"] >= 2 * window
        assert r.trace["lat_fit"] == pytest.approx([1.0, 0.01, 1.0])
        assert 0 <= r.trace["sel_alpha"] <= 1


# ---- configuration ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("method=clasp method.skip_layers=4", "skip_layers=4: must be an integer in [1, L − 1], here [1, 3]"),
    ("method=clasp method.skip_layers=2 method.gamma=0", "gamma=0: must be an integer ≥ 1"),
    ("method=knapspec method.warmup_rounds=3", "warmup_rounds=3 must be an integer ≥ window_rounds + 1 (6)"),
    ("method=knapspec method.latency_contexts=[64]", "needs ≥ 2 distinct positive context lengths"),
    ("method=del_knapspec method.min_draft=2", "min_draft=2: must be one of 0, 1"),
])
def test_invalid_hyperparameters_fail_before_the_model_loads(run_cfg, monkeypatch, override, message):
    def no_loading(*_, **__):
        raise AssertionError("weights loaded before validation")

    monkeypatch.setattr(session, "load_model", no_loading)
    with pytest.raises(ConfigError, match=re.escape(message)):
        runner.run(run_cfg(*override.split()))


def test_knapspec_run_records_its_latency_model(run_cfg):
    cfg = run_cfg("method=knapspec", "method.latency_contexts=[8,16,32]", "method.warmup_rounds=2",
                  "method.window_rounds=1", "method.interval=2", "method.confidence=0.0", "limit=1")
    runner.run(cfg)
    out = Path(cfg.out_dir)
    costs = json.loads((out / "costs.json").read_text())
    assert [row[0] for row in costs["sublayer_s"]] == [8, 16, 32]
    fits = [json.loads(line).get("lat_fit") for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert any(fits)
