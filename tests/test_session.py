"""session.build: the one setup every entry point decodes with (runner, bench rows' host syncs, bench-controller's
twins): the task's decoding over the run's, its stop strings, the costs a run already measured."""

from __future__ import annotations

import pytest

from del_bench import session
from del_bench.engine.sampling import Sampling
from del_bench.models.layer_stack import LayerStack
from del_bench.records import RunDir

COSTS = {"layer_s": 1e-3, "head_s": 5e-3, "batch_s": [[1, 1e-3], [2, 1.5e-3]]}


def test_a_task_that_fixes_its_decoding_samples_whatever_the_run_says(run_cfg):
    """HumanEval pass@10 samples at T 0.6, top-p 0.95 (its config's generation) over the run's greedy default."""
    assert session.sampling_of(run_cfg("task=humaneval")) == Sampling()
    pass10 = Sampling(do_sample=True, temperature=0.6, top_p=0.95)
    assert session.sampling_of(run_cfg("task=humaneval_pass10")) == pass10


def test_a_session_takes_the_costs_its_run_measured_and_the_tasks_stop_strings(run_cfg, monkeypatch):
    cfg = run_cfg("method=del_cpu", "layers=eager", "task.stop_strings=[xyz]")
    run_dir = RunDir(cfg.out_dir)
    run_dir.path.mkdir(parents=True)
    monkeypatch.setattr(LayerStack, "cost_device", lambda self: "this device")  # the costs were measured here
    run_dir.write_costs({**COSTS, "device": "this device"})
    ready = session.build(cfg, run_dir=run_dir)
    assert ready.costs == {**COSTS, "device": "this device"}  # not re-measured
    assert ready.method.head_cost == pytest.approx(5.0)  # head_s / layer_s
    ids = ready.tokenizer("ab xyz")["input_ids"]
    assert ready.engine.stop is ready.stop and ready.stop(ids) and not ready.stop(ids[:-1])
    assert ready.setup["layer_path"] == "eager" and ready.setup["compile"] == "auto" and not ready.setup["compiled"]
    assert ready.engine.sampling == Sampling() and ready.eos == session.eos_ids(ready.loaded.model, ready.tokenizer)
