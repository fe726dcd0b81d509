"""AdaDecode (Wei et al., 2025): adaptive layer parallelism with early-exit heads at a few layers.

Policy only; the schedule is the engine's (del_bench/engine/layer_parallel.py, `draft_shape = "layer_parallel"`):
a token is emitted at the first head layer whose head's top probability exceeds γ (App. D: 0.75), its deeper
layers are deferred and run batched with the next token that reaches them, at most `max_outstanding` (5) early
predictions are unverified at a time, and layer L verifies them (greedy equality or rejection sampling).
Heads: `head_layers` (1-based), default the paper's three at ¼, ½, ¾ depth (round(L·k/4): 8, 15, 22 of 30). The
heads are the model's exit heads (`LayerStack.exit_logits`): its exit adapters with `model.exit_adapters=D`
(AdaDecode as published), else its own LM head ("w/ original LM head", the paper's 0.84× ablation).
"""

from __future__ import annotations

from dataclasses import dataclass

from del_bench.methods.base import EARLY_EXIT, Method, MethodConfig, Plan
from del_bench.schema import LAYERS, key


@dataclass(kw_only=True)
class AdaDecodeConfig(MethodConfig):
    gamma: float = key(0.75, "emit at the first head whose top probability exceeds this", ge=0, le=1)
    head_layers: list[int] | None = key(None, "1-based layers with an exit head (null: ¼, ½, ¾ depth)", ge=1, lt=LAYERS)
    max_outstanding: int = key(5, "early predictions unverified at a time, at most", ge=0)


class AdaDecode(Method):
    name = "adadecode"
    label, family, order = "AdaDecode", EARLY_EXIT, 80
    config = AdaDecodeConfig
    draft_shape = "layer_parallel"

    def __init__(self, gamma: float = 0.75, head_layers: list[int] | None = None, max_outstanding: int = 5, **_):
        self.gamma = float(gamma)
        self.configured_layers = None if head_layers is None else [int(x) for x in head_layers]
        self.max_outstanding = int(max_outstanding)
        self.head_layers: set[int] = set()

    @staticmethod
    def default_layers(num_layers: int) -> list[int]:
        return sorted({min(max(round(num_layers * k / 4), 1), num_layers - 1) for k in (1, 2, 3)})

    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        self.head_layers = set(self.configured_layers or self.default_layers(num_layers))

    def plan(self) -> Plan:  # never asked: the layer-parallel step has no rounds
        raise RuntimeError("AdaDecode runs the engine's layer_parallel step, not draft/verify rounds")

    def describe(self) -> dict:
        return {"gamma": self.gamma, "head_layers": self.configured_layers, "max_outstanding": self.max_outstanding}
