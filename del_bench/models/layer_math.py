"""One decoder layer's math as LayerStack runs it — HF's ops, op for op: the norms, the attention calls, the matrix
products in their chosen layouts, a layer's fused tensors (`Layer`) — and the timing helpers the model layer shares.
LayerStack (layer_stack.py) walks layers with these; FamilyLayerStack varies them per family."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from del_bench.models.products import TUNED, X_WT, Layout, product
from del_bench.numerics import HALF_DTYPES


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels before reading a clock (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_of(fn, reps: int, warmup: int = 1, sync=lambda: None) -> list[float]:
    """Wall seconds of each of `reps` calls of fn after `warmup` untimed ones, sync() (waiting for the devices fn
    queues work on) before each clock read: every micro-timing of the project, engine's and benches'."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def cat_on(tensors, device: torch.device, dim: int = 0) -> torch.Tensor:
    """torch.cat on `device` of tensors that may live on several (states of layers split by device_map): each moves
    there first — a no-op for a tensor already there, so on one device this is the plain cat."""
    return torch.cat([t.to(device) for t in tensors], dim=dim)


def joined(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat, or the one tensor as it is (a batch of one's: no copy kernel to launch)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def moved(device: torch.device, *tensors):
    """RoPE tables and mask (None, or any non-tensor, stays as it is) on a layer's device: once per device crossed."""
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm, op for op (variance in float32, weight applied in the input dtype)."""
    if x.dtype != torch.float32:
        dtype = x.dtype
        return weight * _normalized(x.to(torch.float32), eps).to(dtype)
    if x.device.type == "cpu":  # one fused op, the same bits (see _normalized)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * _normalized(x, eps)  # no no-op casts


def gemma_rms_norm(x: torch.Tensor, weight1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma2RMSNorm / Gemma3RMSNorm, op for op: (_norm(x.float()) * (1 + w.float())).type_as(x) — float32 even for
    a float64 model, the weight applied before the cast. weight1: 1 + w, precomputed in float32 (_norm_tensor)."""
    return (_normalized(x.float(), eps) * weight1).to(x.dtype)


def _normalized(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) in float32. On CPU torch's fused F.rms_norm gives HF's bits in one op instead of
    five (~10 µs less per norm, two norms a layer; tests/test_engine.py holds the equality on the machine at hand)."""
    if x32.device.type == "cpu":
        return F.rms_norm(x32, (x32.shape[-1],), None, eps)
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def attend(q, k, v, mask: torch.Tensor | None, pos: int, scale: float, gqa: bool, exact: bool = False) -> torch.Tensor:
    """SDPA of q [1, H, T, hd] (positions pos .. pos+T-1) over k, v [1, KV, pos+T, hd] → [1, H, T, hd]. With no mask
    (LayerStack.rope_and_mask) over several queries: from an empty cache, `is_causal` (T queries, T keys: top-left and
    bottom-right alignment agree; HF's prefill makes the same call); with a cache, row by row, each row the single-query
    call a decode step makes over its own keys [0, pos+i] — the SDPA kernel's bits depend on the key length, so a
    masked batch row is not a decode step's. A token tree with `exact` (LayerStack.exact_rows) likewise, each node
    over the keys its mask row selects (the prefix, then its ancestors: its path's keys, in order). fused_layers.cpp:
    the same rule."""
    T = q.shape[2]
    if exact and mask is not None and T > 1:  # a tree: node i's own keys, gathered [1, KV, n_i, hd]
        return torch.cat([F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, mask[i]], v[:, :, mask[i]],
                                                         scale=scale, enable_gqa=gqa) for i in range(T)], dim=2)
    if mask is None and T > 1 and pos > 0:
        return torch.cat([F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, : pos + i + 1],
                                                         v[:, :, : pos + i + 1], scale=scale, enable_gqa=gqa)
                          for i in range(T)], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, scale=scale,
                                          enable_gqa=gqa)


def softcapped(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma's soft cap, op for op: tanh(x / cap) * cap (attention weights: modeling_gemma2.py:196-198; final logits:
    :519-521)."""
    return torch.tanh(x / cap) * cap


def top_confidence(probs: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """A draft candidate's confidence on the scale of LayerStack.shadow_tokens(vocab=K): probs [V] → the top
    probability normalised over the first K ids and the top token itself (a scalar tensor: no host read) — what
    shadow scoring gives a row whose target is that token. vocab None or ≥ V: the top probability as it is."""
    top, token = probs.max(-1)
    if vocab is None or vocab >= probs.shape[-1]:
        return top
    return top / (probs[:vocab].sum() + torch.where(token >= vocab, top, 0.0))  # the top joins where it lies outside


def fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [Σout, in] matrix (HF's own layout, concatenated) for linears that read the same input (q|k|v, gate|up).
    The HF modules are re-pointed at row slices of it, so no weight is stored twice and the HF model still runs (on
    the same numbers)."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)  # [Σout, in]
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[row : row + n]
        if has_bias:
            lin.bias.data = bias[row : row + n]
        row += n
    return weight, bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual=None,
            layout: Layout = TUNED) -> torch.Tensor:
    """x: [B, T, in] @ weight: [out, in]ᵀ (+ bias) (+ residual [B, T, out]) → [B, T, out], the B·T rows as one
    product (B = 1: the engine's chains; B > 1: rows of a static-shape step), in the layout chosen for
    this shape class at B·T rows (LayerStack.products; models/products.py: x_wt = x @ Wᵀ, HF's; wt_x = W @ Xᵀ with X at
    least two rows, MKL's few-column GEMM); fused_layers.cpp's `product` does the same ops. wt_x, measured on SmolLM2 /
    the testbed at 2 threads on the AMD host it was tuned on (the fused loop; the layers were stored [in, out] for
    x @ W before): a token's layers at one position 0.96× / 1.03× the time, at 2 positions 0.63× / 0.73×, at 5
    0.72× / 0.86×; the LM head at 2 rows 5.2 vs 8.5 ms, at 5 rows 7.0 vs 20 ms. Half precision always x_wt, HF's own
    product, which rounds as HF's nn.Linear does (float16's CPU GEMM gives other bits as W @ Xᵀ; bfloat16's the same),
    the residual added as its own op as in LlamaDecoderLayer (products.product)."""
    rows = x.reshape(-1, x.shape[-1])  # [B·T, in]: for B = 1 the view x[0] (the same strides, the same bits)
    kind = X_WT if x.dtype in HALF_DTYPES else layout.at(rows.shape[0])
    shape = (*x.shape[:-1], weight.shape[0])
    if bias is None:
        flat = None if residual is None else residual.reshape(-1, residual.shape[-1])
        return product(rows, weight, kind, flat).view(shape)
    y = (product(rows, weight, kind) + bias).view(shape)  # [B, T, out]
    return y if residual is None else residual + y


@dataclass
class Layer:
    """One decoder layer's tensors, fused for fewer kernel launches."""

    w_in_norm: torch.Tensor
    w_qkv: torch.Tensor  # [(H + 2·KV)·hd, D]  (all [out, in], HF's layout: see linear)
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor  # [D, H·hd]
    b_o: torch.Tensor | None
    w_post_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2·I, D]
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # [D, I]
    b_down: torch.Tensor | None
    device: torch.device
    # other families (families.py; None / 0 for Llama): q/k norms over head_dim (Qwen3, Gemma 3), the sandwich norms
    # on the attention's and the MLP's outputs (Gemma 2/3), the attention window W (the last W positions) and which
    # rotary table the layer reads (Gemma 3: local / global)
    w_q_norm: torch.Tensor | None = None
    w_k_norm: torch.Tensor | None = None
    w_attn_out_norm: torch.Tensor | None = None
    w_mlp_out_norm: torch.Tensor | None = None
    window: int | None = None
    rope: int = 0


def attend_softcapped(q, k, v, mask: torch.Tensor | None, pos: int, scale: float, cap: float) -> torch.Tensor:
    """HF's eager attention with Gemma 2's logit soft cap (SDPA cannot cap; Gemma2PreTrainedModel._supports_sdpa is
    False, so `generate` runs this), op for op as modeling_gemma2.py's eager_attention_forward: q [1, H, T, hd]
    (positions pos..) over k, v [1, KV, S, hd] → [1, H, T, hd]. HF adds min(dtype) where the mask is False; -inf gives
    the same softmax (exp of either is 0 after the float32 cast)."""
    T, S = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # repeat_kv: [1, H, S, hd]
    weights = softcapped(torch.matmul(q, k.transpose(2, 3)) * scale, cap)  # [1, H, T, S]
    if mask is None and T > 1:  # a chain from pos: causal, bottom-right aligned
        mask = causal(pos, T, S, q.device)
    if mask is not None:
        weights = weights.masked_fill(~mask, float("-inf"))
    probs = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def causal(pos: int, T: int, S: int, device) -> torch.Tensor:
    """[T, S] bool: query i (position pos + i) sees keys 0 .. pos + i."""
    return torch.arange(S, device=device)[None, :] <= (pos + torch.arange(T, device=device))[:, None]


def windowed(mask: torch.Tensor | None, pos: int, T: int, S: int, window: int, device) -> torch.Tensor:
    """The mask of T queries from slot pos over S keys (mask: [T, S] or None for a causal chain) restricted to a
    sliding window: a query at position p sees keys at positions p − window < k ≤ p (masking_utils.py
    sliding_window_overlay). Positions come from the mask itself, so a token tree is windowed too: node i's position is
    pos + its depth (= its ancestors in slots pos.., itself included, − 1); slots before pos hold their own position."""
    if mask is None:
        mask = causal(pos, T, S, device)
    query_pos = pos + mask[:, pos:].sum(-1) - 1  # [T]
    key_pos = torch.cat([torch.arange(pos, device=device), query_pos])  # [S]: slot pos + j holds query j's position
    return mask & (key_pos[None, :] > query_pos[:, None] - window)
