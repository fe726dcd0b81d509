"""scripts/bench_gpu.py (make bench-gpu) at a tiny shape on the CPU: every row runs, the figures are there and sane."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_gpu.py"
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "128",
        "--device", "cpu", "--threads", "1", "--loop", "eager"]  # eager: no build of the fused loop in this test


def bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_gpu_runs_every_row_at_a_tiny_shape(tmp_path, capsys):
    """float32, so our rows must equal generate exactly; the probe measures a bandwidth; the JSON and table agree."""
    out = tmp_path / "gpu.json"
    report = bench_gpu().main([*TINY, "--dtype", "float32", "--prompts", "2", "--prompt-len", "6",
                               "--max-new-tokens", "6", "--configs", "1:2", "--probe-mb", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == ["ours Vanilla", "HF generate", "ours LS(E=1, γ=2)", "HF assistant_early_exit(E=1, γ=2)",
                          "ours DEL"]
    assert report["bandwidth_source"] == "GEMV probe" and report["bandwidth_gbps"] > 0
    for name, r in rows.items():
        assert len(r["per_prompt_tokens_per_s"]) == 2 and r["tokens_per_s"] > 0 and r["roofline_x"] > 0, name
        assert r["peak_memory_bytes"] > 0, name
        assert (r["etpl"] is not None) == name.startswith("ours"), name
    assert rows["ours Vanilla"]["etpl"] == 1 / 2  # one token per full pass of the 2 layers
    assert rows["ours Vanilla"]["equal_hf_generate"] == rows["ours LS(E=1, γ=2)"]["equal_hf_generate"] == 2
    bytes_ = report["bytes"]
    assert bytes_["layer"] == 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64)  # q, o; k, v (GQA); MLP; norms
    assert bytes_["head"] == 4 * (128 * 64 + 64)
    table = capsys.readouterr().out
    assert all(name in table for name in rows)


def test_bench_gpu_builds_the_model_in_the_dtype_on_the_device():
    module = bench_gpu()
    args = module.parse_args([*TINY, "--dtype", "bfloat16"])
    model = module.build_model(args, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 2
    assert torch.get_default_dtype() == torch.float32  # restored


def test_nominal_bandwidth_tells_the_variants_apart():
    module = bench_gpu()
    names = {"NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H100 PCIe": 2000.0, "NVIDIA A100-SXM4-80GB": 2039.0,
             "NVIDIA A100-SXM4-40GB": 1555.0, "NVIDIA L40S": 864.0, "NVIDIA L4": 300.0, "Some GPU": None}
    assert {name: module.nominal_gbps(name) for name in names} == names
