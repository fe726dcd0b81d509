"""Report tables from golden mini-records: exact Markdown for Tables 1–6, plus the rules behind the cells.

The records are synthetic run directories written by tests/data/report_golden/records.py (a compact spec,
the runner's file layout); the expected tables are the committed tests/data/report_golden/table*.md.
After an intended change to the tables, regenerate the goldens and review the diff:

    DEL_BENCH_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_report_tables.py -q
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from del_bench.report import render, tables
from del_bench.report.collect import aggregate, segment_speeds

GOLDEN = Path(__file__).parent / "data" / "report_golden"
UPDATE = os.environ.get("DEL_BENCH_UPDATE_GOLDEN") == "1"


@pytest.fixture(scope="module")
def built(df) -> dict[str, tables.Table]:
    return {t.name: t for t in tables.build_tables(df)}


@pytest.mark.parametrize("name", [f"table{i}" for i in range(1, 7)])
def test_table_matches_golden(built, name):
    text = render.to_markdown(built[name])
    path = GOLDEN / f"{name}.md"
    if UPDATE:
        path.write_text(text)
    assert path.is_file(), f"no golden {path}: run with DEL_BENCH_UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(), f"{name} differs from {path} (DEL_BENCH_UPDATE_GOLDEN=1 to accept)"


def _row(table: tables.Table, model: str, label: str, source: str = "ours") -> tables.TableRow:
    hits = [r for r in table.rows if r.model == model and r.label == label and r.source.startswith(source)]
    assert len(hits) == 1, [(r.model, r.label, r.source) for r in table.rows]
    return hits[0]


def test_paper_rows_sit_beside_ours_with_hardware(built):
    t1 = built["table1"]
    ours = t1.rows.index(_row(t1, "llama2-7b", "DEL"))
    paper = t1.rows[ours + 1]
    assert paper.source == "paper: 1× A100-40GB" and paper.label == "DEL"
    assert paper.cells["overall:speedup"].render() == "2.50"
    assert _row(t1, "llama2-7b", "DEL").source == "ours: cpu/x86_64 (2 threads)"


def test_repeats_give_mean_and_std(df, built):
    dels = df[(df.model == "llama2-7b") & (df.task == "cnndm_sum") & (df.method_tag == "del-w0.95-layers-vNone")]
    assert sorted(dels.seed) == [42, 43]  # two seeds, same prompts: one configuration, two repeats
    agg = aggregate(dels)
    assert len(agg) == 1 and agg.runs.iloc[0] == 2
    cell = _row(built["table3"], "llama2-7b", "DEL").cells["cnndm_sum:tokens_per_s"]
    assert cell.runs == 2 and cell.mean == pytest.approx(dels.tokens_per_s.mean())
    assert cell.std == pytest.approx(dels.tokens_per_s.std()) and " ± " in cell.render()


def test_speedup_needs_a_vanilla_partner(df, built):
    assert _row(built["table3"], "llama2-7b", "LS(E7-γ6)").cells["wmt14_de_en:speedup"].render() == "no vanilla"
    ls = df[(df.model == "llama2-7b") & (df.task == "aqua_rat") & (df.method == "ls")].iloc[0]
    vanilla = df[(df.model == "llama2-7b") & (df.task == "aqua_rat") & (df.method == "vanilla")].iloc[0]
    assert ls.speedup == pytest.approx(ls.tokens_per_s / vanilla.tokens_per_s)


def test_pairing_requires_the_same_generation_length(df):
    other = df[df.task == "aqua_rat"].copy()
    vanilla = other.method == "vanilla"
    other.loc[vanilla, "run_key"] = other.loc[vanilla, "run_key"].map(lambda k: replace(k, max_new_tokens=64))
    from del_bench.report.collect import add_speedup

    paired = add_speedup(other)
    assert not paired[paired.method != "vanilla"].has_vanilla.any()


def test_calibration_grid_points_stay_out_of_the_tables(df, built):
    calib = df[df.sample_set == "calibration"]
    assert len(calib) == 3 * 5 and set(calib.max_new_tokens) == {"256"}
    labels = {r.label for t in built.values() for r in t.rows if r.model == "smollm2-135m"}
    assert "LS(E20-γ2)" not in labels  # run only as a grid point
    assert {"LS(E12-γ2)", "LS(E20-γ4)", "LS(E12-γ4)"} <= labels


def test_task_generation_settings_define_the_decoding(df):
    """humaneval_pass10 samples (its task config says so) although the runner's summary says greedy."""
    pass10 = df[df.task == "humaneval_pass10"]
    assert set(pass10.decoding) == {"sample-t0.6-p0.95"}
    assert set(df[df.task == "humaneval"].decoding) == {"greedy"}


def test_table2_joins_greedy_and_sampled_runs_on_one_row(built):
    row = _row(built["table2"], "codellama-7b", "DEL")
    for key in ("humaneval:etpl", "humaneval:speedup", "humaneval_pass10:etpl", "humaneval_pass10:speedup",
                "humaneval_pass10:q_rouge2"):
        assert not math.isnan(row.cells[key].mean), key
    assert row.cells["humaneval_pass10:q_rouge2"].mark == ""  # quality is not ranked
    paper = built["table2"].rows[built["table2"].rows.index(row) + 1]
    assert paper.source.startswith("paper") and paper.cells["humaneval_pass10:speedup"].render() == "1.73"


def test_table4_gain_is_del_minus_ls_and_skipping_minus_one(built):
    """DEL's gain is over LS; the layer-skipping methods' (SWIFT, CLaSp, KnapSpec: no early-exit training) over
    Vanilla; a block without SWIFT runs says so."""
    t4 = built["table4"]
    ls, dl = _row(t4, "llama2-7b", "LS(E7-γ6)"), _row(t4, "llama2-7b", "DEL")
    for task in tables.TABLE4_TASKS:
        gain = dl.cells[f"{task}:gain"]
        assert gain.mean == pytest.approx(dl.cells[f"{task}:speedup"].mean - ls.cells[f"{task}:speedup"].mean)
        for label in ("SWIFT", "CLaSp", "KnapSpec"):
            row = _row(t4, "llama2-7b", label)
            assert row.cells[f"{task}:gain"].mean == pytest.approx(row.cells[f"{task}:speedup"].mean - 1)
    assert _row(t4, "codellama-7b", "SWIFT").cells["humaneval:speedup"].render() == "no SWIFT runs"
    paper_swift = _row(t4, "llama2-13b", "SWIFT", "paper")  # the paper's rows, although we ran no 13B
    assert paper_swift.cells["cnndm_lm:gain"].render() == "0.26"


def test_table5_memory_overhead_and_missing_fields(df, built):
    t5 = built["table5"]
    ls = _row(t5, "llama2-7b", "LS(E7-γ6)")
    run = df[(df.model == "llama2-7b") & (df.task == "gsm8k") & (df.method == "ls")].iloc[0]
    vanilla = df[(df.model == "llama2-7b") & (df.task == "gsm8k") & (df.method == "vanilla")].iloc[0]
    expected = (run.peak_memory_gib / vanilla.peak_memory_gib - 1) * 100
    assert ls.cells["gsm8k:memory_overhead_pct"].mean == pytest.approx(expected)
    assert _row(t5, "llama2-7b", "Vanilla").cells["gsm8k:memory_overhead_pct"].render() == "–"
    assert _row(t5, "llama2-7b", "DV(E7)").cells["aqua_rat:peak_memory_gib"].render() == "n/a"  # not recorded
    assert _row(t5, "smollm2-135m", "Vanilla").cells["humaneval:peak_memory_gib"].render() == "n/a"
    assert any("peak RSS growth (synthetic)" in n for n in t5.notes)
    paper = _row(t5, "llama2-7b", "DEL", "paper")
    assert paper.cells["overall:memory_overhead_pct"].render() == "1.54"


def test_table5_overall_follows_the_papers_definition():
    """The paper's overall overheads (0.91 %, 1.54 %) are its overall memories' ratio to Vanilla's, not the
    mean of the per-task overheads (that gives 0.90 % for LS): the definition _overall_memory uses."""
    pv = tables.paper_values()
    t5 = pv[pv.table == "5"]

    def value(method, task, metric):
        return float(t5[(t5.method == method) & (t5.task == task) & (t5.metric == metric)].value.iloc[0])

    for method, printed in (("ls", 0.91), ("del", 1.54)):
        assert value(method, "overall", "memory_overhead_pct") == printed
        ratio = value(method, "overall", "memory_gb") / value("vanilla", "overall", "memory_gb") - 1
        assert round(ratio * 100, 2) == printed
    per_task = [value("ls", t, "memory_overhead_pct") for t in tables.TABLE5_TASKS]
    assert round(sum(per_task) / len(per_task), 2) == 0.90


def test_table6_blocks_hold_vanilla_and_every_omega(built):
    labels = [r.label for r in built["table6"].rows if r.source.startswith("ours")]
    assert labels == ["CNN/DM-Sum ω=- (Vanilla)", "CNN/DM-Sum ω=0.5", "CNN/DM-Sum ω=0.9", "CNN/DM-Sum ω=0.95",
                      "CNN/DM-Sum ω=0.95, DEL (Alg. 1)", "CNN/DM-Sum ω=1"]  # another reading of DEL says which


def test_best_and_second_are_marked_per_block(built):
    t3 = built["table3"]
    marks = {r.label: r.cells["aqua_rat:speedup"].mark for r in t3.rows
             if r.model == "llama2-7b" and r.source.startswith("ours")}
    assert marks["Vanilla"] == "" and sorted(marks.values()).count("best") == 1
    assert "second" in marks.values()


def test_latex_has_the_same_rows(built):
    for table in built.values():
        tex = render.to_latex(table)
        assert tex.count(r" \\") == len(table.rows) + 1  # + the header
        assert "_" not in tex.replace(r"\_", "")


def test_segment_speeds_split_a_straddling_round():
    rounds = pd.DataFrame([
        {"round": 0, "emitted": 1, "draft_s": 0.0, "verify_s": 1.0, "policy_s": 0.0},
        {"round": 1, "emitted": 2, "draft_s": 0.5, "verify_s": 0.5, "policy_s": 0.0},  # tokens 1, 2
        {"round": 2, "emitted": 4, "draft_s": 1.0, "verify_s": 1.0, "policy_s": 0.0},  # tokens 3..6: 3 | 4, 5, 6
    ])
    seg = segment_speeds(rounds, size=4)
    assert list(seg.tokens) == [4, 3] and list(seg.start) == [0, 4] and list(seg.end) == [4, 7]
    assert list(seg.seconds) == pytest.approx([1.0 + 1.0 + 0.5, 1.5])
    assert list(seg.tokens_per_s) == pytest.approx([4 / 2.5, 3 / 1.5])


def test_rounds_of_the_records_sum_to_the_samples_tokens(runs_dir):
    """The golden records are self-consistent the way the runner's are (emitted per round → tokens)."""
    run = next(runs_dir.glob("smollm2-135m/humaneval/ls-E12-g2/*"))
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    for s in samples:
        assert sum(r["emitted"] for r in rounds if r["sample_id"] == s["sample_id"]) == s["generated_tokens"]
        assert sum(r["loaded_layers"] for r in rounds if r["sample_id"] == s["sample_id"]) == s["loaded_layers"]


def test_the_gpu_table_is_the_bench_result_beside_the_papers_table1(tmp_path):
    """report/gpu.py: each row of `make gpu-check`'s bench result as it recorded it, the paper's Table 1 LLaMA-2-7B
    overall speed and speedup beside them; no file, no table."""
    from del_bench.report import gpu

    result = {"model": "synthetic-llama2-7b", "synthetic": {"agreement": 0.79, "exit_layer": 8},
              "settings": {"prompts": 3, "max_new_tokens": 64}, "provenance": {"device": "NVIDIA H200"},
              "rows": [{"row": "LS(E8-γ4) (fused graphs)", "tokens_per_s": 256.58, "speedup": 1.54, "etpl": 0.0506},
                       {"row": "DEL (graphs)", "failure": "CompileUnavailable: …"}]}
    path = tmp_path / "bench_gpu_7b.json"
    assert gpu.write_gpu(tmp_path, path) == []
    path.write_text(json.dumps(result))
    md = (gpu.write_gpu(tmp_path / "out", path)[0]).read_text()
    assert "| synthetic-llama2-7b | LS(E8-γ4) (fused graphs) | ours: NVIDIA H200, bf16 | 256.58 | 1.54 | 0.051 |" in md
    assert "| llama2-7b | DEL | paper: 1× A100-40GB | 90.29 | 2.50 |" in md and "DEL (graphs)" not in md
