"""The processes of one judgement: the program and its judge, started, waited on within their deadlines, ended.

The program's side (bwrap, or the fallback's interpreter) is started by the Sandbox (del_bench/sandbox/box.py); here
the judge is started on the program's pipes (`judged`), and the harness waits for its verdict: at most the program's
start-up (`GRACE_S` + `timeout`), then `timeout` from when the program was ready, each plus `JUDGE_GRACE_S` for the
judge's own last work. A judge still busy then is killed: "timed out". Whatever happens, both are killed and reaped
(`end`): nothing they started is left behind, no zombie and no orphan for init to reap.
"""

from __future__ import annotations

import json
import math
import os
import signal
import site
import subprocess
import sys
import time
from typing import Any

from del_bench.sandbox.base import GRACE_S, JUDGE_GRACE_S, MINIMAL_ENV, Limits, SandboxError
from del_bench.sandbox.judge import Broken, Channel, judge_source


def start(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """`cmd` in a new session (its own process group, for `end`), its standard streams piped unless `popen` says."""
    streams = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(cmd, start_new_session=True, **streams)


def judged(proc: subprocess.Popen, problem: dict[str, Any], job: dict, timeout: float, began: float,
           limits: Limits) -> str:
    """Start the judge on the program's pipes, and wait for its verdict: at most the program's start-up
    (`GRACE_S` + `timeout` from `began`, when it was started), then `timeout` from when it was ready, each plus
    `JUDGE_GRACE_S`. A judge still busy then (a reply that is costly to decode or to test) is killed: "timed out"."""
    deadline = began + timeout + GRACE_S
    read, write = proc.stdout.fileno(), proc.stdin.fileno()
    judge = start([sys.executable, "-I", "-S", "-c", judge_source()], env=MINIMAL_ENV, pass_fds=(read, write),
                  stderr=subprocess.DEVNULL)
    proc.stdout.close()  # the judge alone talks with the program now
    proc.stdin.close()
    cpu = math.ceil(timeout + GRACE_S + JUDGE_GRACE_S) + 1
    task = {"read": read, "write": write, "deadline": deadline, "timeout": timeout, "job": job, "problem": problem,
            "memory": limits.memory_mb << 20, "cpu": cpu, "path": _site_paths()}
    try:
        judge.stdin.write((json.dumps(task) + "\n").encode())
        judge.stdin.close()
        listen = Channel(judge.stdout.fileno(), -1, deadline + JUDGE_GRACE_S, limit=1 << 20)
        message = listen.receive()
        if message == {"ready": True}:
            listen.deadline = time.monotonic() + timeout + JUDGE_GRACE_S
            message = listen.receive()
    except Broken as broken:
        return broken.verdict or "failed: sandbox: the judge ended without a verdict"
    except OSError:  # its input closed: it died at once
        return "failed: sandbox: the judge ended without a verdict"
    finally:
        judge.kill()
        judge.wait()
        judge.stdout.close()
    if "error" in message:
        raise SandboxError(f"judging a program failed: {message['error']}")
    verdict = message.get("verdict")
    return str(verdict)[:1000] if verdict is not None else _ended(proc, deadline)


def _ended(proc: subprocess.Popen, deadline: float) -> str:
    """The verdict on a program whose output ended: how it ended, from its exit status or bwrap's error."""
    try:
        proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        return "failed: sandbox: the program closed its output"
    err = _read_now(proc.stderr.fileno()).decode(errors="replace").strip().splitlines()[-1:]
    code = proc.returncode
    how = f"signal {-code}" if code < 0 else f"exit status {code}"
    return f"failed: sandbox: the program ended without a result ({err[0][:300] if err else how})"


def end(proc: subprocess.Popen, info_fd: int | None) -> None:
    """Kill the program and reap what ran it. Under bwrap the program is bwrap's child (its pid from --info-fd):
    killed first, it is reaped by bwrap, which then exits and is reaped here (killing bwrap first would leave an
    orphan for init to reap, or a zombie where nothing does)."""
    if info_fd is not None:
        try:
            pid = json.loads(_read_now(info_fd))["child-pid"]
            if proc.poll() is None:
                os.kill(pid, signal.SIGKILL)  # not reaped (bwrap is alive until it is), so the pid is still its own
        except (ValueError, KeyError, TypeError, ProcessLookupError, PermissionError):
            pass
    else:
        proc.kill()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            stream.close()
        except OSError:
            pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _site_paths() -> list[str]:
    """This Python's package directories: the judge's tests may import from them, as they could in the harness."""
    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def _read_now(fd: int, limit: int = 1 << 16) -> bytes:
    """Whatever `fd` holds now (at most `limit` bytes), without waiting."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except (BlockingIOError, OSError):
        return b""
