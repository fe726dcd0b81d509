"""LS(E, γ): LayerSkip self-speculation with a fixed exit layer E and a fixed draft length γ."""

from del_bench.methods.base import EARLY_EXIT, Method, Plan, StaticShape, check_exit_layer, check_gamma


class LayerSkip(Method):
    name = "ls"
    label, family, order = "LS", EARLY_EXIT, 10
    label_hyperparameters = (("exit_layer", "E"), ("gamma", "γ"))

    def __init__(self, exit_layer: int, gamma: int, **_):
        self.exit_layer = exit_layer
        self.gamma = gamma

    def validate(self, num_layers: int) -> None:
        check_exit_layer(self.exit_layer, num_layers)
        check_gamma(self.gamma)

    def plan(self) -> Plan:
        return Plan(exit_layer=self.exit_layer, max_draft=self.gamma)

    def describe(self) -> dict:
        return {"exit_layer": self.exit_layer, "gamma": self.gamma}

    def static_shape(self) -> StaticShape:
        return StaticShape(self.exit_layer, self.gamma)
