"""Where a token's time goes on SmolLM2 (CPU, fp32): HF's forward vs our layer loop (eager and fused); every layer's
products and the LM head's at 1, 2 and 5 rows in the engine's form (layer_stack._linear: W @ Xᵀ on [out, in], X ≥ 2
rows) beside the plain x @ W_t (an [in, out] copy) and F.linear, so each engine choice can be checked on this machine.

    python scripts/bench_engine_parts.py [--threads 2] [--context 150] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from del_bench.config import CONFIG_DIR
from del_bench.models import loading
from del_bench.models.layer_stack import LayerStack, _linear


def ms(fn, reps: int = 20) -> float:
    """Median wall milliseconds of fn() after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def loop_rows(stack, layers: str, prompt, token, context: int) -> dict[str, float]:
    """Median ms of the layer loop `layers` at one token (all layers, with and without the head; an LS draft) and
    at an LS verification batch, after a prefill of `prompt`."""
    kv = stack.new_cache(context + 64)
    stack.forward_layers(stack.embed(prompt), 0, stack.num_layers, 0, kv)
    x, x5 = stack.embed(token), torch.randn(1, 5, stack.head_weight.shape[1], dtype=stack.head_weight.dtype)
    L, E = stack.num_layers, 4 * stack.num_layers // 5  # SmolLM2: 30 layers, E = 24
    return {
        f"ours ({layers}), 1 token, {L} layers + head": ms(lambda: stack.logits(stack.forward_layers(x, 0, L, context,
                                                                                                    kv))),
        f"ours ({layers}), 1 token, {L} layers": ms(lambda: stack.forward_layers(x, 0, L, context, kv)),
        f"ours ({layers}), 1 token, {E} layers (an LS draft at E={E})": ms(
            lambda: stack.forward_layers(x, 0, E, context, kv)),
        f"ours ({layers}), 5 positions, layers {E + 1}-{L} (LS verify at E={E}, γ=4)": ms(
            lambda: stack.forward_layers(x5, E, L, context, kv)),
    }


def product_rows(stack) -> dict[str, float]:
    """Median ms of every layer's four products (q|k|v, o, gate|up, down: 425 MB on SmolLM2, streamed from memory) at
    1, 2 and 5 rows: the engine's (_linear: W @ Xᵀ on HF's [out, in], X ≥ 2 rows) against x @ W_t on [in, out]
    copies (the layout before). Why the engine lays its layers out as it does."""
    mats = [w for lay in stack.layers for w in (lay.w_qkv, lay.w_o, lay.w_gate_up, lay.w_down)]  # [out, in]
    copies = [w.t().contiguous() for w in mats]  # [in, out]
    rows = {}
    for n in (1, 2, 5):
        xs = {w.shape[1]: torch.randn(1, n, w.shape[1], dtype=w.dtype) for w in mats}
        rows[f"layer products, {n} row(s), the engine's W @ Xᵀ (_linear)"] = ms(
            lambda xs=xs: [_linear(xs[w.shape[1]], w, None) for w in mats], reps=5)
        rows[f"layer products, {n} row(s), x @ W_t on [in, out] copies"] = ms(
            lambda xs=xs: [xs[w.shape[0]] @ w for w in copies], reps=5)
    return rows


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--model", default="smollm2-135m", help="a configs/model name (tiny-random: the suite's smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = OmegaConf.load(CONFIG_DIR / "model" / f"{args.model}.yaml")
    hf = loading.load(cfg).model
    prompt = torch.randint(100, min(10_000, hf.config.vocab_size), (1, args.context))  # a tiny model's is smaller
    token = torch.tensor([[42]])
    rows = {}

    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    hf(prompt, past_key_values=cache, use_cache=True)

    def hf_step():
        hf(token, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # keep the context length fixed (transformers 5.x: crop takes tokens to remove)

    rows[f"HF forward, 1 token ({hf.config.num_hidden_layers} layers + head)"] = ms(hf_step)
    head = hf.lm_head.weight.detach().clone()  # [V, D], HF's layout
    head_t = head.t().contiguous()  # [D, V]

    for layers in ("eager", "fused"):
        stack = LayerStack(loading.load(cfg).model, layers=layers)
        rows.update(loop_rows(stack, layers, prompt, token, args.context))
    rows.update(product_rows(stack))
    for n in (1, 2, 5):
        h = torch.randn(1, n, head.shape[1], dtype=head.dtype)
        rows[f"LM head, {n} row(s), the engine's [V, D] @ Xᵀ (_linear)"] = ms(lambda h=h: _linear(h, head, None))
        rows[f"LM head, {n} row(s), F.linear on [V, D] (HF's)"] = ms(lambda h=h: F.linear(h, head))
        rows[f"LM head, {n} row(s), x @ W_t on a [D, V] copy"] = ms(lambda h=h: h @ head_t)
    print(f"{args.model} {hf.dtype}, {args.threads} threads, context {args.context} (median ms)")
    for name, value in rows.items():
        print(f"  {name:<60} {value:7.2f}")


if __name__ == "__main__":
    main()
