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
from del_bench.engine.steps import Draft, DraftShape, Verified, candidate_of, judge, keep_candidate, whole
from del_bench.methods.base import Method
from del_bench.models.layer_math import joined
from del_bench.transfer import charged, to_device, to_list


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
    h = engine.forward_skipping(st.embed(engine.ids(ids[:-1])), pos, cache, probe.skip, write=False)  # [1, length, D]
    predicted = st.logits(h)[0].argmax(-1)  # [length]
    matchness = to_list((predicted == to_device(ids[1:], predicted.device)).double().mean())
    trace = method.scored(probe, matchness)
    return {"opt_kind": probe.kind, "opt_matchness": matchness, **trace,
            "opt_loaded_layers": whole(probe.skip.layers(st.num_layers)), "opt_head_calls": probe.length,
            "opt_s": time.perf_counter() - t}


class Skipping(DraftShape):
    name = "skipping"

    def draft(self, batch, slots: list) -> None:
        """Draft every row through every layer with its own skip set's sublayers skipped (each row running only the
        sublayers its set keeps; a sublayer no row runs is not computed), until its budget, an EOS, or its method stops
        (SWIFT keeps the draft that stopped it): each draft step one pass of every row still drafting, then the draft
        head over them in one product and one read of every row's candidate (and confidence). Only tokens a draft is
        predicted from go through the draft model: d passes for d drafts (the last draft is only verified). Attention
        that runs writes its KV at the drafted positions in place; a layer whose attention is skipped has no entry
        there, and no draft reads one (the set is the same all round). The next draft's input stays on the device.
        With a token tree (SWIFT's `tree`), a row's draft head also names the siblings beside each draft."""
        for slot in slots:
            slot.round.draft = Draft()
        drafting = [s for s in slots if s.round.plan.budget > 0]
        L = batch.stack.num_layers
        while drafting:
            h = batch.stack.embed(joined([s.round.token.view(1, 1) for s in drafting], dim=1))  # [1, n, D]
            passes = {s: batch.passing(h[:, i : i + 1], s.round.pos, 0, L, s.round.plan.plan.skip)
                      for i, s in enumerate(drafting)}
            out, _ = batch.step(passes)
            for s in drafting:
                s.round.draft.exit_states.append(out[s])  # [1, 1, D]
            drafting = _candidates(batch, drafting)

    def verify(self, batch, slots: list) -> None:
        """Every row's pending token and drafts (a token tree's siblings too, in slots after the chain's) from their
        embeddings through all L layers: every layer's KV at those slots is (re)written with the full model's. Rows
        of plain chains go in one step of width max(d_r + 1); a row with a tree alone, under its tree's mask. Where a
        row's method asks (Method.wants_states) its inputs and every layer's ("layers") or sublayer's ("sublayers")
        output are kept for its selection."""
        st, L = batch.stack, batch.stack.num_layers
        keeps = {s: s.method.wants_states() for s in slots}
        trees = {s: s.round.draft.tree() for s in slots}
        chains = [s for s in slots if trees[s] is None]
        groups = [chains] if chains else []
        groups += [[s] for s in slots if trees[s] is not None]
        for group in groups:
            wanted = {keeps[s] for s in group}
            collect = "sublayers" if "sublayers" in wanted else "layers" if "layers" in wanted else None
            inputs, passes = {}, {}
            for s in group:
                r = s.round
                siblings, mask, _ = trees[s] or ([], None, None)
                ids = torch.cat([r.pending.view(-1), *(i.view(-1) for i in r.draft.ids),
                                 *([to_device(siblings, r.pending.device)] if siblings else [])])[None]  # [1, T]
                batch.reserve(r.n - 1 + ids.shape[1])  # a tree's siblings take slots past the budget's
                inputs[s] = st.embed(ids)
                passes[s] = batch.passing(inputs[s], r.n - 1, 0, L, tree=mask)
            out, states = batch.step(passes, collect)
            for s in group:
                kept = None
                if keeps[s] is not None:  # "layers" from a step that kept every sublayer: every MLP's output
                    rows = states[s]
                    kept = [inputs[s], *(rows if keeps[s] == collect else rows[1::2])]
                where = trees[s][2] if trees[s] is not None else None
                s.round.verified = Verified(st.norm(out[s]), None, st.head, siblings=where,
                                            gaps={} if s.engine.track_gaps else None, states=kept)


def _candidates(batch, slots: list) -> list:
    """The draft head for every row (one product, one read of every row's candidate and, where its method stops on
    one, its confidence); with a token tree each row's siblings beside it → the rows drafting on."""
    logits = batch.head(slots, [s.round.draft.exit_states[-1] for s in slots], [None] * len(slots))
    picked = [candidate_of(s.engine, s.round.draft, row, s.run.rng, s.method) for s, row in zip(slots, logits)]
    confident = [s.method.wants_confidence for s in slots]  # each row's method (a batch may mix them)
    values = [torch.cat([token.double(), top.double()[None]]) if sure else token.double()
              for sure, (token, top, _) in zip(confident, picked)]
    with charged([s.ledger for s in slots]):  # one read: each row's candidate (and its confidence)
        read = to_list(torch.cat(values))
    drafting, at = [], 0
    for s, sure, (token, _, q) in zip(slots, confident, picked):
        r = s.round
        candidate = int(read[at])
        if sure:
            candidate, keep = judge(r.draft, s.method, token, q, candidate, read[at + 1])
            at += 2
            if candidate is None:  # only with drop_stopped_draft
                continue
        else:
            at += 1
            keep = True
            keep_candidate(r.draft, token, q, candidate)
        tree = s.method.tree_width(r.draft.confidences[-1]) if r.draft.confidences else 1
        with charged([s.ledger]):
            r.draft.siblings.append(siblings(r.draft, tree - 1, s.run.rng) if tree > 1 else [])
        r.token, r.pos = r.draft.ids[-1].view(1, 1), r.pos + 1
        if keep and candidate not in s.engine.eos_ids and len(r.draft.drafts) < r.plan.budget:
            drafting.append(s)
    return drafting
