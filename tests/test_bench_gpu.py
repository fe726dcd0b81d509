"""`python -m del_bench bench gpu` (make bench-gpu) at a tiny shape on the CPU (on CUDA too where there is one): every
row runs with records, the figures are there and sane; eager and captured rows, a refused compile a row that says
why; per-prompt speed; "= generate" by the near-tie rule; the random model made on the device, deterministic."""

from __future__ import annotations

import json

import pytest
import torch

from del_bench.bench import gpu as bench_gpu
from del_bench.bench import harness as h
from del_bench.engine import path_choice
from del_bench.records import read_jsonl
from tests.conftest import DEVICES, compose_run

TINY = ["--shape", "tiny", "--threads", "1", "--loop", "eager"]  # eager: no build of the fused loop in this test
SMALL = ["--prompts", "2", "--prompt-len", "6", "--max-new-tokens", "6", "--configs", "1:2", "--probe-mb", "8"]


def run_bench(tmp_path, *argv, **kwargs):
    out = tmp_path / "gpu.json"
    report = bench_gpu.bench(bench_gpu.parse_args([*TINY, *SMALL, *argv, "--out", str(out),
                                                   "--root", str(tmp_path / "runs"), "--set", "warmup_tokens=2"]),
                             **kwargs)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(report["rows"]))
    return report, {r["row"]: r for r in report["rows"]}


def test_bench_gpu_runs_every_row_at_a_tiny_shape(tmp_path, capsys):
    """float32, so our rows must equal generate exactly; the probe measures a bandwidth; the JSON and table agree;
    per-prompt speeds are the records' own, in decode order."""
    report, rows = run_bench(tmp_path, "--device", "cpu", "--dtype", "float32", "--captured", "off")
    assert list(rows) == ["Vanilla (eager)", "LS(E1-γ2) (eager)", "DEL (eager)", "HF generate †",
                          "HF assistant_early_exit(E1-γ2) †"]
    assert report["bandwidth_source"] == "GEMV probe" and report["bandwidth_gbps"] == report["probe"]["gbps"] > 0
    assert report["probe"]["timer"] == "host clock" and report["probe"]["median_gbps"] <= report["probe"]["gbps"]
    for name, r in rows.items():
        samples = read_jsonl(tmp_path / "runs" / r["method_tag"] / "samples.jsonl")
        assert len(samples) == 2 and all(s["generated_tokens"] == 6 for s in samples), name  # no EOS: to the end
        assert r["tokens_per_s"] > 0 and r["roofline_x"] > 0 and r["peak_gib"] > 0, name
        assert (r.get("hbm_fraction") is None) == name.endswith("†"), name  # what our loop streamed: ours only
        assert r["speedup"] is not None, name  # peers pair with our eager Vanilla
        assert r["per_prompt"] == [s["tokens_per_s"] for s in samples], name
        assert r["first_over_rest"] == pytest.approx(r["per_prompt"][0] / r["per_prompt"][1]), name
        assert all(s["top2_gap_ulps"] is None for s in samples), name  # full precision: no gaps to judge by
        if name != "HF generate †":  # float32: lossless, every output equal
            assert r["equal_generate"] == "2/2", name
    assert all(r["equal_vanilla"] == "2/2" for name, r in rows.items() if not name.startswith("Vanilla"))
    assert rows["Vanilla (eager)"]["etpl"] == rows["HF generate †"]["etpl"] == 1 / 2  # one token per pass of 2 layers
    bytes_ = report["bytes"]
    assert bytes_["layer"] == 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64)  # q, o; k, v (GQA); MLP; norms
    assert bytes_["head"] == 4 * (128 * 64 + 64)
    assert bytes_["kv_per_position"] == 4 * 2 * 2 * 2 * 16  # K and V, 2 layers, 2 KV heads of 16
    token_bytes = 2 * bytes_["layer"] + bytes_["head"] + bytes_["kv_per_position"] * (6 + 6 / 2)  # mean context
    roofline = report["bandwidth_gbps"] * 1e9 / token_bytes  # tok/s: bandwidth ÷ the bytes a token streams
    for name, r in rows.items():
        assert r["roofline_x"] == pytest.approx(r["tokens_per_s"] / roofline), name
    out = capsys.readouterr().out
    assert all(name in out for name in rows) and "tok/s per prompt" in out


@pytest.mark.parametrize("device", DEVICES)
def test_bench_gpu_half_precision_eager_and_captured_rows(device, tmp_path, capsys):
    """bf16, as a GPU runs it: generate's records carry its top-2 gaps, so every output of ours is equal to it or
    departs at a near-tie, never for real. The captured rows: on CUDA they must run the graphs (graphs: the eager
    kernels captured; on: inductor's fused kernels captured — each held to the near-tie rule); on the CPU they would
    compile with inductor for a minute — what they do there is tests/test_compiled.py's, so the CPU run has the eager
    rows only."""
    captured = "graphs,on" if device == "cuda" else "off"
    _, rows = run_bench(tmp_path, "--device", device, "--dtype", "bfloat16", "--captured", captured, "--no-del")
    generate = read_jsonl(tmp_path / "runs" / rows["HF generate †"]["method_tag"] / "samples.jsonl")
    assert all(len(s["top2_gap_ulps"]) == s["generated_tokens"] for s in generate)
    ours = [r for name, r in rows.items() if "†" not in name and "failure" not in r]
    assert {r["path"] for r in ours} >= {"eager"}
    for r in ours:
        vs = r["vs_generate"]
        assert vs["departs_at"] == [] and vs["outputs_compared"] == 2, r["row"]
        assert vs["outputs_equal"] + len(vs["near_tie_at"]) == 2, r["row"]
    captured = [r for name, r in rows.items() if name.endswith("graphs)")]
    if device == "cuda":
        assert [r["row"] for r in captured] == ["Vanilla (graphs)", "LS(E1-γ2) (graphs)", "Vanilla (fused graphs)",
                                                "LS(E1-γ2) (fused graphs)"]
        assert [r["graph_kind"] for r in captured] == ["cuda_graphs"] * 2 + ["fused_cuda_graphs"] * 2
        assert all("failure" not in r and r["graphs"] for r in captured), [r.get("failure") for r in captured]
    else:
        assert captured == []


def test_every_row_is_also_a_fraction_of_the_bandwidth_probed_in_the_same_run(tmp_path, capsys):
    """The roofline measured, not assumed: the bench probes a weight-sized GEMV in the run (here a stand-in probe
    reporting 50 GB/s; on CUDA probe_bandwidth times it with CUDA events) and each row's roofline and HBM fraction
    are given against it beside those against the data sheet's figure (here --bandwidth 200)."""
    asked = []

    def probe(device, dtype, megabytes):
        asked.append((device.type, dtype, megabytes))
        return {"gbps": 50.0, "median_gbps": 40.0, "megabytes": megabytes, "dtype": "float32", "timer": "stand-in"}

    report, rows = run_bench(tmp_path, "--device", "cpu", "--dtype", "float32", "--captured", "off", "--no-del",
                             "--bandwidth", "200", probe=probe)
    assert asked == [("cpu", torch.float32, 8)] and report["probe"]["gbps"] == 50.0
    assert report["bandwidth_gbps"] == 200.0 and report["bandwidth_source"] == "--bandwidth"
    for name, r in rows.items():
        assert r["roofline_probe_x"] == pytest.approx(4 * r["roofline_x"]), name  # 200 / 50
        if "†" not in name:
            assert r["hbm_probe_fraction"] == pytest.approx(4 * r["hbm_fraction"]), name
    out = capsys.readouterr().out
    assert "50 GB/s probed (8 MiB float32 GEMV, stand-in)" in out and "HBM/probe" in out


def test_batched_rows_are_checked_against_generate_and_scaled_over_batch_1(tmp_path):
    """--batch B: Vanilla and LS at batch_size=B after the other rows, B prompts at a time, each held to generate and
    to its path's Vanilla (float32: equal), its speedup by throughput over Vanilla at B, its scaling over itself at
    batch size 1, its roofline by throughput."""
    report, rows = run_bench(tmp_path, "--device", "cpu", "--dtype", "float32", "--captured", "off", "--no-del",
                             "--peers", "generate", "--batch", "2")
    assert list(rows) == ["Vanilla (eager)", "LS(E1-γ2) (eager)", "HF generate †", "Vanilla B=2 (eager)",
                          "LS(E1-γ2) B=2 (eager)"]
    vanilla, ls, alone = rows["Vanilla B=2 (eager)"], rows["LS(E1-γ2) B=2 (eager)"], rows["LS(E1-γ2) (eager)"]
    for r in (vanilla, ls):
        assert r["batch_size"] == 2 and r["equal_generate"] == "2/2" and r["equal_vanilla"] == "2/2", r["row"]
        one = rows["Vanilla (eager)"]  # the same prompts and lengths: the same bytes a token
        assert r["roofline_x"] / r["throughput"] == pytest.approx(one["roofline_x"] / one["tokens_per_s"]), r["row"]
    assert ls["speedup"] == pytest.approx(ls["throughput"] / vanilla["throughput"])
    assert ls["scaling"] == pytest.approx(ls["throughput"] / alone["throughput"])
    assert alone["batch_size"] == 1 and "scaling" not in alone
    with pytest.raises(SystemExit):
        bench_gpu.parse_args([*TINY, "--batch", "4", "--prompts", "2"])


def test_the_random_model_is_made_on_the_device_in_the_dtype_and_by_the_seed():
    args = bench_gpu.parse_args([*TINY, "--dtype", "bfloat16"])
    model = bench_gpu.build_model(args, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 2
    assert torch.get_default_dtype() == torch.float32  # restored
    again = bench_gpu.build_model(args, torch.device("cpu"))
    other = bench_gpu.build_model(bench_gpu.parse_args([*TINY, "--dtype", "bfloat16", "--seed", "1"]), "cpu")
    weights = [dict(m.named_parameters()) for m in (model, again, other)]
    assert all(torch.equal(p, weights[1][k]) for k, p in weights[0].items())
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(weights[0][up], weights[2][up])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the on-device build ran on CPU only")
def test_the_random_model_is_built_on_cuda_without_a_host_copy():
    """On the device, in the dtype: the GPU's peak is the bf16 weights (a float32 build cast after would be 3×)."""
    args = bench_gpu.parse_args([*TINY, "--dtype", "bfloat16", "--hidden", "512", "--intermediate", "1024",
                                 "--vocab", "4096"])  # tensors large enough that the allocator's rounding is noise
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = bench_gpu.build_model(args, torch.device("cuda"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cuda", torch.bfloat16)}
    assert torch.cuda.max_memory_allocated() - base < 1.2 * weights
    again = bench_gpu.build_model(args, torch.device("cuda"))  # the same seed on the same device: the same weights
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_shapes_by_name_and_flags_over_them():
    args = bench_gpu.parse_args(["--shape", "llama3-8b"])
    assert (args.layers, args.kv_heads, args.intermediate, args.vocab) == (32, 8, 14336, 128256)
    assert bench_gpu.parse_args([]).intermediate == 11008  # Llama-2-7B by default
    assert bench_gpu.parse_args(["--shape", "llama3-8b", "--layers", "4"]).layers == 4
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--shape", "llama9"])


def test_bench_gpu_on_the_testbed(tmp_path):
    """--model testbed: the trained checkpoint through the runner's loader, its held-out code prompts and its LS."""
    report, rows = run_bench(tmp_path, "--model", "testbed", "--device", "cpu", "--dtype", "float32",
                             "--captured", "off", "--no-peers", "--no-del", "--configs", "")
    assert list(rows) == ["Vanilla (eager)", "LS(E6-γ2) (eager)"]  # configs/model/testbed.yaml's default LS
    assert report["bytes"]["num_layers"] == 16 and rows["LS(E6-γ2) (eager)"]["equal_vanilla"] == "2/2"
    assert all(r["model"] == "testbed" and r["task"] == "prompts" for r in rows.values())


def test_nominal_bandwidth_tells_the_variants_apart():
    names = {"NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H100 PCIe": 2000.0, "NVIDIA A100-SXM4-80GB": 2039.0,
             "NVIDIA A100-SXM4-40GB": 1555.0, "NVIDIA L40S": 864.0, "NVIDIA L4": 300.0, "Some GPU": None}
    assert {name: bench_gpu.nominal_gbps(name) for name in names} == names


# ---- the harness pieces bench gpu reads its rows with ------------------------------------------------------------

def write_samples(path, outputs, gaps=None, speeds=None):
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"sample_id": str(i), "repeat": 0, "output_ids": out, "tokens_per_s": (speeds or [1.0] * 9)[i],
             "top2_gap_ulps": None if gaps is None else gaps[i]} for i, out in enumerate(outputs)]
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_lossless_vs_judges_a_departure_by_the_references_gaps(tmp_path):
    """Equal, a first departure where the reference's top-2 gap is a near-tie (≤ NEAR_TIE_ULPS), one where it is not;
    the departing run's own gaps say the opposite and must not be read."""
    ref = write_samples(tmp_path / "ref", [[1, 2, 3], [4, 5, 6], [7, 8, 9]], gaps=[[9, 9, 9], [9, 2.0, 9], [9, 9, 40]])
    run = write_samples(tmp_path / "run", [[1, 2, 3], [4, 0, 6], [7, 8, 0]], gaps=[[0, 0, 0], [0, 40, 0], [0, 0, 1]])
    vs = h.lossless_vs(run, ref, "generate")
    assert (vs["outputs_equal"], vs["outputs_compared"], vs["near_tie_at"], vs["departs_at"]) == (1, 3, [1], [2])
    assert vs["cell"] == "1/3 (1 near-tie, 1 real)"
    assert vs["note"] == "outputs = generate 1/3; near-tie departures 1 at tokens 1; real departures 1 at tokens 2"
    full = write_samples(tmp_path / "full", [[1, 2, 3], [4, 5, 6], [7, 8, 9]])  # no gaps (full precision): real
    assert h.lossless_vs(run, full)["departs_at"] == [1, 2]
    assert h.lossless_vs(full, full)["cell"] == "3/3"


def test_per_prompt_speed_is_the_first_against_the_median_of_the_rest(tmp_path):
    run = write_samples(tmp_path / "run", [[1]] * 4, speeds=[25.0, 28.0, 186.0, 190.0])
    speed = h.per_prompt_speed(run)
    assert speed["per_prompt"] == [25.0, 28.0, 186.0, 190.0] and speed["rest_median"] == 186.0
    assert speed["first_over_rest"] == pytest.approx(25 / 186)
    one = h.per_prompt_speed(write_samples(tmp_path / "one", [[1]], speeds=[9.0]))
    assert one["first"] == 9.0 and one["rest_median"] is None and one["first_over_rest"] is None


def test_a_row_that_may_fail_is_left_with_its_reason_and_the_others_go_on(tmp_path):
    """An error in a may_fail row (bench gpu's captured rows: a refused compile) ends that row only, before or after
    prompts it decoded; in any other row it ends the bench."""
    from del_bench.engine.compiled import CompileUnavailable

    def refused():
        raise CompileUnavailable("no graphs here")

    def cfg(name):
        return compose_run("model=tiny-random", "task=humaneval", "data=local", "method=vanilla", "max_new_tokens=2",
                           "warmup_tokens=0", "threads=1", "layers=eager", f"out_dir={tmp_path / name}")

    rows = [h.BenchRow("refused", cfg("a"), load=refused, may_fail=True), h.BenchRow("fine", cfg("b"))]
    h.run_rows(rows, 2)
    assert rows[0].failure == "CompileUnavailable: no graphs here" and rows[0].summary == {}
    assert rows[1].failure is None and rows[1].summary["n_samples"] == 2
    assert h.finished(rows) == [rows[1]]
    with pytest.raises(CompileUnavailable):
        h.run_rows([h.BenchRow("refused", cfg("c"), load=refused)], 1)


def test_a_peer_after_a_captured_row_is_recorded_as_the_loop_it_ran(tmp_path):
    """Interleaved rows share one stack, and a captured row's graphs stay made for it (static_steps.memo); a peer
    after it never runs them, so its records must not say '+compiled' (it would pair with the wrong Vanilla)."""
    from del_bench.methods.peers import peer_method
    from del_bench.methods.vanilla import Vanilla
    from del_bench.session import load_model

    cfg = compose_run("model=tiny-random", "task=humaneval", "data=local", "max_new_tokens=2", "limit=1",
                      "warmup_tokens=0", "threads=1", "layers=eager", f"out_dir={tmp_path / 'peer'}")
    cfg.method = peer_method("hf_generate")
    loaded, stack = load_model(cfg.model, "eager")
    path_choice.choose_graphs(stack, "on", Vanilla(), 2, backend="eager")  # what a captured row before it made
    h.run_rows([h.BenchRow("HF generate †", cfg, load=lambda: (loaded, stack))], 1)
    assert [s["layer_path"] for s in read_jsonl(tmp_path / "peer" / "samples.jsonl")] == ["eager"]


def test_a_lookahead_row_decodes_dels_tokens_in_fewer_reads(tmp_path):
    """--del-lookahead K adds DEL reading its stop decisions K candidates at a time: a run of its own (its tag), the
    same greedy outputs as DEL's."""
    _, rows = run_bench(tmp_path, "--captured", "off", "--no-peers", "--del-lookahead", "3")
    plain, ahead = rows["DEL (eager)"], rows["DEL lookahead 3 (eager)"]
    assert ahead["method_tag"] == "del-lookahead3" and plain["out_dir"] != ahead["out_dir"]
    outputs = [[s["output_ids"] for s in read_jsonl(tmp_path / "runs" / r["method_tag"] / "samples.jsonl")]
               for r in (plain, ahead)]
    assert outputs[0] == outputs[1]
