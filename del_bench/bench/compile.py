"""The graph-captured steps (engine/compiled.py) vs our layer loops at one decode token (micro-benchmark).

One decode token (T = 1) through all layers at a fixed context, on the model's own weights and KV cache:
- eager: LayerStack.forward_layers — the engine's Python loop and the reference (and the fused C++ loop the engine
  uses by default, layers=auto: del_bench/models/fused.py);
- per-layer graphs: the engine's static steps one layer at a time (StaticSteps, the layer's tensors passed in: one
  graph per width serves every layer, so any exit layer E reuses it — what DEL's rounds replay);
- whole-stack graph: all L layers as one step (what gpt-fast compiles; Vanilla's and a fixed E's chains): the most
  fusion, one graph per layer range [a, b) × width.
Both graphs are the engine's own (Graphs: torch.compile with --backend on a CPU; CUDA graphs with --capture on CUDA).
Prints median ms per token, the compile time apart (first call, then new positions: recompiles), and how far the
graphs' logits are from eager (float32: not bit for bit; the argmax is compared); the result file keeps the raw
seconds. Noisy on a shared machine: run it alone.
"""

from __future__ import annotations

import argparse
import time

import torch

from del_bench.bench import harness as h
from del_bench.engine.compiled import Graphs, StepShapes
from del_bench.models import fused, loading
from del_bench.models.layer_stack import LayerStack


def parse(argv):
    ap = h.parser("compile", __doc__, runs=False)
    ap.add_argument("--models", default="testbed,smollm2-135m")
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: tracing only, no codegen)")
    ap.add_argument("--capture", action="store_true", help="CUDA graphs instead of torch.compile (a CUDA model)")
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True, help="also time the fused loop")
    return ap.parse_args(argv)


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
    for name, chain in (("per-layer graph", False), ("whole-stack graph", True)):
        graphs = Graphs(stack, backend=args.backend, capture=args.capture)  # fullgraph: a graph break raises
        t0 = time.perf_counter()
        if chain:
            graphs.prepare(StepShapes(None, 0), context + 64)  # Vanilla's chain [0, L) at width 1
        elif graphs.capture:
            graphs.runner.cache_of(context + 64)  # the graphs are made on first use, on their own cache
        run_cache = graphs.cache or cache
        if run_cache is not cache:  # CUDA graphs decode in the cache they were captured on: the same prompt there
            stack.forward_layers(stack.embed(ids), 0, L, 0, run_cache)

        def step(pos: int, graphs=graphs, chain=chain, run_cache=run_cache):
            # collect=[]: every layer's state kept, as DEL's rounds ask, so the steps run layer by layer
            run_cache.lengths = [max(pos, context)] * L  # a later position's step (its slots' contents: a timing's)
            return graphs.forward_layers(x, 0, L, pos, run_cache, collect=None if chain else [])

        logits = stack.logits(step(context))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for pos in (context + 1, context + 2, context + 17):  # new positions: recompiles, if any
            step(pos)
        later = time.perf_counter() - t0
        out[name] = h.timings(lambda step=step: step(context), args.reps)
        t, eager = h.median_ms(out[name]), h.median_ms(out["eager"])
        out[f"{name}: compile s"], out[f"{name}: 3 new positions s"] = [first], [later]
        print(f"  {name:<18} {t:7.2f} ms/token ({t / eager:.2f}× eager); compile {first:.1f} s, 3 new positions "
              f"{later:.1f} s; max |Δlogit| {(logits - reference).abs().max().item():.1e}, argmax equal: "
              f"{bool(logits.argmax() == reference.argmax())}")
    if args.fused:
        stack.use_loop(fused.built_for(stack), 0.0)  # the same stack and cache through the C++ loop
        out["fused loop"] = h.timings(lambda: stack.forward_layers(x, 0, L, context, cache), args.reps)
        print(f"  fused loop (C++)   {h.median_ms(out['fused loop']):7.2f} ms/token")
    return out


def main(argv: list[str]) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    seconds = {model: bench(model, args) for model in args.models.split(",")}
    h.write_result(args.out, "compile", vars(args), seconds=seconds)
    return 0
