"""A ragged batch (engine/batch.py, the thread scheduler's rows): several rows' segments through one sublayer, or the
head, at once. The weight-bound products run over all rows' positions concatenated ([1, ΣT, D]: each weight read once
for the batch, in the layouts timed at its width: products.products_for); RoPE reads each position's own table; the
cache write and the attention run per row, each exactly as the eager loop runs that row alone (its own positions,
cache, mask) — so no row sees another's keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from del_bench.models.kv_cache import KVCache
from del_bench.models.products import products_for


@dataclass
class RaggedRow:
    """One row of a ragged batch (attention_rows, engine/batch.py): its states h [1, T, D] at positions
    pos .. pos+T−1, its own KV cache (a view of its row of the batch's cache: KVCache.row), its rotary tables and mask
    (LayerStack.rope_and_mask: a chain or a token tree) and whether its attention writes the cache (False: SWIFT's
    teacher-forced probe)."""

    h: torch.Tensor
    pos: int
    cache: KVCache
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    write: bool = True


def split(out: torch.Tensor, rows: list[RaggedRow]) -> None:
    """out [1, ΣT, D], the rows' positions in order → each row's h, a view of its own positions [1, T_r, D]."""
    for r, h in zip(rows, out.split([r.h.shape[1] for r in rows], dim=1)):
        r.h = h


def attention_rows(stack, i: int, rows: list[RaggedRow]) -> None:
    """Layer i's attention sublayer for every row (one load of it): each row's h becomes h + attention(norm(h));
    a row that writes sets its cache's length of layer i."""
    for r in rows:
        if r.cache.lengths[i] < r.pos:
            raise RuntimeError(f"layer {i} holds {r.cache.lengths[i]} positions; cannot attend at {r.pos}")
    with products_for(stack, sum(r.h.shape[1] for r in rows)):
        _attention_rows(stack, i, rows)


def _attention_rows(stack, i: int, rows: list[RaggedRow]) -> None:
    h = torch.cat([r.h for r in rows], dim=1)  # [1, ΣT, D]
    cos = torch.cat([r.cos for r in rows], dim=-3)  # [(R,) 1, ΣT, 1, hd]: each position's table
    sin = torch.cat([r.sin for r in rows], dim=-3)
    w, h, cos, sin, _ = stack.attention_inputs(i, h, cos, sin, None)
    q, k_new, v_new = stack.project_qkv(w, h, cos, sin)  # q [1, H, ΣT, hd]; k_new, v_new [1, KV, ΣT, hd]
    attn, a = [], 0
    for r in rows:
        b = a + r.h.shape[1]
        mask = r.mask if not isinstance(r.mask, torch.Tensor) else r.mask.to(w.device)
        attn.append(stack.attend_cached(i, w, q[:, :, a:b], k_new[:, :, a:b], v_new[:, :, a:b], r.pos, mask,
                                        r.cache, r.write))  # [1, H, T_r, hd]
        if r.write:
            r.cache.lengths[i] = r.pos + (b - a)
        a = b
    split(stack.attention_out(w, torch.cat(attn, dim=2), h), rows)


def mlp_rows(stack, i: int, rows: list[RaggedRow]) -> None:
    """Layer i's MLP for every row (one load of it): each row's h becomes h + MLP(norm(h))."""
    with products_for(stack, sum(r.h.shape[1] for r in rows)):
        split(stack.layer_mlp(i, torch.cat([r.h for r in rows], dim=1)), rows)


def head_rows(stack, hs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The LM head over several rows' normed states (each [1, T_r, D]) in one product → each row's logits
    [1, T_r, V]."""
    if len(hs) == 1:
        return [stack.head(hs[0])]
    with products_for(stack, sum(h.shape[-2] for h in hs)):
        return list(stack.head(torch.cat(hs, dim=-2)).split([h.shape[-2] for h in hs], dim=-2))
