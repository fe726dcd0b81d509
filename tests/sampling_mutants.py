"""Subtle bugs in speculative sampling, as drop-in replacements of the real functions: the negative controls of
tests/test_sampling_exact.py and tests/test_sampling_stats.py apply one (MUTANTS[name](monkeypatch)) and must fail.

Each bug is a plausible slip in code like engine/sampling.py, small enough to pass a blatant-bias test."""

from __future__ import annotations

import torch

from del_bench.engine import acceptance, layer_parallel, sampling
from del_bench.engine.sampling import residual


def without(q, x):
    """q [V] with token x removed and renormalised: the tree's proposal for its first sibling."""
    rest = q.clone()
    rest[x] = 0
    return rest / rest.sum()


def tree_sampler(residual_of=None, proposal_of=None):
    """A copy of sampling.accept_sampling_tree with two hooks: residual_of(i, x, p, q) is the residual at the first
    rejected draft i (right: residual(p, q)), proposal_of(tried) a sibling's proposal (right: tried / tried.sum())."""
    residual_of = residual_of or (lambda i, x, p, q: residual(p, q))
    proposal_of = proposal_of or (lambda tried: tried / tried.sum())

    def accept_sampling_tree(drafts, draft_probs, siblings, target_row, samp, rng):
        for i, (x, q) in enumerate(zip(drafts, draft_probs)):
            p = samp.probs(target_row(i))
            q = q.to(p.dtype)
            if sampling.accepts(x, q, p, rng):
                continue
            rest = residual_of(i, x, p, q)
            tried = q.clone()
            tried[x] = 0
            for j, (s, row) in enumerate(zip(siblings.tokens[i], siblings.rows[i]) if siblings else ()):
                proposal = proposal_of(tried)
                if sampling.accepts(s, proposal, rest, rng):
                    return i, j, rng.categorical(samp.probs(target_row(row)))
                rest = sampling.residual(rest, proposal)
                tried[s] = 0
            return i, None, rng.categorical(rest)
        return len(drafts), None, rng.categorical(samp.probs(target_row(len(drafts))))

    return accept_sampling_tree


def chain_sampler(residual_of):
    """A copy of sampling.accept_sampling (the engine's chain, on the device) whose residual at a rejected draft i is
    residual_of(i, x, p, q) (right: residual(p, q))."""

    def accept_sampling(drafts, draft_probs, target_logits, samp, rng):
        p = samp.probs(target_logits)
        d = drafts.shape[0]
        if d == 0:
            return drafts.new_zeros(()), rng.sample(p[0])
        q = draft_probs.to(p.dtype)
        k = sampling.accepts_each(drafts, q, p[:d], rng).long().cumprod(0).sum()
        rows = [residual_of(i, int(x), p[i], q[i]) for i, x in enumerate(drafts.tolist())] + [p[d]]
        return k, rng.sample(torch.stack(rows)[int(k)])

    return accept_sampling


def ada_verify(residual_of):
    """layer_parallel._verify (sampling) with the replacement drawn from residual_of(check, x, p, q), where check
    counts the deferred checks of a row's current step from 0 (right: residual(p, q))."""
    checks = {"step": 0}
    real_step = layer_parallel.Walk.verify

    def step(walk):
        checks["step"] = 0
        return real_step(walk)

    def verify(token, row, q, samp, rng):
        check, checks["step"] = checks["step"], checks["step"] + 1
        p = samp.probs(row)
        q = q.to(p.dtype)
        if sampling.accepts(token, q, p, rng):
            return True, token
        return False, rng.categorical(residual_of(check, token, p, q))

    return step, verify


def _use(monkeypatch, residual_of=None, proposal_of=None):
    tree = tree_sampler(residual_of, proposal_of)
    monkeypatch.setattr(sampling, "accept_sampling_tree", tree)  # what accept_sampling calls
    monkeypatch.setattr(acceptance, "accept_sampling_tree", tree)
    if residual_of is not None:
        chain = chain_sampler(residual_of)
        monkeypatch.setattr(sampling, "accept_sampling", chain)
        monkeypatch.setattr(acceptance, "accept_sampling", chain)
        step, verify = ada_verify(residual_of)
        monkeypatch.setattr(layer_parallel.Walk, "verify", step)
        monkeypatch.setattr(layer_parallel, "_verify", verify)


def over_accepting(monkeypatch):
    """Accept with min(1, 1.1·p(x)/q(x)): over-acceptance by 10%."""
    def accepts(x, q, p, rng):
        return rng.below(1.1 * p[x], q[x])

    def accepts_each(drafts, q, p, rng):
        at = drafts.view(-1, 1)
        return rng.below_each(1.1 * p.gather(1, at)[:, 0], q.gather(1, at)[:, 0])

    monkeypatch.setattr(sampling, "accepts", accepts)
    monkeypatch.setattr(sampling, "accepts_each", accepts_each)
    monkeypatch.setattr(layer_parallel, "accepts", accepts)


def residual_from_p_after_first(monkeypatch):
    """From the second draft (AdaDecode: the second deferred check of a step) on, a rejection draws from p."""
    _use(monkeypatch, residual_of=lambda i, x, p, q: residual(p, q) if i == 0 else p)


def residual_against_q_without_x(monkeypatch):
    """A mis-normalised residual: against q renormalised without the rejected token (the tree's q' in a chain)."""
    _use(monkeypatch, residual_of=lambda i, x, p, q: residual(p, without(q, x)))


def unnormalised_residual(monkeypatch):
    """residual() forgets to normalise: harmless where it is only drawn from (a draw normalises: chain and
    AdaDecode, an equivalent mutant), wrong where it is a distribution again (the tree's sibling tests)."""
    def unnormalised(p, q):
        rest = (p - q).clamp_min(0)
        return rest if rest.sum() > 0 else p

    def unnormalised_rows(p, q):  # the chain's residuals
        rest = (p[:-1] - q).clamp_min(0)
        return torch.cat([torch.where(rest.sum(-1, keepdim=True) > 0, rest, p[:-1]), p[-1:]])

    monkeypatch.setattr(sampling, "residual", unnormalised)
    monkeypatch.setattr(sampling, "residuals", unnormalised_rows)
    monkeypatch.setattr(layer_parallel, "residual", unnormalised)


def unnormalised_proposal(monkeypatch):
    """The tree: a sibling is tested against q with the tried tokens zeroed but not renormalised."""
    _use(monkeypatch, proposal_of=lambda tried: tried)


MUTANTS = {
    "over-accept-10%": over_accepting,
    "residual-from-p-after-first": residual_from_p_after_first,
    "residual-vs-q-without-x": residual_against_q_without_x,
    "unnormalised-residual": unnormalised_residual,
    "unnormalised-proposal": unnormalised_proposal,
}
