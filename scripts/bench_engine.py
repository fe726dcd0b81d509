"""Engine efficiency, per model: what each method's wall clock delivers of what its accounting predicts, what DEL's
controller costs, and how close Vanilla comes to the memory-bandwidth floor measured in the same run.

Per model (SmolLM2 and the LayerSkip testbed by default) and per decoder-layer loop (--layers: the eager Python loop
and the fused C++ one, del_bench/models/fused.py — before and after), rows Vanilla, LS (the model's default E, γ; the
testbed: its best static point), DEL as published and `del_cpu`, interleaved prompt by prompt (each row decodes prompt
i before any decodes prompt i + 1) with a memory-bandwidth probe before each prompt, so the drift of a shared machine
(±10%) hits every row and the floor alike. Every row is a normal run directory (records and all) under --root; a
row's speedup is against the Vanilla of its own layer loop (they pair: RunKey's machine names the loop).

Columns:
- tok/s: generated tokens ÷ wall seconds per prompt (prefill included), mean over prompts (paper B.4);
- speedup, pred., meas/pred: tok/s ÷ Vanilla's; eTPL × L (Vanilla's eTPL is 1/L); their ratio — how much of the
  accounting's promise the wall clock keeps (bench_del.table_row / add_speedups);
- ctrl: the method's own time (plan, keep_drafting, observe, shadow tokens, a layer-skip selection: Round.policy_s)
  ÷ decode time;
- ms/tok: decode time per emitted token, prefill excluded (rounds ≥ 1 of rounds.jsonl);
- floor: Vanilla only — (bytes of weights one token reads ÷ the probe's GB/s) ÷ ms/tok: 1.0 = at the floor;
- gemv: Vanilla only — a token's matrix products alone (gemv_ms, same run) ÷ ms/tok: 1.0 = every other op is free.
  On this CPU the layer-sized GEMVs stream slower than the probe's large one, so gemv < floor bounds what any loop
  can reach.
The probe streams a large [in, out] fp32 matrix with x @ W at one row, the engine's own GEMV layout (layer_stack
stores q|k|v, o, gate|up and the head transposed), median of a few passes; the weights a Vanilla token reads are
every decoder layer's matrices and norms plus the final norm and the LM head (the embedding row and the KV cache
are left out: < 3% at these lengths). Warm-up and start-up (model load, building and checking the fused loop, the
measured costs of cost_model=measured) are untimed and reported apart: `setup_s` per model and loop here, setup.jsonl
in each run.

    python scripts/bench_engine.py [--models smollm2-135m,testbed] [--layers eager,fused] [--limit 6]
                                   [--max-new-tokens 128] [--probe-mb 512] [--threads 2] [--quick]
                                   [--methods clasp,knapspec,del_knapspec]
                                   [--out results/runs/bench/engine.json]

--quick: 2 prompts, 48 new tokens, a 256 MB probe (a few minutes; a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_del import OFFLINE, add_speedups, compose, run_interleaved, table_row  # noqa: E402
from bench_engine_parts import ms  # noqa: E402 (median ms after a warm-up)

from del_bench.models.layer_stack import _linear  # noqa: E402
from del_bench.records import RunDir  # noqa: E402
from del_bench.runner import load_model, provenance  # noqa: E402

LS_POINT = {"testbed": (4, 4)}  # the testbed's best static (E, γ) (make bench-testbed); else the model's default


def rows_for(model: str, extra: list[str] = ()) -> list[tuple[str, list[str]]]:
    """(label, method overrides) of one model's rows; Vanilla first (the others' speedups are against it); `extra`:
    more method configs as rows, each with its defaults (e.g. clasp, knapspec, del_knapspec)."""
    ls = ["method=ls"]
    if model in LS_POINT:
        e, g = LS_POINT[model]
        ls += [f"method.exit_layer={e}", f"method.gamma={g}"]
    return [("Vanilla", ["method=vanilla"]), ("LS", ls), ("DEL (paper)", ["method=del"]),
            ("DEL del_cpu", ["method=del_cpu"]), *((name, [f"method={name}"]) for name in extra)]


@torch.inference_mode()
def stream_gbps(mb: int, reps: int = 5) -> float:
    """GB/s of x @ W for one row x [1, in] and W [in, out] fp32 of about `mb` MB (≫ any cache), median of reps."""
    cols = 16384
    rows = mb * 2**20 // (4 * cols)
    w = torch.randn(rows, cols)  # [in, out], contiguous: the engine's layout
    x = torch.randn(1, rows)
    x @ w  # first touch
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x @ w
        times.append(time.perf_counter() - t0)
    return w.numel() * 4 / statistics.median(times) / 1e9


@torch.inference_mode()
def gemv_ms(stack, reps: int = 5) -> float:
    """Milliseconds of one token's matrix products alone, as the engine computes them (layer_stack._linear: every
    layer's q|k|v, o, gate|up and down, then the LM head, at one position), median of reps: what this BLAS streams
    on these shapes, with no other op between them. Floor ÷ this is the best a Vanilla token could reach with every
    other op free."""
    mats = [w for lay in stack.layers for w in (lay.w_qkv, lay.w_o, lay.w_gate_up, lay.w_down)]
    rows = {w.shape[1]: torch.randn(1, 1, w.shape[1], dtype=w.dtype, device=w.device) for w in mats}
    head_row = torch.randn(1, 1, stack.head_weight.shape[1], dtype=stack.dtype, device=stack.head_weight.device)

    def products():
        for w in mats:
            _linear(rows[w.shape[1]], w, None)
        stack.head(head_row)

    return ms(products, reps)


def token_bytes(stack) -> int:
    """Bytes of weights one Vanilla token reads: every decoder layer's tensors, the final norm, the LM head [V, D]."""
    tensors = [t for lay in stack.layers for t in vars(lay).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in [*tensors, stack.norm_weight, stack.head_weight])


def decode_ms_per_token(out_dir: str) -> float:
    """Decode time per emitted token, prefill (round 0) excluded, pooled over the run's prompts."""
    rounds = [r for r in RunDir(out_dir).rounds() if r["round"] > 0]
    seconds = sum(r["draft_s"] + r["verify_s"] + r["policy_s"] for r in rounds)
    return 1000 * seconds / max(1, sum(r["emitted"] for r in rounds))


def bench_model(model: str, args) -> dict:
    """One model's rows for each layer loop, interleaved prompt by prompt, with a bandwidth probe (and the GEMV-only
    time of a token) before each prompt."""
    loads, setup_s, specs = {}, {}, []
    for layers in args.layers.split(","):
        t0 = time.perf_counter()
        loads[layers] = load_model(compose(f"model={model}").model, layers)  # (Loaded, LayerStack): every row's
        setup_s[layers] = time.perf_counter() - t0
        if loads[layers][1].layer_path != layers:
            raise SystemExit(f"{model}: layers={layers} gave the {loads[layers][1].layer_path} loop")
        for label, overrides in rows_for(model, [m for m in args.methods.split(",") if m]):
            cfg = compose(f"model={model}", f"task={args.task}", f"max_new_tokens={args.max_new_tokens}",
                          f"threads={args.threads}", f"layers={layers}", *OFFLINE[args.task], *overrides)
            cfg.out_dir = f"{args.root}/{model}/{layers}/{cfg.method.tag}"  # a re-run skips finished prompts
            cfg.experiment_name = args.experiment
            specs.append((f"{label} [{layers}]", cfg, lambda stack=loads[layers]: stack))
    torch.set_num_threads(args.threads)
    stack = next(iter(loads.values()))[1]
    probes, gemv = [], []

    def measure_floor():
        probes.append(stream_gbps(args.probe_mb))
        gemv.append(gemv_ms(stack))

    done = run_interleaved(specs, args.limit, before_prompt=measure_floor)
    rows = [table_row(args.task, label, cfg, summary) for label, cfg, summary in done]
    add_speedups(rows)
    gbps = statistics.median(probes)
    weights = token_bytes(stack)
    floor_ms = 1000 * weights / (gbps * 1e9)
    for r in rows:
        r["model"], r["decode_ms_per_token"] = model, decode_ms_per_token(r["out_dir"])
        r["floor_fraction"] = floor_ms / r["decode_ms_per_token"] if r["method_tag"] == "vanilla" else None
    return {"model": model, "rows": rows, "probe_gbps": probes, "gbps": gbps, "token_bytes": weights,
            "floor_ms_per_token": floor_ms, "gemv_ms_per_token": gemv, "setup_s": setup_s,
            "layer_setup_s": {k: v[1].layer_setup_s for k, v in loads.items()}}


def print_model(res: dict) -> None:
    gemv = statistics.median(res["gemv_ms_per_token"])
    setup = ", ".join(f"{k} {v:.1f} s (of which building/checking the loop {res['layer_setup_s'][k]:.1f} s)"
                      for k, v in res["setup_s"].items())
    print(f"\n{res['model']}: probe {res['gbps']:.1f} GB/s (per prompt: "
          f"{', '.join(f'{g:.1f}' for g in res['probe_gbps'])}), one token reads {res['token_bytes'] / 1e6:.0f} MB "
          f"→ floor {res['floor_ms_per_token']:.2f} ms/token; its matrix products alone take {gemv:.2f} ms "
          f"(= {res['floor_ms_per_token'] / gemv:.2f} of the floor); setup, untimed: {setup}")
    print(f"  {'row':<22} {'tok/s':>7} {'speedup':>8} {'pred.':>6} {'meas/pred':>9} {'ctrl':>6} {'ms/tok':>7} "
          f"{'floor':>6} {'gemv':>5}")
    for r in res["rows"]:
        ctrl = f"{r['controller_share']:.1%}" if r["controller_share"] is not None else "-"
        floor = f"{r['floor_fraction']:.2f}" if r["floor_fraction"] is not None else ""
        of_gemv = f"{gemv / r['decode_ms_per_token']:.2f}" if r["floor_fraction"] is not None else ""
        print(f"  {r['row']:<22} {r['tokens_per_s']:>7.2f} {r['speedup']:>7.2f}x {r['predicted_speedup']:>5.2f}x "
              f"{r['measured_over_predicted']:>9.2f} {ctrl:>6} {r['decode_ms_per_token']:>7.2f} {floor:>6} "
              f"{of_gemv:>5}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,testbed")
    ap.add_argument("--task", default="humaneval", choices=sorted(OFFLINE))
    ap.add_argument("--limit", type=int, default=6, help="prompts per row")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--probe-mb", type=int, default=512, help="size of the bandwidth probe's matrix")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default="eager,fused", help="layer loops to compare (each row runs under each)")
    ap.add_argument("--methods", default="", help="more method configs as rows (e.g. clasp,knapspec,del_knapspec)")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 48 new tokens, 256 MB probe: a smoke test")
    ap.add_argument("--root", default="results/runs/bench/engine_runs")
    ap.add_argument("--out", default="results/runs/bench/engine.json")
    ap.add_argument("--experiment", default="bench-engine", help="recorded in every row's run_key.experiments")
    args = ap.parse_args()
    if args.quick:
        args.limit, args.max_new_tokens, args.probe_mb = 2, 48, 256
        args.root += "-quick"
    results = [bench_model(model, args) for model in args.models.split(",")]
    print(f"\n{args.task}, {args.limit} prompts/row, {args.max_new_tokens} new tokens, greedy, "
          f"{args.threads} threads; rows interleaved per prompt")
    for res in results:
        print_model(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for res in results:
        for r in res["rows"]:
            r.pop("_key")
    out.write_text(json.dumps({"settings": vars(args), "models": results, "provenance": provenance()}, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
