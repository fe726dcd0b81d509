"""Where a token's time goes: HF's forward vs our layer loops, the products in each layout (micro-benchmark).

HF's forward at one token vs our eager and fused layer loops (all layers with and without the head, an LS draft
at E = 4L/5, an LS verification batch of 5 positions); every layer's products and the LM head's at 1, 2 and 5 rows
in the engine's form (layer_math.linear) beside x @ W_t on an [in, out] copy and F.linear, so each engine choice
can be checked on this machine. Prints median ms; the result file keeps every part's raw seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from del_bench.bench import harness as h
from del_bench.engine.path_choice import stack_of
from del_bench.models import loading
from del_bench.models.layer_math import linear
from del_bench.models.products import layer_matrices


def parse(argv):
    ap = h.parser("parts", __doc__, runs=False)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--model", default="smollm2-135m", help="a configs/model name (tiny-random: the suite's smoke run)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--loops", default="eager,fused", help="our layer loops to time")
    return ap.parse_args(argv)


def loop_parts(stack, layers: str, prompt, token, context: int, reps: int) -> dict[str, list[float]]:
    """The layer loop `layers` at one token (all layers with and without the head; an LS draft) and at an LS
    verification batch, after a prefill of `prompt`."""
    kv = stack.new_cache(context + 64)
    stack.forward_layers(stack.embed(prompt), 0, stack.num_layers, 0, kv)
    x, x5 = stack.embed(token), torch.randn(1, 5, stack.head_weight.shape[1], dtype=stack.head_weight.dtype)
    L, E = stack.num_layers, max(1, 4 * stack.num_layers // 5)  # SmolLM2: 30 layers, E = 24
    return {
        f"ours ({layers}), 1 token, {L} layers + head": h.timings(
            lambda: stack.logits(stack.forward_layers(x, 0, L, context, kv)), reps),
        f"ours ({layers}), 1 token, {L} layers": h.timings(lambda: stack.forward_layers(x, 0, L, context, kv), reps),
        f"ours ({layers}), 1 token, {E} layers (an LS draft at E={E})": h.timings(
            lambda: stack.forward_layers(x, 0, E, context, kv), reps),
        f"ours ({layers}), 5 positions, layers {E + 1}-{L} (LS verify at E={E}, γ=4)": h.timings(
            lambda: stack.forward_layers(x5, E, L, context, kv), reps),
    }


def product_parts(stack, reps: int) -> dict[str, list[float]]:
    """Every layer's four products at 1, 2 and 5 rows: the engine's (linear) against x @ W_t on [in, out] copies."""
    mats = layer_matrices(stack)
    copies = [w.t().contiguous() for w in mats]
    parts = {}
    for n in (1, 2, 5):
        xs = {w.shape[1]: torch.randn(1, n, w.shape[1], dtype=w.dtype) for w in mats}
        parts[f"layer products, {n} row(s), the engine's linear"] = h.timings(
            lambda xs=xs: [linear(xs[w.shape[1]], w, None) for w in mats], reps)
        parts[f"layer products, {n} row(s), x @ W_t on [in, out] copies"] = h.timings(
            lambda xs=xs: [xs[w.shape[0]] @ w for w in copies], reps)
    return parts


def head_parts(head: torch.Tensor, reps: int) -> dict[str, list[float]]:
    """The LM head [V, D] at 1, 2 and 5 rows: the engine's linear, F.linear (HF's) and x @ W_t on a [D, V] copy."""
    head_t = head.t().contiguous()
    parts = {}
    for n in (1, 2, 5):
        x = torch.randn(1, n, head.shape[1], dtype=head.dtype)
        parts[f"LM head, {n} row(s), the engine's linear"] = h.timings(lambda x=x: linear(x, head, None), reps)
        parts[f"LM head, {n} row(s), F.linear on [V, D] (HF's)"] = h.timings(lambda x=x: F.linear(x, head), reps)
        parts[f"LM head, {n} row(s), x @ W_t on a [D, V] copy"] = h.timings(lambda x=x: x @ head_t, reps)
    return parts


@torch.inference_mode()
def main(argv: list[str]) -> int:
    from transformers import DynamicCache

    args = parse(argv)
    torch.set_num_threads(args.threads)
    cfg = h.model_config(args.model)
    hf = loading.load(cfg).model
    prompt = torch.randint(100, min(10_000, hf.config.vocab_size), (1, args.context))  # a tiny model's is smaller
    token = torch.tensor([[42]])
    cache = DynamicCache(config=hf.config)
    hf(prompt, past_key_values=cache, use_cache=True)

    def hf_step():
        hf(token, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # keep the context length fixed (transformers 5.x: crop takes tokens to remove)

    parts = {f"HF forward, 1 token ({hf.config.num_hidden_layers} layers + head)": h.timings(hf_step, args.reps)}
    head = hf.lm_head.weight.detach().clone()  # [V, D], HF's layout
    for layers in args.loops.split(","):
        stack = stack_of(loading.load(cfg).model, layers=layers)
        parts.update(loop_parts(stack, layers, prompt, token, args.context, args.reps))
    parts.update(product_parts(stack, max(1, args.reps // 4)))
    parts.update(head_parts(head, args.reps))
    print(f"{args.model} {hf.dtype}, {args.threads} threads, context {args.context} (median ms of {args.reps})")
    for name, seconds in parts.items():
        print(f"  {name:<64} {h.median_ms(seconds):7.2f}")
    h.write_result(args.out, "parts", vars(args), seconds=parts)
    return 0
