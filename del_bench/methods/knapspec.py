"""KnapSpec: self-speculation by a knapsack over attention and MLP sublayers under a measured latency model.

The draft model is the full model with a set of attention / MLP sublayers skipped (layers 1..L−2; a skipped sublayer,
with its norm, is the identity on the residual stream), drafted and verified by the engine as SWIFT's
(`Skipping.draft`, `Skipping.verify`; a sublayer counts ½ a loaded layer). This file is the policy, as the KnapSpec
authors' code runs it (docs/design.md §4.7, §4.9; their paper was not reachable):
- Draft: at most `gamma` tokens (4), stop after a draft whose top probability is < `confidence` (0.7; kept) or at EOS.
- Latency model, measured on the machine at hand before decoding (LayerStack.measure_sublayers; the runner's cost
  step, recorded in the run's costs.json): one token through layer 0's attention and MLP at `latency_contexts` cached
  positions (5 warm-up, 10 timed); fit t_attn(n) = c₂·n + c₃ (least squares), t_mlp = c₁ (the mean).
- Weights at the current KV length n: the cheaper sublayer type weighs 1, the other round(ratio), at most
  `weight_cap` (5); capacity B = ⌊(w_a + w_m)·L/2⌋.
- Selection (`select`), on the full model's states after every sublayer from the verification passes of the last
  `window_rounds` (5) rounds — a window of r tokens: each round's input token and accepted drafts; the prefix KV before
  the window is what branches attend to. DP over the sublayers in order with state (sublayers done, weight skipped
  j ≤ B): exec keeps j, skip adds the sublayer's weight; a state's score is Σ_t cos(state_t, x_t) over the window (x:
  the full model's state after that sublayer); exec is tried first and skip replaces it only when strictly better
  (ties → exec); states with score / r < `prune` (0.5) are dropped; if all are dropped, nothing is skipped. Every
  surviving weight j ≥ 1 gives a set S_j; its α_j = the share of window positions where the LM head's argmax after
  the last layer equals the full model's; the S_j maximising TPT = max over d = 0..`tpt_d_max` (17) of
  Σ_{k≤d} α_j^k / [t_attn·(n_attn·d + L) + t_mlp·(n_mlp·d + L)] is kept (n_attn, n_mlp: the sublayers the draft
  runs; only S is kept, d is not: drafting still uses gamma and the confidence stop). All branches of one step run
  as one batch (LayerStates.run, block-causal); each step is ½ a loaded layer, each head row a head call, in the
  round's accounting (sel_loaded_layers, sel_head_calls, sel_s).
- Schedule: rounds 1..`warmup_rounds` (6) of a prompt draft with the full model; the first selection follows round 6's
  verification (on rounds 2..6), then one every `interval` (64) rounds. Everything restarts with every prompt.
Their sampling mode accepts a draft when it equals an independently sampled target token; ours stays the lossless
min(1, p/q) rule (engine/sampling.py).
Records: `skip_set` when it changes (as SWIFT's); on selection rounds sel_weights [w_a, w_m], sel_capacity, sel_alpha
and sel_tpt of the kept set, lat_fit [c₁, c₂, c₃] (seconds), plus the engine's sel_* accounting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from del_bench.methods.base import LAYER_SKIPPING, Method, MethodConfig, Plan, SkipSet, StaticShape
from del_bench.methods.clasp import cosine
from del_bench.methods.swift import skipping_plan
from del_bench.schema import key

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 24576)


@dataclass(kw_only=True)
class KnapSpecConfig(MethodConfig):
    gamma: int = key(4, "drafts per round at most", ge=1)
    confidence: float = key(0.7, "stop drafting after a draft whose top probability is below this", ge=0, le=1)
    interval: int = key(64, "rounds between selections", ge=1)
    warmup_rounds: int = key(6, "rounds drafted with the full model before the first selection (> window_rounds)",
                             ge=2)
    window_rounds: int = key(5, "the last rounds whose verification states a selection reads", ge=1)
    prune: float = key(0.5, "a DP state whose mean cosine to the full model falls below this is dropped", ge=0, le=1)
    weight_cap: int = key(5, "the dearer sublayer type weighs round(latency ratio), at most this", ge=1)
    tpt_d_max: int = key(17, "TPT is maximised over d = 0..tpt_d_max", ge=0)
    latency_contexts: list[int] = key(list(CONTEXTS), "KV lengths layer 0's sublayers are timed at (≥ 2 distinct)",
                                      ge=1)


class KnapSpec(Method):
    name = "knapspec"
    label, family, order = "KnapSpec", LAYER_SKIPPING, 60
    draft_shape = "skipping"
    config = KnapSpecConfig
    wants_confidence = True
    wants_costs = True  # the latency model (set_costs' sublayer_s)

    def __init__(self, gamma: int = 4, confidence: float = 0.7, interval: int = 64, warmup_rounds: int = 6,
                 window_rounds: int = 5, prune: float = 0.5, weight_cap: int = 5, tpt_d_max: int = 17,
                 latency_contexts=CONTEXTS, **_):
        self.gamma, self.confidence, self.interval = gamma, confidence, interval
        self.warmup_rounds, self.window_rounds, self.prune = warmup_rounds, window_rounds, prune
        self.weight_cap, self.tpt_d_max = weight_cap, tpt_d_max
        self.latency_contexts = tuple(latency_contexts)
        self.fit: tuple[float, float, float] | None = None  # (c₁, c₂, c₃): t_mlp = c₁, t_attn(n) = c₂·n + c₃

    def validate(self, num_layers: int) -> None:
        if self.warmup_rounds < self.window_rounds + 1:
            raise ValueError(f"method.warmup_rounds={self.warmup_rounds!r} must be an integer ≥ window_rounds + 1 "
                             f"({self.window_rounds + 1}): the first selection reads the window's rounds after round 1")
        contexts = self.latency_contexts
        if len(set(contexts)) < 2:
            raise ValueError(f"method.latency_contexts={list(contexts)!r} needs ≥ 2 distinct positive context lengths "
                             "(the attention latency is fitted as a line)")
        if num_layers < 3:
            raise ValueError(f"KnapSpec needs ≥ 3 layers (the first and last are never skipped), not {num_layers}")


    def static_shape(self) -> StaticShape:
        """A skip set chosen as it goes, up to gamma drafts a round."""
        return StaticShape(None, self.gamma)

    def describe(self) -> dict:
        return {"gamma": self.gamma, "confidence": self.confidence, "interval": self.interval,
                "warmup_rounds": self.warmup_rounds, "window_rounds": self.window_rounds, "prune": self.prune,
                "weight_cap": self.weight_cap, "tpt_d_max": self.tpt_d_max,
                "latency_contexts": list(self.latency_contexts)}

    def set_costs(self, layer_s: float, head_s: float, batch_s: list | None = None,
                  sublayer_s: list | None = None) -> None:
        if not sublayer_s:
            raise ValueError("KnapSpec needs its latency model: costs without sublayer_s (measure_costs(contexts=…))")
        n, attn, mlp = np.array(sublayer_s, dtype=np.float64).T
        c2, c3 = np.polyfit(n, attn, 1)
        self.fit = (float(mlp.mean()), float(c2), float(c3))

    # ---- per prompt ----
    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        if self.fit is None:
            raise RuntimeError("KnapSpec's latency model was not measured (set_costs) before decoding")
        self.skip = SkipSet()  # rounds 1..warmup_rounds draft with the full model
        self.rounds = 0  # rounds of this prompt verified so far
        self.window: deque = deque(maxlen=self.window_rounds)  # (pos, [2L+1, W, D]) of the latest kept rounds
        self.traced_skip: SkipSet | None = None

    def plan(self) -> Plan:
        return skipping_plan(self, self.skip, self.gamma)

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return confidence >= self.confidence

    def _selects_after(self, round_number: int) -> bool:
        """Selection after the verification of this prompt's round `round_number` (1-based)?"""
        since = round_number - self.warmup_rounds
        return since >= 0 and since % self.interval == 0

    def wants_states(self) -> str | None:
        upcoming = self.rounds + 1  # the round about to be verified
        soon = any(self._selects_after(upcoming + k) for k in range(self.window_rounds))
        return "sublayers" if soon else None

    def observe(self, evidence) -> None:
        self.rounds += 1

    # ---- selection ----
    def weights(self, n: int) -> tuple[int, int, int]:
        """(w_attn, w_mlp, capacity B) at KV length n."""
        t_mlp, t_attn = self.latencies(n)
        cheap, dear = sorted((t_attn, t_mlp))
        heavy = int(min(max(round(dear / cheap), 1), self.weight_cap)) if cheap > 0 else self.weight_cap
        w_attn, w_mlp = (1, heavy) if t_attn <= t_mlp else (heavy, 1)
        return w_attn, w_mlp, (w_attn + w_mlp) * self.num_layers // 2

    def latencies(self, n: int) -> tuple[float, float]:
        c1, c2, c3 = self.fit
        return c1, c2 * n + c3

    def select(self, states) -> dict:
        self.window.append((states.pos, states.states))
        if not self._selects_after(self.rounds + 1):  # observe has not counted this round yet
            return {}
        pos = self.window[0][0]
        x = torch.cat([s for _, s in self.window], dim=1)  # [2L+1, r, D]
        n = states.pos + states.states.shape[1]  # the KV length now
        w_attn, w_mlp, capacity = self.weights(n)
        t_mlp, t_attn = self.latencies(n)
        sets = knapsack_sets(x, w_attn, w_mlp, capacity, self.prune, lambda s, h: states.run(h, range(s, s + 1), pos))
        trace = {"sel_weights": [w_attn, w_mlp], "sel_capacity": capacity, "lat_fit": list(self.fit)}
        candidates = [(j, skip, h) for j, (skip, h) in sorted(sets.items()) if j >= 1]
        if not candidates:
            self.skip = SkipSet()
            return {**trace, "sel_alpha": None, "sel_tpt": None}
        L = self.num_layers
        last = states.run(torch.stack([h for _, _, h in candidates]), range(2 * L - 2, 2 * L), pos)  # [C, r, D]
        target = states.argmax(x[-1])  # [r] the full model's greedy tokens
        C, r, D = last.shape
        alphas = (states.argmax(last.reshape(C * r, D)).view(C, r) == target).double().mean(1).tolist()
        tpts = [tokens_per_time(a, L - len(skip.attn), L - len(skip.mlp), L, t_attn, t_mlp, self.tpt_d_max)
                for a, (_, skip, _) in zip(alphas, candidates)]
        best = int(np.argmax(tpts))  # the first maximum: the smallest weight among ties
        self.skip = candidates[best][1]
        return {**trace, "sel_alpha": alphas[best], "sel_tpt": tpts[best]}


def tokens_per_time(alpha: float, n_attn: int, n_mlp: int, L: int, t_attn: float, t_mlp: float, d_max: int) -> float:
    """max over d = 0..d_max of Σ_{k≤d} α^k / [t_attn·(n_attn·d + L) + t_mlp·(n_mlp·d + L)]."""
    d = np.arange(d_max + 1, dtype=np.float64)
    expected = np.cumsum(alpha**d)
    return float((expected / (t_attn * (n_attn * d + L) + t_mlp * (n_mlp * d + L))).max())


def knapsack_sets(x: torch.Tensor, w_attn: int, w_mlp: int, capacity: int, prune: float,
                  run_sublayer) -> dict[int, tuple[SkipSet, torch.Tensor]]:
    """KnapSpec's DP. x: [2L+1, r, D] the full model's states over the window (x[0] the inputs, x[s+1] after sublayer
    s: layer s // 2's attention for even s, its MLP for odd s). run_sublayer(s, h [B, r, D]) → [B, r, D]: sublayer s
    on B independent branches. Returns {skipped weight j: (its skip set, the state after sublayer 2L − 3)} for the
    states that survive pruning ({} when none does)."""
    S = x.shape[0] - 1  # 2L sublayers
    r = x.shape[1]
    # j → (skipped (layer, kind) pairs, state [r, D]); after layer 0 every branch is the full model's state
    g: dict[int, tuple[tuple, torch.Tensor]] = {0: ((), x[2])}
    for s in range(2, S - 2):  # the sublayers of layers 1..L−2
        weight = w_attn if s % 2 == 0 else w_mlp
        ref = x[s + 1]  # [r, D]
        live = sorted(g)
        before = torch.stack([g[j][1] for j in live])  # [B, r, D] the live states before sublayer s
        executed = run_sublayer(s, before)  # [B, r, D]
        exec_score = cosine(executed, ref[None]).sum(-1).tolist()  # [B]
        stay_score = cosine(before, ref[None]).sum(-1).tolist()
        column = {j: (g[j][0], executed[b], exec_score[b]) for b, j in enumerate(live)}  # exec first
        for b, j in enumerate(live):
            to = j + weight
            if to <= capacity and (to not in column or stay_score[b] > column[to][2]):  # strictly better: ties → exec
                column[to] = ((*g[j][0], s), g[j][1], stay_score[b])
        g = {j: (skipped, h) for j, (skipped, h, score) in column.items() if score / r >= prune}
        if not g:
            return {}
    return {j: (SkipSet(attn=[s // 2 for s in skipped if s % 2 == 0], mlp=[s // 2 for s in skipped if s % 2]), h)
            for j, (skipped, h) in g.items()}
