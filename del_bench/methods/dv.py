"""DV(E): Draft & Verify's adaptive draft-exiting (Zhang et al., 2024) on a fixed exit layer E.

Draft up to d_max tokens; stop after a draft whose confidence (top draft probability) is below θ.
After each round: AR ← β₁·AR + (1−β₁)·acc; θ̃ = θ + ε if AR < α_target else θ − ε; θ ← β₂·θ + (1−β₂)·θ̃.

Choices made explicit (docs/design.md §4.4): `acceptance: round` uses the round's accepted/drafted (Draft & Verify);
`acceptance: cumulative` uses the prompt's acceptance so far (the DEL authors' code, the default here since
the paper's DV numbers come from it). The authors' code keeps θ and AR across prompts; we restart them per
prompt by default (`reset_per_prompt: true`) so results do not depend on prompt order or on resuming."""

from dataclasses import dataclass
from typing import Literal

from del_bench.methods.base import EARLY_EXIT, Method, MethodConfig, Plan, RoundEvidence, StaticShape, exit_layer_key
from del_bench.schema import key


@dataclass(kw_only=True)
class DVConfig(MethodConfig):
    exit_layer: int = exit_layer_key()
    d_max: int = key(18, "drafts per round at most", ge=1)
    theta: float = key(0.6, "θ₀: the initial confidence threshold", ge=0, le=1)
    beta1: float = key(0.5, "β₁: the acceptance rate's decay", ge=0, le=1)
    beta2: float = key(0.9, "β₂: the threshold's decay", ge=0, le=1)
    epsilon: float = key(0.01, "ε: the threshold's step", ge=0, le=1)
    target_acceptance: float = key(0.8, "α_target: the acceptance rate θ steers to", ge=0, le=1)
    acceptance: Literal["cumulative", "round"] = key(
        "cumulative", "cumulative: the prompt's acceptance so far (the DEL authors' code); round: the round's (D&V)")
    reset_per_prompt: bool = key(True, "restart θ and the acceptance rate at every prompt")


class DraftVerify(Method):
    name = "dv"
    label, family, order = "DV", EARLY_EXIT, 30
    label_hyperparameters = (("exit_layer", "E"),)
    config = DVConfig
    wants_confidence = True
    stops_at_threshold = True  # confidence ≥ θ

    def __init__(self, exit_layer: int, d_max: int = 18, theta: float = 0.6, beta1: float = 0.5,
                 beta2: float = 0.9, epsilon: float = 0.01, target_acceptance: float = 0.8,
                 acceptance: str = "cumulative", reset_per_prompt: bool = True, **_):
        self.exit_layer, self.d_max, self.theta0 = exit_layer, d_max, theta
        self.beta1, self.beta2, self.epsilon, self.target = beta1, beta2, epsilon, target_acceptance
        self.acceptance, self.reset_per_prompt = acceptance, reset_per_prompt
        self.theta, self.ar = theta, 0.0
        self.drafted_total = self.accepted_total = 0

    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        if self.reset_per_prompt or not hasattr(self, "_started"):
            self.theta, self.ar = self.theta0, 0.0
        self.drafted_total = self.accepted_total = 0  # "cumulative" is per prompt in the authors' code
        self._started = True

    def plan(self) -> Plan:
        return Plan(exit_layer=self.exit_layer, max_draft=self.d_max)

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return confidence >= self.stop_threshold()

    def stop_threshold(self) -> float:
        return self.theta

    def observe(self, evidence: RoundEvidence) -> None:
        if evidence.drafted == 0:
            return
        self.drafted_total += evidence.drafted
        self.accepted_total += evidence.accepted
        if self.acceptance == "round":
            acc = evidence.accepted / evidence.drafted
        else:
            acc = self.accepted_total / self.drafted_total
        self.ar = self.beta1 * self.ar + (1 - self.beta1) * acc
        nudged = self.theta + self.epsilon if self.ar < self.target else self.theta - self.epsilon
        self.theta = self.beta2 * self.theta + (1 - self.beta2) * nudged

    def describe(self) -> dict:
        return {"exit_layer": self.exit_layer, "d_max": self.d_max, "acceptance": self.acceptance}

    def static_shape(self) -> StaticShape:
        return StaticShape(self.exit_layer, self.d_max)

    def state(self) -> dict | None:
        if self.reset_per_prompt or not hasattr(self, "_started"):
            return None
        return {"theta": self.theta, "ar": self.ar}

    def restore(self, state: dict) -> None:
        self.theta, self.ar, self._started = state["theta"], state["ar"], True
