"""DV(E): Draft & Verify's adaptive draft-exiting (Zhang et al., 2024) on a fixed exit layer E.

Draft up to d_max tokens; stop after a draft whose confidence (top draft probability) is below θ.
After each round: AR ← β₁·AR + (1−β₁)·acc; θ̃ = θ + ε if AR < α_target else θ − ε; θ ← β₂·θ + (1−β₂)·θ̃.

Choices made explicit (docs/design.md §4.4): `acceptance: round` uses the round's accepted/drafted (Draft & Verify);
`acceptance: cumulative` uses the prompt's acceptance so far (the DEL authors' code, the default here since
the paper's DV numbers come from it). The authors' code keeps θ and AR across prompts; we restart them per
prompt by default (`reset_per_prompt: true`) so results do not depend on prompt order or on resuming."""

from del_bench.methods.base import EARLY_EXIT, Method, Plan, RoundEvidence, StaticShape, check_exit_layer, check_gamma


class DraftVerify(Method):
    name = "dv"
    label, family, order = "DV", EARLY_EXIT, 30
    label_hyperparameters = (("exit_layer", "E"),)
    wants_confidence = True

    def __init__(self, exit_layer: int, d_max: int = 18, theta: float = 0.6, beta1: float = 0.5,
                 beta2: float = 0.9, epsilon: float = 0.01, target_acceptance: float = 0.8,
                 acceptance: str = "cumulative", reset_per_prompt: bool = True, **_):
        self.exit_layer, self.d_max, self.theta0 = exit_layer, d_max, theta
        self.beta1, self.beta2, self.epsilon, self.target = beta1, beta2, epsilon, target_acceptance
        self.acceptance, self.reset_per_prompt = acceptance, reset_per_prompt
        self.theta, self.ar = theta, 0.0
        self.drafted_total = self.accepted_total = 0

    def validate(self, num_layers: int) -> None:
        check_exit_layer(self.exit_layer, num_layers)
        check_gamma(self.d_max, "method.d_max")
        for key in ("theta", "beta1", "beta2", "target_acceptance"):
            value = {"theta": self.theta0, "beta1": self.beta1, "beta2": self.beta2,
                     "target_acceptance": self.target}[key]
            if not 0 <= value <= 1:
                raise ValueError(f"method.{key}={value!r} must be in [0, 1]")
        if self.acceptance not in ("round", "cumulative"):
            raise ValueError(f"method.acceptance={self.acceptance!r} must be 'round' or 'cumulative'")

    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        if self.reset_per_prompt or not hasattr(self, "_started"):
            self.theta, self.ar = self.theta0, 0.0
        self.drafted_total = self.accepted_total = 0  # "cumulative" is per prompt in the authors' code
        self._started = True

    def plan(self) -> Plan:
        return Plan(exit_layer=self.exit_layer, max_draft=self.d_max)

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return confidence >= self.theta

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
