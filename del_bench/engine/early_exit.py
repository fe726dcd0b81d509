"""The early-exit draft shape (LS, FS, DV, DEL and its ablations, Vanilla as d = 0): layers 1..E and the exit head,
token by token, then layers E+1..L over the d + 1 positions in one batch.

Verification reuses the early layers' KV from drafting: only the last draft token goes through layers 1..E; the
layer-E states of all d+1 positions (the "exit query cache") then go through layers E+1..L in one batch. A round
therefore loads d·E + L layers (paper §4.1)."""

from __future__ import annotations

import torch

from del_bench.engine.steps import Draft, Verified
from del_bench.methods.base import Method
from del_bench.transfer import charged, to_list


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
    h = engine.forward_layers(engine.stack.embed(token), 0, E, pos, cache, collect=layers)
    draft.exit_states.append(h)  # [1, 1, D]
    if draft.early is not None:
        draft.early.append(layers)  # E × [1, 1, D]


def verify(engine, draft: Draft, E: int, pos: int, cache) -> Verified:
    """All d + 1 positions (from pos) through layers E+1..L at once, from drafting's layer-E states. No head runs
    here: acceptance runs it (over every row at once, greedy or sampling)."""
    late: list[torch.Tensor] | None = None if draft.early is None else []  # [layer] → [1, d+1, D]
    states = torch.cat(draft.exit_states, dim=1)  # [1, d+1, D]
    h = engine.stack.norm(engine.forward_layers(states, E, engine.stack.num_layers, pos, cache, collect=late))
    return Verified(h, late, engine.stack.head, gaps={} if engine.track_gaps else None)


# ---- a batch's rows in lockstep (engine/lockstep.py) -------------------------------------------------------------
def draft_rows(batch, slots: list) -> None:
    """`draft` for every row of a batch at once, the same drafts, decisions and records as row by row: each draft
    step passes every row with a token to pass through layers 1..E_r — one step to the deepest row's exit, each row
    reading its own layer-E_r state (a shallower row idles above its exit, masked) — then the draft head over every
    row still drafting in one product, and where the method stops on confidence one read of every row's candidate
    and confidence. A row whose draft ended idles in the steps after. A row with no draft this round (E = L: its one
    pass through every layer is its round) goes as deep as the deepest drafting row in the first step and through
    the rest in the verification step (verify_rows): the same layers in the same order, and no step runs every layer
    for one row while the others idle above their exits."""
    L = batch.stack.num_layers
    reach = max((s.round.plan.exit_layer for s in slots if s.round.plan.budget > 0), default=L)
    for slot in slots:
        r = slot.round
        r.draft = Draft(early=[] if slot.method.wants_shadow else None, exit_layer=r.plan.exit_layer)
        r.stop = r.plan.budget == 0
        r.depth = r.plan.exit_layer if r.plan.budget > 0 else reach  # where its passes leave off this round
    passing = list(slots)
    while passing:
        _layers_rows(batch, passing)
        heads = [s for s in passing if not (s.round.stop or len(s.round.draft.ids) >= s.round.plan.budget)]
        passing = _heads_rows(batch, heads) if heads else []


def _layers_rows(batch, slots: list) -> None:
    """draft_layers for every row of `slots`: its token [1, 1] at its position through layers 1..depth (its E)."""
    deepest = max(s.round.depth for s in slots)
    collect = "layers" if slots[0].round.draft.early is not None else None
    h = batch.stack.embed(torch.cat([s.round.token.view(1, 1) for s in slots], dim=1))  # [1, n, D]
    inputs = {s: (h[:, i : i + 1], s.round.pos) for i, s in enumerate(slots)}
    out, states = batch.step(0, deepest, inputs, {s: (0, s.round.depth) for s in slots}, collect)
    for s in slots:
        r = s.round
        r.draft.exit_states.append(out[s])  # [1, 1, D]: its state at its own depth (it idled above)
        if r.draft.early is not None:
            r.draft.early.append([state[s.index : s.index + 1] for state in states[: r.depth]])
        r.pos += 1


def _heads_rows(batch, slots: list) -> list:
    """Engine.draft_token for every row of `slots` (their draft heads in one product; one read of the candidates
    and confidences where the method stops on them) → the rows whose candidate joined their draft, to pass next."""
    logits = batch.head(slots, [s.round.draft.exit_states[-1] for s in slots], [s.round.plan.exit_layer for s in slots])
    picked = [s.engine.candidate_of(s.round.draft, row, s.run.rng, s.method) for s, row in zip(slots, logits)]
    confident = slots[0].method.wants_confidence  # one method a batch
    if confident:  # one read: each row's token and confidence (a token id is exact in float64)
        with charged([s.ledger for s in slots]):
            read = to_list(torch.cat([torch.cat([token.double(), top.double()[None]]) for token, top, _ in picked]))
    passing = []
    for j, (s, (token, _, q)) in enumerate(zip(slots, picked)):
        r = s.round
        if confident:
            candidate, keep = s.engine.judge(r.draft, s.method, token, q, int(read[2 * j]), read[2 * j + 1])
            if candidate is None:  # stopped, and the stopping candidate is dropped
                continue
        else:
            candidate, keep = -1, True  # on the device until acceptance reads it
            s.engine.keep_candidate(r.draft, token, q, candidate)
        r.token = r.draft.ids[-1].view(1, 1)
        r.stop = not keep or candidate in s.engine.eos_ids
        passing.append(s)
    return passing


def verify_rows(batch, slots: list) -> None:
    """`verify` for every row of a batch at once, through layers E_min+1..L in one step of width max(d_r + 1): a row
    that drafted from its own exit layer, its d + 1 positions; a row that did not (E = L) its one position from where
    its pass left off (draft_rows), its every layer's state (DEL's shadow tokens) the draft's and this step's; below
    its layer a row idles."""
    st, L = batch.stack, batch.stack.num_layers
    joining = [s for s in slots if s.round.depth < L]
    out, states, lowest = {}, [], L
    if joining:
        lowest = min(s.round.depth for s in joining)
        collect = "layers" if joining[0].round.draft.early is not None else None
        inputs = {s: (torch.cat(s.round.draft.exit_states, dim=1), s.round.n - 1) for s in joining}  # [1, d+1, D]
        out, states = batch.step(lowest, L, inputs, {s: (s.round.depth, L) for s in joining}, collect)
    for s in slots:
        r = s.round
        T = len(r.draft.exit_states)
        h = out.get(s, r.draft.exit_states[0])  # [1, d+1, D]; a row through every layer already: [1, 1, D]
        late = None
        if r.draft.early is not None:
            late = [state[s.index : s.index + 1, :T] for state in states[r.depth - lowest :]] if s in out else []
            if r.plan.exit_layer == L:  # no draft: its one pass's every layer is the draft's (as one pass alone)
                r.draft.early[0] += late
                late = []
        r.verified = Verified(st.norm(h), late, st.head, gaps={} if s.engine.track_gaps else None)
