"""LS(E, γ): LayerSkip self-speculation with a fixed exit layer E and a fixed draft length γ."""

from dataclasses import MISSING, dataclass

from del_bench.methods.base import EARLY_EXIT, Method, MethodConfig, Plan, StaticShape, exit_layer_key
from del_bench.schema import key


@dataclass(kw_only=True)
class LSConfig(MethodConfig):
    exit_layer: int = exit_layer_key()
    # γ = 0 would never draft: Vanilla under LS's label (method=vanilla is that run)
    gamma: int = key(MISSING, "γ: draft tokens per round", ge=1)


class LayerSkip(Method):
    name = "ls"
    label, family, order = "LS", EARLY_EXIT, 10
    label_hyperparameters = (("exit_layer", "E"), ("gamma", "γ"))
    config = LSConfig

    def __init__(self, exit_layer: int, gamma: int, **_):
        self.exit_layer = exit_layer
        self.gamma = gamma

    def plan(self) -> Plan:
        return Plan(exit_layer=self.exit_layer, max_draft=self.gamma)

    def describe(self) -> dict:
        return {"exit_layer": self.exit_layer, "gamma": self.gamma}

    def static_shape(self) -> StaticShape:
        return StaticShape(self.exit_layer, self.gamma)
