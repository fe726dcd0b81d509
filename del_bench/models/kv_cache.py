"""What the layers write and how their work is counted: the preallocated KV cache (a length per layer), a token
tree's mask, and the counter tests hold each round's accounting against."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WorkCounter:
    """What a LayerStack really executed, counted where it runs — below the engine, apart from its bookkeeping —
    so tests can hold each Round's self-reported accounting against it (LayerStack.counting). Units are the
    paper's: a decoder layer run over any number of positions at once is one load (a batch of positions reads the
    weights once), an attention or MLP sublayer half of one; a head row is one position through the LM head."""

    layers: float = 0.0  # decoder layers loaded: ½ per sublayer run (eager), end − start per fused call
    head_rows: int = 0  # LM-head rows (LayerStack.head): drafts, verification, prefill, SWIFT's probe
    shadow_rows: int = 0  # rows scored by shadow_tokens (DEL's controller; its head work is not in head_rows)
    adapter_rows: int = 0  # exit-head rows through an exit adapter (exit_input; shadow rows not included)


class KVCache:
    """Preallocated keys/values per layer, each layer with its own filled length.

    During drafting the early layers run ahead of the late ones, so lengths differ per layer;
    rejection only lowers lengths (stale slots are overwritten by the next write)."""

    def __init__(self, stack, max_len: int, num_layers: int | None = None, batch: int = 1):
        """num_layers: allocate only the first layers (a latency probe of one layer at a long context). batch: rows
        (a batched run's shared cache, engine/batch.py: each row decodes in its own view, `row`)."""
        self.max_len = max_len
        self.k, self.v = [], []
        for layer in stack.layers[:num_layers]:
            # k, v: [batch, KV, max_len, hd]
            shape = (batch, stack.n_kv_heads, max_len, stack.head_dim)
            self.k.append(torch.empty(shape, dtype=stack.dtype, device=layer.device))
            self.v.append(torch.empty(shape, dtype=stack.dtype, device=layer.device))
        self.lengths = [0] * len(self.k)

    def row(self, r: int, view: "KVCache | None" = None) -> "KVCache":
        """Row r of a batched cache as a cache of its own: each layer's [1, KV, max_len, hd] view of that row (a slice
        along the batch dimension: contiguous, the strides of a one-row cache), with its own lengths — a row writes
        in place, so nothing is copied per round. `view`: an existing row view to re-point (the cache grew)."""
        view = view if view is not None else object.__new__(KVCache)
        view.max_len = self.max_len
        view.k = [k[r : r + 1] for k in self.k]
        view.v = [v[r : r + 1] for v in self.v]
        if not hasattr(view, "lengths"):
            view.lengths = [0] * len(self.k)
        return view

    def crop(self, length: int) -> None:
        """Forget every position ≥ length in every layer."""
        self.lengths = [min(n, length) for n in self.lengths]

    def move(self, src: int, dst: int) -> None:
        """Copy every layer's entry at position src to dst (a token tree's accepted leaf joins its path)."""
        for k, v in zip(self.k, self.v):
            k[:, :, dst] = k[:, :, src]
            v[:, :, dst] = v[:, :, src]


@dataclass(frozen=True)
class TreeMask:
    """A token tree in one batch (SWIFT's dynamic token tree): node i holds RoPE position pos + depth[i] and sees
    the cached prefix [0, pos), its ancestors and itself. Its KV is written at slot pos + i, like a chain's."""

    depth: torch.Tensor  # [T] long: 0 for the root (the pending token)
    ancestors: torch.Tensor  # [T, T] bool: ancestors[i, j] = node j is node i or one of its ancestors

    @staticmethod
    def of(parents: list[int]) -> "TreeMask":
        """parents[i]: node i's parent (−1 for the root), each before its children."""
        T = len(parents)
        ancestors = torch.eye(T, dtype=torch.bool)
        depth = [0] * T
        for i, parent in enumerate(parents):
            if parent >= 0:
                ancestors[i] |= ancestors[parent]
                depth[i] = depth[parent] + 1
        return TreeMask(torch.tensor(depth), ancestors)

    @staticmethod
    def branches(count: int, length: int) -> "TreeMask":
        """`count` independent chains of `length` tokens each, branch after branch in the batch: every chain starts
        at the same position, sees the cached prefix and its own earlier tokens, never another chain (a selection's
        candidate draft models, each over the same window)."""
        return TreeMask.of([-1 if t == 0 else b * length + t - 1 for b in range(count) for t in range(length)])
