"""CLaSp (Chen et al., ACL 2025): in-context layer skipping, chosen by a dynamic program over the model's own states.

The draft model is the full model with exactly M whole layers skipped (any layer, the first and last included); the
engine drafts and verifies it as SWIFT's (`Skipping.draft`, `Skipping.verify`), a skipped layer counting as one
loaded layer less per draft token (SkipSet: both sublayers). This file is the policy, as the KnapSpec authors' code runs
CLaSp (docs/design.md §4.7, §4.8), with the paper's Algorithm 1 for the selection:
- Draft: at most `gamma` tokens (4), stop after a draft whose top probability is < `confidence` (0.7; that draft is
  kept) or at EOS.
- Selection (`select`), on the verification pass's per-layer states x_0..x_L of the round's last accepted token: a DP
  table g[i][j] = the state after i layers with j of them skipped; g[i][0] = x_i; for 1 ≤ j ≤ min(i−1, M),
  exec = layer i−1 on g[i−1][j] (a one-token forward against the committed prefix KV, writing nothing) and
  skip = g[i−1][j−1], keeping exec iff cos(exec, x_i) > cos(skip, x_i) (ties → skip); g[i][i] = g[i−1][i−1] for
  i ≤ M. All j of one i run as one batch of independent one-token branches (LayerStates.run). Backtracking from
  (L, M): layer i−1 is skipped where g[i][j] came from g[i−1][j−1]. Cost: one layer load per i ≥ 2, L − 1 in all,
  counted in the round's loaded layers (sel_loaded_layers) and timed as its policy time (sel_s).
- Schedule: the first round of a prompt drafts with nothing skipped and selects after its verification; the set is
  re-selected every `interval` rounds (64, the code; the paper finds speed rising with the interval up to ~128).
  Everything restarts with every prompt.
- Cosines are computed in float32 for half-precision models (the model's own dtype otherwise).
Records: `skip_set` (compact, as SWIFT's) on the first round of a prompt and whenever it changes; on selection rounds
the engine's sel_loaded_layers, sel_head_calls (0: CLaSp reads no head), sel_s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from del_bench.methods.base import LAYER_SKIPPING, Method, MethodConfig, Plan, SkipSet, StaticShape
from del_bench.methods.swift import skipping_plan
from del_bench.numerics import widened
from del_bench.schema import LAYERS, key


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity over the last dimension, in float32 or wider (half precision widened)."""
    return F.cosine_similarity(widened(a), widened(b), dim=-1)


@dataclass(kw_only=True)
class CLaSpConfig(MethodConfig):
    skip_layers: int = key(8, "M: whole layers the draft skips (the authors' script: 8 for 3B-8B)", ge=1, lt=LAYERS)
    gamma: int = key(4, "drafts per round at most", ge=1)
    confidence: float = key(0.7, "stop drafting after a draft whose top probability is below this", ge=0, le=1)
    interval: int = key(64, "rounds between selections", ge=1)


class CLaSp(Method):
    name = "clasp"
    label, family, order = "CLaSp", LAYER_SKIPPING, 50
    draft_shape = "skipping"
    config = CLaSpConfig
    wants_confidence = True  # stop after a draft below `confidence` (kept: drop_stopped_draft stays False)

    def __init__(self, skip_layers: int = 8, gamma: int = 4, confidence: float = 0.7, interval: int = 64, **_):
        self.skip_layers, self.gamma, self.confidence, self.interval = skip_layers, gamma, confidence, interval


    def static_shape(self) -> StaticShape:
        """A skip set chosen as it goes, up to gamma drafts a round."""
        return StaticShape(None, self.gamma)

    def describe(self) -> dict:
        return {"skip_layers": self.skip_layers, "gamma": self.gamma, "confidence": self.confidence,
                "interval": self.interval}

    # ---- per prompt ----
    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        self.skip = SkipSet()  # the first round drafts with the full model
        self.rounds = 0  # rounds of this prompt verified so far
        self.traced_skip: SkipSet | None = None

    def plan(self) -> Plan:
        return skipping_plan(self, self.skip, self.gamma)

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return confidence >= self.confidence

    def wants_states(self) -> str | None:
        return "layers" if self.rounds % self.interval == 0 else None

    def observe(self, evidence) -> None:
        self.rounds += 1

    # ---- selection ----
    def select(self, states) -> dict:
        x = states.states[:, -1]  # [L+1, D]: the input and every layer's output at the last accepted token
        pos = states.pos + states.states.shape[1] - 1
        layers = skipped_layers(x, self.skip_layers, lambda i, h: states.run(h[:, None], range(2 * i, 2 * i + 2),
                                                                             pos)[:, 0])
        self.skip = SkipSet(attn=layers, mlp=layers)
        return {}


def skipped_layers(x: torch.Tensor, M: int, run_layer) -> tuple[int, ...]:
    """CLaSp's DP (paper Algorithm 1). x: [L+1, D] the full model's states (x_0 the input, x_i after layer i);
    run_layer(i, h [B, D]) → layer i (0-based) on B independent branches, [B, D]. Returns the M skipped layers
    (0-based, sorted)."""
    L = x.shape[0] - 1
    g = {0: x[0]}  # column i − 1 of the table: j → state after i − 1 layers with j skipped
    skipped_from = {}  # (i, j) → True where g[i][j] = g[i−1][j−1] (layer i − 1 skipped)
    for i in range(1, L + 1):
        column = {0: x[i]}
        js = list(range(1, min(i - 1, M) + 1))
        if js:
            executed = run_layer(i - 1, torch.stack([g[j] for j in js]))  # [B, D]
            skipped = torch.stack([g[j - 1] for j in js])  # [B, D]
            keep_exec = (cosine(executed, x[i][None]) > cosine(skipped, x[i][None])).tolist()  # ties → skip
            for b, j in enumerate(js):
                column[j] = executed[b] if keep_exec[b] else skipped[b]
                skipped_from[i, j] = not keep_exec[b]
        if i <= M:
            column[i] = g[i - 1]
            skipped_from[i, i] = True
        g = column
    layers, j = [], M
    for i in range(L, 0, -1):
        if j and skipped_from.get((i, j), False):
            layers.append(i - 1)
            j -= 1
    return tuple(sorted(layers))
