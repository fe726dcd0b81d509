"""Token choice and acceptance: greedy, and speculative sampling (Leviathan et al., 2023).

Draft and target distributions use the same warping (temperature, then top-p, as transformers'
TemperatureLogitsWarper + TopPLogitsWarper), which is what makes speculative sampling exact."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"generation.temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generation.top_p must be in (0, 1], got {self.top_p}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [..., V] → warped probabilities [..., V] (float32 or wider)."""
        scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        scores = scores / self.temperature
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            remove_sorted = cumulative <= (1 - self.top_p)
            remove_sorted[..., -1:] = False  # always keep the most likely token
            remove = remove_sorted.scatter(-1, order, remove_sorted)
            scores = scores.masked_fill(remove, float("-inf"))
        return scores.softmax(dim=-1)


def choose(logits: torch.Tensor, sampling: Sampling, rng: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """One token from logits [V]: argmax, or a sample from the warped distribution (returned too)."""
    if not sampling.do_sample:
        return int(logits.argmax()), None
    probs = sampling.probs(logits)
    return int(torch.multinomial(probs, 1, generator=rng)), probs


def accept_greedy(drafts: list[int], target_row) -> tuple[int, int]:
    """Longest prefix of drafts equal to the verifier's argmax, plus the verifier's next token.

    target_row(i) → the verifier's logits [V] at draft position i (i = 0..d), computed on demand:
    rows after the first mismatch are never needed, so they are never paid for."""
    for k, draft in enumerate(drafts):
        target = int(target_row(k).argmax())
        if draft != target:
            return k, target
    return len(drafts), int(target_row(len(drafts)).argmax())


def accept_sampling(
    drafts: list[int],
    draft_probs: list[torch.Tensor],
    target_row,
    sampling: Sampling,
    rng: torch.Generator,
) -> tuple[int, int]:
    """Speculative sampling. draft_probs[i]: q_i [V]; target_row(i) → logits [V] whose warping is p_i.

    Accept x_i with prob min(1, p_i(x_i)/q_i(x_i)); at the first rejection draw from
    norm(max(0, p_i − q_i)); if all d are accepted draw a bonus token from p_d."""
    for i, (x, q) in enumerate(zip(drafts, draft_probs)):
        p = sampling.probs(target_row(i))
        u = torch.rand((), generator=rng, device=p.device, dtype=p.dtype)
        if u * q[x] < p[x]:  # u < p/q without dividing by a possibly tiny q
            continue
        residual = (p - q.to(p.dtype)).clamp_min(0)
        total = residual.sum()
        # p == q exactly leaves no residual mass; then any draw from p is already exact
        dist = residual / total if total > 0 else p
        return i, int(torch.multinomial(dist, 1, generator=rng))
    p = sampling.probs(target_row(len(drafts)))
    return len(drafts), int(torch.multinomial(p, 1, generator=rng))
