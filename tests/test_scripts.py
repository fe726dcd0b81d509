"""Every bench script runs once, end to end, on the tiny random model (configs/model/tiny-random.yaml) with the
smallest sizes it takes, so a script that a change elsewhere broke (a TypeError in a bench script once went unnoticed
until a manual run) fails the suite. Each runs in this process through its `__main__` (runpy: the imports are
already warm); its figures are not checked, only that it runs to the end and writes what it says it writes."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from del_bench import runner
from tests.conftest import compose_run
from tests.test_exit_adapters import random_adapters

SCRIPTS_DIR = Path(__file__).resolve().parent.parent / "scripts"
TINY = "tiny-random"
# script: (its arguments, the file it writes); {tmp} is the test's temporary directory
SCRIPTS = {
    "bench_adapters.py": (["--adapters", "{tmp}/adapters", "--model", TINY, "--limit", "1", "--max-new-tokens", "8",
                           "--methods", "vanilla,ls", "--root", "{tmp}/runs", "--out", "{tmp}/out.json"],
                          "out.json"),
    "bench_compile.py": (["--models", TINY, "--context", "8", "--reps", "1", "--threads", "1", "--backend", "eager"],
                         None),
    "bench_controller.py": (["--model", TINY, "--prompts", "1", "--max-new-tokens", "8", "--vocab", "64",
                             "--threads", "1", "--every", "2", "--out", "{tmp}/out.json"], "out.json"),
    "bench_del.py": (["--model", TINY, "--tasks", "humaneval", "--limit", "1", "--max-new-tokens", "8",
                      "--grid", "1:2", "--del-methods", "del_cpu", "--root", "{tmp}/runs",
                      "--out", "{tmp}/out.json"], "out.json"),
    "bench_engine.py": (["--models", TINY, "--limit", "1", "--max-new-tokens", "8", "--probe-mb", "1",
                         "--threads", "1", "--layers", "eager", "--root", "{tmp}/runs", "--out", "{tmp}/out.json"],
                        "out.json"),
    "bench_engine_parts.py": (["--model", TINY, "--context", "8", "--threads", "1"], None),
    "bench_peer.py": (["--model", TINY, "--prompts", "1", "--max-new-tokens", "8", "--configs", "1:2",
                       "--threads", "1", "--out", "{tmp}/out.json"], "out.json"),
    "bench_sandbox.py": (["--trivial", "1", "--workers", "1", "--problems", "2", "--skip-rescore",
                          "--out", "{tmp}/out.json"], "out.json"),
    "bench_swift.py": (["--models", f"{TINY}:0.5", "--tasks", "humaneval", "--limit", "1", "--max-new-tokens", "8",
                        "--grid", "1:2", "--root", "{tmp}/runs", "--out", "{tmp}/out.json"], "out.json"),
    "check_half_lossless.py": (["--model", TINY, "--dtype", "bfloat16", "--prompts", "1", "--max-new-tokens", "8",
                                "--layers", "eager", "--out", "{tmp}/out.json"], "out.json"),
    "specbench_speed.py": (["{tmp}/method.jsonl", "{tmp}/baseline.jsonl"], None),
    "tag_experiments.py": (["smoke", "--records-root", "{tmp}/records"], None),
}
NOT_HERE = {  # scripts in scripts/ that this file does not run, and why
    "bench_gpu.py": "tests/test_bench_gpu.py",
    "bench_memory.py": "tests/test_memory.py (in a subprocess: it sets the process's malloc for measuring)",
    "freeze_constraints.py": "writes constraints.txt from the environment",
}


def run_script(name: str, args: list[str], monkeypatch) -> None:
    """scripts/<name> as `python scripts/<name> ARGS` would run it, in this process; the torch thread count and
    sys.path (a script may put scripts/ on it) are restored after."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS_DIR / name), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(SCRIPTS_DIR / name), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None), f"{name} exited with {done.code}"
    finally:
        torch.set_num_threads(threads)


def prepare(name: str, tmp) -> None:
    """What a script reads, made here: exit adapters, Spec-Bench answer files, a finished run to tag."""
    if name == "bench_adapters.py":
        agreement = {"agreement": [0.3, 0.5, 0.7]}
        random_adapters(64).save(tmp / "adapters", {"model": {"name": TINY, "num_layers": 4}, "layers": [1, 2, 3],
                                                    "agreement": {"own_head": agreement, "final": agreement}})
    elif name == "specbench_speed.py":
        for file, seconds in (("method.jsonl", 1.0), ("baseline.jsonl", 2.0)):
            answers = [{"question_id": i, "category": category, "choices": [
                {"index": 0, "turns": ["an answer"], "new_tokens": [8], "wall_time": [seconds],
                 "accept_lengths": [2, 3, 3]}]} for i, category in enumerate(("writing", "translation"))]
            (tmp / file).write_text("".join(json.dumps(a) + "\n" for a in answers))
    elif name == "tag_experiments.py":  # the smoke sweep's run, made without its experiment name
        cfg = compose_run("experiment=smoke", f"records_root={tmp / 'records'}", "experiment_name=null", "threads=1",
                          "warmup_tokens=0")
        runner.run(cfg)
        (tmp / "run_dir").write_text(cfg.out_dir)


def test_every_script_is_run_here():
    scripts = {p.name for p in SCRIPTS_DIR.glob("*.py")}
    assert scripts - set(NOT_HERE) == set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_runs_on_the_tiny_model(name, tmp_path, monkeypatch, capsys):
    args, writes = SCRIPTS[name]
    prepare(name, tmp_path)
    run_script(name, [a.format(tmp=tmp_path) for a in args], monkeypatch)
    out = capsys.readouterr().out
    if writes:
        assert json.loads((tmp_path / writes).read_text())
    if name == "specbench_speed.py":  # method 8 tokens/s, baseline 4: speedup 2 on every selection it has
        assert "2.0000" in out and "(no questions)" in out
    if name == "tag_experiments.py":
        assert "smoke: 1 jobs, 1 finished runs tagged, 0 not composable here" in out
        summary = json.loads((Path((tmp_path / "run_dir").read_text()) / "summary.json").read_text())
        assert summary["run_key"]["experiments"] == ["smoke"]
