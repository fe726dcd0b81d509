"""Every bench (`python -m del_bench bench NAME`) runs once, end to end, on the tiny random model
(configs/model/tiny-random.yaml) at the smallest sizes it takes, so a bench a change elsewhere broke fails the
suite; so do the tools left in scripts/. The benches run in this process (the imports are already warm). Beyond
running: what a bench prints is recomputable from the records it wrote, and a peer row (transformers decoding) is a
run like ours — its records pair with our Vanilla and hold the work its hooks counted."""

from __future__ import annotations

import argparse
import json
import re
import runpy
import statistics
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from del_bench import bench, runner
from del_bench.__main__ import cmd_show
from del_bench.bench import harness
from del_bench.bench import sandbox as bench_sandbox
from del_bench.bench.engine import ON_ACCEPTANCE
from del_bench.errors import ConfigError
from del_bench.methods.peers import cut
from del_bench.records import PEER_NOTE, RunKey, method_label, read_jsonl
from del_bench.report import render
from del_bench.report.render import Table, TableRow
from del_bench.sandbox import SandboxError
from tests.conftest import compose_run
from tests.test_exit_adapters import random_adapters

REPO = Path(__file__).resolve().parent.parent
TINY = "tiny-random"
RUNS = ["--root", "{tmp}/runs", "--set", "layers=eager", "threads=1", "warmup_tokens=2"]  # eager: no fused build
# bench: its arguments beyond --out; {tmp} is the test's temporary directory
BENCHES = {
    "adapters": ["--adapters", "{tmp}/adapters", "--model", TINY, "--limit", "1", "--max-new-tokens", "8",
                 "--methods", "vanilla,ls", *RUNS],
    "batch": ["--models", TINY, "--batch-sizes", "1,2", "--limit", "2", "--max-new-tokens", "6", *RUNS],
    "compile": ["--models", TINY, "--context", "8", "--reps", "1", "--threads", "1", "--backend", "eager",
                "--no-fused"],
    "controller": ["--model", TINY, "--limit", "1", "--max-new-tokens", "8", "--vocab", "64", "--every", "2", *RUNS],
    "del-stop": ["--device", "cpu", "--shape", "tiny", "--budget", "4", "--stops", "1,3", "--reps", "1"],
    "graph-reads": ["--model", TINY, "--prompts", "1", "--max-new-tokens", "8", "--batch", "2", "--threads", "1"],
    "del-trace": ["{tmp}/del_run"],
    "del": ["--model", TINY, "--tasks", "humaneval", "--limit", "2", "--max-new-tokens", "8", "--grid", "1:2",
            "--del-methods", "del_cpu", *RUNS],
    "engine": ["--models", TINY, "--limit", "1", "--max-new-tokens", "8", "--probe-mb", "1", "--layers", "eager",
               "--root", "{tmp}/runs", "--set", "threads=1", "warmup_tokens=2"],
    "half-lossless": ["--model", TINY, "--dtype", "bfloat16", "--prompts", "1", "--max-new-tokens", "8",
                      "--layers", "eager"],
    "parts": ["--model", TINY, "--context", "8", "--threads", "1", "--reps", "1", "--loops", "eager"],
    "peer": ["--model", TINY, "--limit", "2", "--max-new-tokens", "8", "--configs", "1:2", *RUNS],
    "profile": ["--limit", "2", "--max-new-tokens", "4", "--top", "3", "--set", f"model={TINY}", "layers=eager",
                "threads=1", "warmup_tokens=2"],
    "segments": ["--model", "synthetic-testbed", "--limit", "1", "--max-new-tokens", "8", "--grid", "1:2,2:2",
                 "--prompt-len", "8", "--ablations", "", "--root", "{tmp}/runs", "--set", "layers=eager", "threads=1",
                 *(f"++model.{k}" for k in ("num_layers=4", "hidden_size=64", "num_heads=4", "num_kv_heads=2",
                                          "intermediate_size=128", "vocab_size=512", "tokenizer=bytes",
                                          "default_exit_layer=2", "calibration_prompts=4", "calibration_tokens=8",
                                          "segment_tokens=4"))],
    "sandbox": ["--trivial", "1", "--workers", "1", "--problems", "2", "--skip-rescore"],
    "specbench-speed": ["{tmp}/method.jsonl", "{tmp}/baseline.jsonl"],
    "swift": ["--models", f"{TINY}:0.5", "--tasks", "humaneval", "--limit", "1", "--max-new-tokens", "8",
              "--grid", "1:2", *RUNS],
}
NOT_HERE = {  # benches this file does not run, and why
    "ab": "test_the_ab_bench_interleaves_the_sides_and_compares_round_by_round (it runs a git worktree's code)",
    "gpu": "tests/test_bench_gpu.py",
    "memory": "tests/test_memory.py (in a subprocess: it sets the process's malloc for measuring)",
}
SCRIPTS = {"tag_experiments.py": ["smoke", "--records-root", "{tmp}/records"]}
SCRIPTS_NOT_HERE = {"freeze_constraints.py": "writes constraints.txt from the environment",
                    "gpu_node.py": "tests/test_gpu_node.py (make gpu-check, make gpu-wheels)",
                    "del_authors_compare.py": "tests/test_del_authors_compare.py (drive needs the DEL authors' code)",
                    "per_prompt.py": "tests/test_gpu_node.py (finished runs' tok/s prompt by prompt)",
                    "reference.py": "tests/test_reference.py (make reference: hours of decoding)"}


def run_bench(name: str, tmp: Path) -> dict:
    """`python -m del_bench bench NAME ARGS --out tmp/out.json` in this process (torch's threads restored after);
    → the result file."""
    threads = torch.get_num_threads()
    try:
        assert bench.main([name, *(a.format(tmp=tmp) for a in BENCHES[name]), "--out", str(tmp / "out.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((tmp / "out.json").read_text())


def prepare(name: str, tmp: Path) -> None:
    """What a bench reads, made here: exit adapters, Spec-Bench answer files."""
    if name == "adapters":
        agreement = {"agreement": [0.3, 0.5, 0.7]}
        random_adapters(64).save(tmp / "adapters", {"model": {"name": TINY, "num_layers": 4}, "layers": [1, 2, 3],
                                                    "agreement": {"own_head": agreement, "final": agreement}})
    elif name == "del-trace":  # a hand-built DEL run's records (tests/test_del_trace.py)
        from tests.test_del_trace import ROUNDS, write_run

        write_run(tmp / "del_run", [r for r, _, _ in ROUNDS])
    elif name == "specbench-speed":
        for file, seconds in (("method.jsonl", 1.0), ("baseline.jsonl", 2.0)):
            answers = [{"question_id": i, "category": category, "choices": [
                {"index": 0, "turns": ["an answer"], "new_tokens": [8], "wall_time": [seconds],
                 "accept_lengths": [2, 3, 3]}]} for i, category in enumerate(("writing", "translation"))]
            (tmp / file).write_text("".join(json.dumps(a) + "\n" for a in answers))


def samples(out_dir: str) -> list[dict]:
    return read_jsonl(Path(out_dir) / "samples.jsonl")


def mean_speed(out_dir: str) -> float:
    """tok/s of a run recomputed from its samples with json alone: generated tokens ÷ wall seconds, mean over them."""
    return statistics.fmean(s["generated_tokens"] / s["wall_s"] for s in samples(out_dir))


def test_every_bench_is_run_here_and_listed():
    assert set(bench.BENCHES) == set(BENCHES) | set(NOT_HERE)
    modules = {p.stem for p in (REPO / "del_bench" / "bench").glob("*.py")} - {"__init__", "harness", "peers", "syncs"}
    assert modules == set(bench.BENCHES.values())  # no bench module outside the listing
    listing = bench.listing().splitlines()
    assert [line.split()[0] for line in listing] == list(bench.BENCHES)
    assert all(len(line.split()) > 3 for line in listing)  # each with its line


def test_no_bench_script_is_left_and_make_calls_the_benches():
    left = {p.name for p in (REPO / "scripts").iterdir() if p.name != "__pycache__"}  # bytecode: where Python writes it
    assert left == {*SCRIPTS, *SCRIPTS_NOT_HERE, "smoke_tasks.sh"}
    makefile = (REPO / "Makefile").read_text()
    called = set(re.findall(r"^\t.*-m del_bench bench ([\w-]+)", makefile, re.M))  # in recipes
    assert called == set(bench.BENCHES) - {"specbench-speed"}  # it compares two answer files you exported
    assert "scripts/bench_" not in makefile + (REPO / "README.md").read_text()


def test_the_ab_bench_interleaves_the_sides_and_compares_round_by_round():
    """bench ab: each round runs every row on both sides, the side going first alternating; a row's ratio is the
    median over rounds of this ÷ base. Mutant caught: the same side first every round."""
    from del_bench.bench import ab

    calls = []

    def decode(side, model, method, k):
        calls.append((side, model, k))
        speed = {"this": 11.0, "base": 10.0}[side] * (1 + k)  # the machine drifts: both sides alike within a round
        return {"tokens_per_s": speed, "etpl": 0.1, "busy": 0}

    table = ab.compared(ab.interleaved([("m", "ls"), ("m", "vanilla")], 3, decode))
    assert [c[0] for c in calls[:4]] == ["this", "base", "this", "base"]
    assert [c[0] for c in calls[4:8]] == ["base", "this", "base", "this"]
    assert table["m:ls"]["ratio_median"] == pytest.approx(1.1) and table["m:ls"]["etpl_equal"]


def test_the_ab_bench_says_why_a_run_failed(tmp_path):
    """A side's run that exits non-zero stops the bench with the run's own last log lines (they were swallowed)."""
    from del_bench.bench import ab

    args = argparse.Namespace(limit=1, max_new_tokens=4)
    with pytest.raises(SystemExit, match=r"exited 2:[\s\S]*no-such-model"):
        ab.decode(ab.ROOT, "no-such-model", "vanilla", tmp_path / "run", args)


def test_no_sys_path_edits_in_the_repo():
    edits = [str(p) for d in ("del_bench", "scripts", "tests") for p in (REPO / d).rglob("*.py")
             if re.search(r"sys\.path\.(insert|append)|sys\.path\s*=|sys\.path\s*\+=", p.read_text())]
    assert edits == []


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_runs_on_the_tiny_model(name, tmp_path, capsys):
    prepare(name, tmp_path)
    result = run_bench(name, tmp_path)
    out = capsys.readouterr().out
    assert result["bench"] == name and result["provenance"]
    if name == "specbench-speed":  # method 8 tokens/s, baseline 4: speedup 2 on every selection it has
        assert "2.0000" in out and "(no questions)" in out
    if name == "engine":  # host syncs per row, counted independently after the timed rows (bench/syncs.py)
        syncs = result["models"][0]["host_syncs"]
        rows = [r["row"] for r in result["models"][0]["rows"]]  # DEL's also with its statistics on acceptance
        assert [r["row"] for r in syncs] == [x for r in rows for x in (r, r + ON_ACCEPTANCE)[: 1 + r.startswith("DEL")]]
        assert all(r["total"] >= r["rounds"] > 0 for r in syncs) and "host syncs" in out
    if name == "controller":  # the false-match figure printed is the sum of its per-layer counts (test_false_matches)
        for twin, summary in result["vocab_matches"].items():
            layers = summary["layers"]
            false, positions = (sum(x[k] for x in layers) for k in ("false_matches", "positions"))
            assert positions > 0 and f"{twin}: false matches" in out
            assert f"{false} of {positions} layer-positions" in out and summary["missed_matches"] == 0
    if name == "segments":  # both profiles, DEL judged against the best LS, every row's outputs Vanilla's
        assert [r["profile"] for r in result["results"]] == ["segments", "uniform"]
        assert all(r["del_over_best_ls"] and r["synthetic"]["exit_layer"] == 2 for r in result["results"])
        assert {t["lossless"] for r in result["results"] for t in r["rows"]} == {"1/1"}
    if name in ("del", "peer"):
        check_recomputable(result["rows"], out)
        check_interleaved(result["rows"], limit=2)
    if name == "peer":
        check_peer_records(result["rows"])
        assert cmd_show([r["out_dir"] for r in result["rows"]]) == 0  # `show` lists the peers as marked rows
        shown = capsys.readouterr().out
        assert "HF generate†" in shown and "HF assistant_early_exit(E1-γ2)†" in shown and PEER_NOTE in shown
        assert "HF generate† drafted no token" not in shown  # a peer has no policy to explain


def test_the_sandbox_bench_measures_the_fallback_with_an_interpreter_it_can_run(monkeypatch, capsys):
    """As root the fallback runs programs as a private uid, which cannot run an interpreter under /root: the bench
    goes on to the system's of this version, and says which it measured."""
    class Fallback:
        def __init__(self, mode, allow_root_fallback, python):
            if python == "/root/python":
                raise SandboxError("the fallback cannot run /root/python here")

        def run(self, problem, completion, timeout):
            return {"passed": True}

    monkeypatch.setattr(bench_sandbox, "Sandbox", Fallback)
    monkeypatch.setattr(bench_sandbox, "same_version_pythons", lambda: ["/root/python", "/usr/bin/python3"])
    ms, python = bench_sandbox.fallback_ms(2)
    assert python == "/usr/bin/python3" and ms >= 0 and "not measured with /root/python" in capsys.readouterr().out
    monkeypatch.setattr(bench_sandbox, "same_version_pythons", lambda: ["/root/python"])
    assert bench_sandbox.fallback_ms(2) == (None, None)


def test_a_bench_table_marks_a_row_timed_on_a_busy_machine(capsys):
    rows = [{"row": "Vanilla", "tokens_per_s": 10.0, "busy_samples": 0},
            {"row": "DEL", "tokens_per_s": 12.0, "busy_samples": 1}]
    harness.print_table(rows, ["row", "tok/s"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["Vanilla", "10.00"] and lines[2].split() == ["DEL", "*", "12.00"]
    assert lines[3].startswith("* timed on a busy machine")
    harness.print_table(rows[:1], ["row", "tok/s"])
    assert "busy" not in capsys.readouterr().out


def test_a_bench_table_marks_a_row_not_timed_at_steady_state(capsys):
    rows = [{"row": "Vanilla", "tokens_per_s": 10.0, "unsteady": True, "busy_samples": 1},
            {"row": "DEL", "tokens_per_s": 12.0, "unsteady": False}]
    harness.print_table(rows, ["row", "tok/s"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["Vanilla", "*~", "10.00"] and lines[2].split() == ["DEL", "12.00"]
    assert lines[4].startswith("~ not timed at steady state: its warm-up did not converge, or one of its first two "
                               "timed samples took more than 2×")
    harness.print_table(rows[1:], ["row", "tok/s"])
    assert "steady" not in capsys.readouterr().out


def test_a_bench_composes_as_run_does():
    """A bench's --task/--set go through run's aliases and its name check: `cnndm` is CNN/DM's summarisation task, and
    a misspelt method fails with a suggestion before Hydra's own error."""
    assert harness.compose("task=cnndm", "model=testbed").task.name == "cnndm_sum"
    with pytest.raises(ConfigError, match="ls"):
        harness.compose("method=lss")


def test_a_bench_row_is_its_summary_paired_with_its_vanilla():
    """table(): a row's numbers from its summary.json alone, its speedup against the Vanilla it pairs with, and how
    many of its samples were timed on a busy machine (the summary's load)."""
    def finished(method: str, speed: float, busy: int) -> harness.BenchRow:
        key = RunKey(model="m", weights="", task="t", task_version="1", method=method, method_tag=method,
                     hyperparameters=(), decoding="greedy", max_new_tokens=8, prompts="p", machine="cpu")
        summary = {"method": method, "method_tag": method, "model": "m", "task": "t", "n_samples": 2,
                   "tokens_per_s": speed, "etpl": 0.5, "generated_tokens": 8, "loaded_layers": 16, "wall_s": 2.0,
                   "acceptance_rate": None, "time_split": {"policy": 0.1}, "load": {"overloaded": busy},
                   "run_key": key.as_dict(), "steady_state": {"first_slowdown": 1 + 2 * busy,
                                                              "warmups_unconverged": 0, "steady": not busy}}
        cfg = OmegaConf.create({"model": {"num_layers": 4}, "out_dir": method})
        return harness.BenchRow(method, cfg, None, summary)

    vanilla, ls = harness.table([finished("vanilla", 4.0, 0), finished("ls", 6.0, 1)])
    assert (vanilla["speedup"], ls["speedup"], ls["predicted_speedup"]) == (1.0, 1.5, 2.0)
    assert (vanilla["busy_samples"], ls["busy_samples"]) == (0, 1) and ls["pooled_tokens_per_s"] == 4.0
    assert (vanilla["unsteady"], ls["unsteady"], ls["first_slowdown"]) == (False, True, 3)  # records.steady_state


def test_tables_mark_a_peer_and_say_why():
    assert method_label("hf_assistant_early_exit", {"exit_layer": 24, "gamma": 4}) == "HF assistant_early_exit(E24-γ4)†"
    assert method_label("hf_generate") == "HF generate†"
    assert method_label("ls", {"exit_layer": 24, "gamma": 4}) == "LS(E24-γ4)"
    # DEL's variants by their settings (methods.dynamic_exit.variant), whatever the tag says
    authors = {"keep_stopped_draft": True, "prefill_draft": True}
    assert [method_label("del", h) for h in
            ({"cost_model": "layers", **authors}, {"cost_model": "layers"},
             {"cost_model": "measured", "shadow_vocab": 1024}, {"cost_model": "layers", "keep_stopped_draft": True},
             {"d_max": 4, **authors})] == \
        ["DEL", "DEL (Alg. 1)", "DEL-CPU", "DEL (KnapSpec's)", "DEL"]
    table = Table("t", "T", [], rows=[TableRow("b", "m", method_label("hf_generate"), "ours", {})])
    assert PEER_NOTE in render.notes(table)
    assert PEER_NOTE not in render.notes(Table("t", "T", [], rows=[TableRow("b", "m", "DEL", "ours", {})]))


def check_recomputable(rows: list[dict], printed: str) -> None:
    """Every row's tok/s and speedup, as printed, from the run directories it names (samples.jsonl and each run's
    Vanilla partner: the same model, task, prompts and length, method vanilla) with json alone."""
    vanilla = [r["out_dir"] for r in rows if r["method"] == "vanilla"]
    for r in rows:
        speed = mean_speed(r["out_dir"])
        assert r["tokens_per_s"] == pytest.approx(speed, rel=1e-9)
        speedup = speed / statistics.fmean(map(mean_speed, vanilla))  # one model × task × length here
        assert r["speedup"] == pytest.approx(speedup, rel=1e-9)
        # timed on a busy machine, or not at steady state: marked (harness._marks)
        marks = "*" * bool(r["busy_samples"]) + "~" * bool(r.get("unsteady"))
        marked = re.escape(r["row"]) + (" " + re.escape(marks) if marks else "")
        assert re.search(rf"{marked}\s+{speed:.2f}\s+{speedup:.2f}x", printed), r["row"]


def check_interleaved(rows: list[dict], limit: int) -> None:
    """Rows grown one prompt at a time across all rows: every run was decoded in `limit` sessions of one prompt each
    (setup.jsonl: a line per session, with the samples finished before it)."""
    for r in rows:
        sessions = read_jsonl(Path(r["out_dir"]) / "setup.jsonl")
        assert [line["samples_before"] for line in sessions] == list(range(limit)), r["row"]


def check_peer_records(rows: list[dict]) -> None:
    """A peer's records hold what its hooks counted: generate runs all L layers and one head row per token; the
    early-exit assistant drafts; every greedy output equals generate's (float64); peers pair with our Vanilla."""
    by_method = {r["method"]: r for r in rows}
    assert set(by_method) == {"vanilla", "hf_generate", "hf_forward_loop", "ls", "hf_assistant_early_exit"}
    for name in ("hf_generate", "hf_forward_loop"):
        for s in samples(by_method[name]["out_dir"]):
            assert s["loaded_layers"] == 4 * s["generated_tokens"] and s["head_calls"] == s["generated_tokens"]
            assert s["drafted"] == s["accepted"] == 0 and s["rounds"] == 0
    for s in samples(by_method["hf_assistant_early_exit"]["out_dir"]):  # E = 1 of L = 4 layers
        targets = s["generated_tokens"] - s["accepted"]  # verification passes: each emits its accepted drafts + 1
        assert s["drafted"] > 0 and s["loaded_layers"] == s["drafted"] + 4 * targets
        assert s["head_calls"] == 2 * s["drafted"] + targets  # a row per draft, then one per verified position
    assert all(r["equal_generate"] == "2/2" and r["speedup"] is not None for r in rows)
    summary = json.loads((Path(by_method["hf_generate"]["out_dir"]) / "summary.json").read_text())
    assert summary["run_key"]["method"] == "hf_generate" and summary["method_tag"] == "hf-generate"


def test_a_peer_output_ends_as_ours():
    """Through the first EOS, or the token that completes a stop string (assisted generation may run past both)."""
    assert cut([5, 9, 2, 7, 2], {2}, None) == [5, 9, 2]
    assert cut([5, 9, 7, 8], {2}, lambda ids: ids[-2:] == [9, 7]) == [5, 9, 7]
    assert cut([5, 9], {2}, lambda ids: False) == [5, 9]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_runs(name, tmp_path, monkeypatch, capsys):
    """scripts/<name> as `python scripts/<name> ARGS` would run it, in this process."""
    cfg = compose_run("experiment=smoke", f"records_root={tmp_path / 'records'}", "experiment_name=null",
                      "threads=1", "warmup_tokens=0")  # the smoke sweep's run, made without its experiment name
    runner.run(cfg)
    monkeypatch.setattr(sys, "argv", [name, *(a.format(tmp=tmp_path) for a in SCRIPTS[name])])
    try:
        runpy.run_path(str(REPO / "scripts" / name), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None), f"{name} exited with {done.code}"
    assert "smoke: 1 jobs, 1 finished runs tagged, 0 not composable here" in capsys.readouterr().out
    summary = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
    assert summary["run_key"]["experiments"] == ["smoke"]


def test_tag_experiments_prune_untags_only_runs_of_settings_the_sweep_no_longer_has(tmp_path, monkeypatch, capsys):
    """--prune: a run of the sweep's old settings (another max_new_tokens; another prompt count) loses the sweep's
    name and stays on disk; the sweep's own run, and a run elsewhere of the same settings (a peer row), keep it."""
    import shutil

    cfg = compose_run("experiment=smoke", f"records_root={tmp_path / 'records'}", "threads=1", "warmup_tokens=0")
    runner.run(cfg)
    ours = Path(cfg.out_dir)
    copies = {"same": None, "tokens": ("max_new_tokens", 999), "prompts": ("selection", {"limit": 999})}
    for name, change in copies.items():
        other = tmp_path / "records" / "elsewhere" / name
        shutil.copytree(ours, other)
        summary = json.loads((other / "summary.json").read_text())
        if change and change[0] == "selection":
            summary["selection"] = {**summary["selection"], **change[1]}
        elif change:
            summary["run_key"][change[0]] = change[1]
        (other / "summary.json").write_text(json.dumps(summary))
    monkeypatch.setattr(sys, "argv", ["tag_experiments.py", "smoke", "--records-root", str(tmp_path / "records"),
                                      "--prune"])
    runpy.run_path(str(REPO / "scripts" / "tag_experiments.py"), run_name="__main__")
    assert "2 runs it no longer covers untagged" in capsys.readouterr().out

    def experiments(run_dir: Path) -> list[str]:
        return json.loads((run_dir / "summary.json").read_text())["run_key"]["experiments"]

    assert experiments(ours) == experiments(tmp_path / "records" / "elsewhere" / "same") == ["smoke"]
    assert experiments(tmp_path / "records" / "elsewhere" / "tokens") == []
    assert experiments(tmp_path / "records" / "elsewhere" / "prompts") == []
