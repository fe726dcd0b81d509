"""Token choice and acceptance: greedy, and speculative sampling (Leviathan et al., 2023).

Draft and target distributions use the same warping (temperature, then top-p, as transformers'
TemperatureLogitsWarper + TopPLogitsWarper), which is what makes speculative sampling exact."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from del_bench.numerics import widened
from del_bench.schema import check, key
from del_bench.transfer import to_list


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: the run's `generation` keys (and a task's own, over them), each typed and ranged here."""

    do_sample: bool = key(False, "false: greedy; true: speculative sampling with the warping below")
    temperature: float = key(1.0, "the logits' divisor when sampling (greedy: do_sample=false)", gt=0)
    top_p: float = key(1.0, "nucleus: the smallest set of tokens whose probability reaches it", gt=0, le=1)

    def __post_init__(self):
        problems = check(Sampling, asdict(self), "generation")
        if problems:
            raise ValueError("; ".join(problems))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [..., V] → warped probabilities [..., V] (float32 or wider)."""
        scores = widened(logits)
        scores = scores / self.temperature
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            remove_sorted = cumulative <= (1 - self.top_p)
            remove_sorted[..., -1:] = False  # always keep the most likely token
            remove = remove_sorted.scatter(-1, order, remove_sorted)
            scores = scores.masked_fill(remove, float("-inf"))
        return scores.softmax(dim=-1)


class Draws:
    """Every random draw of decoding, in the three shapes decoding uses, from one torch.Generator in call order.

    The acceptance rules below and the engine draw only through this: a test substitutes an implementation that
    enumerates both sides of every draw with its exact probability (tests/test_sampling_exact.py)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def below(self, num: torch.Tensor, den: torch.Tensor) -> bool:
        """One uniform u ∈ [0, 1): u·den < num, i.e. True with probability min(1, num/den) (scalars, same dtype)."""
        u = torch.rand((), generator=self.generator, device=num.device, dtype=num.dtype)
        return to_list(u * den < num)

    def categorical(self, weights: torch.Tensor) -> int:
        """One index of weights [V] (≥ 0, not necessarily normalised) with probability weights / weights.sum()."""
        return to_list(torch.multinomial(weights, 1, generator=self.generator))[0]

    def without_replacement(self, weights: torch.Tensor, count: int) -> list[int]:
        """count distinct indices of weights [V], drawn one after another, each renormalised without the earlier."""
        return to_list(torch.multinomial(weights, count, replacement=False, generator=self.generator))

    # the same draws left on the device (no read: a round's chain acceptance reads once, at its end)
    def below_each(self, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        """below for each of d pairs (num, den: [d], same dtype) at once: d independent uniforms → [d] bool."""
        u = torch.rand(num.shape, generator=self.generator, device=num.device, dtype=num.dtype)
        return u * den < num

    def sample(self, weights: torch.Tensor) -> torch.Tensor:
        """categorical on the device: [1] long. The exponential race argmax(w / e), e ~ Exp(1) — the draw
        torch.multinomial(weights, 1) makes, from the same generator state, after it reads the weights' min and max
        to check them (two host reads this skips)."""
        race = torch.empty_like(weights).exponential_(generator=self.generator)  # [V]
        return (weights / race).argmax(-1, keepdim=True)


def choose(logits: torch.Tensor, sampling: Sampling, rng: Draws) -> tuple[int, torch.Tensor | None]:
    """One token from logits [V]: argmax, or a sample from the warped distribution (returned too)."""
    if not sampling.do_sample:
        return to_list(logits.argmax()), None
    probs = sampling.probs(logits)
    return rng.categorical(probs), probs


def accept_greedy(drafts: list[int], target_row) -> tuple[int, int]:
    """Longest prefix of drafts equal to the verifier's argmax, plus the verifier's next token.

    target_row(i) → the verifier's logits [V] at draft position i (i = 0..d), computed on demand:
    rows after the first mismatch are never needed, so they are never paid for."""
    for k, draft in enumerate(drafts):
        target = to_list(target_row(k).argmax())
        if draft != target:
            return k, target
    return len(drafts), to_list(target_row(len(drafts)).argmax())


def accept_sampling(drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                    sampling: Sampling, rng: Draws) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over a chain, on the device with no host read. drafts: [d] ids, draft_probs: q [d, V]
    (None when d = 0), target_logits: [d+1, V] whose warping is p. Returns (k accepted drafts [], the next token [1]).

    Accept x_i with prob min(1, p_i(x_i)/q_i(x_i)); at the first rejection draw from norm(max(0, p_i − q_i)); if
    all d are accepted draw a bonus token from p_d. Every draft's test is drawn (d uniforms at once) and only the
    tests up to the first rejection count: the later ones are independent of the outcome, so exactness holds."""
    p = sampling.probs(target_logits)  # [d+1, V]
    d = drafts.shape[0]
    if d == 0:
        return drafts.new_zeros(()), rng.sample(p[0])
    q = draft_probs.to(p.dtype)  # [d, V]
    accepted = accepts_each(drafts, q, p[:d], rng)  # [d] bool
    k = accepted.long().cumprod(0).sum()  # [] the accepted prefix
    rest = residuals(p, q)  # [d+1, V]: row k is what the next token is drawn from
    return k, rng.sample(rest.index_select(0, k.view(1))[0])  # index_select: a 0-d index would read k


def accepts_each(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, rng: Draws) -> torch.Tensor:
    """accepts for every draft of a chain at once: drafts [d], q and p [d, V] → [d] bool (one uniform each)."""
    at = drafts.view(-1, 1).to(p.device)  # [d, 1]
    return rng.below_each(p.gather(1, at)[:, 0], q.gather(1, at)[:, 0])


def residuals(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """residual(p_i, q_i) for every row i < d of a chain, and p_d for the row after the last draft: p [d+1, V],
    q [d, V] → [d+1, V] (each row normalised, as residual's)."""
    rest = (p[:-1] - q).clamp_min(0)  # [d, V]
    total = rest.sum(-1, keepdim=True)  # [d, 1]
    rest = torch.where(total > 0, rest / total, p[:-1])
    return torch.cat([rest, p[-1:]])


@dataclass(frozen=True)
class Siblings:
    """A dynamic token tree's other candidates (SWIFT): tokens[i] hang off the chain's node before draft i,
    beside draft i (so they are leaves at depth i + 1); rows[i] are their rows in the verification batch.
    Greedy: the draft distribution's next most likely tokens. Sampling: drawn from q_i without replacement,
    after the chain token (tokens[i][j] ~ q_i with the chain token and tokens[i][:j] removed, renormalised) —
    the proposal that recursive rejection (accept_sampling_tree) needs to stay exact."""

    tokens: list[list[int]]
    rows: list[list[int]]


def accept_greedy_tree(drafts: list[int], siblings: Siblings, target_row) -> tuple[int, int | None, int]:
    """The longest path of the tree the verifier agrees with: the chain's accepted prefix (accept_greedy), then,
    at the first mismatch, the sibling equal to the verifier's token there, if any (siblings are leaves).
    Returns (k chain drafts accepted, index of the accepted sibling at depth k + 1 or None, next token)."""
    k, target = accept_greedy(drafts, target_row)
    if k < len(drafts):
        for j, token in enumerate(siblings.tokens[k]):
            if token == target:
                return k, j, to_list(target_row(siblings.rows[k][j]).argmax())
    return k, None, target


def accept_sampling_tree(
    drafts: list[int],
    draft_probs: list[torch.Tensor],
    siblings: Siblings | None,
    target_row,
    sampling: Sampling,
    rng: Draws,
) -> tuple[int, int | None, int]:
    """Speculative sampling over a chain with sibling leaves (SpecInfer-style recursive rejection).

    Down the chain as accept_sampling. At the first rejected draft x_i, each sibling s_j in turn is a draft
    from q' = q_i without the tokens already tried (x_i, s_1.., renormalised) — how it was drawn — against the
    residual r (first norm(max(0, p_i − q_i))): accept it with prob min(1, r(s_j)/q'(s_j)), else
    r ← norm(max(0, r − q')). Each step is exact speculative sampling of r, so the token that ends the walk
    (an accepted sibling, or a draw from the final r) is distributed as p_i. After an accepted sibling the
    bonus token is drawn from p at its row. Returns (k chain drafts accepted, accepted sibling or None, token)."""
    for i, (x, q) in enumerate(zip(drafts, draft_probs)):
        p = sampling.probs(target_row(i))
        q = q.to(p.dtype)
        if accepts(x, q, p, rng):
            continue
        rest = residual(p, q)
        tried = q.clone()
        tried[x] = 0
        for j, (s, row) in enumerate(zip(siblings.tokens[i], siblings.rows[i]) if siblings else ()):
            proposal = tried / tried.sum()  # [V] the distribution s was drawn from
            if accepts(s, proposal, rest, rng):
                return i, j, rng.categorical(sampling.probs(target_row(row)))
            rest = residual(rest, proposal)
            tried[s] = 0
        return i, None, rng.categorical(rest)
    p = sampling.probs(target_row(len(drafts)))
    return len(drafts), None, rng.categorical(p)


def accepts(x: int, q: torch.Tensor, p: torch.Tensor, rng: Draws) -> bool:
    """One speculative-sampling test of draft token x drawn from q against the target p ([V] each, same dtype):
    u < p(x)/q(x), written u·q(x) < p(x) so a tiny q is never divided by. Draws one uniform from rng."""
    return rng.below(p[x], q[x])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) [V]; p == q exactly leaves no residual mass, and then any draw from p is already exact."""
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else p
