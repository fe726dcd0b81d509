"""A del_bench CLI command that kills its own process (SIGKILL: no clean-up, no exception) at a chosen point, for
the resume tests in tests/test_runner.py:

    python -m tests.killed_run POINT K run key=value …

POINT  decoded            after the K-th generation ends (Engine.finish), before anything of that sample is written
       method_state.json  after the K-th atomic write of method_state.json (os.replace), before the sample's records
       rounds.jsonl       after the K-th fsync of rounds.jsonl, before the sample's line (between the two appends)
       samples.jsonl      after the K-th fsync of samples.jsonl (all of the sample written)

The points are found from outside the runner (a call returning; os.fsync of, or os.replace onto, a named file), so
the runner carries no test hook; a point the run never reaches shows as a normal exit, which the tests reject
(they expect −9)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def kill_on_hit(k: int):
    """A callable that SIGKILLs this process the k-th time it is called."""
    hits = 0

    def hit() -> None:
        nonlocal hits
        hits += 1
        if hits == k:
            os.kill(os.getpid(), signal.SIGKILL)

    return hit


def after_generate(hit) -> None:
    from del_bench.engine.decode import Engine

    finish = Engine.finish

    def finish_then_hit(self, *args, **kwargs):
        out = finish(self, *args, **kwargs)
        hit()
        return out

    Engine.finish = finish_then_hit


def after_writing(name: str, hit) -> None:
    """hit() after each os.fsync of a file called `name` and each os.replace onto one (RunDir's two ways to write)."""
    fsync, replace = os.fsync, os.replace

    def fsync_then_hit(fd: int) -> None:
        fsync(fd)
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name == name:
            hit()

    def replace_then_hit(src, dst, **kwargs) -> None:
        replace(src, dst, **kwargs)
        if Path(dst).name == name:
            hit()

    os.fsync, os.replace = fsync_then_hit, replace_then_hit


def main(point: str, k: str, *command: str) -> int:
    hit = kill_on_hit(int(k))
    if point == "decoded":
        after_generate(hit)
    else:
        after_writing(point, hit)
    from del_bench.__main__ import main as del_bench_main

    sys.argv = ["del_bench", *command]
    return del_bench_main()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
