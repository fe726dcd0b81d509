"""The calibrated cost model's units, measured on the path an engine decodes on (its graph-captured steps where it
has them, else the stack's loop): seconds for one token through a decoder layer, for one LM-head row, for T positions
through every layer, and (KnapSpec's latency model) layer 0's sublayers at several contexts."""

from __future__ import annotations

import statistics

import torch

from del_bench.models.layer_math import seconds_of


def measure_costs(engine, context: int = 128, reps: int = 5, batch_sizes=(1, 2, 4, 8, 16, 32),
                  contexts=()) -> dict:
    """Seconds for one token through one decoder layer (mean over all layers) and for one LM-head row, at `context`
    cached positions: the calibrated cost model's units. Median of `reps`, every device synchronised around each.
    batch_s: [[T, seconds for T positions through every layer], …] (what a verification batch costs there: on a CPU
    several single positions' worth, on a GPU about one). contexts (KnapSpec's latency model): also sublayer_s,
    LayerStack.measure_sublayers(contexts). `device`: where they were measured (LayerStack.cost_device): costs
    measured elsewhere are not this stack's."""
    stack = engine.stack
    costs = {"device": stack.cost_device(), **_layer_costs(engine, context, reps, batch_sizes)}
    if contexts:
        costs["sublayer_s"] = stack.measure_sublayers(contexts)
    return costs


@torch.inference_mode()
def _layer_costs(engine, context: int, reps: int, batch_sizes) -> dict:
    stack, L = engine.stack, engine.stack.num_layers
    # on the path that decodes: graph-captured steps run on the cache they were captured on
    cache = engine.path.cache(1, context + max(batch_sizes))
    cache.crop(0)
    engine.forward_layers(stack.embed(torch.zeros(1, context, dtype=torch.long)), 0, L, 0, cache)
    x = stack.embed(torch.zeros(1, 1, dtype=torch.long))

    def timed(fn) -> float:
        return statistics.median(seconds_of(fn, reps, 1, stack.synchronize))

    layers_s = timed(lambda: engine.forward_layers(x, 0, L, context, cache))
    batch_s = []
    for T in batch_sizes:
        xs = stack.embed(torch.zeros(1, T, dtype=torch.long))  # [1, T, D]
        batch_s.append([T, timed(lambda xs=xs: engine.forward_layers(xs, 0, L, context, cache))])
    # a draft head row: with exit adapters it includes the d×d map (so DEL's head cost h counts it)
    exit_layer = stack.adapters.layers[len(stack.adapters.layers) // 2] if stack.adapters else L
    head_s = timed(lambda: stack.exit_logits(x, exit_layer))
    return {"layer_s": layers_s / L, "head_s": head_s, "batch_s": batch_s}
