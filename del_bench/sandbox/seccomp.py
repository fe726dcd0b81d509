"""The seccomp filter every sandboxed program loads before it runs: what it may not ask of the kernel.

Built with libseccomp (PyPI pyseccomp) and exported as a BPF program (hex) the worker loads itself (after
PR_SET_NO_NEW_PRIVS): no new processes (fork, vfork, clone without CLONE_THREAD; threads are fine), no exec, no
memfd, SysV IPC, POSIX message queues, io_uring, userfaultfd, bpf, ptrace, process_vm_*, kcmp, pidfd calls or
namespaces, no sockets (`DENIED`); nothing aimed at another process: signals only to itself (`SIGNALS`), no
file-descriptor owner (the routes by which the kernel signals a pid for I/O), and the calls naming a pid on itself
only (`SELF_ONLY`). A denied call fails with EPERM (clone3 with ENOSYS, so that glibc falls back to clone, whose
flags the filter can read).
"""

from __future__ import annotations

import errno
import functools
import tempfile
from typing import Any

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
