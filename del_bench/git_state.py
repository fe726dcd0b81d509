"""The code a process runs, as git sees it (a run's and a bench's `provenance`): read once per process, when it starts
measuring — the CLI asks before any command that measures, before a model loads — so that a commit made while a run
decodes does not relabel what it measured. Kept apart from the runner so that asking costs no import: asked where a
bench started instead (its modules and the runner imported, no model yet), git's fork moved the memory bench's peak
RSS by ±8 MiB from run to run (tests/test_memory.py failed); asked first thing, it did not in five runs."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def code_state() -> tuple[str | None, bool]:
    """(the commit, whether the code differed from it) as this process found them first."""
    return git(REPO, "rev-parse", "--verify", "HEAD") or None, git_dirty(REPO)


def git(repo: Path, *args) -> str:
    """A git command's output in `repo` ("" where git fails or is missing)."""
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def git_dirty(repo: Path) -> bool:
    """Whether the code differs from the commit: any tracked file changed or untracked file added (ignored ones
    aside), outside results/ — the records and tables written there are data, committed apart from code."""
    return bool(git(repo, "status", "--porcelain", "--", ".", ":(exclude)results"))
