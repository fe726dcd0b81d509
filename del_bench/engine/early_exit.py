"""The early-exit draft shape (LS, FS, DV, DEL and its ablations, Vanilla as d = 0): layers 1..E and the exit head,
token by token, then layers E+1..L over the d + 1 positions in one batch — for every row of a batch at once.

Verification reuses the early layers' KV from drafting: only the last draft token goes through layers 1..E; the
layer-E states of all d+1 positions (the "exit query cache") then go through layers E+1..L in one batch. A round
therefore loads d·E + L layers (paper §4.1).

Rows of one batch may draft from different exit layers (DEL picks E per row and round): a draft step passes every
row with a token to pass through layers 1..E_r — one step to the deepest row's exit, each row reading its own
layer-E_r state — then the draft head over every row still drafting in one product; verification runs from the lowest
exit, each row joining at its own. A row alone in a step runs it on the stack's own loop (engine/layer_path.py), so a
batch of one is the single-row decode it always was."""

from __future__ import annotations

import math

import torch

from del_bench.engine.draft_chain import drafts_in_chain
from del_bench.engine.steps import Draft, DraftShape, Verified, candidate_of, decide, keep_candidate
from del_bench.models.layer_math import joined
from del_bench.transfer import charged, to_list


class EarlyExit(DraftShape):
    name = "early_exit"

    def draft(self, batch, slots: list) -> None:
        """Draft every row from its pending token until its budget, an EOS, or its method stops. The pending token and
        every kept draft go through layers 1..E; the last one's pass is already part of verification: its layer-E
        state joins the batch (a draft head ran on it only if its candidate was dropped). With budget 0 (E = L) that
        single pass is the whole round's forward: such a row goes as deep as the deepest drafting row in the first
        step and through the rest in the verification step — the same layers in the same order.

        Drafts stay on the device unless the method stops on confidence: then every row's candidate and confidence
        come to the host in one read — every `lookahead` candidates (Method.lookahead: K candidates drafted as if
        each kept drafting, then decided in order as one by one — the same drafts and decisions, one read per K;
        the passes of candidates drafted past a stop are `wasted`, counted in loaded layers). An EOS drafted by a
        method that does not stop on confidence is seen only at acceptance: the drafts after it are paid for (and
        counted), never emitted.

        A row whose round a captured draft chain can draft (engine/draft_chain.py: a threshold stop, greedy, a batch
        of one on CUDA graphs) drafts there instead — its whole draft one replay, read with its acceptance, the same
        drafts (Draft.undecided)."""
        L = batch.stack.num_layers
        reach = max((s.round.plan.exit_layer for s in slots if s.round.plan.budget > 0), default=L)
        for slot in slots:
            r = slot.round
            r.draft = Draft(early=[] if slot.method.wants_shadow else None, exit_layer=r.plan.exit_layer)
            r.stop = r.plan.budget == 0
            r.depth = r.plan.exit_layer if r.plan.budget > 0 else reach  # where its passes leave off this round
            r.window = []
        passing = []
        for slot in slots:
            graph = _chain_for(batch, slot)
            if graph is None:
                passing.append(slot)
            else:
                _draft_on_device(batch, slot, graph)
        while passing:
            _layers(batch, passing)
            heads = [s for s in passing if not (s.round.stop or _drafted(s.round) >= s.round.plan.budget)]
            passing = _heads(batch, heads) if heads else []

    def verify(self, batch, slots: list) -> None:
        """All d + 1 positions of every row through layers E+1..L in one step of width max(d_r + 1), from drafting's
        layer-E states: a row that drafted from its own exit layer, its d + 1 positions; a row that did not (E = L)
        its one position from where its pass left off, its every layer's state (DEL's shadow tokens) the draft's and
        this step's; below its layer a row idles. The head runs after it, in acceptance over every row at once — or, on
        CUDA graphs, inside the step's graph (its token tail: Verified.tail)."""
        st, L = batch.stack, batch.stack.num_layers
        joining = {s: s.round for s in slots if s.round.depth < L}
        out, states, tails = {}, {}, {}
        if joining:
            collect = "layers" if any(r.draft.early is not None for r in joining.values()) else None
            passes = {s: batch.passing(torch.cat(r.draft.exit_states, dim=1), r.n - 1, r.depth, L)
                      for s, r in joining.items()}  # [1, d+1, D] each
            out, states = batch.step(passes, collect, tails)
        for s in slots:
            r = s.round
            h = out.get(s, r.draft.exit_states[0])  # [1, d+1, D]; a row through every layer already: [1, 1, D]
            tail = tails.get(s) if s in joining else r.tail  # the head ran inside the step's graph (CUDA graphs)
            late = None
            if r.draft.early is not None:
                late = states.get(s, [])
                if r.plan.exit_layer == L:  # no draft: its one pass's every layer is the draft's (as one pass alone)
                    r.draft.early[0] += late
                    late = []
            r.verified = Verified(st.norm(h) if tail is None else tail.normed, late, st.head,
                                  gaps={} if s.engine.track_gaps else None, tail=tail)


def _chain_for(batch, slot):
    """The captured draft chain that drafts this row's round (Graphs.draft_chain), or None: the host's loop drafts
    it (no chains, a batch, sampling, no budget, a stop neither a threshold nor the budget, a chain not made, or a
    method told to read its candidates `lookahead` > 1 at a time: the host's loop as asked — bench gpu's A/B row)."""
    graphs, r, method = batch.path.graphs, slot.round, slot.method
    if graphs is None or graphs.chain is None or batch.size != 1 or slot.engine.sampling.do_sample:
        return None
    if r.plan.budget == 0 or not drafts_in_chain(method) or (method.wants_confidence and method.lookahead > 1):
        return None
    return graphs.draft_chain(r.plan.exit_layer, r.pos, r.plan.budget, slot.engine.cache)


def _draft_on_device(batch, slot, graph) -> None:
    """The row's whole draft as one replay of its chain, read with the round's acceptance: until then the draft is
    provisional — the budget's candidates and the states of its budget + 1 passes (those past the stop: a slot's
    stale, finite states), verified together at that width — and once read, the method decides over the candidates
    in order as it would one by one (steps.decide; Draft.undecided): the kept drafts, their passes' states, the
    round's accounting as the host's loop keeps it. The chain decided the same stops on the device (below τ, the
    budget); only an EOS ends the draft on the host first (the passes past it are `wasted`)."""
    r, method = slot.round, slot.method
    chain, E, draft, budget = batch.path.graphs.chain, r.plan.exit_layer, r.draft, r.plan.budget
    tau = method.stop_threshold() if method.wants_confidence else -math.inf  # -inf: only the budget stops it
    chain.load(r.token, r.pos, tau, budget, method.drop_stopped_draft)
    counter, batch.stack.counter = batch.stack.counter, None  # what ran is counted once read (settle)
    try:
        graph.replay()
    finally:
        batch.stack.counter = counter
    ids = chain.candidates[:budget].clone()  # [budget]: the drafts stay on the device
    states = chain.states[: budget + 1].clone()  # [budget + 1, 1, 1, D]
    draft.ids = list(ids.split(1))  # [1] each
    draft.draft_probs = [None] * budget
    draft.exit_states = list(states.unbind(0))  # [1, 1, D] each: the pending token's, then each candidate's
    if draft.early is not None:  # [position][layer] → [1, 1, D]: layers 1..E of each pass
        draft.early = [list(layers.unbind(0)) for layers in chain.early[: budget + 1, :E].clone()]
    slot.engine.cache.lengths[:E] = [r.pos + budget + 1] * E  # at most: acceptance crops to what it keeps

    def settle(read: list[float]) -> None:
        count, passes, candidates, confidences = chain.parse(read)
        if method.wants_confidence:
            kept = _decide_read(slot, draft, candidates, confidences)
        else:  # drafted by id to the budget, as the host's loop does (an EOS among them seen at acceptance)
            draft.drafts += candidates
            kept = count
        if passes < kept + 1:
            raise RuntimeError(f"the draft chain stopped after {passes} passes where the method kept {kept} drafts")
        del draft.ids[kept:], draft.draft_probs[kept:], draft.exit_states[kept + 1 :]
        if draft.early is not None:
            del draft.early[kept + 1 :]
        draft.candidates += count
        draft.wasted = passes - (kept + 1)  # passes past an EOS
        _count_chain(batch, slot, E, passes, count, counter)

    draft.undecided = (chain.values(), settle)


def _decide_read(slot, draft: Draft, candidates: list[int], confidences: list[float]) -> int:
    """The method's decisions over a chain's candidates as read, in order (a candidate joins the draft's host ids
    unless dropped; its device id is already there) → how many it kept."""
    kept = 0
    for candidate, confidence in zip(candidates, confidences):
        keep = decide(draft, slot.method, candidate, confidence)
        if keep is None:  # dropped (drop_stopped_draft): the chain did not pass it
            break
        draft.drafts.append(candidate)
        kept += 1
        if not keep or candidate in slot.engine.eos_ids:
            break
    return kept


def _count_chain(batch, slot, E: int, passes: int, heads: int, counter) -> None:
    """A chain's work as the host's loop counts it: E layers a pass and a head row a candidate — in the row's and the
    batch's loads, and in the stack's counter (tests) where one was counting."""
    for _ in range(passes):
        batch._alone(slot, E)
    for _ in range(heads):
        batch._head_pass([slot])
    if counter is not None:
        counter.layers += E * passes
        counter.head_rows += heads
        if batch.stack.has_adapter(E):
            counter.adapter_rows += heads


def _drafted(r) -> int:
    """A row's candidates so far: those decided into its draft and those drafted ahead, not yet decided."""
    return len(r.draft.ids) + len(r.window)


def _layers(batch, slots: list) -> None:
    """Every row's token [1, 1] at its position through layers 1..depth (its E), writing their KV; its layer-E state
    goes to its draft's exit_states and, for shadow tokens, every layer's output to its draft's early."""
    collect = "layers" if any(s.round.draft.early is not None for s in slots) else None
    h = batch.stack.embed(joined([s.round.token.view(1, 1) for s in slots], dim=1))  # [1, n, D]
    passes = {s: batch.passing(h[:, i : i + 1], s.round.pos, 0, s.round.depth) for i, s in enumerate(slots)}
    tails = {}
    out, states = batch.step(passes, collect, tails)
    for s in slots:
        r = s.round
        if r.depth == batch.stack.num_layers:  # no draft: its one pass went through every layer, the head in its graph
            r.tail = tails.get(s)
        r.draft.exit_states.append(out[s])  # [1, 1, D]: its state at its own depth
        if r.draft.early is not None:
            r.draft.early.append(states[s])  # E × [1, 1, D]
        r.pos += 1


def _heads(batch, slots: list) -> list:
    """The draft head for every row of `slots` (one product), each candidate joining the row's window; the rows whose
    window is full — `lookahead` candidates, or the budget's last — read in one read and decided in order → the rows
    to pass next (their newest candidate through layers 1..E)."""
    logits = batch.head(slots, [s.round.draft.exit_states[-1] for s in slots], [s.round.plan.exit_layer for s in slots])
    for s, row in zip(slots, logits):
        r = s.round
        if not r.window:  # a new window: as many candidates as the method reads at once, within the budget
            ahead = s.method.lookahead if s.method.wants_confidence else 1
            r.window_size = min(ahead, r.plan.budget - len(r.draft.ids))
        r.window.append(candidate_of(s.engine, r.draft, row, s.run.rng, s.method))
    full = [s for s in slots if len(s.round.window) >= s.round.window_size]
    confident = [s for s in full if s.method.wants_confidence]  # each row's method (a batch may mix them)
    read = []
    if confident:  # one read: each full window's tokens and confidences (a token id is exact in float64)
        with charged([s.ledger for s in confident]):
            read = to_list(torch.cat([torch.cat([tok.double(), top.double()[None]])
                                      for s in confident for tok, top, _ in s.round.window]))
    passing, at = [], 0
    for s in slots:
        r = s.round
        if s not in full:  # drafting ahead: its newest candidate passes as if it kept drafting
            r.token = r.window[-1][0].view(1, 1)
            passing.append(s)
            continue
        window, r.window = r.window, []
        if s not in confident:  # drafted by id, read at acceptance; only the budget stops it
            token, _, q = window[0]
            keep_candidate(r.draft, token, q, -1)
            r.token, r.stop = token.view(1, 1), False
            passing.append(s)
            continue
        size = len(window)
        if _decided(s, window, read[at : at + 2 * size]):
            passing.append(s)
        at += 2 * size
    return passing


def _decided(s, window: list, read: list) -> bool:
    """A full window's candidates decided in order, as one by one → whether the row passes a token next (its newest
    kept candidate: to draft on, or — the last, kept with a stop — as verification's). Candidates drafted past a stop
    are trimmed from the draft, their passes counted `wasted`."""
    r, size = s.round, len(window)
    for j, (token, _, q) in enumerate(window):
        candidate, confidence = int(read[2 * j]), read[2 * j + 1]
        keep = decide(r.draft, s.method, candidate, confidence)
        if keep is None:  # stopped, and the stopping candidate is dropped: the passes of candidates j.. ran for nothing
            _trim(r.draft, wasted=size - 1 - j)
            return False
        keep_candidate(r.draft, token, q, candidate)
        if not keep or candidate in s.engine.eos_ids:  # kept, and the last: its own pass is verification's
            if j == size - 1:
                r.token, r.stop = token.view(1, 1), True
                return True
            _trim(r.draft, wasted=size - 2 - j)
            return False
    r.token, r.stop = window[-1][0].view(1, 1), False
    return True


def _trim(draft: Draft, wasted: int) -> None:
    """The draft's states cut to the pending token and its kept drafts; `wasted` passes ran past them."""
    kept = len(draft.ids)
    del draft.exit_states[kept + 1 :]
    if draft.early is not None:
        del draft.early[kept + 1 :]
    draft.wasted += wasted
