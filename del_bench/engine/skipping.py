"""The sublayer-skipping draft shape (SWIFT, CLaSp, KnapSpec): every layer with a set of attention/MLP sublayers
skipped, then all L layers over the pending token and the drafts (and a token tree's siblings) from their embeddings;
and SWIFT's optimiser pass (probe), which runs a candidate draft model teacher-forced over generated tokens.

A round loads d·(L − skipped/2) + L layers (a sublayer counts ½). Attention that runs writes its KV in place at the
drafted positions; verification rewrites every layer's entries there, and acceptance's crop rolls rejected positions
back — no cache is cloned."""

from __future__ import annotations

import time

import torch

from del_bench.engine.rounds import Generation
from del_bench.engine.steps import Draft, Verified, whole
from del_bench.methods.base import Method, SkipSet
from del_bench.transfer import charged, to_device, to_list


def draft(engine, token: int, pos: int, skip: SkipSet, budget: int, cache, method: Method, rng) -> Draft:
    """Draft from the pending token at position pos through every layer with skip's sublayers skipped
    (LayerStack.forward_skipping), until the budget, an EOS, or the method stops (SWIFT keeps the draft that
    stopped it). Only tokens that a draft is predicted from go through the draft model: d passes for d
    drafts (the last draft is only verified). Attention that runs writes its KV at the drafted positions in
    place; a layer whose attention is skipped has no entry there, and no draft reads one (the set is the
    same all round). Draft.exit_states holds the draft model's last states ([1, 1, D] per pass)."""
    draft = Draft()
    attn, mlp = frozenset(skip.attn), frozenset(skip.mlp)
    while len(draft.drafts) < budget:
        h = engine.forward_skipping(engine.stack.embed(engine.ids([token])), pos, cache, attn, mlp)
        draft.exit_states.append(h)  # [1, 1, D]
        candidate, keep = engine.draft_token(draft, method, rng, on_host=True)
        if candidate is None:  # only with drop_stopped_draft
            break
        width = method.tree_width(draft.confidences[-1]) if draft.confidences else 1
        draft.siblings.append(siblings(draft, width - 1, rng) if width > 1 else [])
        token, pos = candidate, pos + 1
        if not keep or candidate in engine.eos_ids:
            break
    return draft


def siblings(draft: Draft, count: int, rng) -> list[int]:
    """Up to `count` other candidates beside the newest draft (a token tree's leaves): greedy, the draft head's
    next most likely tokens; sampling, draws from q without replacement after the chain token (the proposal
    accept_sampling_tree assumes)."""
    chain = draft.drafts[-1]
    q = draft.draft_probs[-1]
    if q is None:
        top = to_list(draft.logits.topk(min(count + 1, draft.logits.shape[-1])).indices)
        return [t for t in top if t != chain][:count]
    rest = q.clone()
    rest[chain] = 0  # [V]
    count = min(count, to_list((rest > 0).sum()))
    return rng.without_replacement(rest, count) if count else []


def verify(engine, pending: int, draft: Draft, pos: int, cache, keep: str | None = None) -> Verified:
    """The pending token and the drafts (positions pos ..) — with a token tree, its siblings too (slots after
    the chain's) — through all L layers in one batch, from their embeddings: every layer's KV at those slots
    is (re)written with the full model's. keep (Method.wants_states): also keep the inputs and every layer's
    ("layers") or sublayer's ("sublayers": the eager sublayer loop, same ops) output for a selection."""
    st = engine.stack
    tree = draft.tree()
    siblings, mask, where = tree if tree else ([], None, None)
    tokens = [pending, *draft.drafts, *siblings]
    h = st.embed(engine.ids(tokens))  # [1, T, D]
    states = None if keep is None else [h]
    if keep == "sublayers" and mask is None:
        h = engine.forward_skipping(h, pos, cache, frozenset(), frozenset(), collect=states)
    else:
        h = engine.forward_layers(h, 0, st.num_layers, pos, cache, tree=mask, collect=states)  # [1, T, D]
    return Verified(st.norm(h), None, st.head, siblings=where, gaps={} if engine.track_gaps else None,
                    states=states)


def probe(engine, method: Method, n: int, gen: Generation, cache) -> dict:
    """The optimiser's step, when the method asks for one (Method.probe): the candidate draft model runs
    once, teacher-forced, over generated tokens already in the cache (nothing is written: it attends to the
    full-model KV before its window and to its own keys), and the method gets the matchness — the fraction
    of positions whose draft argmax is the generated next token. Returns the round's trace fields."""
    t = time.perf_counter()
    probe = method.probe(len(gen.output_ids))  # the candidate's suggestion (a BO step fits a GP) is opt_s too
    if probe is None:
        return {}
    ids = gen.output_ids[probe.start : probe.start + probe.length + 1]
    if probe.start < 0 or probe.length < 1 or len(ids) != probe.length + 1:
        raise ValueError(f"probe of tokens {probe.start}..{probe.start + probe.length} needs "
                         f"{probe.start + probe.length + 1} generated tokens; there are {len(gen.output_ids)}")
    st = engine.stack
    pos = n - len(gen.output_ids) + probe.start  # output_ids[j] sits at position prompt + j
    h = engine.forward_skipping(st.embed(engine.ids(ids[:-1])), pos, cache, frozenset(probe.skip.attn),
                                frozenset(probe.skip.mlp), write=False)  # [1, length, D]
    predicted = st.logits(h)[0].argmax(-1)  # [length]
    matchness = to_list((predicted == to_device(ids[1:], predicted.device)).double().mean())
    trace = method.scored(probe, matchness)
    return {"opt_kind": probe.kind, "opt_matchness": matchness, **trace,
            "opt_loaded_layers": whole(probe.skip.layers(st.num_layers)), "opt_head_calls": probe.length,
            "opt_s": time.perf_counter() - t}


# ---- a batch's rows in lockstep (engine/lockstep.py) -------------------------------------------------------------
def draft_rows(batch, slots: list) -> None:
    """`draft` for every row of a batch at once, the same drafts, decisions and records as row by row (no token
    tree: the thread scheduler runs SWIFT's, lockstep.serves): each draft step passes every row still drafting
    through every layer, each row running only the sublayers its own skip set keeps (a sublayer no row runs is not
    computed), then the draft head over them in one product and one read of every row's candidate (and confidence).
    The next draft's input stays on the device (the row's drafted id)."""
    for slot in slots:
        slot.round.draft = Draft()
    drafting = [s for s in slots if s.round.plan.budget > 0]
    skips = batch.skips_of(drafting) if drafting else None  # on the device once a round
    L = batch.stack.num_layers
    while drafting:
        h = batch.stack.embed(torch.cat([s.round.token.view(1, 1) for s in drafting], dim=1))  # [1, n, D]
        inputs = {s: (h[:, i : i + 1], s.round.pos) for i, s in enumerate(drafting)}
        out, _ = batch.step(0, L, inputs, {s: (0, L) for s in drafting}, skips=skips)
        for s in drafting:
            s.round.draft.exit_states.append(out[s])  # [1, 1, D]
        drafting = _candidates_rows(batch, drafting)


def _candidates_rows(batch, slots: list) -> list:
    """Engine.draft_token(on_host=True) for every row (one head product, one read) → the rows drafting on."""
    logits = batch.head(slots, [s.round.draft.exit_states[-1] for s in slots], [None] * len(slots))
    picked = [s.engine.candidate_of(s.round.draft, row, s.run.rng, s.method) for s, row in zip(slots, logits)]
    confident = slots[0].method.wants_confidence  # one method a batch
    values = [torch.cat([token.double(), top.double()[None]]) if confident else token.double()
              for token, top, _ in picked]
    with charged([s.ledger for s in slots]):  # one read: each row's candidate (and its confidence)
        read = to_list(torch.cat(values))
    width = 2 if confident else 1
    drafting = []
    for j, (s, (token, _, q)) in enumerate(zip(slots, picked)):
        r = s.round
        candidate = int(read[width * j])
        if confident:
            candidate, keep = s.engine.judge(r.draft, s.method, token, q, candidate, read[width * j + 1])
            if candidate is None:  # only with drop_stopped_draft
                continue
        else:
            keep = True
            s.engine.keep_candidate(r.draft, token, q, candidate)
        r.draft.siblings.append([])
        r.token, r.pos = r.draft.ids[-1].view(1, 1), r.pos + 1
        if keep and candidate not in s.engine.eos_ids and len(r.draft.drafts) < r.plan.budget:
            drafting.append(s)
    return drafting


def verify_rows(batch, slots: list) -> None:
    """`verify` for every row of a batch at once: each row's pending token and drafts from their embeddings through
    all L layers in one step of width max(d_r + 1), keeping every layer's (or sublayer's) states where a row's method
    asks for them (Method.wants_states: its selection reads its own rows of them)."""
    st, L = batch.stack, batch.stack.num_layers
    keeps = {s: s.method.wants_states() for s in slots}
    collect = "sublayers" if "sublayers" in keeps.values() else "layers" if "layers" in keeps.values() else None
    inputs = {}
    for s in slots:
        r = s.round
        ids = torch.cat([r.pending.view(-1), *(i.view(-1) for i in r.draft.ids)])[None]  # [1, d+1]
        inputs[s] = (st.embed(ids), r.n - 1)
    out, states = batch.step(0, L, inputs, {s: (0, L) for s in slots}, collect)
    for s in slots:
        h, T, keep = inputs[s][0], inputs[s][0].shape[1], keeps[s]
        kept = None
        if keep is not None:
            rows = [state[s.index : s.index + 1, :T] for state in states]
            kept = [h, *(rows if keep == collect else rows[1::2])]  # "layers" from sublayers: every MLP's output
        s.round.verified = Verified(st.norm(out[s]), None, st.head, gaps={} if s.engine.track_gaps else None,
                                    states=kept)
