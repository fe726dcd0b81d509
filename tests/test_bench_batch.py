"""`python -m del_bench bench batch` (make bench-batch) on bench gpu's random model at a tiny shape on the CPU: every
row runs with records at its batch size, the figures are there and sane, and every output is Vanilla's at batch 1."""

from __future__ import annotations

import json
from pathlib import Path

from del_bench.bench import batch as bench_batch
from del_bench.records import read_jsonl
from tests.test_bench_gpu import TINY


def test_bench_batch_runs_every_row_at_every_batch_size(tmp_path, capsys):
    out = tmp_path / "batch.json"
    assert bench_batch.main(["--batch-sizes", "1,2", "--limit", "3", "--max-new-tokens", "5", "--out", str(out),
                             "--root", str(tmp_path / "runs"), "--set", "warmup_tokens=2",
                             "--random", *TINY, "--dtype", "float32", "--prompt-len", "6", "--configs", "1:2"]) == 0
    rows = json.loads(out.read_text())["rows"]
    # batch size 1 with and without the graph-captured steps (on a CPU compile=auto makes none), then batch size 2;
    # transformers' generate at each
    assert [(r["row"], r["batch_size"]) for r in rows] == [
        ("Vanilla (graphs)", 1), ("LS(E1-γ2) (graphs)", 1), ("DEL (graphs)", 1),
        ("Vanilla (eager)", 1), ("LS(E1-γ2) (eager)", 1), ("DEL (eager)", 1), ("HF generate †", 1),
        ("Vanilla", 2), ("LS(E1-γ2)", 2), ("DEL", 2), ("HF generate †", 2)]
    generate = {r["batch_size"]: r for r in rows if r["method"] == "hf_generate"}
    for B, r in generate.items():  # its own records, at its batch size, our Vanilla's outputs (prompts of one length)
        samples = read_jsonl(Path(r["out_dir"]) / "samples.jsonl")
        assert len(samples) == 3 and (samples[0]["batch"] is None) == (B == 1) and r["equal_vanilla"] == "3/3"
        assert r["over_generate"] == 1.0 and r["host_reads_per_round"] is None  # transformers' reads: not counted
    for r in (r for r in rows if r["method"] != "hf_generate"):
        samples = read_jsonl(Path(r["out_dir"]) / "samples.jsonl")
        assert len(samples) == 3 and all(s["generated_tokens"] == 5 for s in samples), r["row"]  # no EOS
        assert (samples[0]["batch"] is None) == (r["batch_size"] == 1), r["row"]
        assert r["throughput"] > 0 and r["scaling"] > 0 and r["equal_vanilla"] == "3/3", r["row"]  # float32: lossless
        assert r["speedup"] is not None and r["over_generate"] == r["throughput"] / generate[r["batch_size"]][
            "throughput"], r["row"]
        if r["batch_size"] == 1:  # the batch's loads are the prompts' own: the pooled eTPL
            assert r["batch_etpl"] == r["pooled_etpl"]
        else:  # each (sub)layer loaded once for the rows that ran it together
            assert r["batch_etpl"] > r["pooled_etpl"]
        assert 0 < r["ttft_s"] <= r["latency_s"] and r["host_reads_per_round"] >= 1, r["row"]
    assert [r["speedup"] for r in rows if r["row"] == "Vanilla"] == [1.0]  # over itself: Vanilla at B = 2
    # a batch's round reads once for all its rows: fewer host reads a token than one prompt at a time
    reads = {r["row"]: r["host_reads_per_token"] for r in rows}
    assert reads["Vanilla"] < reads["Vanilla (eager)"] and reads["LS(E1-γ2)"] < reads["LS(E1-γ2) (eager)"]
    table = capsys.readouterr().out
    assert "B=2" not in table and all(r["row"] in table for r in rows)
