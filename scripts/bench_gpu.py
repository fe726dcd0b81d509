"""GPU benchmark (make bench-gpu): a Llama-2-7B-shaped model with random weights, built in code (no hub), on one device.

Rows, greedy, the same random prompts: our Vanilla, LS(E, γ) and DEL (the paper's configuration) on our LayerStack /
Engine, against transformers' `generate` and `generate(assistant_early_exit=E, num_assistant_tokens=γ)` (confidence
threshold 0, so it drafts exactly γ) on the same weights (LayerStack re-points HF's modules at its own storage: one
copy). Every row gets one untimed warm-up generation, then the prompts are interleaved (each prompt runs every row back
to back). Clocks are read after torch.cuda.synchronize, so queued kernels are inside the measured time.

Per row: tokens/s (mean over prompts of new tokens ÷ seconds), `roofline_x` (tokens/s ÷ the memory-bandwidth
roofline of one-token decoding: bandwidth ÷ the bytes a token streams — every layer's weights, the final norm, the LM
head, and the KV cache read at the mean context; Vanilla's value is its fraction of the roofline, a speculative row can
exceed 1), for our rows `hbm_fraction` (the bytes our loop really streamed ÷ seconds ÷ bandwidth: loaded layers ×
one layer's bytes + (rounds + drafted) × the head's bytes; DEL's shadow-token head batches not counted), eTPL, α, how
many outputs equal HF generate's, and peak memory (CUDA: max_memory_allocated over the timed prompts; CPU: the peak RSS,
del_bench/memory.py). Bandwidth: --bandwidth GB/s, else the device's nominal figure (H100 SXM 3350, H100 PCIe 2000,
H200 4800, A100 2039/1555, …), else (CPU, unknown GPUs) a GEMV probe measured here.

Random weights: early layers almost never agree with the last, so drafts are rarely accepted and DEL's controller
mostly declines to draft. The rows measure the mechanics — what a round costs, how close one-token decoding gets to
the bandwidth roofline, peak memory — not the speedups of a LayerSkip checkpoint (run those with
`python -m del_bench run model=llama2-7b …`). bf16 outputs may depart from `generate` at near-ties (README "GPU").

    python scripts/bench_gpu.py [--layers 32 --hidden 4096 --heads 32 --kv-heads 32 --intermediate 11008 --vocab 32000]
        [--dtype bfloat16] [--device cuda] [--prompts 3 --prompt-len 128 --max-new-tokens 128] [--configs 8:6]
        [--bandwidth GB/s] [--out results/runs/bench/gpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.memory import PeakMemory
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.ls import LayerSkip
from del_bench.methods.vanilla import Vanilla
from del_bench.models.layer_stack import LayerStack
from del_bench.models.loading import DTYPES
from del_bench.runner import provenance

NOMINAL_GBPS = (  # (substring of torch.cuda.get_device_name, GB/s): HBM bandwidth from the vendors' data sheets
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),  # first match wins
    ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
    ("L40S", 864.0), ("A10G", 600.0), ("A10", 600.0), ("L4", 300.0), ("V100", 900.0),
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = ap.add_argument_group("model shape (default: Llama-2-7B)")
    shape.add_argument("--layers", type=int, default=32)
    shape.add_argument("--hidden", type=int, default=4096)
    shape.add_argument("--heads", type=int, default=32)
    shape.add_argument("--kv-heads", type=int, default=32)
    shape.add_argument("--intermediate", type=int, default=11008)
    shape.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--loop", default="auto", choices=("auto", "fused", "eager"), help="our decoder-layer loop")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", default="8:6", help="comma-separated E:γ for LS and assistant_early_exit")
    ap.add_argument("--no-del", action="store_true", help="leave out the DEL row")
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s (default: the device's nominal, or a probe)")
    ap.add_argument("--probe-mb", type=int, default=512, help="matrix size of the GEMV bandwidth probe")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/runs/bench/gpu.json")
    return ap.parse_args(argv)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args, device: torch.device):
    """A Llama with random weights of the given shape, initialised on the device in the dtype (no float32 copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)  # no EOS: every row runs to the end
    torch.manual_seed(args.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def nominal_gbps(device_name: str) -> float | None:
    """The data-sheet HBM bandwidth of a GPU by its torch.cuda.get_device_name (None: not in NOMINAL_GBPS)."""
    return next((gbps for key, gbps in NOMINAL_GBPS if key in device_name), None)


def nominal_bandwidth(device: torch.device) -> float | None:
    return nominal_gbps(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


@torch.inference_mode()
def probe_bandwidth(device: torch.device, dtype: torch.dtype, megabytes: int, reps: int = 10) -> float:
    """GB/s of y = W @ x over a W of `megabytes` (larger than the caches): what one-token decoding streams at best."""
    cols = 4096
    rows = max(1, megabytes * 2**20 // (cols * torch.tensor([], dtype=dtype).element_size()))
    w = torch.randn(rows, cols, dtype=dtype, device=device)
    x = torch.randn(cols, 1, dtype=dtype, device=device)
    torch.mm(w, x)
    best = float("inf")
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        torch.mm(w, x)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return w.numel() * w.element_size() / best / 1e9


def stream_bytes(model, args) -> dict:
    """Bytes one token streams: a decoder layer's weights, the final norm + LM head, and KV per cached position."""
    layer = model.model.layers[0]
    element = model.model.embed_tokens.weight.element_size()
    layer_bytes = sum(p.numel() for p in layer.parameters()) * element
    head_bytes = (model.lm_head.weight.numel() + model.model.norm.weight.numel()) * element
    head_dim = args.hidden // args.heads
    kv_per_position = 2 * args.layers * args.kv_heads * head_dim * element
    return {"layer": layer_bytes, "head": head_bytes, "kv_per_position": kv_per_position}


def hf_generate(model, prompt_ids, max_new_tokens, **kwargs):
    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist(), None


def rows_of(args, engine: Engine, model) -> list[tuple[str, object]]:
    """(name, generate(prompt, tokens) → (output ids, our Generation or None)) per row."""
    def ours(method):
        def gen(prompt, max_new_tokens):
            g = engine.generate(prompt, method, max_new_tokens, seed=0)
            return g.output_ids, g
        return gen

    def hf(**kwargs):
        return lambda p, m: hf_generate(model, p, m, **kwargs)

    rows = [("ours Vanilla", ours(Vanilla())), ("HF generate", hf())]
    for e, g in (tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")):
        rows.append((f"ours LS(E={e}, γ={g})", ours(LayerSkip(e, g))))
        rows.append((f"HF assistant_early_exit(E={e}, γ={g})",
                     hf(assistant_early_exit=e, num_assistant_tokens=g, assistant_confidence_threshold=0.0)))
    if not args.no_del:
        rows.append(("ours DEL", ours(DEL())))
    return rows


def measure(rows, prompts, max_new_tokens: int, device: torch.device) -> dict:
    """Interleaved timed generations (after one untimed warm-up per row): per row its speeds, outputs, generations
    and peak memory over its timed prompts."""
    for _, gen in rows:
        gen(prompts[0], 8)  # warm-up: kernel selection, allocator, the fused loop's first call
    stats = {name: {"speeds": [], "outputs": [], "gens": [], "peak": 0, "measure": ""} for name, _ in rows}
    for i, prompt in enumerate(prompts):
        for name, gen in rows:
            with PeakMemory(str(device)) as peak:
                synchronize(device)
                t0 = time.perf_counter()
                out, g = gen(prompt, max_new_tokens)
                synchronize(device)
                wall = time.perf_counter() - t0
            st = stats[name]
            st["speeds"].append(len(out) / wall)
            st["outputs"].append(out)
            st["gens"].append((g, wall))
            st["peak"], st["measure"] = max(st["peak"], peak.bytes or 0), peak.measure
        print(f"  prompt {i + 1}/{len(prompts)} done", flush=True)
    return stats


def summarise(stats, reference: str, sizes: dict, bandwidth: float, context: float) -> list[dict]:
    token_bytes = sizes["layer"] * sizes["num_layers"] + sizes["head"] + sizes["kv_per_position"] * context
    roofline = bandwidth * 1e9 / token_bytes  # tokens/s of one-token decoding at full bandwidth
    results = []
    for name, st in stats.items():
        speed = statistics.fmean(st["speeds"])
        row = {"row": name, "tokens_per_s": speed, "per_prompt_tokens_per_s": st["speeds"],
               "roofline_x": speed / roofline, "peak_memory_bytes": st["peak"], "memory_measure": st["measure"],
               "equal_hf_generate": sum(o == r for o, r in zip(st["outputs"], stats[reference]["outputs"])),
               "etpl": None, "acceptance": None, "hbm_fraction": None}
        gens = [(g, wall) for g, wall in st["gens"] if g is not None]
        if gens:
            drafted = sum(g.drafted for g, _ in gens)
            streamed = [(g.loaded_layers * sizes["layer"] + (len(g.rounds) + g.drafted) * sizes["head"]) / wall
                        for g, wall in gens]
            row.update(etpl=statistics.fmean(len(g.output_ids) / g.loaded_layers for g, _ in gens),
                       acceptance=sum(g.accepted for g, _ in gens) / drafted if drafted else None,
                       hbm_fraction=statistics.fmean(streamed) / (bandwidth * 1e9))
        results.append(row)
    return results


def print_table(results, n_prompts: int) -> None:
    def fmt(value, spec: str, width: int) -> str:
        return f"{'-' if value is None else format(value, spec):>{width}}"

    print(f"\n{'row':<38} {'tok/s':>8} {'roofline':>8} {'HBM':>5} {'eTPL':>6} {'α':>5} {'peak GiB':>8}  = generate")
    for r in results:
        print(f"{r['row']:<38} {r['tokens_per_s']:>8.2f} {fmt(r['roofline_x'], '.3g', 7)}x "
              f"{fmt(r['hbm_fraction'], '.2f', 5)} {fmt(r['etpl'], '.3f', 6)} {fmt(r['acceptance'], '.2f', 5)} "
              f"{r['peak_memory_bytes'] / 2**30:>8.2f}  {r['equal_hf_generate']}/{n_prompts}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    model = build_model(args, device)
    stack = LayerStack(model, layers=args.loop)
    engine = Engine(stack, Sampling(), eos_ids=set())
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    bandwidth, source = args.bandwidth, "--bandwidth"
    if bandwidth is None:
        bandwidth, source = nominal_bandwidth(device), "nominal"
    if bandwidth is None:
        bandwidth, source = probe_bandwidth(device, DTYPES[args.dtype], args.probe_mb), "GEMV probe"
    sizes = {**stream_bytes(model, args), "num_layers": args.layers}
    print(f"{args.layers} layers × {args.hidden} ({args.heads}/{args.kv_heads} heads, {args.intermediate} MLP, "
          f"{args.vocab} vocab), {args.dtype} on {device}; our loop: {stack.layer_path}; "
          f"bandwidth {bandwidth:.0f} GB/s ({source})")
    stats = measure(rows_of(args, engine, model), prompts, args.max_new_tokens, device)
    context = args.prompt_len + args.max_new_tokens / 2
    results = summarise(stats, "HF generate", sizes, bandwidth, context)
    print_table(results, len(prompts))
    report = {"settings": vars(args), "device": provenance()["device"], "layer_path": stack.layer_path,
              "bandwidth_gbps": bandwidth, "bandwidth_source": source, "bytes": sizes, "rows": results,
              "provenance": provenance(layer_path=stack.layer_path)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {out}")
    return report


if __name__ == "__main__":
    main()
