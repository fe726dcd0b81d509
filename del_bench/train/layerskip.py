"""The LayerSkip training recipe (Elhoushi et al. 2024, §3): layer dropout whose rate rises with depth, and an
early-exit loss on intermediate layers through the model's SHARED final norm + LM head, with a curriculum that
picks which exits are trained at a step.

Everything that decides "which layers" is a pure function of (config, step, seed), so a resumed run makes the
same choices as an uninterrupted one. The forward walks the HF LlamaForCausalLM's own modules (embed_tokens,
layers[i], norm, lm_head, rotary_emb); nothing in transformers is patched.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

DEPTH_SCALES = ("linear", "exp")
TIME_SCALES = ("none", "linear", "exp")
CURRICULA = ("none", "rotational", "gradual", "random_k")
LOSS_SCALES = ("uniform", "l", "sum_l", "sqrt_l")


# ---- layer dropout ------------------------------------------------------------------------------------------
def _ramp(x: float, kind: str) -> float:
    """A ramp from 0 at x=0 to 1 at x=1: linear, or exp = e^{x·ln 2} − 1 (LayerSkip's D(l) and S(t))."""
    if kind == "linear":
        return x
    if kind == "exp":
        return 2.0**x - 1.0
    raise ValueError(f"scale must be one of {DEPTH_SCALES}, not {kind!r}")


def dropout_rates(
    num_layers: int,
    p_max: float,
    scale: str = "exp",
    first_layer_zero: bool = True,
    step: int = 0,
    max_steps: int = 1,
    time_scale: str = "none",
) -> list[float]:
    """p_l = p_max · D(l) · S(t) for layers l = 0..L−1 (0-based).

    D(l) rises with depth to 1 at the last layer. With first_layer_zero (LayerSkip) depth is l/(L−1), so the first
    layer is never dropped; otherwise (l+1)/L. S(t) = 1 (time_scale none: continual pre-training / fine-tuning)
    or a ramp over training (LayerSkip ramps it up exponentially when pre-training from scratch)."""
    if not 0.0 <= p_max <= 1.0:
        raise ValueError(f"layer_dropout.p_max={p_max} must be in [0, 1]")
    if time_scale not in TIME_SCALES:
        raise ValueError(f"layer_dropout.time_scale must be one of {TIME_SCALES}, not {time_scale!r}")
    s_t = 1.0 if time_scale == "none" else _ramp(min(step / max(max_steps - 1, 1), 1.0), time_scale)
    if first_layer_zero:
        depth = [i / (num_layers - 1) if num_layers > 1 else 0.0 for i in range(num_layers)]
    else:
        depth = [(i + 1) / num_layers for i in range(num_layers)]
    return [p_max * s_t * _ramp(x, scale) for x in depth]


# ---- early-exit loss scales and curricula -------------------------------------------------------------------
def exit_weights(num_layers: int, loss_scale: str = "sum_l", e_scale: float = 1.0) -> list[float]:
    """Un-normalised e(l) per layer (0-based index, depth l+1), rising with depth; intermediate exits × e_scale.
    sum_l = 1 + 2 + … + (l+1) is LayerSkip's; l, sqrt_l and uniform are the variants of its code."""
    base = {"uniform": lambda d: 1.0, "l": float, "sum_l": lambda d: d * (d + 1) / 2, "sqrt_l": math.sqrt}
    if loss_scale not in base:
        raise ValueError(f"early_exit.loss_scale must be one of {LOSS_SCALES}, not {loss_scale!r}")
    return [base[loss_scale](i + 1) * (e_scale if i < num_layers - 1 else 1.0) for i in range(num_layers)]


def normalised_scales(enabled: list[int], weights: list[float]) -> dict[int, float]:
    """ẽ(l) = C(l)·e(l) / Σ_i C(i)·e(i) over the enabled exits: sums to 1, so the loss stays on the CE scale."""
    total = sum(weights[i] for i in enabled)
    if total <= 0:
        raise ValueError(f"early-exit weights of layers {enabled} sum to {total}; e_scale must be > 0")
    return {i: weights[i] / total for i in enabled}


def enabled_exits(cfg, num_layers: int, step: int, max_steps: int, seed: int) -> list[int]:
    """0-based layers whose exit loss is trained at `step` (0-based); the last layer always is.

    none: every layer. rotational: every `every`-th layer, the phase advancing one layer every `period` steps
    (LayerSkip's C_rot). gradual: exits switch on from the deepest to the first as training progresses; all are
    on from step gradual_fraction·max_steps (LayerSkip's C_grad). random_k: k distinct intermediate layers
    drawn afresh each step (seeded by (seed, step)): k+1 heads per step whatever the depth, cheap on CPU."""
    last = num_layers - 1
    kind = cfg.curriculum
    if kind == "none":
        layers = list(range(last))
    elif kind == "rotational":
        phase = (step // cfg.period) % cfg.every
        layers = [i for i in range(last) if i % cfg.every == phase]
    elif kind == "gradual":
        progress = step / max(max_steps, 1)
        layers = [i for i in range(last) if progress >= cfg.gradual_fraction * (num_layers - i) / num_layers]
    elif kind == "random_k":
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        layers = sorted(torch.randperm(last, generator=gen)[: min(cfg.k, last)].tolist())
    else:
        raise ValueError(f"early_exit.curriculum must be one of {CURRICULA}, not {kind!r}")
    return [*layers, last]


# ---- forward through the HF modules --------------------------------------------------------------------------
def _check_attention(model: nn.Module) -> None:
    # We pass no attention mask and rely on SDPA's is_causal, which is right here because queries and keys have
    # the same length (no KV cache in training). Eager attention would read a missing mask as "attend to all".
    impl = model.config._attn_implementation
    if impl != "sdpa":
        raise ValueError(f"training needs attn_implementation='sdpa' (causal without a mask), not {impl!r}")


def _layer_on_kept(layer: nn.Module, h: torch.Tensor, keep: torch.Tensor, **kwargs) -> torch.Tensor:
    """Layer dropout per sample: dropped samples skip the layer (h unchanged, its residual update skipped); the
    layer runs only on the kept ones, so dropping also saves compute.  h: [B, T, D], keep: [B] bool"""
    if bool(keep.all()):
        return layer(h, **kwargs)
    idx = keep.nonzero().squeeze(1)  # [B_kept]
    if idx.numel() == 0:
        return h
    return h.index_copy(0, idx, layer(h.index_select(0, idx), **kwargs))  # out-of-place: autograd-safe


def run_layers(
    model: nn.Module,
    ids: torch.Tensor,
    outputs: set[int],
    drop_rates: list[float] | None = None,
    generator: torch.Generator | None = None,
) -> dict[int, torch.Tensor]:
    """ids: [B, T] → {i: h_i [B, T, D]}, the residual stream after layer i (0-based) for each i in `outputs`.
    Layers past the deepest requested output are not run."""
    _check_attention(model)
    inner = model.model
    h = inner.embed_tokens(ids)  # [B, T, D]
    position_ids = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, T]: broadcasts over any batch subset
    cos_sin = inner.rotary_emb(h, position_ids)  # 2 × [1, T, head_dim]
    kwargs = dict(attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin)
    hiddens = {}
    for i in range(max(outputs) + 1):
        p = drop_rates[i] if drop_rates is not None else 0.0
        if p > 0:
            keep = torch.rand(ids.shape[0], generator=generator) >= p  # [B]
            h = _layer_on_kept(inner.layers[i], h, keep.to(ids.device), **kwargs)
        else:
            h = inner.layers[i](h, **kwargs)
        if i in outputs:
            hiddens[i] = h
    return hiddens


def exit_logits(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """h: [B, T, D] → logits [B, T, V] through the shared final norm and LM head (no per-exit parameters)."""
    return model.get_output_embeddings()(model.model.norm(h))


def layerskip_loss(
    model: nn.Module,
    ids: torch.Tensor,
    labels: torch.Tensor,
    scales: dict[int, float],
    drop_rates: list[float] | None,
    generator: torch.Generator | None,
    distill: float = 0.0,
):
    """Σ_l ẽ(l)·CE_l over the enabled exits.  ids, labels: [B, T] → (loss [], {layer: CE_l as float})

    distill = λ > 0 (beyond LayerSkip, which trains every exit on the labels only): an intermediate exit's term
    becomes (1 − λ)·CE(labels) + λ·CE(the last layer's detached distribution) — self-distillation, which trains
    the exits on what greedy self-speculation accepts (agreement with the last layer), not only on the data."""
    hiddens = run_layers(model, ids, set(scales), drop_rates, generator)
    last = max(hiddens)
    logits = {i: exit_logits(model, h).flatten(0, 1).float() for i, h in hiddens.items()}  # [B·T, V] each
    teacher = logits[last].detach().softmax(-1) if distill > 0 else None
    loss = torch.zeros((), device=ids.device)
    ce = {}
    for i, z in logits.items():
        ce_i = F.cross_entropy(z, labels.flatten())
        term = ce_i if teacher is None or i == last else (1 - distill) * ce_i + distill * F.cross_entropy(z, teacher)
        loss = loss + scales[i] * term
        ce[i] = ce_i.item()
    return loss, ce


@torch.no_grad()
def evaluate_exits(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list[float]]:
    """Per layer (index 0 = layer 1): mean early-exit CE, and greedy agreement with the last layer = the fraction of
    positions where the layer's exit argmax equals the last layer's (what greedy self-speculation accepts)."""
    num_layers = model.config.num_hidden_layers
    ce_sum, agree, positions = [0.0] * num_layers, [0] * num_layers, 0
    for ids, labels in batches:
        hiddens = run_layers(model, ids, set(range(num_layers)))
        tokens = []
        for i in range(num_layers):
            logits = exit_logits(model, hiddens[i])  # [B, T, V]
            ce_sum[i] += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum").item()
            tokens.append(logits.argmax(-1))  # [B, T]
        for i in range(num_layers):
            agree[i] += int((tokens[i] == tokens[-1]).sum())
        positions += labels.numel()
    return {"exit_loss": [s / positions for s in ce_sum], "agreement": [a / positions for a in agree]}
