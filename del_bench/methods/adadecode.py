"""AdaDecode (Wei et al., 2025): adaptive layer parallelism with early-exit heads at a few layers.

Policy only; the schedule is the engine's (del_bench/engine/layer_parallel.py, `schedule = "layer_parallel"`):
a token is emitted at the first head layer whose head's top probability exceeds γ (App. D: 0.75), its deeper
layers are deferred and run batched with the next token that reaches them, at most `max_outstanding` (5) early
predictions are unverified at a time, and layer L verifies them (greedy equality or rejection sampling).
Heads: `head_layers` (1-based), default the paper's three at ¼, ½, ¾ depth (round(L·k/4): 8, 15, 22 of 30). The
heads are the model's exit heads (`LayerStack.exit_logits`): its exit adapters with `model.exit_adapters=D`
(AdaDecode as published), else its own LM head ("w/ original LM head", the paper's 0.84× ablation).
"""

from __future__ import annotations

from del_bench.methods.base import EARLY_EXIT, Method, Plan, check_exit_layer


class AdaDecode(Method):
    name = "adadecode"
    label, family, order = "AdaDecode", EARLY_EXIT, 80
    schedule = "layer_parallel"

    def __init__(self, gamma: float = 0.75, head_layers: list[int] | None = None, max_outstanding: int = 5, **_):
        self.gamma = float(gamma)
        self.configured_layers = None if head_layers is None else [int(x) for x in head_layers]
        self.max_outstanding = int(max_outstanding)
        self.head_layers: set[int] = set()

    @staticmethod
    def default_layers(num_layers: int) -> list[int]:
        return sorted({min(max(round(num_layers * k / 4), 1), num_layers - 1) for k in (1, 2, 3)})

    def validate(self, num_layers: int) -> None:
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"method.gamma={self.gamma!r} must be in [0, 1] (a probability threshold)")
        for layer in self.configured_layers or []:
            check_exit_layer(layer, num_layers, "method.head_layers")
        if self.max_outstanding < 0:
            raise ValueError(f"method.max_outstanding={self.max_outstanding!r} must be ≥ 0")

    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        self.head_layers = set(self.configured_layers or self.default_layers(num_layers))

    def plan(self) -> Plan:  # never asked: the layer-parallel step has no rounds
        raise RuntimeError("AdaDecode runs the engine's layer_parallel step, not draft/verify rounds")

    def describe(self) -> dict:
        return {"gamma": self.gamma, "head_layers": self.configured_layers, "max_outstanding": self.max_outstanding}
