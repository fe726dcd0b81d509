"""FS(E, γ): fixed exit layer E; γ follows a finite-state controller (Liu et al., 2025):
+1 after a round whose drafts were all accepted, −1 otherwise, never below `floor`.

Choices made explicit (docs/design.md §4.3): the paper's controller keeps γ ≥ 1 (`floor: 1`); the DEL authors'
code has no floor (`floor: 0`: γ can reach 0, and a round with no drafts then counts as all accepted).
`reset_per_prompt: true` restarts γ at every prompt, so results do not depend on prompt order."""

from del_bench.methods.base import (
    EARLY_EXIT,
    UNBOUNDED,
    Method,
    Plan,
    RoundEvidence,
    StaticShape,
    check_exit_layer,
    check_gamma,
)


class FiniteState(Method):
    name = "fs"
    label, family, order = "FS", EARLY_EXIT, 20
    label_hyperparameters = (("exit_layer", "E"), ("gamma", "γ"))

    def __init__(self, exit_layer: int, gamma: int, floor: int = 1, max_gamma: int | None = None,
                 reset_per_prompt: bool = True, **_):
        self.exit_layer, self.initial_gamma, self.floor = exit_layer, gamma, floor
        self.max_gamma, self.reset_per_prompt = max_gamma, reset_per_prompt
        self.gamma = gamma

    def validate(self, num_layers: int) -> None:
        check_exit_layer(self.exit_layer, num_layers)
        check_gamma(self.initial_gamma)
        if self.floor not in (0, 1):
            raise ValueError(f"method.floor={self.floor!r} must be 0 (authors' code) or 1 (paper)")
        if self.max_gamma is not None and self.max_gamma < max(self.floor, 1):
            raise ValueError(f"method.max_gamma={self.max_gamma!r} must be ≥ 1 or null")

    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        if self.reset_per_prompt:
            self.gamma = self.initial_gamma

    def plan(self) -> Plan:
        return Plan(exit_layer=self.exit_layer, max_draft=self.gamma)

    def observe(self, evidence: RoundEvidence) -> None:
        if evidence.budget_capped:  # the last round of a prompt is cut by the token budget: no signal
            return
        grow = evidence.accepted == evidence.drafted
        self.gamma = max(self.floor, self.gamma + (1 if grow else -1))
        if self.max_gamma is not None:
            self.gamma = min(self.gamma, self.max_gamma)

    def describe(self) -> dict:
        return {"exit_layer": self.exit_layer, "gamma": self.initial_gamma, "floor": self.floor}

    def static_shape(self) -> StaticShape:
        """E, and γ as far as it may grow (max_gamma; without one, every width the steps have)."""
        return StaticShape(self.exit_layer, UNBOUNDED if self.max_gamma is None else self.max_gamma)
