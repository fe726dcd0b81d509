"""torch.compile vs our layer loops at one decode token: per-layer and whole-stack graphs (micro-benchmark).

One decode token (T = 1) through all layers at a fixed context, on the model's own weights and KV cache:
- eager: LayerStack.forward_layers — the engine's Python loop and the reference (and, for comparison, the fused C++
  loop the engine uses by default, layers=auto: del_bench/models/fused.py);
- per-layer graph: one compiled function for a decoder layer, its weights and cache passed as inputs, positions
  dynamic: recompilation is bounded (one graph per batch width T), so any exit layer E reuses it;
- whole-stack graph: all L layers in one compiled function (what gpt-fast compiles): the most fusion, but one graph
  per layer range [a, b) × T — draft [0, E) and verify [E, L) for every E that DEL may choose.
Prints median ms per token, the compile time apart (first call, then new positions: recompiles), and how far the
compiled logits are from eager (float32: not bit for bit; the argmax is compared); the result file keeps the raw
seconds. Noisy on a shared machine: run it alone.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from del_bench.bench import harness as h
from del_bench.models import fused, loading
from del_bench.models.layer_stack import LayerStack, _linear, rms_norm


def parse(argv):
    ap = h.parser("compile", __doc__, runs=False)
    ap.add_argument("--models", default="testbed,smollm2-135m")
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: tracing only, no codegen)")
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True, help="also time the fused loop")
    return ap.parse_args(argv)


def layer_fn(stack: LayerStack):
    """The engine's decoder-layer math (LayerStack._attention + _mlp, no bias) as a pure function of tensors and
    the write position: what a compiled graph can take without guarding on the cache's Python-side lengths."""
    H, KV, hd, eps, scale = stack.n_heads, stack.n_kv_heads, stack.head_dim, stack.eps, stack.scale
    gqa = bool(KV != H)  # a constant: under dynamic=True an int comparison inside the graph would be a SymBool

    def layer(h, w_in, w_qkv, w_o, w_post, w_gate_up, w_down, k_cache, v_cache, cos, sin, pos: int):
        T = h.shape[1]
        qkv = _linear(rms_norm(h, w_in, eps), w_qkv, None).view(1, T, H + 2 * KV, hd)
        qk = qkv[:, :, : H + KV]
        qk = qk * cos + torch.roll(qk, hd // 2, dims=-1) * sin
        end = pos + T
        k_cache[:, :, pos:end] = qk[:, :, H:].transpose(1, 2)
        v_cache[:, :, pos:end] = qkv[:, :, H + KV :].transpose(1, 2)
        attn = F.scaled_dot_product_attention(qk[:, :, :H].transpose(1, 2), k_cache[:, :, :end],
                                              v_cache[:, :, :end], scale=scale, enable_gqa=gqa)
        h = _linear(attn.transpose(1, 2).reshape(1, T, H * hd), w_o, None, residual=h)
        gate, up = _linear(rms_norm(h, w_post, eps), w_gate_up, None).chunk(2, dim=-1)
        return _linear(F.silu(gate) * up, w_down, None, residual=h)

    return layer


def all_layers(stack: LayerStack, cache, layer):
    """h [1, T, D] at position pos through every layer with `layer` (eager or compiled)."""
    def run(h, pos: int):
        cos = stack._cos[pos : pos + h.shape[1]][None, :, None, :]
        sin = stack._sin[pos : pos + h.shape[1]][None, :, None, :]
        for i, w in enumerate(stack.layers):
            h = layer(h, w.w_in_norm, w.w_qkv, w.w_o, w.w_post_norm, w.w_gate_up, w.w_down, cache.k[i], cache.v[i],
                      cos, sin, pos)
        return h

    return run


@torch.inference_mode()
def bench(model: str, args) -> dict:
    """Raw seconds of each way, the compile times and the compiled logits' distance from eager."""
    stack = LayerStack(loading.load(h.model_config(model)).model)
    L, context = stack.num_layers, args.context
    cache = stack.new_cache(context + 64)
    ids = torch.randint(100, min(1000, stack.vocab_size), (1, context))  # a tiny model's vocabulary is smaller
    stack.forward_layers(stack.embed(ids), 0, L, 0, cache)
    x = stack.embed(torch.tensor([[42]]))
    reference = stack.logits(stack.forward_layers(x, 0, L, context, cache))
    out = {"eager": h.timings(lambda: stack.forward_layers(x, 0, L, context, cache), args.reps)}
    print(f"{model}: eager {h.median_ms(out['eager']):.2f} ms/token")
    # fullgraph: a graph break would silently measure something else
    compiled = torch.compile(layer_fn(stack), dynamic=True, fullgraph=True, backend=args.backend)
    per_layer = all_layers(stack, cache, compiled)
    torch._dynamo.reset()  # the whole-stack graph compiles from scratch, not from the per-layer one's caches
    whole = torch.compile(all_layers(stack, cache, layer_fn(stack)), dynamic=True, fullgraph=True,
                          backend=args.backend)
    for name, fn in (("per-layer graph", per_layer), ("whole-stack graph", whole)):
        t0 = time.perf_counter()
        logits = stack.logits(fn(x, context))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for pos in (context + 1, context + 2, context + 17):  # new positions: recompiles, if any
            fn(x, pos)
        later = time.perf_counter() - t0
        out[name] = h.timings(lambda fn=fn: fn(x, context), args.reps)
        t, eager = h.median_ms(out[name]), h.median_ms(out["eager"])
        out[f"{name}: compile s"], out[f"{name}: 3 new positions s"] = [first], [later]
        print(f"  {name:<18} {t:7.2f} ms/token ({t / eager:.2f}× eager); compile {first:.1f} s, 3 new positions "
              f"{later:.1f} s; max |Δlogit| {(logits - reference).abs().max().item():.1e}, argmax equal: "
              f"{bool(logits.argmax() == reference.argmax())}")
    if args.fused:
        stack.fused, _, _ = fused.choose(stack, "fused")  # the same stack and cache through the C++ loop
        out["fused loop"] = h.timings(lambda: stack.forward_layers(x, 0, L, context, cache), args.reps)
        print(f"  fused loop (C++)   {h.median_ms(out['fused loop']):7.2f} ms/token")
    return out


def main(argv: list[str]) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    seconds = {model: bench(model, args) for model in args.models.split(",")}
    h.write_result(args.out, "compile", vars(args), seconds=seconds)
    return 0
