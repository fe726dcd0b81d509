"""The install contract: pyproject.toml's ranges admit the exact set tested together (constraints.txt), and that
set pins every declared dependency — so `make setup` installs what the suite ran on, and a CUDA environment keeps
its torch."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11

ROOT = Path(__file__).resolve().parent.parent


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in project.get("optional-dependencies", {}).values() for r in group]
    return [Requirement(r) for r in [*project["dependencies"], *extras]]


def pinned() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_every_dependency_is_pinned_inside_its_range():
    pins = pinned()
    for req in declared():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared but not in constraints.txt (make constraints)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req} excludes the tested {pins[name]}"


def test_ranges_not_pins_and_torch_accepts_other_builds():
    """A range keeps a CUDA environment's torch; constraints.txt pins torch without a local label (+cpu)."""
    torch = next(r for r in declared() if r.name == "torch")
    assert torch.specifier.contains("2.14.1") and not torch.specifier.contains("2.4.1")
    assert not any(s.operator == "==" for r in declared() for s in r.specifier)
    assert pinned()["torch"] == "2.13.0"
