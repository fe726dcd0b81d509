#!/usr/bin/env python3
"""make reference: the committed reference records re-measured — every experiment the tables and figures read, on
both local models, and the benches the README cites — into results/reference, from a clean tree.

    python scripts/reference.py [--root results/reference] [--retries 2] [--steps a,b] [--list] [--keep-old]

- Refuses to start when the code differs from its commit (git_state.git_dirty: records under results/ do not count):
  every run must say which code measured it.
- Records measured by other code are removed first (git keeps them; `--keep-old` keeps them, and they are then
  re-used as finished runs), except `gpu/`, which no CPU can re-measure. Code is the commit's tree with results/ left
  out: a results-only commit (the reference itself, committed apart from code) keeps the records it made.
- Runs the steps in order (STEPS: `calibrate`/`run -m experiment=… scale=local` per model, then the benches through
  their make targets with RECORDS=ROOT), each resumable: a finished run is skipped, a partial one resumed.
- After each step, the runs it made that were timed on a busy machine, not at steady state, or whose speedup pairs
  two states of the machine (§: records.drifted, against their Vanilla partners) are removed with those partners
  and the step runs again, at most --retries times; then it stops and names them (exit 1).
- Prints each step's progress and an estimate of the time left (the mean time of the steps done × the steps left); a
  progress file (ROOT/.reference.json) keeps the steps done by this code and their seconds, so a rerun goes on where
  an interrupted one stopped.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from del_bench.git_state import git, git_dirty
from del_bench.report.collect import load_runs

REPO = Path(__file__).resolve().parent.parent

MODELS = ("smollm2-135m", "testbed")
# what each experiment's local sweep is (configs/experiment/*.yaml): calibration first (fig1a reads its best points)
EXPERIMENTS = ("fig1a_calibrate", "table1", "table2", "table3", "table4", "table5", "table6", "fig1a", "fig3", "fig3b",
               "fig4")
BENCHES = ("bench-del", "bench-testbed", "bench-controller", "bench-peer", "bench-sandbox", "bench-synthetic",
           "bench-batch")


def table1_local() -> tuple[list[str], int, int]:
    """Table 1's tasks and, at scale=local, its prompts and new tokens (configs/experiment/table1.yaml): what its peer
    rows are measured on, so that they pair with its Vanilla."""
    text = (REPO / "configs" / "experiment" / "table1.yaml").read_text()
    tasks = re.search(r"^\s+task: (\S+)", text, re.M).group(1).split(",")
    local = [int(re.search(rf"^{key}: \$\{{at_scale:[^,]+,(\d+)\}}", text, re.M).group(1))
             for key in ("limit", "max_new_tokens")]
    return tasks, *local


@dataclass
class Step:
    name: str
    argv: list[str]
    experiment: str | None = None  # the run_key.experiments tag its runs carry (None: a bench's own tag)
    model: str | None = None
    benches: tuple[str, ...] = ()  # a bench's result files under ROOT/bench


def steps(root: str, python: str = sys.executable) -> list[Step]:
    """The reference's steps, in order."""
    run = [python, "-m", "del_bench"]
    tasks, limit, max_new_tokens = table1_local()
    out = []
    for model in MODELS:
        for name in EXPERIMENTS:
            command = "calibrate" if name.endswith("_calibrate") else "run"
            out.append(Step(f"{name}:{model}", [*run, command, "-m", f"experiment={name}", "scale=local",
                                                f"model={model}", f"records_root={root}"], f"{name}_local", model))
        for task in tasks:  # Table 1's peer rows (†): transformers' own decoding, per task, by bench peer
            peers = f"{root}/local/{model}/{task}/peers/max{max_new_tokens}"  # a new length: new runs, not a conflict
            out.append(Step(f"table1-peers:{model}:{task}", [
                *run, "bench", "peer", "--model", model, "--task", task, "--limit", str(limit),
                "--max-new-tokens", str(max_new_tokens), "--experiment", "table1_local", "--root", peers,
                "--out", f"{peers}/peer.json"], "table1_local", model))
    out.append(Step("specbench:smollm2-135m", [*run, "run", "-m", "experiment=specbench", "scale=local",
                                               f"records_root={root}"], "specbench_local", "smollm2-135m"))
    for target in BENCHES:
        name = target.removeprefix("bench-")
        results = ("synthetic_a0.6.json", "synthetic_a0.9.json") if name == "synthetic" else (f"{name}.json",)
        out.append(Step(target, ["make", target, f"RECORDS={root}"], f"bench-{name}", benches=results))
    return out


def bad_runs(root: Path, step: Step) -> list[str]:
    """The run directories of a step's runs (and their Vanilla partners) that cannot be kept: timed busy, not at
    steady state, or drifted against their partners."""
    df = load_runs([root])
    if df.empty:
        return []
    mine = df[pd.Series([step.experiment in (e or ()) for e in df["experiments"]], index=df.index)]
    if step.model:
        mine = mine[mine["model"].str.startswith(step.model)]
    flagged = mine[(mine["busy_samples"] > 0) | mine["unsteady"] | mine["drifted"]]
    bad = set(flagged["run_dir"])
    for _, row in flagged.iterrows():  # re-measure a drifted run together with its Vanilla partners
        if row["drifted"]:
            bad.update(r["run_dir"] for r in df.to_dict("records")
                       if r["method"] == "vanilla" and row["run_key"].pairs_with(r["run_key"]))
    return sorted(bad)


def bad_bench_rows(root: Path, step: Step) -> list[str]:
    """A bench's rows marked busy, unsteady or § in its result files."""
    rows = [r for name in step.benches if (root / "bench" / name).is_file()
            for r in json.loads((root / "bench" / name).read_text()).get("rows") or []]
    return [r.get("row", "?") for r in rows if r.get("busy_samples") or r.get("unsteady") or r.get("drifted")]


def run_step(step: Step, root: Path, retries: int) -> list[str]:
    """Run a step until its runs can all be kept (at most retries + 1 times): what still cannot, else []."""
    for attempt in range(retries + 1):
        print(f"  $ {' '.join(step.argv)}" + (f"   (again: attempt {attempt + 1})" if attempt else ""), flush=True)
        done = subprocess.run(step.argv, cwd=REPO)
        if done.returncode != 0:
            return [f"the step exited {done.returncode}"]
        if step.benches:
            bad = bad_bench_rows(root, step)
            if bad:  # a bench re-measures all its rows together (they are interleaved)
                for name in step.benches:
                    shutil.rmtree(root / "bench" / name.replace(".json", "_runs"), ignore_errors=True)
        else:
            bad = bad_runs(root, step)
            for run_dir in bad:
                shutil.rmtree(run_dir, ignore_errors=True)
        if not bad:
            return []
        print(f"  {len(bad)} not kept (busy, unsteady or §): {', '.join(map(str, bad[:6]))}"
              + (" …" if len(bad) > 6 else ""), flush=True)
    return bad


@functools.cache
def code_of(commit: str, repo: Path = REPO) -> str:
    """The code a commit holds: a digest of its tree without results/ ("" where git does not know the commit). Two
    commits that differ only in results/ hold the same code."""
    entries = [line for line in git(repo, "ls-tree", commit).splitlines() if line.split("\t")[-1] != "results"]
    return hashlib.sha1("\n".join(entries).encode()).hexdigest() if entries else ""


def measured_by_other_code(provenance: dict, code: str) -> bool:
    return code_of(provenance.get("git_commit") or "") != code


def clear_old(root: Path, code: str) -> None:
    """Remove records that other code measured (git keeps them), `gpu/` apart."""
    for summary in list(root.rglob("summary.json")):  # listed first: rglob walks lazily into what is removed
        provenance = json.loads(summary.read_text()).get("provenance") or {}
        if measured_by_other_code(provenance, code) and "gpu" not in summary.relative_to(root).parts[:1]:
            shutil.rmtree(summary.parent, ignore_errors=True)
    for result in (root / "bench").glob("*.json"):
        if measured_by_other_code(json.loads(result.read_text()).get("provenance") or {}, code):
            result.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/reference.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="results/reference")
    ap.add_argument("--retries", type=int, default=2, help="re-measures of a step whose runs cannot be kept")
    ap.add_argument("--steps", default=None, help="comma-separated step names: only these")
    ap.add_argument("--list", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--keep-old", action="store_true", help="keep records other code measured (re-used as finished)")
    args = ap.parse_args(argv)
    plan = steps(args.root)
    if args.steps:
        wanted = set(args.steps.split(","))
        unknown = wanted - {s.name for s in plan}
        if unknown:
            ap.error(f"unknown steps {', '.join(sorted(unknown))}; --list shows them")
        plan = [s for s in plan if s.name in wanted]
    if args.list:
        print("\n".join(f"{s.name}: {' '.join(s.argv)}" for s in plan))
        return 0
    if git_dirty(REPO):
        print("the code differs from its commit (git status, results/ aside): commit it first, so that every run "
              "says which code measured it", file=sys.stderr)
        return 2
    commit = git(REPO, "rev-parse", "HEAD")
    code = code_of(commit)
    root = REPO / args.root
    progress_file = root / ".reference.json"
    progress = json.loads(progress_file.read_text()) if progress_file.is_file() else {}
    if progress.get("code") != code:
        progress = {"commit": commit, "code": code, "done": {}}
        if not args.keep_old:
            clear_old(root, code)
    t0 = time.monotonic()
    for i, step in enumerate(plan, 1):
        if step.name in progress["done"]:
            continue
        print(f"[{i}/{len(plan)}] {step.name}  — {eta(progress, plan)}", flush=True)
        started = time.monotonic()
        bad = run_step(step, root, args.retries)
        if bad:
            print(f"stopped at {step.name}: {len(bad)} runs still busy, unsteady or § after {args.retries} re-measures "
                  f"({', '.join(map(str, bad[:10]))}); run on a quiet machine, then again", file=sys.stderr)
            return 1
        progress["done"][step.name] = round(time.monotonic() - started, 1)
        root.mkdir(parents=True, exist_ok=True)
        progress_file.write_text(json.dumps(progress, indent=1) + "\n")
    print(f"reference done in {(time.monotonic() - t0) / 3600:.2f} h this invocation "
          f"({sum(progress['done'].values()) / 3600:.2f} h over all of this code's invocations); now: make tables "
          "figures, and commit results/ apart from code")
    return 0


def eta(progress: dict, plan: list[Step]) -> str:
    """The time left, estimated from the steps done: their mean seconds × the steps left."""
    done = [progress["done"][s.name] for s in plan if s.name in progress["done"]]
    left = sum(s.name not in progress["done"] for s in plan)
    if not done:
        return f"{left} steps left"
    return f"{left} steps left, about {sum(done) / len(done) * left / 3600:.1f} h"


if __name__ == "__main__":
    sys.exit(main())
