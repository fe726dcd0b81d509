"""The early-exit draft shape (LS, FS, DV, DEL and its ablations, Vanilla as d = 0): layers 1..E and the exit head,
token by token, then layers E+1..L over the d + 1 positions in one batch.

Verification reuses the early layers' KV from drafting: only the last draft token goes through layers 1..E; the
layer-E states of all d+1 positions (the "exit query cache") then go through layers E+1..L in one batch. A round
therefore loads d·E + L layers (paper §4.1)."""

from __future__ import annotations

import torch

from del_bench.engine.steps import Draft, Verified
from del_bench.methods.base import Method
from del_bench.transfer import to_list


def draft(engine, token: torch.Tensor, pos: int, E: int, budget: int, cache, method: Method, rng) -> Draft:
    """Draft from the pending token ([1, 1] on the device) at position pos until the budget, an EOS, or the method
    stops.

    The pending token and every kept draft go through layers 1..E; the last one's pass is already
    part of verification: its layer-E state joins the batch (a draft head ran on it only if its
    candidate was dropped). With budget 0 (E = L) that single pass is the whole round's forward.
    Drafts (greedy or sampled) stay on the device unless the method stops on confidence (one read per candidate: its
    token and confidence together), so an EOS drafted by a method that does not is seen only at acceptance: the
    drafts after it are paid for (and counted), never emitted."""
    draft = Draft(early=[] if method.wants_shadow else None, exit_layer=E)
    if method.wants_confidence and method.lookahead > 1 and budget > 0:
        return draft_ahead(engine, token, pos, E, budget, cache, method, rng, draft)
    stop = budget == 0
    while True:
        draft_layers(engine, token, pos, E, cache, draft)
        pos += 1
        if stop or len(draft.ids) >= budget:
            return draft
        candidate, keep = engine.draft_token(draft, method, rng)
        if candidate is None:  # stopped, and the stopping candidate is dropped
            return draft
        token = draft.ids[-1].view(1, 1)
        stop = not keep or candidate in engine.eos_ids


def draft_ahead(engine, token: torch.Tensor, pos: int, E: int, budget: int, cache, method: Method, rng,
                draft: Draft) -> Draft:
    """`draft` with the stop decisions read `method.lookahead` candidates at a time: up to k candidates are drafted
    as if each kept drafting (each through layers 1..E for the next), then their tokens and confidences come to the
    host in one read and the method decides on them in order, as `draft` would one by one — the same drafts, the
    same decisions (the method sees the same calls), so the same tokens. The price: candidates drafted past the stop
    (their head rows count in `candidates`, their passes in `wasted`: loaded layers), for one read per k candidates
    instead of one each. Which pays depends on the device: a read drains a GPU's queue (tens of µs), a pass costs E
    layers' weight reads (the README's GPU section says what each costs)."""
    draft_layers(engine, token, pos, E, cache, draft)  # the pending token
    pos += 1
    while True:
        k = min(method.lookahead, budget - len(draft.ids))
        window = []  # (token [1], top [], q) of each candidate drafted ahead
        for j in range(k):
            if j:  # the previous candidate through layers 1..E, as if it kept drafting
                draft_layers(engine, window[-1][0].view(1, 1), pos + j - 1, E, cache, draft)
            window.append(engine.draft_head(draft, rng, method))
        # one read: each candidate's token and confidence, [2k] (a token id is exact in float64)
        read = to_list(torch.cat([torch.cat([tok.double(), top.double()[None]]) for tok, top, _ in window]))
        for j, (token_j, _, q) in enumerate(window):
            candidate, confidence = int(read[2 * j]), read[2 * j + 1]
            keep = engine.decide(draft, method, candidate, confidence)
            if keep is None:  # dropped: the passes of candidates j.. ran for nothing
                return _trimmed(draft, kept=len(draft.ids), wasted=k - 1 - j)
            engine.keep_candidate(draft, token_j, q, candidate)
            if not keep or candidate in engine.eos_ids:  # kept, and the last: its own pass is verification's
                if j == k - 1:
                    draft_layers(engine, token_j.view(1, 1), pos + j, E, cache, draft)
                return _trimmed(draft, kept=len(draft.ids), wasted=max(k - 2 - j, 0))
        draft_layers(engine, window[-1][0].view(1, 1), pos + k - 1, E, cache, draft)
        pos += k
        if len(draft.ids) >= budget:
            return draft


def _trimmed(draft: Draft, kept: int, wasted: int) -> Draft:
    """The draft's states cut to the pending token and its `kept` drafts; `wasted` passes ran past them."""
    del draft.exit_states[kept + 1 :]
    if draft.early is not None:
        del draft.early[kept + 1 :]
    draft.wasted += wasted
    return draft


def draft_layers(engine, token: torch.Tensor, pos: int, E: int, cache, draft: Draft) -> None:
    """Layers 1..E for one token ([1, 1] ids) at position pos (writing their KV); its layer-E state [1, 1, D]
    goes to draft.exit_states and, for shadow tokens, every layer's output to draft.early."""
    layers = None if draft.early is None else []
    h = engine.stack.forward_layers(engine.stack.embed(token), 0, E, pos, cache, collect=layers)
    draft.exit_states.append(h)  # [1, 1, D]
    if draft.early is not None:
        draft.early.append(layers)  # E × [1, 1, D]


def verify(engine, draft: Draft, E: int, pos: int, cache) -> Verified:
    """All d + 1 positions (from pos) through layers E+1..L at once, from drafting's layer-E states. No head runs
    here: acceptance runs it (over every row at once, greedy or sampling)."""
    late: list[torch.Tensor] | None = None if draft.early is None else []  # [layer] → [1, d+1, D]
    states = torch.cat(draft.exit_states, dim=1)  # [1, d+1, D]
    h = engine.stack.norm(engine.stack.forward_layers(states, E, engine.stack.num_layers, pos, cache, collect=late))
    return Verified(h, late, engine.stack.head, gaps={} if engine.track_gaps else None)
