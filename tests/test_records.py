"""The record contract (del_bench/records/): one RunKey per run, one pairing rule every reader uses, tables
that show only their experiments' runs, and the committed tables rebuilt byte for byte from the reference."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from pathlib import Path

import pytest

from del_bench import jobs, machine_load, records, runner
from del_bench.__main__ import format_table
from del_bench.engine.rounds import Round
from del_bench.records import RunKey, SampleRecord, run_key_of
from del_bench.report import render, tables
from del_bench.report.build import write_report
from del_bench.report.collect import DEFAULT_ROOTS, load_runs

REPO = Path(__file__).resolve().parent.parent

KEY = RunKey(model="m", weights="w1", task="t", task_version="1", method="ls", method_tag="ls-E1-g2",
             hyperparameters=(("exit_layer", 1), ("gamma", 2)), decoding="greedy", max_new_tokens=16,
             prompts="abc", machine="cpu/x86_64 (2 threads)")
VANILLA = dataclasses.replace(KEY, method="vanilla", method_tag="vanilla", hyperparameters=())


def test_pairs_with_its_vanilla_only():
    assert KEY.pairs_with(VANILLA)
    assert not KEY.pairs_with(dataclasses.replace(KEY, method_tag="ls-E2-g2"))  # a partner must be Vanilla
    assert KEY.pairs_with(dataclasses.replace(VANILLA, experiments=("table1",)))  # membership is not identity


@pytest.mark.parametrize("field, other", [("max_new_tokens", 32), ("prompts", "xyz"), ("weights", "w2"),
                                          ("machine", "cuda/NVIDIA H100"), ("decoding", "sample-t0.6-p0.95"),
                                          ("task_version", "2"), ("model", "m2"), ("task", "t2"),
                                          ("prompt_digest", "0123456789")])
def test_a_vanilla_run_that_differs_never_pairs(field, other):
    assert not KEY.pairs_with(dataclasses.replace(VANILLA, **{field: other}))


def test_run_key_round_trips_through_summary_json():
    key = KEY.with_experiment("table3").with_experiment("table1")
    assert key.experiments == ("table1", "table3")
    assert RunKey.from_dict(json.loads(json.dumps(key.as_dict()))) == key


def test_runner_writes_the_key_and_the_sweep_that_asked(run_cfg):
    cfg = run_cfg("method=ls", "method.exit_layer=1", "method.gamma=2", "limit=1", "experiment_name=table3_local")
    summary = runner.run(cfg)
    key = run_key_of(summary)
    assert (key.model, key.method, key.hyperparameter("gamma"), key.max_new_tokens) == ("tiny-random", "ls", 2, 16)
    assert key.experiments == ("table3_local",)
    # the records written before run_key existed give the same key through the adapter
    old = {k: v for k, v in summary.items() if k != "run_key"}
    samples = [json.loads(line) for line in (Path(cfg.out_dir) / "samples.jsonl").read_text().splitlines()]
    adapted = run_key_of(old, samples)
    # but for the prompt digest, which such records never had: they pair among themselves only
    assert adapted.pair_id() == dataclasses.replace(key, prompt_digest="").pair_id() and key.prompt_digest
    assert adapted.method_tag == key.method_tag


def test_a_sweep_that_finds_the_run_finished_adds_itself(run_cfg):
    cfg = run_cfg("method=vanilla", "limit=1", "experiment_name=table1_local")
    assert jobs.run_once(cfg)[0] == "ok"
    cfg.experiment_name = "table3_local"  # another sweep covers the same out_dir: skipped, and recorded
    status, _ = jobs.run_once(cfg)
    summary = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
    assert status == "skipped" and run_key_of(summary).experiments == ("table1_local", "table3_local")


def test_other_length_or_prompts_never_pair_in_report_or_show(run_cfg, tmp_path):
    runs = tmp_path / "runs"
    vanilla = runner.run(run_cfg("method=vanilla", "limit=2", "max_new_tokens=12", f"out_dir={runs / 'v12'}"))
    fewer = runner.run(run_cfg("method=vanilla", "limit=1", f"out_dir={runs / 'v16-1'}"))
    ls = runner.run(run_cfg("method=ls", "method.exit_layer=1", "method.gamma=2", "limit=2", f"out_dir={runs / 'ls'}"))
    df = load_runs([runs]).set_index("method_tag")
    assert not df.loc["ls-E1-g2", "has_vanilla"]
    ls_line = next(line for line in format_table([vanilla, fewer, ls]).splitlines() if "LS(E1-γ2)" in line)
    assert " n/a" in ls_line  # (then `*` where this shared machine was busy)


def _rows(table: tables.Table) -> list[str]:
    return [f"{r.model} {r.label} {r.tag}" for r in table.rows if r.source.startswith("ours")]


def test_sweep_runs_reach_only_their_own_tables(df):
    built = {t.name: t for t in tables.build_tables(df)}
    for name in ("table1", "table2", "table3", "table4", "table5"):
        assert not any("ω0.5" in r or "d2-fixed" in r or "d4-fixed" in r for r in _rows(built[name])), name
    assert any("ω=0.5" in r for r in _rows(built["table6"]))
    assert any("(outputs = Vanilla 1/2)" in r for r in _rows(built["table3"]))  # DEL-E's differing output
    # the = Vanilla column: every greedy row's count over its tasks, '–' for Vanilla itself and for paper rows
    lossless = {r.label.split(" (")[0]: r.cell(tables.LOSSLESS).render() for r in built["table3"].rows
                if r.source.startswith("ours")}
    assert lossless["Vanilla"] == "–" and lossless["DEL-E"].endswith("/2") and lossless["DEL-E"] != "2/2"
    assert all(v.split("/")[0] == v.split("/")[1] for k, v in lossless.items() if k not in ("Vanilla", "DEL-E"))
    assert all(r.cell(tables.LOSSLESS).render() == "–" for r in built["table3"].rows if r.source.startswith("paper"))


def test_without_ad_hoc_runs_a_table_shows_only_its_experiment_and_partners(df):
    table6 = tables.build_tables(df, adhoc=False)[5]
    rows = _rows(table6)
    assert rows and all("ω=0.95" not in r for r in rows)  # the ad hoc ω = 0.95 runs stay out
    assert any("Vanilla" in r for r in rows)  # the sweep's Vanilla partner is its baseline row
    assert _rows(tables.build_tables(df, adhoc=False)[0]) == []


def test_committed_tables_rebuild_byte_for_byte_from_the_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the default roots are relative to the repository, as `make tables` runs
    written = write_report(DEFAULT_ROOTS, tmp_path, None, adhoc=False)
    committed = sorted(p.name for p in (REPO / "results" / "tables").iterdir())
    assert sorted(p.name for p in written) == committed and len(committed) >= 12  # Tables 1–6 (+ Spec-Bench's)
    for path in written:
        assert path.read_bytes() == (REPO / "results" / "tables" / path.name).read_bytes(), path.name


def _readme_fields(file: str) -> set[str]:
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| `{file}` |"))
    return set(re.findall(r"`([a-z_0-9]+)`", row.split("|")[2]))


def test_readme_record_table_lists_the_dataclass_fields():
    assert _readme_fields("samples.jsonl") == {f.name for f in dataclasses.fields(SampleRecord)}
    rounds = {f.name for f in dataclasses.fields(Round)} - {"trace"} | {"sample_id", "repeat", "turn"}
    assert _readme_fields("rounds.jsonl") == rounds
    assert _readme_fields("summary.json") >= {"run_key", "selection", "quality", "provenance"}
    assert {f.name for f in dataclasses.fields(RunKey)} <= _readme_fields("run_key")


# ---- records a reader can trust (issue 30): the machine's load, the prompt digest, one Vanilla baseline, labels

def _load(busy, own, interval=1.0, cores=4, threads=2, loadavg=(0.0, 0.0)) -> dict:
    return {"interval_s": interval, "loadavg_before": loadavg[0], "loadavg_after": loadavg[1], "busy_cores": busy,
            "own_cores": own, "cores": cores, "torch_threads": threads}


def test_a_sample_is_overloaded_when_others_take_more_than_the_free_cores():
    assert not records.overloaded(_load(busy=2.0, own=2.0))  # only us
    assert not records.overloaded(_load(busy=4.0, own=1.5))  # others: 2.5 = the 2 free cores + the tolerance
    assert records.overloaded(_load(busy=4.0, own=1.25))  # others: 2.75
    assert records.overloaded(_load(busy=1.75, own=1.0, threads=4))  # threads = cores: nothing free; others 0.75
    assert not records.overloaded(_load(busy=1.5, own=1.0, threads=4))
    # too short for /proc/stat's ticks (or off Linux): the larger load average less torch's threads judges
    assert not records.overloaded(_load(busy=4.0, own=0.0, interval=0.125, loadavg=(2.0, 4.5)))
    assert records.overloaded(_load(busy=None, own=1.0, loadavg=(4.75, 1.0)))
    assert not records.overloaded(None) and records.other_cores(None) is None  # older records
    summary = records.load_summary([{"load": _load(4.0, 1.25)}, {"load": _load(2.0, 2.0)}, {"load": None}])
    assert summary == {"samples": 2, "overloaded": 1, "max_other_cores": 2.75, "free_cores": 2}
    assert records.load_summary([{"sample_id": "old"}]) is None


def test_busy_cores_from_proc_stat_counts_only_the_cpus_this_process_may_use():
    def stat(cpu0, cpu2):  # user nice system idle iowait irq softirq steal
        return (f"cpu  0 0 0 0 0 0 0 0\ncpu0 {cpu0} 0 0 {100 - cpu0} 5 0 0 0\ncpu1 0 0 0 100 0 0 0 0\n"
                f"cpu2 {cpu2} 1 2 {100 - cpu2} 0 3 4 5\nintr 7 0\n")

    before, after = machine_load.cpu_times(stat(10, 20), {0, 2}), machine_load.cpu_times(stat(60, 20), {0, 2})
    assert before == (10 + 20 + 1 + 2 + 3 + 4 + 5, 105 + 115) and after == (95, 220)  # steal is busy; iowait not
    assert machine_load.busy_cores(before, after, 2) is None  # no tick passed
    assert machine_load.busy_cores((10, 100), (40, 140), 2) == 1.5
    assert machine_load.cpu_times("intr 1\n", {0}) is None


def test_prompt_digest_is_what_the_model_saw():
    a = {"sample_id": "1", "prompt_ids": [1, 2, 3]}
    b = {"sample_id": "2", "prompt_ids": [4]}
    digest = records.prompt_digest([a, b, {**a, "repeat": 1}], ["\n\n"])
    assert digest == records.prompt_digest([b, a], ["\n\n"])  # order and repeats do not matter
    assert digest != records.prompt_digest([{**a, "prompt_ids": [9, 2, 3]}, b], ["\n\n"])  # other shots/system prompt
    assert digest != records.prompt_digest([a, b], [])  # stop strings end outputs
    turns = [{"user": "hi"}, {"user": "and then?"}]
    multi = records.prompt_digest([{**a, "turns": turns}], [])
    assert multi != records.prompt_digest([{**a, "turns": [turns[0], {"user": "why?"}]}], [])  # a later user turn
    assert multi != records.prompt_digest([{**a, "turns": turns, "prompt_format": "plain"}], [])


def test_vanilla_baseline_is_the_mean_over_partners_that_recorded_one():
    other_machine = dataclasses.replace(VANILLA, machine="cuda/NVIDIA H100")
    runs = [(VANILLA, {"tokens_per_s": 2.0}), (VANILLA, {"tokens_per_s": 5.0}), (VANILLA, {"tokens_per_s": math.nan}),
            (VANILLA, {"tokens_per_s": None}), (other_machine, {"tokens_per_s": 100.0}), (KEY, {"tokens_per_s": 50.0})]
    assert records.vanilla_baseline(KEY, runs) == 3.5
    assert len(records.vanilla_partners(KEY, runs)) == 4
    assert records.vanilla_baseline(KEY, runs[4:]) is None


def _summary(key: RunKey, tps: float, load: dict | None = None) -> dict:
    return {"model": key.model, "task": key.task, "method": key.method, "method_tag": key.method_tag, "n_samples": 2,
            "tokens_per_s": tps, "etpl": 0.5, "acceptance_rate": 0.5, "drafted": 4, "quality": {},
            "provenance": {}, "run_key": key.as_dict(), "load": load}


def test_show_labels_methods_as_the_tables_do_and_marks_busy_runs():
    del_paper = dataclasses.replace(KEY, method="del", method_tag="del-w0.95-layers-vnull",
                                    hyperparameters=(("exit_layer", None), ("keep_stopped_draft", True),
                                                     ("omega", 0.95), ("prefill_draft", True)))
    del_cpu = dataclasses.replace(del_paper, method_tag="del-w0.95-measured-v1024-deferred",
                                  hyperparameters=(("cost_model", "measured"), ("exit_layer", None), ("omega", 0.95)))
    del_short = dataclasses.replace(del_paper, method_tag="del-w0.95-d4",
                                    hyperparameters=(("d_max", 4), *del_paper.hyperparameters))
    busy = records.load_summary([{"load": _load(4.0, 1.0)}])
    text = format_table([_summary(VANILLA, 10.0, busy), _summary(KEY, 20.0), _summary(del_paper, 5.0),
                         _summary(del_cpu, 15.0), _summary(del_short, 25.0)])
    lines = text.splitlines()
    assert "Vanilla" in lines[2] and "10.00*" in lines[2]
    assert "LS(E1-γ2)" in lines[3] and " 2.00x*" in lines[3]  # its speedup is against a busy Vanilla
    assert "DEL [1]" in lines[4] and "0.50x" in lines[4] and "DEL-CPU " in lines[5] and "1.50x" in lines[5]
    assert "DEL [2]" in lines[6] and "2.50x" in lines[6]  # same label, another tag: numbered
    assert "[1] = del-w0.95-layers-vnull" in text and "[2] = del-w0.95-d4" in text and "deferred" not in text
    assert "* Vanilla on m/t: timed on a busy machine — around 1 of 1 samples" in text
    assert "up to 3.0 CPUs where torch's threads left 2 free" in text
    assert "ls-E1-g2" not in text and len({len(line) for line in lines[:2]}) == 1  # one column layout
    assert "*" not in format_table([_summary(VANILLA, 10.0), _summary(KEY, 20.0)])


def _make_busy(run_dir: Path) -> None:
    """Give the first sample of a run an overloaded load (3 other CPUs busy, 2 free)."""
    path = run_dir / "samples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["load"] = _load(4.0, 1.0)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tables_mark_busy_runs_and_their_partners_and_the_report_can_leave_them_out(tmp_path):
    from tests.data.report_golden.records import write_records

    runs = write_records(tmp_path)
    vanilla = load_runs([runs]).query("model == 'llama2-7b' and task == 'gsm8k' and method == 'vanilla'")
    _make_busy(Path(vanilla.run_dir.iloc[0]))
    table3 = {r.label: r for r in tables.build_tables(load_runs([runs]))[2].rows if r.source.startswith("ours")
              and r.model == "llama2-7b"}
    assert {"Vanilla ‡", "LS(E7-γ6) ‡", "DEL ‡"} <= set(table3)  # the partners of a busy Vanilla too
    assert "FS(E7-γ6)" in table3  # not run on GSM8K: its speedups stand
    assert render.BUSY_NOTE in render.to_markdown(tables.build_tables(load_runs([runs]))[2])
    assert r"$\ddagger$" in render.to_latex(tables.build_tables(load_runs([runs]))[2])
    kept = load_runs([runs], exclude_busy=True)
    assert len(kept) == len(load_runs([runs])) - 1
    ls = kept.query("model == 'llama2-7b' and task == 'gsm8k' and method == 'ls'")
    assert not ls.has_vanilla.any()  # its only Vanilla was left out: no baseline
    assert write_report([runs], tmp_path / "t", None, exclude_busy=True)
    assert "‡" not in (tmp_path / "t" / "table3.md").read_text()


def test_an_n_shot_variant_never_pairs_with_the_other_vanilla(run_cfg, tmp_path):
    data = REPO / "tests" / "data" / "tasks"

    def run(method, n_shot):
        return runner.run(run_cfg(f"method={method}", "task=gsm8k", f"task.data_files={data / 'gsm8k_test.jsonl'}",
                                  f"task.shots_files={data / 'gsm8k_train.jsonl'}", f"task.n_shot={n_shot}",
                                  "limit=1", "max_new_tokens=4", f"out_dir={tmp_path / 'runs' / f'{method}-{n_shot}'}"))

    vanilla, ls_0, ls_2 = run("vanilla", 2), run("ls", 0), run("ls", 2)
    keys = {name: run_key_of(s) for name, s in (("vanilla", vanilla), ("ls_0", ls_0), ("ls_2", ls_2))}
    assert keys["ls_2"].pairs_with(keys["vanilla"]) and not keys["ls_0"].pairs_with(keys["vanilla"])
    assert keys["ls_0"].prompts == keys["vanilla"].prompts  # same task version and sample ids: only the digest differs
    df = load_runs([tmp_path / "runs"]).set_index("run_dir")
    assert not df.loc[str(tmp_path / "runs" / "ls-0"), "has_vanilla"]
    assert df.loc[str(tmp_path / "runs" / "ls-2"), "has_vanilla"]
    # every timed sample recorded the machine's load, and the summary counts it
    sample = json.loads((tmp_path / "runs" / "ls-2" / "samples.jsonl").read_text().splitlines()[0])
    assert set(sample["load"]) == {"interval_s", "loadavg_before", "loadavg_after", "busy_cores", "own_cores", "cores",
                                   "torch_threads"}
    assert sample["load"]["torch_threads"] == 1 and sample["load"]["interval_s"] > 0 and sample["load"]["cores"] >= 1
    assert ls_2["load"]["samples"] == 1


# ---- steady state (issue 36): a run whose first timed prompt ran cold is flagged, as a busy one is

def _timed(per_layer: list[float], rounds: int = 4, layers: int = 10, emitted: int = 1, prefill_s: float = 0.01):
    """Samples (in decoding order) and their rounds: sample i's decode rounds each load `layers` layers in
    per_layer[i] seconds per layer and emit `emitted` tokens; round 0, its prefill, takes prefill_s."""
    samples, lines = [], []
    for i, seconds in enumerate(per_layer):
        samples.append({"sample_id": f"s{i}", "repeat": 0, "wall_s": 1.0, "loaded_layers": layers * (rounds + 1)})
        lines.append({"sample_id": f"s{i}", "repeat": 0, "round": 0, "loaded_layers": layers, "emitted": 1,
                      "draft_s": 0.0, "verify_s": prefill_s, "policy_s": 0.0})
        lines += [{"sample_id": f"s{i}", "repeat": 0, "round": r, "loaded_layers": layers, "emitted": emitted,
                   "draft_s": seconds * layers / 2, "verify_s": seconds * layers / 2, "policy_s": 0.0}
                  for r in range(1, rounds + 1)]
    return samples, lines


@pytest.mark.parametrize("per_layer, steady", [
    ([7.0, 7.0, 1.0, 1.0], False),  # issue 36 on the GPU: two cold prompts, then steady — the median sees through one
    ([1.1, 1.0, 0.9, 1.05], True),  # a quiet run
    ([2.0, 1.0, 1.0], True),  # at the threshold: still steady
    ([2.01, 1.0, 1.0], False),  # just past it
    ([3.0, 1.0, 1.0, 13.0], False),  # one slow later sample moves a mean of the rest, not their median
    ([0.2, 1.0, 1.0], True),  # a faster first sample is no warm-up's failure
    ([7.0, 7.0, 1.0], False),  # three prompts, two cold: the first's median of the rest is (7 + 1) / 2, the second's 1
    ([1.0, 2.5, 1.0], False),  # the second sample cold (a shape first met there)
    ([1.0, 1.0, 1.0, 2.5], True),  # the third and later: past the warm-up's reach, not judged
], ids=["cold-start", "quiet", "at-threshold", "past-threshold", "median", "faster-first", "two-of-three",
        "second", "third"])
def test_a_run_whose_first_timed_samples_are_slow_is_not_at_steady_state(per_layer, steady):
    samples, lines = _timed(per_layer)
    state = records.steady_state(samples, lines)
    assert state["steady"] is steady and records.unsteady(state) is not steady
    assert state["first_slowdown"] == pytest.approx(per_layer[0] / statistics.median(per_layer[1:]))
    assert state["lead_slowdown"] == pytest.approx(max(per_layer[i] / statistics.median(per_layer[i + 1:])
                                                       for i in range(2)))


def test_steady_state_compares_decode_seconds_per_loaded_layer():
    """Not per token (a first prompt that accepted fewer drafts takes longer a token at the same speed a layer), and
    not the prefill (a long first prompt prefills longer)."""
    first, first_lines = _timed([1.0], emitted=1, prefill_s=50.0)  # one token a round, a long prefill
    rest, rest_lines = _timed([1.0, 1.0], emitted=4)  # four tokens a round
    rest = [{**s, "sample_id": f"r{i}"} for i, s in enumerate(rest)]
    rest_lines = [{**r, "sample_id": f"r{r['sample_id'][1:]}"} for r in rest_lines]
    state = records.steady_state(first + rest, first_lines + rest_lines)
    assert state["steady"] and state["first_slowdown"] == pytest.approx(1.0)
    # a run without round lines (a peer: transformers decodes) is judged on its wall seconds per loaded layer
    peer = [{"sample_id": "a", "wall_s": 9.0, "loaded_layers": 3}, {"sample_id": "b", "wall_s": 1.0,
                                                                    "loaded_layers": 3}]
    assert records.steady_state(peer, [])["first_slowdown"] == pytest.approx(9.0)


def test_a_warm_up_that_did_not_converge_flags_the_run():
    samples, lines = _timed([1.0, 1.0])
    quick = {"warmup": {"mode": "quick", "ms_per_token": [3.0], "converged": None}}
    converged = {"warmup": {"mode": "steady", "ms_per_token": [9.0, 3.0, 3.1], "converged": True}}
    not_converged = {"warmup": {"mode": "steady", "ms_per_token": [9.0, 5.0], "converged": False}}
    assert records.steady_state(samples, lines, [quick, converged])["steady"]
    state = records.steady_state(samples, lines, [converged, not_converged])
    assert not state["steady"] and state["warmups_unconverged"] == 1
    assert records.steady_state(samples[:1], lines, [{"load_s": 1.0}]) is None  # one sample, no warm-up: nothing
    assert records.steady_state(samples[:1], lines, [not_converged])["first_slowdown"] is None


def test_show_marks_runs_not_at_steady_state_and_the_speedups_against_them():
    cold = {"first_slowdown": 7.25, "warmups_unconverged": 0, "steady": False}
    vanilla, ls = _summary(VANILLA, 10.0), _summary(KEY, 20.0)
    text = format_table([{**vanilla, "steady_state": cold}, ls])
    lines = text.splitlines()
    assert "10.00~" in lines[2] and "20.00~" not in lines[3] and " 2.00x~" in lines[3]  # its partner was cold
    assert ("~ Vanilla on m/t: not timed at steady state — one of its first two timed samples took 7.2× the median "
            "decode time per loaded layer of the samples after it (more than 2×)") in text
    unconverged = {"first_slowdown": None, "warmups_unconverged": 2, "steady": False}
    text = format_table([vanilla, {**ls, "steady_state": unconverged, "load": records.load_summary(
        [{"load": _load(4.0, 1.0)}])}])
    assert "20.00*~" in text and "2.00x*~" in text and "the warm-up of 2 session(s) did not converge" in text
    assert "~" not in format_table([vanilla, {**ls, "steady_state": {**cold, "steady": True}}])


def test_show_judges_steady_state_again_from_the_records(run_cfg, tmp_path, capsys):
    from del_bench.__main__ import cmd_show

    runner.run(run_cfg("method=vanilla", "limit=2", "max_new_tokens=4"))
    run_dir = tmp_path / "run"
    assert cmd_show([str(run_dir)]) == 0 and "~" not in capsys.readouterr().out
    with open(run_dir / "setup.jsonl", "a") as f:  # as a session whose steady warm-up ran out of passes writes it
        f.write(json.dumps({"warmup": {"mode": "steady", "ms_per_token": [9.0, 5.0], "converged": False}}) + "\n")
    assert cmd_show([str(run_dir)]) == 0
    assert "not timed at steady state — the warm-up of 1 session(s) did not converge" in capsys.readouterr().out


def test_tables_mark_runs_not_at_steady_state_and_the_report_can_leave_them_out(tmp_path):
    from tests.data.report_golden.records import write_records

    runs = write_records(tmp_path)
    vanilla = load_runs([runs]).query("model == 'llama2-7b' and task == 'gsm8k' and method == 'vanilla'")
    path = Path(vanilla.run_dir.iloc[0]) / "rounds.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    first = lines[0]["sample_id"]
    for r in lines:  # the first sample's decode rounds three times slower
        if r["sample_id"] == first and r["round"] > 0:
            r["verify_s"] = 3 * (r["draft_s"] + r["verify_s"] + r["policy_s"]) - r["draft_s"] - r["policy_s"]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    table3 = tables.build_tables(load_runs([runs]))[2]
    labels = {r.label for r in table3.rows if r.source.startswith("ours") and r.model == "llama2-7b"}
    assert {"Vanilla ¶", "LS(E7-γ6) ¶", "DEL ¶"} <= labels and "FS(E7-γ6)" in labels  # partners too
    assert render.UNSTEADY_NOTE in render.to_markdown(table3) and render.BUSY_NOTE not in render.to_markdown(table3)
    kept = load_runs([runs], exclude_unsteady=True)
    assert len(kept) == len(load_runs([runs])) - 1
    assert r"\P{}" in render.to_latex(table3)
    assert write_report([runs], tmp_path / "t", None, exclude_unsteady=True)
    assert "¶" not in (tmp_path / "t" / "table3.md").read_text()


def _products_line(ms_one_row: dict[str, float], **extra) -> dict:
    """A setup line as `products: auto` writes it: seconds per shape class, row count and layout."""
    seconds = {shape: {"1": {"x_wt": ms / 1e3, "wt_x": 9.0}, "2": {"x_wt": 9.0, "wt_x": 9.0}}
               for shape, ms in ms_one_row.items()}
    return {"products": {"setting": "auto", "seconds": {**seconds, **extra}}}


def test_the_machine_probe_is_one_tokens_products_and_a_drift_is_a_factor_either_way():
    shapes = {"qkv": 2.0, "o": 1.0, "gate_up": 8.0, "down": 3.0, "head": 4.0}  # ms: SmolLM2 on a good day
    line = _products_line(shapes, rows_8={"qkv": {"x_wt": 5.0}})  # a batch's widths (products.for_rows): not one row
    assert records.machine_probe([line]) == pytest.approx(0.018)
    slow = _products_line({s: 3 * ms for s, ms in shapes.items()})
    assert records.machine_probe([line, slow, line]) == pytest.approx(0.018)  # the median over sessions
    assert records.machine_probe([{"products": {"setting": "wt_x", "layouts": {}}}, {"load_s": 1.0}]) is None
    assert records.drifted(0.018, [0.026]) is False  # 1.44×: within DRIFT_LIMIT
    assert records.drifted(0.018, [0.028]) and records.drifted(0.028, [0.018])  # slower or faster, either way
    assert records.drifted(0.018, [0.030, 0.030]) and not records.drifted(0.018, [0.030, 0.012])  # partners' mean
    assert not records.drifted(0.001, [0.004]) and not records.drifted(None, [0.018])  # too short to tell; none


def test_tables_mark_a_speedup_paired_across_machine_states(tmp_path):
    from tests.data.report_golden.records import write_records

    runs = write_records(tmp_path)
    df = load_runs([runs]).query("model == 'llama2-7b' and task == 'gsm8k'")
    for method, ms in (("vanilla", 4.0), ("ls", 10.0), ("del", 5.0)):  # LS ran with the machine 2.5× slower
        run_dir = Path(df[df.method == method].run_dir.iloc[0])
        line = _products_line({"qkv": ms, "gate_up": ms})
        (run_dir / "setup.jsonl").write_text(json.dumps(line) + "\n")
    table3 = tables.build_tables(load_runs([runs]))[2]
    labels = {r.label for r in table3.rows if r.source.startswith("ours") and r.model == "llama2-7b"}
    assert "LS(E7-γ6) §" in labels and "DEL" in labels and "Vanilla" in labels  # DEL: 1.25×, within the limit
    assert render.DRIFT_NOTE in render.to_markdown(table3) and r"\S{}" in render.to_latex(table3)
