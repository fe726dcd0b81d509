"""A row's acceptance: which of its drafts the verifier keeps, and what it emits.

Over a chain (`chain`) the verifier's head runs over every row at once and the decision is the device's — greedy:
the longest prefix where draft == the verifier's argmax; sampling: speculative sampling (sampling.accept_sampling,
tests and the residual draw on the device) — so a round needs one host read, which a batch makes for all its rows
at once: `chain` returns the device part done and the host part waiting for the values (`Acceptance`). Over a token
tree (`tree`, SWIFT's) the rows are read one by one, up to the first rejection. Either way the row emits the kept
drafts plus the verifier's token, crops its cache to the kept positions and keeps the next pending token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from del_bench.engine.sampling import accept_greedy_tree, accept_sampling, accept_sampling_tree
from del_bench.engine.steps import Draft, Verified
from del_bench.models.layer_stack import verifier_logits
from del_bench.numerics import gap_from_top2
from del_bench.transfer import to_list


@dataclass
class Acceptance:
    """A round's acceptance between its device part and its host part: `values`, what its one read brings to the host
    (token ids, in half precision each row's top-2 logits, DEL's statistics riding along), and `finish`, the host's
    part given them (emit, crop, the next pending token) → (k accepted drafts, tokens emitted)."""

    values: torch.Tensor  # [N]
    finish: Callable[[list], tuple[int, int]]


def verified_logits(engine, verified: Verified) -> torch.Tensor:
    """The verifier's logits of every row, [T, V]: one product, or row by row where each row must keep a decode
    step's bits (LayerStack.exact_rows: CPU half precision, whose GEMM rounds by the row count)."""
    return verifier_logits(engine.stack, verified.h)


def chain(engine, run, draft: Draft, verified: Verified, E: int, logits: torch.Tensor) -> Acceptance:
    """A row's acceptance over a chain, its device part done (logits [d+1, V]: the verifier's head over every row)
    and its host part waiting for the values its one read brings."""
    def ride() -> torch.Tensor | None:  # DEL's shadow statistics, scored once the targets are known (ShadowScorer.ride)
        return engine.shadow.ride(run.method, draft, verified, E)

    if not engine.sampling.do_sample:
        return _greedy(engine, run, draft, verified, ride, logits)
    return _sampling(engine, run, draft, verified, ride, logits)


def _greedy(engine, run, draft: Draft, verified: Verified, ride, logits: torch.Tensor) -> Acceptance:
    """chain, greedy, in one host read: their argmax (targets) on the device, then the drafts still on the device, the
    targets and (half precision) each row's top-2 logits come to the host together. The next pending token stays on
    the device (targets[k])."""
    d, n, gen, tail = len(draft.ids), run.n, run.gen, verified.tail
    targets = verified.targets = logits.argmax(-1) if tail is None else tail.targets  # [d+1]
    undecided = draft.undecided  # a draft chain's: its candidates, confidences and counts ride first
    unread = undecided is None and len(draft.drafts) < d  # drafts left on the device: read them with the targets
    values, parse = read_values(engine, torch.cat([torch.cat(draft.ids).to(targets.device), targets]) if unread
                                else targets, logits, ride(), None if tail is None else tail.top2)
    # values: [2d+1] or [d+1] ids (+ gaps, rider)
    chained = 0
    if undecided is not None:
        chain_values, settle = undecided
        chained = chain_values.numel()
        values = torch.cat([chain_values, values.double()])

    def finish(read: list) -> tuple[int, int]:
        nonlocal d
        if undecided is not None:  # the method decides over the chain's candidates: the draft is what it kept
            settle(read[:chained])
            draft.undecided, d = None, len(draft.ids)
        targets_host, gaps = parse(read[chained:])
        if unread:
            draft.drafts, targets_host = targets_host[:d], targets_host[d:]
        k = next((i for i, (x, t) in enumerate(zip(draft.drafts, targets_host)) if x != t), d)
        verified.rows = dict(enumerate(targets_host))
        if gaps:
            verified.gaps = dict(enumerate(gaps))
        emitted = engine.emit(gen, draft.drafts[:k] + [targets_host[k]])
        engine.record_gaps(gen, verified, range(emitted))  # token j of the round came from row j
        run.cache.crop(n + k)  # keep the pending token and the accepted drafts; the new pending is targets[k]
        engine.pending = targets[k : k + 1].view(1, 1)
        return k, emitted

    return Acceptance(values, finish)


def _sampling(engine, run, draft: Draft, verified: Verified, ride, logits: torch.Tensor) -> Acceptance:
    """chain, sampling, in one host read: speculative sampling on the device (sampling.accept_sampling), then the
    drafts, each row's greedy token (what shadow scoring compares with), k and the next token come to the host
    together. The next token stays on the device as the pending one."""
    d, n, gen = len(draft.ids), run.n, run.gen
    drafts = torch.cat(draft.ids).to(logits.device) if d else logits.new_zeros(0, dtype=torch.long)  # [d]
    q = torch.stack(draft.draft_probs) if d else None  # [d, V]
    k, token = accept_sampling(drafts, q, logits, engine.sampling, run.rng)  # [], [1]
    verified.targets = logits.argmax(-1) if verified.tail is None else verified.tail.targets  # [d+1]
    values, parse = read_values(engine, torch.cat([drafts, verified.targets, k.view(1), token]), logits, ride())

    def finish(read: list) -> tuple[int, int]:
        read, _ = parse(read)
        draft.drafts, verified.rows = read[:d], dict(enumerate(read[d : 2 * d + 1]))
        k = read[-2]
        emitted = engine.emit(gen, draft.drafts[:k] + [read[-1]])
        run.cache.crop(n + k)  # keep the pending token and the accepted drafts; the new pending is the token
        engine.pending = token.view(1, 1)
        return k, emitted

    return Acceptance(values, finish)


def tree(engine, run, draft: Draft, verified: Verified) -> tuple[int, int]:
    """A row's acceptance over a token tree: the chain's accepted prefix, then maybe one sibling (accept_greedy_tree /
    accept_sampling_tree), its rows read one by one. An accepted sibling's KV moves from its slot to the path's next
    one in every layer, so the cache holds exactly the accepted path. → (tokens accepted, incl. a sibling; tokens
    emitted)."""
    n, gen, sib = run.n, run.gen, verified.siblings
    if engine.sampling.do_sample:
        k, j, next_token = accept_sampling_tree(draft.drafts, draft.draft_probs, sib, verified.row, engine.sampling,
                                                run.rng)
    else:
        k, j, next_token = accept_greedy_tree(draft.drafts, sib, verified.row)
    path = draft.drafts[:k]
    if j is not None:
        verified.leaf = sib.rows[k][j]
        path.append(sib.tokens[k][j])
        run.cache.move(n - 1 + verified.leaf, n + k)  # its row's slot → right after the accepted chain
    emitted = engine.emit(gen, path + [next_token])
    rows = [*range(k + 1), *([verified.leaf] if j is not None else [])]  # the chain's rows, then the leaf's
    engine.record_gaps(gen, verified, rows[:emitted])
    run.cache.crop(n + len(path))
    return len(path), emitted


def read_targets(engine, values: torch.Tensor, logits: torch.Tensor,
                 rider: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """values: token ids [N] (device), logits: [T, V] the rows the last T of them came from → (the ids on the host,
    and greedy in half precision each row's top-2 gap: numerics.gap_from_top2) in one read, which also carries rider
    (float64 [R], ShadowScorer.ride) to the shadow scorer when given."""
    values, parse = read_values(engine, values, logits, rider)
    return parse(to_list(values))


def read_values(engine, values: torch.Tensor, logits: torch.Tensor, rider: torch.Tensor | None,
                top2: torch.Tensor | None = None) -> tuple[torch.Tensor, Callable[[list], tuple[list[int], list]]]:
    """read_targets in two parts: what to read (the ids as they are, or with the gaps' top-2 logits — top2 [T, 2]
    where a graph took them already — and the rider, all in float64: token ids are exact there) and how to take it
    apart once read."""
    if not engine.track_gaps and rider is None:  # ids as read (floats where a batch's read carried floats)
        return values, lambda read: ([int(x) for x in read], [])
    parts = [values.double()]
    if engine.track_gaps:
        parts.append((logits.topk(2, dim=-1).values if top2 is None else top2).double().flatten())  # [T·2]
    if rider is not None:
        parts.append(rider)
    count = values.numel()

    def parse(read: list) -> tuple[list[int], list[float]]:
        if rider is not None:
            engine.shadow.received(read[len(read) - rider.numel() :])
        ids, pairs = [int(x) for x in read[:count]], read[count:]
        if not engine.track_gaps:
            return ids, []
        return ids, [gap_from_top2(pairs[2 * i], pairs[2 * i + 1], logits.dtype) for i in range(logits.shape[0])]

    return torch.cat(parts), parse


def gap_of(logits: torch.Tensor) -> float:
    """The top-2 gap of logits [V] in ulps of their dtype (one read)."""
    return gap_from_top2(*to_list(logits.topk(2).values.double()), logits.dtype)
