"""What every part of the sandbox shares: a program's resource limits, the time past its own limit, the environment
processes start with, and the error raised when a sandbox cannot be had."""

from __future__ import annotations

import math
from dataclasses import dataclass

GRACE_S = 2.0  # beyond the program's own time limit: sandbox start-up, the interpreter, the guard's imports
JUDGE_GRACE_S = 0.5  # beyond the program's time: the judge's last work on a reply before it must have a verdict
MINIMAL_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # all that bwrap itself (and its PID 1) inherits


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
