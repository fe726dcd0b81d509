"""The early-exit draft shape (LS, FS, DV, DEL and its ablations, Vanilla as d = 0): layers 1..E and the exit head,
token by token, then layers E+1..L over the d + 1 positions in one batch.

Verification reuses the early layers' KV from drafting: only the last draft token goes through layers 1..E; the
layer-E states of all d+1 positions (the "exit query cache") then go through layers E+1..L in one batch. A round
therefore loads d·E + L layers (paper §4.1)."""

from __future__ import annotations

import torch

from del_bench.engine.steps import Draft, Verified
from del_bench.methods.base import Method


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
