"""`python -m del_bench bench gpu` (make bench-gpu) at a tiny shape on the CPU: every row runs with records, the
figures are there and sane."""

from __future__ import annotations

import json

import torch

from del_bench.bench import gpu as bench_gpu
from del_bench.records import read_jsonl

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "128",
        "--device", "cpu", "--threads", "1", "--loop", "eager"]  # eager: no build of the fused loop in this test


def test_bench_gpu_runs_every_row_at_a_tiny_shape(tmp_path, capsys):
    """float32, so our rows must equal generate exactly; the probe measures a bandwidth; the JSON and table agree."""
    out = tmp_path / "gpu.json"
    report = bench_gpu.bench(bench_gpu.parse_args([
        *TINY, "--dtype", "float32", "--prompts", "2", "--prompt-len", "6", "--max-new-tokens", "6", "--configs", "1:2",
        "--probe-mb", "8", "--out", str(out), "--root", str(tmp_path / "runs"), "--set", "warmup_tokens=2"]))
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(report["rows"]))
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == ["Vanilla", "HF generate †", "LS(E1-γ2)", "HF assistant_early_exit(E1-γ2) †", "DEL"]
    assert report["bandwidth_source"] == "GEMV probe" and report["bandwidth_gbps"] > 0
    for name, r in rows.items():
        samples = read_jsonl(tmp_path / "runs" / r["method_tag"] / "samples.jsonl")
        assert len(samples) == 2 and all(s["generated_tokens"] == 6 for s in samples), name  # no EOS: to the end
        assert r["tokens_per_s"] > 0 and r["roofline_x"] > 0 and r["peak_gib"] > 0, name
        assert (r.get("hbm_fraction") is None) == name.endswith("†"), name  # what our loop streamed: ours only
        assert r["equal_generate"] == "2/2" and r["speedup"] is not None, name  # float32: lossless; peers pair
    assert rows["Vanilla"]["etpl"] == rows["HF generate †"]["etpl"] == 1 / 2  # one token per full pass of 2 layers
    bytes_ = report["bytes"]
    assert bytes_["layer"] == 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64)  # q, o; k, v (GQA); MLP; norms
    assert bytes_["head"] == 4 * (128 * 64 + 64)
    table = capsys.readouterr().out
    assert all(name in table for name in rows)


def test_bench_gpu_builds_the_model_in_the_dtype_on_the_device():
    args = bench_gpu.parse_args([*TINY, "--dtype", "bfloat16"])
    model = bench_gpu.build_model(args, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 2
    assert torch.get_default_dtype() == torch.float32  # restored


def test_nominal_bandwidth_tells_the_variants_apart():
    names = {"NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H100 PCIe": 2000.0, "NVIDIA A100-SXM4-80GB": 2039.0,
             "NVIDIA A100-SXM4-40GB": 1555.0, "NVIDIA L40S": 864.0, "NVIDIA L4": 300.0, "Some GPU": None}
    assert {name: bench_gpu.nominal_gbps(name) for name in names} == names
