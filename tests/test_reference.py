"""scripts/reference.py (make reference) without decoding: its steps are the experiments the tables read on both
local models and the README's benches, each a make target or experiment that exists; it refuses a dirty tree; the
runs it cannot keep — busy, unsteady, drifted (with their Vanilla partners) — are the ones it re-measures; the
records it removes first are those other code measured (a results-only commit holds the same code)."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
from pathlib import Path

import pandas as pd

from del_bench.records import RunKey

REPO = Path(__file__).resolve().parent.parent
reference = runpy.run_path(str(REPO / "scripts" / "reference.py"), run_name="reference")


def test_the_steps_are_every_experiment_on_both_models_and_the_benches():
    plan = reference["steps"]("results/reference", "python3")
    names = [s.name for s in plan]
    for model in reference["MODELS"]:
        for name in reference["EXPERIMENTS"]:
            assert f"{name}:{model}" in names
            assert (REPO / "configs" / "experiment" / f"{name}.yaml").is_file()
    assert names.index("fig1a_calibrate:testbed") < names.index("fig1a:testbed")  # fig1a reads the calibration
    targets = set(re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), re.M))
    assert {s.argv[1] for s in plan if s.benches} <= targets
    assert all("records_root=results/reference" in s.argv for s in plan if not s.benches and s.argv[3] != "bench")
    tasks, limit, tokens = reference["table1_local"]()
    assert tasks == ["aqua_rat", "cnndm_lm", "cnndm_sum", "xsum"] and (limit, tokens) == (4, 128)
    for model in reference["MODELS"]:  # Table 1's peer rows (†), on its prompts, tagged so that Table 1 reads them
        for task in tasks:
            peer = next(s for s in plan if s.name == f"table1-peers:{model}:{task}")
            assert peer.argv[3:5] == ["bench", "peer"] and "table1_local" in peer.argv
            # at a path of their length, as the runs' own out_dirs (a Table 1 of another length adds runs beside)
            assert f"results/reference/local/{model}/{task}/peers/max{tokens}" in peer.argv


def test_a_dirty_tree_is_refused(monkeypatch, capsys):
    monkeypatch.setitem(reference["main"].__globals__, "git_dirty", lambda repo: True)
    assert reference["main"]([]) == 2
    assert "commit it first" in capsys.readouterr().err


def _key(method: str, machine: str = "cpu/x") -> RunKey:
    return RunKey(model="m", weights="", task="t", task_version="1", method=method, method_tag=method,
                  hyperparameters={}, decoding="greedy", max_new_tokens=8, prompts="p", prompt_digest="d",
                  machine=machine, batch_size=1, experiments=("table3_local",))


def test_the_runs_not_kept_are_busy_unsteady_or_drifted_with_their_partners(monkeypatch):
    rows = [  # run_dir, method, busy, unsteady, drifted
        ("vanilla", "vanilla", 0, False, False), ("ls", "ls", 0, False, True), ("fs", "fs", 1, False, False),
        ("dv", "dv", 0, True, False), ("del", "del", 0, False, False), ("other", "vanilla", 0, False, False)]
    df = pd.DataFrame([{"run_dir": d, "method": m, "busy_samples": b, "unsteady": u, "drifted": dr, "model": "m",
                        "experiments": ("table3_local",), "run_key": _key(m, "cpu/y" if d == "other" else "cpu/x")}
                       for d, m, b, u, dr in rows])
    monkeypatch.setitem(reference["bad_runs"].__globals__, "load_runs", lambda roots: df)
    step = reference["Step"]("table3:m", [], "table3_local", "m")
    assert reference["bad_runs"](Path("."), step) == ["dv", "fs", "ls", "vanilla"]  # ls drifted: its partner too


def test_records_other_code_measured_are_removed_the_gpu_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setitem(reference["clear_old"].__globals__, "code_of", {"old": "A", "new": "B", "data": "B"}.get)

    def run(path: str, commit: str) -> Path:
        (tmp_path / path).mkdir(parents=True)
        (tmp_path / path / "summary.json").write_text(json.dumps({"provenance": {"git_commit": commit}}))
        return tmp_path / path

    old = [run("local/m/t/ls/greedy", "old"), run("local/m/t/vanilla/greedy", "old"), run("local/m/u/ls", "old")]
    kept = [run("local/m/t/del/greedy", "new"), run("local/m/t/fs/greedy", "data"), run("gpu/bench_runs/x", "old")]
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "del.json").write_text(json.dumps({"provenance": {"git_commit": "old"}}))
    (tmp_path / "bench" / "ls.json").write_text(json.dumps({"provenance": {"git_commit": "data"}}))
    reference["clear_old"](tmp_path, "B")
    assert [p.exists() for p in old] == [False] * 3 and all(p.exists() for p in kept)
    assert not (tmp_path / "bench" / "del.json").exists() and (tmp_path / "bench" / "ls.json").exists()


def test_a_results_only_commit_holds_the_same_code(tmp_path):
    def commit(path: str, text: str) -> str:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", path], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    code = commit("del_bench/engine.py", "x = 1\n")
    data = commit("results/reference/run/summary.json", "{}\n")
    more_data = commit("results/tables/table1.md", "| |\n")
    changed = commit("del_bench/engine.py", "x = 2\n")
    code_of = reference["code_of"]
    assert code_of(code, tmp_path) == code_of(data, tmp_path) == code_of(more_data, tmp_path) != ""
    assert code_of(changed, tmp_path) != code_of(data, tmp_path)
    assert code_of("0" * 40, tmp_path) == ""  # a commit this clone does not have: other code
