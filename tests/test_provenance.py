"""Provenance that means what it says (runner.provenance): git_dirty is the code's state, not the records'; the device
is where the model ran; the CPU as the kernel names it keeps two CPU models apart in a run's machine; and a speedup
that pairs two states of the machine is marked § wherever it is shown (show, every bench table), not only the
report's tables."""

from __future__ import annotations

import subprocess

import pytest
import torch

from del_bench import git_state, runner
from del_bench.__main__ import format_table
from del_bench.bench import harness
from del_bench.records import machine_of


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_git_dirty_is_the_codes_state_not_the_records(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "kept.json").write_text("{}\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    assert not git_state.git_dirty(tmp_path)
    (tmp_path / "results" / "kept.json").write_text('{"new": 1}\n')  # a committed record rewritten
    (tmp_path / "results" / "run").mkdir()
    (tmp_path / "results" / "run" / "samples.jsonl").write_text("{}\n")  # a new record
    assert not git_state.git_dirty(tmp_path)
    (tmp_path / "helper.py").write_text("y = 2\n")  # new code, not yet added
    assert git_state.git_dirty(tmp_path)
    (tmp_path / "helper.py").unlink()
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_state.git_dirty(tmp_path)


def test_the_device_is_where_the_model_ran(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert runner.device_name("cpu") == "cpu"  # a CPU run on a CUDA host is a CPU run
    assert runner.device_name("cuda") == runner.device_name(None) == "NVIDIA H200"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runner.device_name(None) == "cpu"


def test_two_cpu_models_are_two_machines():
    intel = {"device": "cpu", "cpu": "x86_64", "cpu_model": "Intel(R) Xeon(R) Processor", "torch_threads": 2}
    amd = {**intel, "cpu_model": "AMD EPYC 9R14"}
    assert machine_of(intel) != machine_of(amd)
    assert machine_of({k: v for k, v in intel.items() if k != "cpu_model"}) == "cpu/x86_64 (2 threads)"  # older records
    assert runner.cpu_model() and "cores, kernel" in runner.host_kind()


def _summary(method: str, tok_s: float, probe_s: float) -> dict:
    """A run's summary as show and the benches read it, its setup line carrying a machine probe of probe_s seconds."""
    return {"method": method, "method_tag": method, "model": "m", "task": "t", "task_version": "1",
            "decoding": "greedy", "max_new_tokens": 8, "n_samples": 2, "tokens_per_s": tok_s, "etpl": 0.1,
            "acceptance_rate": None if method == "vanilla" else 0.5, "drafted": 3, "generated_tokens": 8,
            "loaded_layers": 80, "wall_s": 1.0, "time_split": {"policy": 0.0}, "quality": {},
            "provenance": {"device": "cpu", "cpu": "x86_64", "torch_threads": 2},
            "setup": [{"products": {"seconds": {"qkv": {"1": {"x_wt": probe_s}}}}}],
            "run_key": {"model": "m", "weights": "", "task": "t", "task_version": "1", "method": method,
                        "method_tag": method, "hyperparameters": {}, "decoding": "greedy", "max_new_tokens": 8,
                        "prompts": "p", "prompt_digest": "d", "machine": "cpu/x86_64 (2 threads)", "batch_size": 1}}


def test_show_marks_a_speedup_across_machine_states():
    vanilla, ls = _summary("vanilla", 10.0, 0.010), _summary("ls", 20.0, 0.030)
    text = format_table([vanilla, ls])
    assert " 2.00x§" in text and "§ LS on m/t: its speedup pairs two states of the machine" in text
    steady = format_table([vanilla, _summary("ls", 20.0, 0.012)])  # within DRIFT_LIMIT
    assert "§" not in steady


def test_a_bench_table_marks_a_speedup_across_machine_states(capsys):
    class FinishedRow:
        def __init__(self, label, summary):
            self.label, self.summary = label, summary
            self.cfg = type("Cfg", (), {"model": type("M", (), {"num_layers": 10})(), "out_dir": label})()

    rows = harness.table([FinishedRow("Vanilla", _summary("vanilla", 10.0, 0.010)),
                          FinishedRow("LS", _summary("ls", 20.0, 0.030))])
    assert [r["drifted"] for r in rows] == [False, True]
    harness.print_table(rows, ["row", "tok/s"])
    out = capsys.readouterr().out
    assert "LS §" in out and "§ its speedup pairs two states of the machine" in out


def test_provenance_is_the_code_the_process_started_with(monkeypatch):
    """A commit made while a run decodes does not relabel its records: the commit and the code's state are read once,
    when the process first asks (run and every bench ask at their start)."""
    git_state.code_state.cache_clear()
    try:
        monkeypatch.setattr(git_state, "git", lambda repo, *args: "c1")
        monkeypatch.setattr(git_state, "git_dirty", lambda repo: False)
        git_state.code_state()  # the start of a run
        monkeypatch.setattr(git_state, "git", lambda repo, *args: "c2")  # committed (or edited) while it decodes
        monkeypatch.setattr(git_state, "git_dirty", lambda repo: True)
        assert {k: runner.provenance()[k] for k in ("git_commit", "git_dirty")} == {"git_commit": "c1",
                                                                                   "git_dirty": False}
    finally:
        git_state.code_state.cache_clear()


def test_a_run_reads_the_codes_state_before_it_decodes(run_cfg, monkeypatch):
    class Started(Exception):
        pass

    def started():
        raise Started

    monkeypatch.setattr(runner, "code_state", started)
    monkeypatch.setattr(runner, "instantiate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("too late")))
    with pytest.raises(Started):  # before the task, the method or the model is built
        runner.run(run_cfg("model=tiny-random", "max_new_tokens=4", "limit=1"))
