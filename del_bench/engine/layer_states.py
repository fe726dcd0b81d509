"""The full model's states of a round's accepted rows, and candidate draft models run on them: what a layer-skip
selection (CLaSp, KnapSpec) reads and runs. The engine keeps the states from the round's verification pass (no extra
forward pass) and hands them to Method.select; every layer, sublayer and head row a selection runs through this object
is counted and becomes part of the round's loaded layers and head calls (traced as sel_loaded_layers, sel_head_calls),
its time part of the round's policy time (sel_s)."""

from __future__ import annotations

import torch

from del_bench.models.kv_cache import KVCache, TreeMask
from del_bench.models.layer_stack import LayerStack


class LayerStates:
    def __init__(self, stack: LayerStack, cache: KVCache, pos: int, states: torch.Tensor):
        self.stack, self.cache = stack, cache
        self.pos = pos  # position of row 0 (the round's pending token)
        # [S, W, D]: row 0 the input embeddings, then after every layer (S = L + 1) or every sublayer (S = 2L + 1)
        self.states = states
        self.loaded_layers = 0.0  # what the selection ran: a sublayer over a batch of branches is ½ a layer load
        self.head_rows = 0

    @property
    def num_layers(self) -> int:
        return self.stack.num_layers

    def run(self, h: torch.Tensor, sublayers: range, pos: int) -> torch.Tensor:
        """h: [B, W, D], B candidate branches over the window of W positions from pos, through `sublayers` (s: layer
        s // 2's attention if even, its MLP if odd) in one batch, writing nothing → [B, W, D]. Each branch sees the
        cached prefix [0, pos) and its own earlier window tokens."""
        B, W, D = h.shape
        if B == 0 or len(sublayers) == 0:
            return h
        out = self.stack.forward_branches(h.reshape(1, B * W, D), sublayers, pos, self.cache,
                                          TreeMask.branches(B, W))  # [1, B·W, D]
        self.loaded_layers += len(sublayers) / 2
        return out.view(B, W, D)

    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, D] last-layer states (pre-norm) → [N] the LM head's greedy tokens (N head rows)."""
        self.head_rows += h.shape[0]
        return self.stack.logits(h[None])[0].argmax(-1)
