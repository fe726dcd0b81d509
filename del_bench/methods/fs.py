"""FS(E, γ): fixed exit layer E; γ follows a finite-state controller (Liu et al., 2025):
+1 after a round whose drafts were all accepted, −1 otherwise, never below `floor`.

Choices made explicit (docs/design.md §4.3): the paper's controller keeps γ ≥ 1 (`floor: 1`); the DEL authors'
code has no floor (`floor: 0`: γ can reach 0, and a round with no drafts then counts as all accepted).
`reset_per_prompt: true` restarts γ at every prompt, so results do not depend on prompt order."""

from dataclasses import MISSING, dataclass
from typing import Literal

from del_bench.methods.base import (
    EARLY_EXIT,
    UNBOUNDED,
    Method,
    MethodConfig,
    Plan,
    RoundEvidence,
    StaticShape,
    exit_layer_key,
)
from del_bench.schema import key


@dataclass(kw_only=True)
class FSConfig(MethodConfig):
    exit_layer: int = exit_layer_key()
    gamma: int = key(MISSING, "the initial γ (draft tokens per round)", ge=0)
    floor: Literal[0, 1] = key(1, "γ never falls below it: 1 = the paper, 0 = the DEL authors' code")
    max_gamma: int | None = key(None, "a cap on γ (null: none)", ge=1)
    reset_per_prompt: bool = key(True, "restart γ at every prompt (false: carry it across prompts)")


class FiniteState(Method):
    name = "fs"
    label, family, order = "FS", EARLY_EXIT, 20
    label_hyperparameters = (("exit_layer", "E"), ("gamma", "γ"))
    config = FSConfig

    def __init__(self, exit_layer: int, gamma: int, floor: int = 1, max_gamma: int | None = None,
                 reset_per_prompt: bool = True, **_):
        self.exit_layer, self.initial_gamma, self.floor = exit_layer, gamma, floor
        self.max_gamma, self.reset_per_prompt = max_gamma, reset_per_prompt
        self.gamma = gamma

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
