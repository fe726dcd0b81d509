"""DEL's statistics and choices on hand-computed values."""

import numpy as np
import pytest
import torch

from del_bench.methods.base import RoundEvidence, Shadow
from del_bench.methods.dynamic_exit import DEL, best_exit, drafting_alpha, tpl_table


def shadow(tokens, confidence, target):
    return Shadow(torch.tensor(tokens), torch.tensor(confidence, dtype=torch.float64), torch.tensor(target))


def test_tpl_table_by_hand_including_alpha_zero_and_one():
    table = tpl_table(torch.tensor([0.0, 0.5, 1.0]), num_layers=4, d_max=2)  # [d, ℓ]
    expected = [[1 / 4, 1 / 4, 1 / 4],
                [1 / 5, 1.5 / 6, 2 / 7],
                [1 / 6, 1.75 / 8, 3 / 10]]
    assert table.flatten().tolist() == pytest.approx([v for row in expected for v in row])
    assert best_exit(torch.tensor([0.0, 0.5, 1.0]), 4, 2, torch.ones(3, dtype=torch.bool)) == (3, 2)


def test_argmax_tie_breaking_prefers_no_drafting_then_the_shallowest_layer():
    allowed = torch.ones(3, dtype=torch.bool)
    assert best_exit(torch.zeros(3), 4, 18, allowed) == (1, 0)  # α = 0 everywhere: every ℓ ties at d = 0
    assert best_exit(torch.full((3,), 0.5), 4, 18, allowed) == (1, 1)  # 1.5/5 beats 1.75/6 and 1.5/(ℓ+4)
    # without ℓ = 1: TPL(2, 1) = 1.5/6 = 1/4 = TPL(2, 0) exactly; the tie goes to not drafting
    assert best_exit(torch.full((3,), 0.5), 4, 18, torch.tensor([False, True, True])) == (2, 0)


def test_alpha_and_tau_after_scripted_rounds():
    m = DEL(omega=0.5)
    m.start(3)  # L = 3: layers 1 and 2 can exit
    m.observe_prefill(shadow([[5, 6], [5, 7]], [[0.9, 0.4], [0.8, 0.6]], [5, 7]))
    assert m.alpha.tolist() == pytest.approx([0.5, 1.0])
    # layer 2 never mismatched: its mismatched mean is taken as 0
    assert m.tau.tolist() == pytest.approx([0.5 * (0.9 + 0.4), 0.5 * (1.4 / 2 + 0.0)])
    m.observe(RoundEvidence(exit_layer=2, drafted=0, accepted=0,
                            shadow=shadow([[3], [4]], [[0.2], [0.7]], [4])))
    # S(c) = .5·[1, 2] + [0, 1]; S(tcs) = .5·[.9, 1.4] + [0, .7]; S(fcs) = .5·[.4, 0] + [.2, 0]; S(n) = .5·2 + 1
    assert m.alpha.tolist() == pytest.approx([0.5 / 2, 2 / 2])
    assert m.tau.tolist() == pytest.approx([0.5 * (0.45 / 0.5 + 0.4 / 1.5), 0.5 * (1.4 / 2)])
    assert (m.exit_layer, m.gamma) == (2, 18)  # α_2 = 1: the longest draft maximises TPL


def test_a_layer_that_never_matched_uses_one_as_its_matched_mean():
    m = DEL()
    m.start(3)
    m.observe_prefill(shadow([[1, 1], [5, 7]], [[0.3, 0.5], [0.9, 0.9]], [5, 7]))
    assert float(m.tau[0]) == pytest.approx(0.5 * (1.0 + 0.8 / 2))
    assert float(m.alpha[0]) == 0.0


def test_falls_back_to_plain_decoding_when_early_layers_never_agree():
    m = DEL()
    m.start(4)
    m.observe_prefill(shadow([[1, 2], [1, 2], [1, 2]], [[0.9, 0.9]] * 3, [5, 7]))
    plan = m.plan()
    assert (plan.exit_layer, plan.max_draft) == (None, 0)
    assert plan.trace["gamma_tpl"] == 0


def test_ablations_budget_and_restrictions():
    agree = shadow([[5, 7], [5, 7], [5, 7]], [[0.9, 0.9]] * 3, [5, 7])
    del_e = DEL(dynamic_draft_exit=False, draft_budget="tpl", d_max=6)
    del_e.start(4)
    del_e.observe_prefill(agree)
    assert del_e.plan().max_draft == 6 and not del_e.wants_confidence  # γ from TPL (α = 1 → d_max)
    fixed = DEL(exit_layer=2)
    fixed.start(4)
    fixed.observe_prefill(agree)
    assert fixed.plan().exit_layer == 2
    lim = DEL(min_exit_layer=3)
    lim.start(4)
    lim.observe_prefill(agree)
    assert lim.plan().exit_layer == 3  # α = 1 everywhere would pick ℓ = 1 without the restriction
    assert DEL.problems({"min_exit_layer": 3}, 4) == []
    (problem,) = DEL.problems({"min_exit_layer": 4}, 4)
    assert problem.startswith("method.min_exit_layer=4: must be an integer in [1, L − 1]")


def test_statistics_restart_with_every_prompt():
    m = DEL()
    m.start(3)
    m.observe_prefill(shadow([[5, 7], [5, 7]], [[0.9, 0.9]] * 2, [5, 7]))
    m.start(3)
    assert m.s_positions == 0 and m.alpha.tolist() == [0.0, 0.0]


def test_calibrated_cost_model_counts_the_head():
    alpha = torch.tensor([0.2, 0.5, 0.9])
    table = tpl_table(alpha, num_layers=4, d_max=1, head_cost=2.0)
    # d = 0: 1 / (L + h); d = 1: (1 + α) / (ℓ + h + L + h)
    assert table[0].tolist() == pytest.approx([1 / 6] * 3)
    assert table[1].tolist() == pytest.approx([1.2 / 9, 1.5 / 10, 1.9 / 11])
    # the paper's model drafts at ℓ = 1 once α_1 > 1/L; counting a 5-layer head it no longer pays
    allowed = torch.ones(3, dtype=torch.bool)
    alpha = torch.tensor([0.3, 0.3, 0.3])
    assert best_exit(alpha, 4, 18, allowed) == (1, 1)  # 1.3/5 > 1/4
    assert best_exit(alpha, 4, 18, allowed, head_cost=5.0)[1] == 0  # 1.3/15 < 1/9
    # the dropped candidate that stops drafting costs one more head row whenever d > 0
    table = tpl_table(torch.tensor([0.5]), num_layers=4, d_max=2, head_cost=2.0, stop_head=True)
    assert table[:, 0].tolist() == pytest.approx([1 / 6, 1.5 / 11, 1.75 / 14])  # d·(ℓ + h) + L + h + h
    half = torch.tensor([0.5])
    assert tpl_table(half, 4, 2, stop_head=True).tolist() == tpl_table(half, 4, 2).tolist()  # h = 0: paper's
    m = DEL(cost_model="measured")
    assert m.wants_costs
    m.set_costs(layer_s=0.001, head_s=0.005)
    assert m.head_cost == pytest.approx(5.0)


def test_a_measured_verification_batch_costs_its_late_layers_c_times():
    # c(T): a T-position layer costs c(T) single ones; verification runs layers ℓ+1..L over d + 1 positions
    alpha, c = torch.tensor([0.5, 0.9]), (1.0, 1.5, 2.0)
    table = tpl_table(alpha, num_layers=3, d_max=2, head_cost=1.0, batch_cost=c)
    for d in range(3):
        for ell in (1, 2):
            cost = d * (ell + 1.0) + ell + (3 - ell) * c[d] + 1.0
            assert table[d, ell - 1] == pytest.approx(sum(alpha[ell - 1].item() ** k for k in range(d + 1)) / cost)
    assert tpl_table(alpha, 3, 2, 1.0, batch_cost=(1.0,) * 3).tolist() == tpl_table(alpha, 3, 2, 1.0).tolist()
    with pytest.raises(ValueError, match="batch sizes"):
        tpl_table(alpha, 3, 2, batch_cost=(1.0, 1.5))
    # a costly batch makes drafting lose where the paper's model drafts
    allowed = np.ones(2, dtype=bool)
    assert best_exit(np.array([0.6, 0.6]), 3, 2, allowed)[1] > 0
    assert best_exit(np.array([0.6, 0.6]), 3, 2, allowed, batch_cost=(1.0, 2.0, 3.0))[1] == 0
    # set_costs interpolates the measured sizes to T = 1..d_max+1 (linear, extrapolated past the largest)
    m = DEL(cost_model="measured", d_max=5)
    m.set_costs(layer_s=0.001, head_s=0.005, batch_s=[[1, 0.03], [2, 0.036], [4, 0.048]])
    assert m.batch_cost == pytest.approx((1.0, 1.2, 1.4, 1.6, 1.8, 2.0))
    assert m.describe()["batch_cost"] == [1.0, 1.2, 1.4, 1.6, 1.8, 2.0]
    m.set_costs(layer_s=0.001, head_s=0.005)  # costs.json of runs measured before batch_s existed
    assert m.batch_cost == () and m.describe()["batch_cost"] is None


def test_drafting_alpha_is_the_closed_form_for_one_draft():
    # d_max = 1, layer costs, no stop head: TPL(ℓ, 1) = (1 + α)/(ℓ + L) beats 1/L exactly when α > ℓ/L
    assert drafting_alpha(8, d_max=1).tolist() == pytest.approx([ell / 8 for ell in range(1, 8)], abs=1e-8)


BATCH = tuple(1 + 0.1 * t for t in range(19))  # c(T) = 1 + 0.1·(T − 1): a CPU-like verification batch


@pytest.mark.parametrize("head_cost, batch_cost", [(0.0, ()), (5.0, ()), (5.0, BATCH)])
def test_no_draft_bound_is_sound_and_tight(head_cost, batch_cost):
    star = drafting_alpha(12, 18, head_cost, True, batch_cost)
    allowed = np.ones(11, dtype=bool)
    rng = np.random.default_rng(0)
    for _ in range(200):  # below every layer's bound TPL keeps d = 0
        alpha = np.minimum(star, 1.0) * rng.random(11)
        assert best_exit(alpha, 12, 18, allowed, head_cost, stop_head=True, batch_cost=batch_cost)[1] == 0
    for ell in range(11):  # just above one layer's bound, drafting (at that layer) wins
        if star[ell] <= 1:
            alpha = np.zeros(11)
            alpha[ell] = star[ell] + 1e-6
            exit_layer, gamma = best_exit(alpha, 12, 18, allowed, head_cost, stop_head=True, batch_cost=batch_cost)
            assert (exit_layer, gamma > 0) == (ell + 1, True)


def test_shadow_every_holds_rounds_back_and_is_validated():
    m = DEL(shadow_every=3)
    m.start(4)
    assert m.can_defer([1]) and m.can_defer([1, 2]) and not m.can_defer([1, 2, 1])  # then exact rules: no defer
    for bad in (0, 17, 1.5):
        assert DEL.problems({"shadow_every": bad}, 4)[0].startswith(f"method.shadow_every={bad}: must be an integer")
    assert "shadow_every" not in DEL().describe() and DEL(shadow_every=2).describe()["shadow_every"] == 2


def test_the_plan_trace_reads_the_chosen_layers_statistics():
    m = DEL(omega=0.5)
    m.start(4)
    m.observe_prefill(shadow([[5, 6], [5, 7], [5, 7]], [[0.9, 0.4], [0.8, 0.6], [0.7, 0.7]], [5, 7]))
    trace, e = m.plan().trace, m.exit_layer - 1
    assert trace["tau"] == m.threshold == float(m.tau[e])
    assert trace["alpha_exit"] == float(m.alpha[e])
    true_mean, false_mean = m.confidence_means
    assert (trace["conf_matched"], trace["conf_mismatched"]) == (float(true_mean[e]), float(false_mean[e]))


# ---- the cost model on any device (issue 36): measured costs, a GPU's included

L16 = 16
GPU_BATCH = [[1, L16 * 1e-4], [2, L16 * 1.004e-4], [4, L16 * 0.998e-4], [8, L16 * 1.01e-4], [16, L16 * 1.02e-4],
             [32, L16 * 1.05e-4]]  # a GPU streams a layer's weights once for all rows: T positions ≈ one
CPU_BATCH = [[1, L16 * 1e-4], [2, L16 * 1.5e-4], [4, L16 * 2.0e-4], [8, L16 * 3.0e-4], [16, L16 * 5e-4],
             [32, L16 * 9e-4]]  # on a CPU a batch costs several single positions (SmolLM2-like)


def measured_del(batch_s) -> DEL:
    m = DEL(cost_model="measured")
    m.set_costs(layer_s=1e-4, head_s=0.6e-4, batch_s=batch_s)
    return m


def test_on_a_gpu_like_cost_table_tpl_prices_a_verification_batch_as_one_position():
    gpu, cpu = measured_del(GPU_BATCH), measured_del(CPU_BATCH)
    assert gpu.head_cost == pytest.approx(0.6) and len(gpu.batch_cost) == gpu.d_max + 1
    assert gpu.batch_cost == pytest.approx((1.0,) * 19, abs=0.03) and min(gpu.batch_cost) >= 1.0
    alpha, d_max = np.linspace(0.9, 0.1, L16 - 1), gpu.d_max
    table = tpl_table(alpha, L16, d_max, gpu.head_cost, True, gpu.batch_cost)
    d = np.arange(d_max + 1)[:, None]
    layers = np.arange(1, L16)[None, :]
    closed = (alpha[None, :] ** d).cumsum(0) / (d * (layers + 0.6) + L16 + 0.6 + 0.6 * (d > 0))  # the paper's + h
    assert table == pytest.approx(closed, rel=0.03)
    # α = 0.6 at layer 4 alone: drafting pays where a batch is free (as the paper's layer count says), not on the CPU
    alpha = np.zeros(L16 - 1)
    alpha[3] = 0.6
    allowed = np.ones(L16 - 1, dtype=bool)
    exact = best_exit(alpha, L16, d_max, allowed, 0.6, True)  # c = 1 exactly
    assert best_exit(alpha, L16, d_max, allowed, 0.6, True, gpu.batch_cost) == exact == (4, 2)
    assert best_exit(alpha, L16, d_max, allowed, cpu.head_cost, True, cpu.batch_cost)[1] == 0


def test_a_recorded_round_is_priced_as_tpl_prices_its_plan():
    from del_bench.methods.dynamic_exit import _round_costs, round_cost

    c, h = measured_del(CPU_BATCH).batch_cost, 0.6
    _, plan_costs = _round_costs(L16, L16 - 1, 18, h, True, c)
    for d in (1, 2, 7, 18):
        for ell in (1, 4, 15):  # d drafts kept, the stopping candidate dropped: d + 1 draft head rows, d + 1 verified
            assert round_cost(d, ell, d * ell + L16, 2 * d + 2, L16, h, c) == pytest.approx(plan_costs[d, ell - 1])
    assert round_cost(0, None, L16, 1, L16, h, c) == pytest.approx(plan_costs[0, 0]) == L16 + h  # Vanilla's
    # a skipping draft (SWIFT, CLaSp, KnapSpec): d tokens through L − S/2 layers, then all L over d + 1 positions
    assert round_cost(3, None, 3 * 12 + L16, 3 + 4, L16, h, c) == pytest.approx(3 * 12 + L16 * c[3] + h * 4)


def test_the_bench_predicts_speedups_from_the_measured_costs():
    from del_bench.bench.engine import cost_predicted_speedup

    costs = {"layer_s": 1e-4, "head_s": 0.6e-4, "batch_s": GPU_BATCH}
    prefill = {"round": 0, "drafted": 0, "exit_layer": None, "loaded_layers": L16, "head_calls": 1, "emitted": 1}
    vanilla = [prefill] + [{**prefill, "round": i} for i in range(1, 9)]
    assert cost_predicted_speedup(vanilla, L16, costs) == pytest.approx(1.0)
    # LS(E4-γ3), every draft accepted: 4 tokens a round for 4·4 one-position layers, 12 over 4 positions, 4 head rows
    ls = [prefill] + [{"round": i, "drafted": 3, "exit_layer": 4, "loaded_layers": 3 * 4 + L16, "head_calls": 3 + 4,
                       "emitted": 4} for i in range(1, 5)]
    gpu = (L16 + 0.6) / ((4 * 4 + 12 * 1.0 + 0.6 * 4) / 4)
    assert cost_predicted_speedup(ls, L16, costs) == pytest.approx(gpu, rel=0.01)  # ≈ 2.18: c(4) ≈ 1
    cpu = cost_predicted_speedup(ls, L16, {**costs, "batch_s": CPU_BATCH})
    assert cpu == pytest.approx((L16 + 0.6) / ((4 * 4 + 12 * 2.0 + 0.6 * 4) / 4))  # c(4) = 2 measured
    assert cost_predicted_speedup([prefill], L16, costs) is None


def test_the_bench_prices_rounds_with_costs_measured_on_this_device(tmp_path):
    from del_bench.bench.engine import loop_costs
    from del_bench.records import RunDir

    class Stack:
        def cost_device(self):
            return "here"

    def measure():
        return {"device": "here", "measured_now": True}

    rows = []
    for name, costs in (("elsewhere", {"device": "NVIDIA H100 80GB HBM3, bfloat16, fused layers"}), ("none", None),
                        ("older", {"layer_s": 1.0})):  # costs.json from before it named its device
        RunDir(tmp_path / name).path.mkdir()
        if costs:
            RunDir(tmp_path / name).write_costs(costs)
        rows.append({"out_dir": str(tmp_path / name)})
    assert loop_costs(rows, Stack(), measure) == {"device": "here", "measured_now": True}
    RunDir(tmp_path / "here").path.mkdir()
    RunDir(tmp_path / "here").write_costs({"device": "here", "layer_s": 1.0})  # what a del_cpu row planned on here
    here = loop_costs([*rows, {"out_dir": str(tmp_path / "here")}], Stack(), measure)
    assert here == {"device": "here", "layer_s": 1.0}


def test_the_authors_prefill_draft_adds_a_plain_round_whose_window_joins_the_prefills():
    """prefill_draft (DEL as its authors' code runs it): the first token drafted at the lowest allowed E is accepted
    iff that layer's token at the last prompt position is the full model's; then one plain round emits the token after
    it, and its window joins the prefill's as one window (no decay between them), as their first call's does."""
    m = DEL(omega=0.5, prefill_draft=True, keep_stopped_draft=True)
    m.start(3)
    m.observe_prefill(shadow([[1, 7], [5, 7]], [[0.3, 0.6], [0.8, 0.9]], [5, 7]))  # layer 1 matched at the last
    plan = m.plan()
    assert (plan.exit_layer, plan.max_draft, plan.trace["prefill_draft"]) == (None, 0, True)
    m.observe(RoundEvidence(exit_layer=None, drafted=0, accepted=0, shadow=shadow([[4], [4]], [[0.5], [0.7]], [4])))
    # one window of three positions: S(c) = [1, 2] + [1, 1], S(n) = 2 + 1 (decayed, it would be .5·[1, 2] + …)
    assert m.alpha.tolist() == pytest.approx([2 / 3, 3 / 3])
    assert m.tau.tolist() == pytest.approx([0.5 * ((0.6 + 0.5) / 2 + 0.3), 0.5 * ((0.8 + 0.9 + 0.7) / 3 + 0.0)])
    assert m.plan().trace.get("prefill_draft") is None  # then TPL plans, and the next round decays as usual
    m.observe(RoundEvidence(exit_layer=2, drafted=0, accepted=0, shadow=shadow([[3], [4]], [[0.2], [0.7]], [4])))
    assert m.alpha.tolist() == pytest.approx([0.5 * 2 / (0.5 * 3 + 1), (0.5 * 3 + 1) / (0.5 * 3 + 1)])


def test_a_rejected_prefill_draft_leaves_the_first_round_to_tpl_and_its_layer_is_the_lowest_allowed():
    m = DEL(prefill_draft=True, keep_stopped_draft=True)
    m.start(3)
    m.observe_prefill(shadow([[5, 6], [5, 7]], [[0.3, 0.6], [0.8, 0.9]], [5, 7]))  # layer 1 missed the last position
    assert m.plan().trace.get("prefill_draft") is None and m.plan().exit_layer is not None
    for kwargs, layer in (({"min_exit_layer": 2}, 2), ({"exit_layer": 2}, 2), ({"first_exit_layer": 2}, 2), ({}, 1)):
        m = DEL(prefill_draft=True, **kwargs)
        m.start(4)
        assert m.prefill_draft_layer == layer  # DEL-E-lim's and DEL-γ's first E, as their code's eligible layers
        tokens = [[5, 7 if i == layer - 1 else 6] for i in range(3)]  # only that layer matches the last position
        m.observe_prefill(shadow(tokens, [[0.5, 0.5]] * 3, [5, 7]))
        assert m.plan().trace.get("prefill_draft") is True


def test_a_kept_stopped_candidate_is_not_priced_as_a_dropped_head_row():
    """TPL's stop_head prices the candidate that stops drafting as a wasted head row only where it is dropped."""
    assert DEL(cost_model="measured").stop_head and not DEL(cost_model="measured", keep_stopped_draft=True).stop_head
    assert not DEL(dynamic_draft_exit=False).stop_head
