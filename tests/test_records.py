"""The record contract (del_bench/records.py): one RunKey per run, one pairing rule every reader uses, tables
that show only their experiments' runs, and the committed tables rebuilt byte for byte from the reference."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from del_bench import jobs, runner
from del_bench.__main__ import format_table
from del_bench.engine.rounds import Round
from del_bench.records import RunKey, SampleRecord, run_key_of
from del_bench.report import tables
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
                                          ("task_version", "2"), ("model", "m2"), ("task", "t2")])
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
    assert adapted.pair_id() == key.pair_id() and adapted.method_tag == key.method_tag


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
    ls_line = next(line for line in format_table([vanilla, fewer, ls]).splitlines() if "ls-E1-g2" in line)
    assert " n/a " in ls_line


def _rows(table: tables.Table) -> list[str]:
    return [f"{r.model} {r.label} {r.tag}" for r in table.rows if r.source.startswith("ours")]


def test_sweep_runs_reach_only_their_own_tables(df):
    built = {t.name: t for t in tables.build_tables(df)}
    for name in ("table1", "table2", "table3", "table4", "table5"):
        assert not any("ω0.5" in r or "d2-fixed" in r or "d4-fixed" in r for r in _rows(built[name])), name
    assert any("ω=0.5" in r for r in _rows(built["table6"]))
    assert any("(outputs = Vanilla 1/2)" in r for r in _rows(built["table3"]))  # DEL-E's differing output


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
