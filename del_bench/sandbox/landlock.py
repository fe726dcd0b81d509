"""Landlock, the fallback's file-system wall: a ruleset that lets the program read its view and write its own
temp dir, and nothing else (Linux >= 5.13, unprivileged; del_bench/sandbox/box.py builds it, the worker enforces it).

Since ABI 4 it also denies TCP bind and connect, since ABI 6 it scopes signals and abstract UNIX sockets to the
program itself; Landlock always forbids tracing a process outside its domain.
"""

from __future__ import annotations

import ctypes
import functools
import os
import stat
from typing import Iterable

# The kernel's interface (linux/landlock.h): three system calls, the same numbers on every architecture.
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
RULE_PATH_BENEATH, CREATE_RULESET_VERSION = 1, 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_DIR, MAKE_REG = 1 << 4, 1 << 5, 1 << 7, 1 << 8
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # all a rule on a file (not a directory) holds
READ = EXECUTE | READ_FILE | READ_DIR
WRITE = READ | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | REFER | TRUNCATE
NET_ALL = 0b11  # ABI 4: bind and connect on TCP ports (no rule: none)
SCOPE_ALL = 0b11  # ABI 6: abstract UNIX sockets and signals, to the program's own domain only
DEVICES = (("/dev/null", READ_FILE | WRITE_FILE), ("/dev/zero", READ_FILE), ("/dev/urandom", READ_FILE),
           ("/dev/random", READ_FILE))


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # packed in the kernel's header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _syscall(*args: int | ctypes._Pointer | None) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


@functools.lru_cache(maxsize=1)
def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (before 5.13, or not enabled)."""
    try:
        return _syscall(CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    except OSError:
        return 0


def landlock_ruleset(rules: Iterable[tuple[str, int]], abi: int | None = None) -> int:
    """A Landlock ruleset (its fd) that allows `rules` ((path, access) pairs, each for the hierarchy beneath) and
    nothing else of the file system, no TCP, and (ABI >= 6) signals and abstract sockets only inside its domain."""
    abi = landlock_abi() if abi is None else abi
    fs = (1 << 13) - 1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0) | (IOCTL_DEV if abi >= 5 else 0)
    attr = _RulesetAttr(fs, NET_ALL if abi >= 4 else 0, SCOPE_ALL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = _syscall(CREATE_RULESET, ctypes.byref(attr), size, 0)
    try:
        for path, access in rules:
            _allow(fd, path, access & fs)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _allow(ruleset: int, path: str, access: int) -> None:
    try:
        target = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:  # gone, or beyond this user's reach: not allowed
        return
    try:
        if not stat.S_ISDIR(os.fstat(target).st_mode):
            access &= FILE_RIGHTS
        if access:
            _syscall(ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(_PathBeneathAttr(access, target)), 0)
    finally:
        os.close(target)


__all__ = ["landlock_abi", "landlock_ruleset", "READ", "WRITE", "DEVICES", "READ_FILE", "READ_DIR"]
