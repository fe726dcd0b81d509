"""bench del-trace: DEL's per-round trace — predicted vs realised TPL, each round's class, the run's losses by class.

A hand-built run (tests below: every number by hand) pins the classification and both TPL columns; tiny float64 runs
hold the predicted TPL the plan records to tpl_table's value at the chosen (E, γ), and the recomputation of older
records (no `tpl_predicted`) to the recorded value, bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from del_bench import runner
from del_bench.bench import del_trace
from del_bench.methods.dynamic_exit import DEL, tpl_table
from tests.test_del import shadow

L = 4
METHOD = {"_target_": "del_bench.methods.dynamic_exit.DEL", "name": "del", "omega": 0.95, "d_max": 4,
          "dynamic_draft_exit": True, "draft_budget": "d_max", "cost_model": "layers", "tag": "del-test"}


def rnd(sample, r, emitted, loaded, drafted=0, accepted=0, budget=0, exit_layer=None, **trace):
    return {"sample_id": sample, "repeat": 0, "round": r, "exit_layer": exit_layer, "budget": budget,
            "drafted": drafted, "accepted": accepted, "emitted": emitted, "loaded_layers": loaded,
            "head_calls": len(trace.get("draft_confidences", [])) + drafted + 1, **trace}  # candidates + d + 1


def plan(gamma, exit_layer, alpha, tau=0.5, conf=None, **more):
    return {"gamma_tpl": gamma, "chosen_exit_layer": exit_layer if gamma else None, "alpha_exit": alpha, "tau": tau,
            **({"draft_confidences": conf} if conf else {}), **more}


# (round, expected class, its predicted TPL by hand): L = 4, TPL(E, d) = Σ_{k≤d} α^k ÷ (d·E + L)
ROUNDS = [
    (rnd("a", 0, 1, 4), "prefill", None),
    # before any decoded round; 1 ÷ 5 < 0.75 × 1.5/5: it loses
    (rnd("a", 1, 1, 5, 1, 0, 4, 1, **plan(1, 1, 0.5, conf=[0.9, 0.1])), "first", (1 + 0.5) / 5),
    (rnd("a", 2, 1, 4, **plan(0, None, 0.5, tpl_predicted=1 / 4)), "no draft", 1 / 4),
    # the candidate fell below τ (0.3 < 0.5) before any draft; the plan expected 2.71/6 for 4 layers: stop cut
    (rnd("a", 3, 1, 4, 0, 0, 4, **plan(2, 1, 0.9, conf=[0.3])), "stop cut", (1 + 0.9 + 0.9 ** 2) / 6),
    # all 4 drafts (the budget) rejected: the estimate was wrong
    (rnd("a", 4, 1, 8, 4, 0, 4, 1, **plan(2, 1, 0.9, conf=[0.9] * 4)), "estimate wrong", (1 + 0.9 + 0.9 ** 2) / 6),
    # all accepted, realised 3/8 above 2.44/8: as planned (a stop on τ that did not lose is no loss)
    (rnd("a", 5, 3, 8, 2, 2, 4, 2, **plan(2, 2, 0.8, conf=[0.9, 0.9, 0.2])), "as planned", (1 + 0.8 + 0.8 ** 2) / 8),
    # the budget capped by the tokens left (1 < d_max) and the output's last round
    (rnd("a", 6, 1, 5, 1, 0, 1, 1, **plan(1, 1, 0.5, conf=[0.9])), "output end", (1 + 0.5) / 5),
    (rnd("b", 0, 1, 4), "prefill", None),
    (rnd("b", 1, 2, 5, 1, 1, 4, 1, **plan(1, 1, 0.5, conf=[0.9, 0.1])), "as planned", (1 + 0.5) / 5),
    # the same loss as round a/4 but not the output's last round, nor capped: estimate wrong, not output end
    (rnd("b", 2, 1, 8, 4, 0, 4, 1, **plan(2, 1, 0.9, conf=[0.9] * 4)), "estimate wrong", (1 + 0.9 + 0.9 ** 2) / 6),
    (rnd("b", 3, 1, 4, **plan(0, None, 0.2)), "no draft", 1 / 4),
]


def write_run(path, rounds, method=METHOD, **summary):
    path.mkdir(parents=True, exist_ok=True)
    (path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (path / "summary.json").write_text(json.dumps({
        "method": "del", "model": "m", "task": "t", "method_tag": method["tag"],
        "config": {"method": method, "model": {"num_layers": L}}, "run_key": {"hyperparameters": {}}, **summary}))
    return path


def test_each_round_is_classified_and_priced_by_hand(tmp_path):
    run = write_run(tmp_path / "run", [r for r, _, _ in ROUNDS])
    df, method, exact = del_trace.load(run)
    df = del_trace.classify(df, method, margin=0.25)
    assert exact and df["class"].tolist() == [c for _, c, _ in ROUNDS]
    assert df["tpl_realised"].tolist() == [r["emitted"] / r["loaded_layers"] for r, _, _ in ROUNDS]
    expected = [np.nan if p is None else p for _, _, p in ROUNDS]
    assert df["tpl_predicted"].tolist() == pytest.approx(expected, rel=1e-15, nan_ok=True)
    assert df["tpl_source"].tolist()[2] == "recorded" and df["tpl_source"].tolist()[1] == "recomputed"
    lost = [0.0 if p is None else p * r["loaded_layers"] - r["emitted"] for r, _, p in ROUNDS]
    assert df["lost"].tolist() == pytest.approx(lost, abs=1e-12)


def test_the_summary_adds_the_losses_up_to_predicted_less_realised(tmp_path):
    run = write_run(tmp_path / "run", [r for r, _, _ in ROUNDS])
    df, method, exact = del_trace.load(run)
    s = del_trace.summarise(del_trace.classify(df, method, 0.25), "m/t/del", exact, L)
    tokens, cost = sum(r["emitted"] for r, _, _ in ROUNDS), sum(r["loaded_layers"] for r, _, _ in ROUNDS)
    assert (s["tokens"], s["etpl"]) == (tokens, tokens / cost)
    assert sum(c["etpl_lost"] for c in s["classes"].values()) == pytest.approx(s["etpl_predicted"] - s["etpl"])
    assert s["classes"]["stop cut"]["etpl_lost"] == pytest.approx(((1 + 0.9 + 0.81) / 6 * 4 - 1) / cost)
    assert {k: c["rounds"] for k, c in s["classes"].items() if c["rounds"]} == {
        "prefill": 2, "first": 1, "no draft": 2, "stop cut": 1, "estimate wrong": 2, "as planned": 2, "output end": 1}
    assert s["stop_cut_before_any_draft"] == 1  # a/3: its first candidate fell below τ
    layer1 = next(r for r in s["layers"] if r["exit_layer"] == 1)  # rounds a/1, a/4, a/6, b/1, b/2: 11 drafted
    assert (layer1["drafted"], layer1["accepted_per_drafted"], layer1["accepted_per_tested"]) == (11, 1 / 11, 1 / 5)


def test_the_margin_decides_which_rounds_lose(tmp_path):
    run = write_run(tmp_path / "run", [r for r, _, _ in ROUNDS])
    df, method, _ = del_trace.load(run)
    loose = del_trace.classify(df, method, 0.25)["class"]
    strict = del_trace.classify(df, method, 0.0)["class"]  # b/1 realised 2/5 > 1.5/5 still as planned
    assert (loose == strict).all()
    assert (del_trace.classify(df, method, 0.9)["class"] == "as planned").sum() == 7  # every drafting plan


def test_costs_that_are_not_the_runs_own_give_no_prediction(tmp_path):
    measured = {**METHOD, "cost_model": "measured"}
    run = write_run(tmp_path / "run", [r for r, _, _ in ROUNDS], measured,
                    measured_costs={"layer_s": 1.0, "head_s": 2.0}, setup=[{"costs_measured": True}])
    df, method, exact = del_trace.load(run)  # the run key records no head_cost_layers: which costs it used is unknown
    assert not exact and df["tpl_predicted"].isna().all() and set(df["tpl_source"]) == {"absent"}
    assert set(del_trace.classify(df, method, 0.25)["class"]) == {"prefill", "no draft", "no prediction"}


def test_measured_costs_recovered_exactly_reprice_the_plan(tmp_path):
    measured = {**METHOD, "cost_model": "measured"}
    costs = {"layer_s": 1.0, "head_s": 2.0, "batch_s": [[1, 1.0], [2, 1.5], [4, 2.0]]}
    m = DEL(d_max=4)
    m.set_costs(**costs)
    key = {"head_cost_layers": m.head_cost, "batch_cost": [round(c, 3) for c in m.batch_cost]}
    run = write_run(tmp_path / "run", [r for r, _, _ in ROUNDS], measured, measured_costs=costs,
                    run_key={"hyperparameters": key})
    df, method, exact = del_trace.load(run)
    assert exact
    r = df.iloc[4]  # round a/4: 4 drafts at E = 1, 9 head rows priced 5: 4 candidates + the verification's product
    assert r["cost"] == 8 - 3 + 3 * m.batch_cost[4] + 2.0 * 5
    assert r["tpl_predicted"] == float(tpl_table(np.full(3, 0.9), L, 4, 2.0, True, m.batch_cost)[2, 0])


def test_the_plans_predicted_tpl_is_tpl_tables_at_the_chosen_plan_and_recomputes_exactly():
    for kwargs in ({}, {"cost_model": "measured"}, {"first_exit_layer": 1, "keep_stopped_draft": True}):
        m = DEL(omega=0.5, d_max=6, **kwargs)
        if m.wants_costs:
            m.set_costs(layer_s=1.0, head_s=0.7, batch_s=[[1, 1.0], [2, 1.2], [8, 1.9]])
        m.start(4)
        m.observe_prefill(shadow([[5, 7, 7], [5, 7, 6], [5, 7, 7]], [[0.9, 0.4, 0.5], [0.8, 0.6, 0.6],
                                                                     [0.7, 0.7, 0.7]], [5, 7, 7]))
        trace = m.plan().trace
        e, gamma = trace["chosen_exit_layer"], trace["gamma_tpl"]
        table = tpl_table(m.alpha, 4, m.d_max, m.head_cost, m.stop_head, m.batch_cost)
        assert gamma > 0 and trace["tpl_predicted"] == float(table[gamma, e - 1])
        assert del_trace.predicted(m, trace["alpha_exit"], e, gamma) == trace["tpl_predicted"]


@pytest.mark.parametrize("method", ["del", "del_knapspec", "del_alg1"])
def test_tiny_runs_record_what_the_trace_recomputes(run_cfg, tmp_path, method):
    """A real run's rounds: every plan's tpl_predicted recorded, and what older records get recomputed equals it."""
    cfg = run_cfg(f"method={method}", "limit=2", "max_new_tokens=12", f"out_dir={tmp_path / method}")
    runner.run(cfg)
    df, m, exact = del_trace.load(tmp_path / method)
    planned = df[df["gamma_tpl"].notna()]
    assert exact and len(planned) and set(planned["tpl_source"]) == {"recorded"}
    for r in planned.itertuples():
        assert del_trace.predicted(m, r.alpha_exit, del_trace._int(r.chosen_exit_layer), int(r.gamma_tpl)) \
            == r.tpl_predicted
    assert (df["tpl_realised"] == df["emitted"] / df["loaded_layers"]).all()  # the paper's cost model: layers


def test_the_bench_writes_a_table_a_figure_and_the_summaries(tmp_path):
    run = write_run(tmp_path / "run", [r for r, _, _ in ROUNDS])
    out = tmp_path / "trace.json"
    assert del_trace.main([str(run), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (summary,) = result["runs"]
    assert summary["run"] == "m/t/del-test" and summary["classes"]["estimate wrong"]["rounds"] == 2
    assert (tmp_path / "trace" / "m_t_del-test.png").stat().st_size > 0
    assert len((tmp_path / "trace" / "m_t_del-test.csv").read_text().splitlines()) == len(ROUNDS) + 1
