"""The decode loop: prefill, then rounds of draft (layers 1..E + head) and verify (full depth).

Verification reuses the early layers' KV from drafting: only the last draft token goes through layers
1..E; the layer-E hidden states of all d+1 positions (the "exit query cache") then go through layers
E+1..L in one batch. A round therefore loads d·E + L layers (paper §4.1); the head runs once per draft
and once per verified position up to the first rejection. Vanilla is the round with d = 0 and no split.
The engine owns the KV cache, RNG, accounting and timing; methods only decide E, the budget and when to
stop drafting.

A round (Engine._round) is a short sequence of steps, each its own function:
- plan: the method's exit layer E and budget γ, capped by the tokens left (budget 0 → E = L, no split);
- _draft: layers 1..E (_draft_layers) and the draft head (_draft_token, which asks keep_drafting) token by
  token → a Draft (layer-E states, drafts, draft distributions, candidates, confidences, early layers);
- _verify: the d+1 layer-E states through E+1..L in one batch → Verified (normed states; LM-head rows on
  demand; the late layers' states);
- _accept: greedy or speculative sampling over Verified.row; emits; crops the cache to what was kept;
- _observe: method.observe, or (shadow tokens) the round's valid window, held back and scored in batches;
then the round's Round (accounting and timing). A new draft shape (e.g. sublayers skipped at full depth,
or tokens emitted at intermediate heads) is a new draft step producing a Draft, not a copy of the loop.

SWIFT's draft shape (Plan.skip, no exit layer) is such a step: _draft_skipping runs every layer with a set of
attention/MLP sublayers skipped (writing KV in place only where attention runs), _verify_full runs all L layers
over the pending token and the drafts from their embeddings (rewriting every layer's entries there), and
_accept's crop rolls rejected positions back — no cache is cloned. A round loads d·(L − skipped/2) + L layers
(a sublayer counts ½). Before planning, _probe runs the optimiser's teacher-forced pass when the method asks
for one (Method.probe): its time is part of policy_s (also traced as opt_s), its layers and head rows are part
of the round's loaded_layers and head_calls (also traced as opt_loaded_layers, opt_head_calls).
With a token tree (Method.tree_width > 1: SWIFT's `tree: true`), _draft_skipping also keeps siblings beside each
draft (Draft.siblings, leaves off the chain); _verify_full runs pending + chain + siblings as one tree-masked batch
(RoPE position by depth, each node sees the prefix, its ancestors and itself; KV in consecutive slots) and
_accept_tree takes the longest accepted path, moving an accepted leaf's KV to its place on the path. The tree
costs rows, not weight loads: the round still loads d·(L − skipped/2) + L layers.
Layer-skip selection (CLaSp, KnapSpec: Method.wants_states) keeps the verification pass's own states — every layer's
or every sublayer's output — and after acceptance _select hands their accepted rows to Method.select as a
LayerStates (engine/layer_states.py), through which the method runs its candidate draft models; what it runs joins
the round's loaded layers and head calls (sel_* in the trace), its time the round's policy time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from del_bench.engine import layer_parallel
from del_bench.engine.layer_states import LayerStates
from del_bench.engine.rounds import Generation, Round  # noqa: F401 (Round: part of this module's API)
from del_bench.engine.sampling import (
    Draws,
    Sampling,
    Siblings,
    accept_greedy_tree,
    accept_sampling,
    accept_sampling_tree,
    choose,
)
from del_bench.methods.base import MAX_DEFERRED, Method, RoundEvidence, Shadow, SkipSet
from del_bench.models.layer_stack import KVCache, LayerStack, TreeMask, cat_on
from del_bench.numerics import gap_from_top2, is_half, widened
from del_bench.transfer import reads, to_list


@dataclass
class Draft:
    """What drafting leaves for verification, acceptance and accounting (one round)."""

    early: list[list[torch.Tensor]] | None = None  # shadow tokens only: [position][layer] → [1, 1, D]
    exit_layer: int | None = None  # E: the draft head is the exit head of this layer (its adapter, if loaded)
    exit_states: list[torch.Tensor] = field(default_factory=list)  # layer-E states, [1, 1, D] per position
    ids: list[torch.Tensor] = field(default_factory=list)  # the d draft tokens on the device, [1] each
    drafts: list[int] = field(default_factory=list)  # the d draft tokens on the host: read as drafted where the
    # host decides on them (sampling, confidence, SWIFT), else with the round's acceptance (_accept_greedy)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)  # q_i [V] when sampling, else None
    candidates: int = 0  # draft heads applied (a dropped low-confidence candidate counts too)
    confidences: list[float] = field(default_factory=list)  # each candidate's (the last may be the dropped one)
    keep_s: float = 0.0  # time inside method.keep_drafting: policy, not drafting
    logits: torch.Tensor | None = None  # [V] the draft head's logits of the newest candidate
    siblings: list[list[int]] = field(default_factory=list)  # token tree (SWIFT): other candidates beside draft i

    def tree(self) -> tuple[list[int], TreeMask, Siblings] | None:
        """The token tree of the pending token (node 0), the chain (nodes 1..d) and the siblings (leaves, in
        depth order): (the siblings' tokens in node order, the tree's mask, where each sibling's row is);
        None for a plain chain."""
        if not any(self.siblings):
            return None
        d = len(self.drafts)
        parents, tokens, rows = [-1, *range(d)], [], []
        for i, level in enumerate(self.siblings):  # siblings of draft i hang off chain node i
            rows.append(list(range(1 + d + len(tokens), 1 + d + len(tokens) + len(level))))
            parents += [i] * len(level)
            tokens += level
        return tokens, TreeMask.of(parents), Siblings(self.siblings, rows)


@dataclass
class Verified:
    """The verification batch. Greedy over a chain (_accept_greedy), the head runs over every row at once and the
    tokens stay on the device (targets); elsewhere (sampling, token trees, SWIFT) row by row on demand (row), only up
    to the first rejection."""

    h: torch.Tensor  # [1, d+1, D] the last layer's normed states of the d + 1 positions
    late: list[torch.Tensor] | None  # shadow tokens only: layers E+1..L, each [1, d+1, D]
    head: Callable[[torch.Tensor], torch.Tensor]  # the LM head: [1, T, D] → [1, T, V]
    rows: dict[int, int] = field(default_factory=dict)  # verified row → the verifier's greedy token there
    siblings: Siblings | None = None  # a token tree's leaves beside the chain (SWIFT with `tree: true`)
    leaf: int | None = None  # set by _accept: the accepted sibling's row, if a sibling ended the path
    gaps: dict[int, float] | None = None  # half precision only: verified row → its top-2 gap in ulps
    states: list[torch.Tensor] | None = None  # Method.wants_states: the inputs, then every (sub)layer's [1, T, D]
    targets: torch.Tensor | None = None  # _accept_greedy: the verifier's greedy token of every row, [T] on the device

    def row(self, i: int) -> torch.Tensor:
        """The verifier's logits [V] at position i (the target_row of accept_greedy / accept_sampling)."""
        logits = self.head(self.h[:, i : i + 1])[0, 0]  # [V]
        if self.gaps is None:
            self.rows[i] = to_list(logits.argmax())
        else:  # one read: the argmax and the top-2 logits (its gap)
            top2 = logits.topk(2)
            values = to_list(torch.cat([top2.indices[:1].double(), top2.values.double()]))
            self.rows[i] = int(values[0])
            self.gaps[i] = gap_from_top2(values[1], values[2], logits.dtype)
        return logits


def _whole(layers: float) -> float:
    """Loaded layers as an int where they are whole (every method but SWIFT's odd sublayer counts)."""
    return int(layers) if float(layers).is_integer() else layers




class Engine:
    def __init__(self, stack: LayerStack, sampling: Sampling, eos_ids: set[int], stop=None):
        """stop: optional callable(output_ids) → True to end generation after the latest token
        (per-task stop strings); checked token by token, so no token after the stop is kept."""
        self.stack = stack
        self.sampling = sampling
        self.eos_ids = set(eos_ids)
        self.stop = stop
        self.device = stack.embed_weight.device  # token ids start here; logits, the RNG: stack.head_device
        # greedy in half precision: each output token's top-2 gap is recorded (Generation.top2_gap_ulps, numerics.py)
        self.track_gaps = is_half(stack.dtype) and not sampling.do_sample
        self._cache: KVCache | None = None

    @property
    def cache(self) -> KVCache | None:
        """The preallocated KV cache, reused across prompts (None before the first generate): what memory reports."""
        return self._cache

    def _fresh_cache(self, max_len: int) -> KVCache:
        # One allocation reused across prompts; stale slots are overwritten before they are read.
        if self._cache is None or self._cache.max_len < max_len:
            self._cache = self.stack.new_cache(max(max_len, 1024))
        self._cache.crop(0)
        return self._cache

    @property
    def rng_device(self) -> torch.device:
        """Where the sampling RNG lives: beside the logits it samples from (the head's device; torch draws with a
        generator on the tensor's own device only)."""
        return self.stack.head_device

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], method: Method, max_new_tokens: int, seed: int,
                 draws: Draws | None = None) -> Generation:
        """Decode up to max_new_tokens (never more) or through the first EOS. Timed end to end.
        draws: where the random draws come from (tests enumerate them); default a torch.Generator seeded by seed."""
        L = self.stack.num_layers
        rng = draws or Draws(torch.Generator(device=self.rng_device).manual_seed(seed))
        cache = self._fresh_cache(len(prompt_ids) + max_new_tokens + 1)
        method.start(L)
        self._deferred: list[tuple[RoundEvidence, torch.Tensor, torch.Tensor]] = []  # unscored shadow windows
        self._shadow_rows = 0  # shadow rows scored since the last Round was recorded (Round.shadow_rows)
        self._pending: torch.Tensor | None = None  # the pending token [1, 1] where it is already on the device
        self._reads_at = reads()  # host reads before the current round (Round.host_syncs)
        gen = Generation(output_ids=[], top2_gap_ulps=[] if self.track_gaps else None)
        self.stack.synchronize()
        t0 = time.perf_counter()
        if max_new_tokens > 0:
            self._prefill(prompt_ids, cache, gen, method, rng)
            if method.schedule == "layer_parallel":  # AdaDecode: its own step (engine/layer_parallel.py)
                layer_parallel.decode(self, len(prompt_ids), cache, gen, method, max_new_tokens, rng)
            # seq length N = prompt + emitted; the last emitted token is not yet in any layer's cache
            while not self._done(gen, max_new_tokens):
                self._round(len(prompt_ids) + len(gen.output_ids), cache, gen, method, max_new_tokens, rng)
            if self._deferred:  # rounds still held back: scored inside the timed region, as without deferral
                t = time.perf_counter()
                self._observe_deferred(method)
                gen.rounds[-1].policy_s += time.perf_counter() - t
                gen.rounds[-1].shadow_rows += self._take_shadow_rows()
                gen.rounds[-1].host_syncs += self._take_reads()
        self.stack.synchronize()
        gen.wall_s = time.perf_counter() - t0
        return gen

    def _done(self, gen: Generation, max_new_tokens: int) -> bool:
        return gen.stopped or len(gen.output_ids) >= max_new_tokens

    def _take_reads(self) -> int:
        """Host reads since the last call (the round just recorded: Round.host_syncs)."""
        now = reads()
        count, self._reads_at = now - self._reads_at, now
        return count

    def append_round(self, gen: Generation, record: Round) -> None:
        """Record a round (every schedule's rounds come through here) with the host reads it made."""
        record.host_syncs = self._take_reads()
        gen.rounds.append(record)

    def _pending_id(self, gen: Generation) -> torch.Tensor:
        """The pending token [1, 1]: kept on the device by the last acceptance, else from the host's output."""
        pending, self._pending = self._pending, None
        return pending if pending is not None else self._ids([gen.output_ids[-1]])

    def _prefill(self, prompt_ids, cache, gen, method: Method, rng) -> None:
        t = time.perf_counter()
        st, L = self.stack, self.stack.num_layers
        layers = [] if method.wants_shadow else None  # each layer's last w positions [1, w, D]: the shadow window
        w = min(method.prefill_window, len(prompt_ids))
        h = st.forward_layers(st.embed(self._ids(prompt_ids)), 0, L, 0, cache, collect=layers, keep=w)  # [1, P, D]
        logits = st.logits(h[:, -1:])[0, -1]  # [V]
        if self.sampling.do_sample:
            token, _ = choose(logits, self.sampling, rng)
            self._emit(gen, [token])
        else:  # one read: the token (and in half precision its top-2 logits, for its gap)
            targets = logits.argmax(-1, keepdim=True)  # [1]
            (token,), gaps = self._read_targets(targets, logits[None])
            self._emit(gen, [token])
            if gaps:
                gen.set_gap(0, gaps[0])
            self._pending = targets.view(1, 1)
        t_policy = time.perf_counter()
        head_rows = 1
        if layers is not None:
            method.observe_prefill(self._prefill_shadow(layers, h, w, method.shadow_vocab))
            head_rows += w  # the shadow window's targets
        self.append_round(gen, Round(0, None, 0, 0, 0, 1, L, head_rows, verify_s=t_policy - t,
                                     policy_s=time.perf_counter() - t_policy, shadow_rows=self._take_shadow_rows()))

    def _prefill_shadow(self, layers: list[torch.Tensor], h: torch.Tensor, w: int, vocab: int | None) -> Shadow:
        """Shadow tokens of the prompt's last w positions: layers 1..L−1's kept states (each [1, w, D], on its
        layer's device) gathered on the head's device, against the full model's tokens there (w head rows)."""
        states = cat_on(layers[: self.stack.num_layers - 1], self.stack.head_device)  # [L-1, w, D]
        target = self.stack.logits(h[:, -w:])[0].argmax(-1)  # [w]
        return self._shadow_of(states, target, vocab)

    def _round(self, n: int, cache, gen: Generation, method: Method, max_new_tokens: int, rng) -> None:
        """One round: plan → draft → verify → accept → observe, then its Round. n = seq length (prompt +
        emitted); the pending token (the last emitted) sits at position n − 1, in no layer's cache yet."""
        L = self.stack.num_layers
        t = time.perf_counter()
        probed = self._probe(method, n, gen, cache)  # the optimiser's pass, if the method asks for one (SWIFT)
        plan = method.plan()
        left = max_new_tokens - len(gen.output_ids)
        skipping = plan.skip is not None and not plan.exit_layer  # SWIFT: full depth, sublayers skipped
        # a round emits at most d + 1 tokens: capping d at left − 1 means we never overshoot
        budget = min(plan.max_draft, left - 1) if plan.exit_layer or skipping else 0
        E = plan.exit_layer if budget > 0 and not skipping else L
        t_draft = time.perf_counter()
        if skipping:
            self._pending = None  # SWIFT drafts from host tokens
            draft = self._draft_skipping(gen.output_ids[-1], n - 1, plan.skip, budget, cache, method, rng)
            t_verify = time.perf_counter()
            verified = self._verify_full(gen.output_ids[-1], draft, n - 1, cache, keep=method.wants_states())
        else:
            draft = self._draft(self._pending_id(gen), n - 1, E, budget, cache, method, rng)
            # with no draft budget the single pass through all L layers is the verification itself
            t_verify = t_draft if budget == 0 else time.perf_counter()
            verified = self._verify(draft, E, n - 1, cache)
        k, emitted = self._accept(draft, verified, n, cache, gen, rng)
        t_observe = time.perf_counter()
        selected = self._select(method, verified, k, n - 1, cache)
        d = len(draft.drafts)
        evidence = RoundEvidence(exit_layer=plan.exit_layer if d else None, drafted=d, accepted=k,
                                 budget_capped=budget < plan.max_draft)
        self._observe(method, evidence, draft, verified, E)
        t_end = time.perf_counter()
        extra = probed.get("opt_loaded_layers", 0) + selected.get("sel_loaded_layers", 0)  # the policy's own passes
        loaded = (d * plan.skip.layers(L) if skipping else d * E) + L + extra
        trace = {**plan.trace, **probed, **selected}
        if draft.confidences:
            trace["draft_confidences"] = draft.confidences
        if verified.siblings is not None:  # a token tree: its size; did a sibling (not the chain) end the path
            trace["tree_siblings"] = sum(map(len, verified.siblings.tokens))
            trace["tree_leaf_accepted"] = verified.leaf is not None
        self.append_round(gen, Round(
            round=len(gen.rounds), exit_layer=E if d and not skipping else None, budget=budget, drafted=d,
            accepted=k, emitted=emitted, loaded_layers=_whole(loaded),
            head_calls=draft.candidates + len(verified.rows) + probed.get("opt_head_calls", 0)
            + selected.get("sel_head_calls", 0),
            # keep_drafting is the method's time, not drafting's; the optimiser's pass is in policy_s (t_draft − t)
            draft_s=t_verify - t_draft - draft.keep_s, verify_s=t_observe - t_verify,
            policy_s=(t_draft - t) + draft.keep_s + (t_end - t_observe),
            adapter_rows=draft.candidates if self.stack.has_adapter(E) else 0,
            shadow_rows=self._take_shadow_rows(), trace=trace,
        ))

    # ---- draft: layers 1..E + the head, token by token ------------------------------------------------
    def _draft(self, token: torch.Tensor, pos: int, E: int, budget: int, cache, method: Method, rng) -> Draft:
        """Draft from the pending token ([1, 1] on the device) at position pos until the budget, an EOS, or the method
        stops.

        The pending token and every kept draft go through layers 1..E; the last one's pass is already
        part of verification: its layer-E state joins the batch (a draft head ran on it only if its
        candidate was dropped). With budget 0 (E = L) that single pass is the whole round's forward.
        Greedy drafts stay on the device unless the method stops on confidence (one read per candidate: its token and
        confidence together), so an EOS drafted by a method that does not is seen only at acceptance: the drafts
        after it are paid for (and counted), never emitted."""
        draft = Draft(early=[] if method.wants_shadow else None, exit_layer=E)
        stop = budget == 0
        while True:
            self._draft_layers(token, pos, E, cache, draft)
            pos += 1
            if stop or len(draft.ids) >= budget:
                return draft
            candidate, keep = self._draft_token(draft, method, rng)
            if candidate is None:  # stopped, and the stopping candidate is dropped
                return draft
            token = draft.ids[-1].view(1, 1)
            stop = not keep or candidate in self.eos_ids

    def _draft_layers(self, token: torch.Tensor, pos: int, E: int, cache, draft: Draft) -> None:
        """Layers 1..E for one token ([1, 1] ids) at position pos (writing their KV); its layer-E state [1, 1, D]
        goes to draft.exit_states and, for shadow tokens, every layer's output to draft.early."""
        layers = None if draft.early is None else []
        h = self.stack.forward_layers(self.stack.embed(token), 0, E, pos, cache, collect=layers)
        draft.exit_states.append(h)  # [1, 1, D]
        if draft.early is not None:
            draft.early.append(layers)  # E × [1, 1, D]

    def _draft_token(self, draft: Draft, method: Method, rng, on_host: bool = False) -> tuple[int | None, bool]:
        """The draft head on the newest layer-E state: a candidate token, and whether to keep drafting
        after it (method.keep_drafting, for methods that want confidence). Returns (None, False) when
        the candidate that stopped drafting is dropped (drop_stopped_draft: DEL's Algorithm 1), and (-1, True) for a
        greedy candidate left on the device (no confidence to read, not on_host: drafted by id, read at acceptance).
        on_host: the caller needs the token itself now (SWIFT: its siblings and the next draft's input)."""
        logits = self.stack.exit_logits(draft.exit_states[-1], draft.exit_layer)[0, -1]  # [V]
        draft.logits = logits
        draft.candidates += 1
        if self.sampling.do_sample:
            candidate, q = choose(logits, self.sampling, rng)  # q: the warped draft distribution [V]
            token = torch.tensor([candidate], device=logits.device)
        else:
            q, token = None, logits.argmax(-1, keepdim=True)  # [1]
            candidate = -1
        keep = True
        if method.wants_confidence:
            # the draft distribution's top probability: it does not depend on which token was
            # sampled, so stopping on it keeps speculative sampling exact. In float32 for half-precision models
            # (numerics.widened): τ comes from shadow confidences computed so, and both must compare like with like
            top = q.max() if q is not None else widened(logits).softmax(-1).max()
            if candidate < 0:  # one read: the greedy token and its confidence (a token id is exact in float64)
                candidate, confidence = to_list(torch.cat([token.double(), top.double()[None]]))
                candidate = int(candidate)
            else:
                confidence = to_list(top)
            draft.confidences.append(confidence)
            tp = time.perf_counter()
            keep = method.keep_drafting(len(draft.ids), confidence)
            draft.keep_s += time.perf_counter() - tp
            if not keep and method.drop_stopped_draft:  # Algorithm 1: break before appending
                return None, False
        elif candidate < 0 and on_host:
            candidate = to_list(token)[0]
        draft.ids.append(token)
        if candidate >= 0:
            draft.drafts.append(candidate)
        draft.draft_probs.append(q)
        return candidate, keep

    # ---- SWIFT: full depth with sublayers skipped; the optimiser's teacher-forced pass ------------------
    def _draft_skipping(self, token: int, pos: int, skip: SkipSet, budget: int, cache, method: Method,
                        rng) -> Draft:
        """Draft from the pending token at position pos through every layer with skip's sublayers skipped
        (LayerStack.forward_skipping), until the budget, an EOS, or the method stops (SWIFT keeps the draft that
        stopped it). Only tokens that a draft is predicted from go through the draft model: d passes for d
        drafts (the last draft is only verified). Attention that runs writes its KV at the drafted positions in
        place; a layer whose attention is skipped has no entry there, and no draft reads one (the set is the
        same all round). Draft.exit_states holds the draft model's last states ([1, 1, D] per pass)."""
        draft = Draft()
        attn, mlp = frozenset(skip.attn), frozenset(skip.mlp)
        while len(draft.drafts) < budget:
            h = self.stack.forward_skipping(self.stack.embed(self._ids([token])), pos, cache, attn, mlp)
            draft.exit_states.append(h)  # [1, 1, D]
            candidate, keep = self._draft_token(draft, method, rng, on_host=True)
            if candidate is None:  # only with drop_stopped_draft
                break
            width = method.tree_width(draft.confidences[-1]) if draft.confidences else 1
            draft.siblings.append(self._siblings(draft, width - 1, rng) if width > 1 else [])
            token, pos = candidate, pos + 1
            if not keep or candidate in self.eos_ids:
                break
        return draft

    def _siblings(self, draft: Draft, count: int, rng) -> list[int]:
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

    def _verify_full(self, pending: int, draft: Draft, pos: int, cache, keep: str | None = None) -> Verified:
        """The pending token and the drafts (positions pos ..) — with a token tree, its siblings too (slots after
        the chain's) — through all L layers in one batch, from their embeddings: every layer's KV at those slots
        is (re)written with the full model's. keep (Method.wants_states): also keep the inputs and every layer's
        ("layers") or sublayer's ("sublayers": the eager sublayer loop, same ops) output for a selection."""
        st = self.stack
        tree = draft.tree()
        siblings, mask, where = tree if tree else ([], None, None)
        tokens = [pending, *draft.drafts, *siblings]
        h = st.embed(self._ids(tokens))  # [1, T, D]
        states = None if keep is None else [h]
        if keep == "sublayers" and mask is None:
            h = st.forward_skipping(h, pos, cache, frozenset(), frozenset(), collect=states)
        else:
            h = st.forward_layers(h, 0, st.num_layers, pos, cache, tree=mask, collect=states)  # [1, T, D]
        return Verified(st.norm(h), None, st.head, siblings=where, gaps={} if self.track_gaps else None,
                        states=states)

    def _select(self, method: Method, verified: Verified, k: int, pos: int, cache) -> dict:
        """The method's layer-skip selection on the full model's states of the accepted rows 0..k (positions pos..),
        when it kept them (Method.wants_states). Its layers and head rows join the round's (sel_* in the trace)."""
        if verified.states is None:
            return {}
        t = time.perf_counter()
        # [S, k+1, D]: the pending token and the accepted drafts, each (sub)layer's rows gathered on the head's device
        rows = cat_on([s[:, : k + 1] for s in verified.states], self.stack.head_device)
        states = LayerStates(self.stack, cache, pos, rows)
        trace = method.select(states)
        if not (trace or states.loaded_layers or states.head_rows):  # states kept for a later selection: nothing ran
            return {}
        return {**trace, "sel_loaded_layers": _whole(states.loaded_layers), "sel_head_calls": states.head_rows,
                "sel_s": time.perf_counter() - t}

    def _probe(self, method: Method, n: int, gen: Generation, cache) -> dict:
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
        st = self.stack
        pos = n - len(gen.output_ids) + probe.start  # output_ids[j] sits at position prompt + j
        h = st.forward_skipping(st.embed(self._ids(ids[:-1])), pos, cache, frozenset(probe.skip.attn),
                                frozenset(probe.skip.mlp), write=False)  # [1, length, D]
        predicted = st.logits(h)[0].argmax(-1)  # [length]
        matchness = to_list((predicted == torch.tensor(ids[1:], device=predicted.device)).double().mean())
        trace = method.scored(probe, matchness)
        return {"opt_kind": probe.kind, "opt_matchness": matchness, **trace,
                "opt_loaded_layers": _whole(probe.skip.layers(st.num_layers)), "opt_head_calls": probe.length,
                "opt_s": time.perf_counter() - t}

    # ---- verify, accept, observe --------------------------------------------------------------------
    def _verify(self, draft: Draft, E: int, pos: int, cache) -> Verified:
        """All d + 1 positions (from pos) through layers E+1..L at once, from drafting's layer-E states.
        No head runs here: acceptance asks for rows one by one (Verified.row)."""
        late: list[torch.Tensor] | None = None if draft.early is None else []  # [layer] → [1, d+1, D]
        states = torch.cat(draft.exit_states, dim=1)  # [1, d+1, D]
        h = self.stack.norm(self.stack.forward_layers(states, E, self.stack.num_layers, pos, cache, collect=late))
        return Verified(h, late, self.stack.head, gaps={} if self.track_gaps else None)

    def _accept(self, draft: Draft, verified: Verified, n: int, cache, gen: Generation, rng) -> tuple[int, int]:
        """Accept a prefix of the drafts (greedy: the verifier's argmax; sampling: speculative sampling)
        and emit it with the verifier's next token; crop the cache to the kept positions.
        Returns (k accepted drafts, tokens emitted: fewer than k + 1 after an EOS or a stop)."""
        if verified.siblings is not None:
            return self._accept_tree(draft, verified, n, cache, gen, rng)
        if not self.sampling.do_sample:
            return self._accept_greedy(draft, verified, n, cache, gen)
        k, next_token = accept_sampling(draft.drafts, draft.draft_probs, verified.row, self.sampling, rng)
        emitted = self._emit(gen, draft.drafts[:k] + [next_token])
        self._record_gaps(gen, verified, range(emitted))  # token j of the round came from row j
        cache.crop(n + k)  # keep the pending token and the accepted drafts; the new pending is next_token
        return k, emitted

    def _accept_greedy(self, draft: Draft, verified: Verified, n: int, cache, gen: Generation) -> tuple[int, int]:
        """_accept, greedy over a chain, in one host read: the head over all d + 1 rows in one product, their argmax
        (targets) on the device, then the drafts still on the device, the targets and (half precision) each row's
        top-2 logits come to the host together. The next pending token stays on the device (targets[k])."""
        d = len(draft.ids)
        logits = self._verified_logits(verified)  # [d+1, V]
        targets = logits.argmax(-1)  # [d+1]
        if len(draft.drafts) < d:  # drafts left on the device: read them with the targets
            drafts_ids = torch.cat(draft.ids).to(targets.device)  # [d]
            values = torch.cat([drafts_ids, targets])  # [2d+1]
            targets_host, gaps = self._read_targets(values, logits)
            draft.drafts, targets_host = targets_host[:d], targets_host[d:]
        else:
            targets_host, gaps = self._read_targets(targets, logits)
        k = next((i for i, (x, t) in enumerate(zip(draft.drafts, targets_host)) if x != t), d)
        verified.targets = targets
        verified.rows = dict(enumerate(targets_host))
        if gaps:
            verified.gaps = dict(enumerate(gaps))
        emitted = self._emit(gen, draft.drafts[:k] + [targets_host[k]])
        self._record_gaps(gen, verified, range(emitted))  # token j of the round came from row j
        cache.crop(n + k)  # keep the pending token and the accepted drafts; the new pending is targets[k]
        self._pending = targets[k : k + 1].view(1, 1)
        return k, emitted

    def _verified_logits(self, verified: Verified) -> torch.Tensor:
        """The verifier's logits of every row, [T, V]: one product, or row by row where each row must keep a decode
        step's bits (LayerStack.exact_rows: CPU half precision, whose GEMM rounds by the row count)."""
        if self.stack.exact_rows:
            return torch.cat([verified.head(verified.h[:, i : i + 1])[0] for i in range(verified.h.shape[1])])
        return verified.head(verified.h)[0]

    def _read_targets(self, values: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """values: token ids [N] (device), logits: [T, V] the rows the last T of them came from → (the ids on the
        host, and in half precision each row's top-2 gap: numerics.gap_from_top2) in one read."""
        if not self.track_gaps:
            return to_list(values), []
        top2 = logits.topk(2, dim=-1).values  # [T, 2]: exact in float64, as the ids are
        read = to_list(torch.cat([values.double(), top2.double().flatten()]))
        ids, pairs = [int(x) for x in read[: values.numel()]], read[values.numel() :]
        return ids, [gap_from_top2(pairs[2 * i], pairs[2 * i + 1], logits.dtype) for i in range(logits.shape[0])]

    def _accept_tree(self, draft: Draft, verified: Verified, n: int, cache, gen: Generation, rng) -> tuple[int, int]:
        """_accept over a token tree: the chain's accepted prefix, then maybe one sibling (accept_greedy_tree /
        accept_sampling_tree). An accepted sibling's KV moves from its slot to the path's next one in every layer,
        so the cache holds exactly the accepted path. Returns (tokens accepted, incl. a sibling; tokens emitted)."""
        sib = verified.siblings
        if self.sampling.do_sample:
            k, j, next_token = accept_sampling_tree(draft.drafts, draft.draft_probs, sib, verified.row,
                                                    self.sampling, rng)
        else:
            k, j, next_token = accept_greedy_tree(draft.drafts, sib, verified.row)
        path = draft.drafts[:k]
        if j is not None:
            verified.leaf = sib.rows[k][j]
            path.append(sib.tokens[k][j])
            cache.move(n - 1 + verified.leaf, n + k)  # its row's slot → right after the accepted chain
        emitted = self._emit(gen, path + [next_token])
        rows = [*range(k + 1), *([verified.leaf] if j is not None else [])]  # the chain's rows, then the leaf's
        self._record_gaps(gen, verified, rows[:emitted])
        cache.crop(n + len(path))
        return len(path), emitted

    def _observe(self, method: Method, evidence: RoundEvidence, draft: Draft, verified: Verified, E: int) -> None:
        """Hand the method its evidence. With shadow tokens, the round's valid window is held back and
        scored in one batch with the other held-back rounds, once the method may not defer any longer."""
        if draft.early is None:
            method.observe(evidence)
            return
        self._deferred.append((evidence, *self._window(draft, verified, E, evidence.accepted)))
        windows = [states.shape[1] for _, states, _ in self._deferred]
        if len(windows) >= MAX_DEFERRED or not method.can_defer(windows):
            self._observe_deferred(method)

    def _observe_deferred(self, method: Method) -> None:
        """Score the shadow tokens of every deferred round in one head pass ([L-1, ΣW, D] rows: the head's
        weights are read once, not once per round) and hand the method its evidence round by round, in order."""
        evidence, states, targets = zip(*self._deferred)
        self._deferred.clear()
        shadow = self._shadow_of(torch.cat(states, dim=1), torch.cat(targets), method.shadow_vocab)
        start = 0
        for ev, window in zip(evidence, (t.shape[0] for t in targets)):
            part = slice(start, start + window)
            start += window
            method.observe(replace(ev, shadow=Shadow(shadow.tokens[:, part], shadow.confidence[:, part],
                                                     shadow.target[part], shadow.states[:, part])))

    def _window(self, draft: Draft, verified: Verified, E: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [L-1, W, D] and the full model's tokens [W] of the valid window, positions 0..k
        (k = accepted drafts: later positions were computed on a context the model did not keep). Layers
        1..E come from drafting, E+1..L−1 from the verification batch."""
        L, W = self.stack.num_layers, k + 1
        m = min(E, L - 1)  # layers 1..m come from drafting
        # early[i][j]: position i after layer j + 1, [1, 1, D]; one cat → [W·m, 1, D] → view [m, W, D]
        head = self.stack.head_device  # shadow states and their scoring live there, whichever device made them
        states = cat_on([h for layers in draft.early[:W] for h in layers[:m]], head).view(W, m, -1).transpose(0, 1)
        if m < L - 1:  # late[j]: layers E+1.., each [1, d+1, D] → [L-1-E, W, D]
            states = torch.cat([states, cat_on(verified.late[: L - 1 - m], head)[:, :W]])  # [L-1, W, D]
        elif W > 1:
            states = states.contiguous()
        if verified.targets is not None:  # greedy: the full model's tokens never left the device
            return states, verified.targets[:W].to(states.device)
        for i in range(W):  # acceptance computed rows 0..k already; this only guards the invariant
            if i not in verified.rows:
                verified.row(i)
        target = torch.tensor([verified.rows[i] for i in range(W)], device=states.device)
        return states, target

    def _shadow_of(self, states: torch.Tensor, target: torch.Tensor, vocab: int | None) -> Shadow:
        """states: [L-1, W, D] (layers 1..L−1), target: [W] the full model's tokens → Shadow."""
        n_layers, W, D = states.shape
        self._shadow_rows += n_layers * W
        layers = None  # row → its layer: only exit adapters need it (each layer's rows through its own map)
        if self.stack.adapters is not None:
            layers = torch.arange(1, n_layers + 1, device=states.device).repeat_interleave(W)
        tokens, confidence = self.stack.shadow_tokens(states.reshape(-1, D), target.repeat(n_layers), vocab,
                                                      layers=layers)
        return Shadow(tokens.view(n_layers, W), confidence.view(n_layers, W), target, states)

    def _take_shadow_rows(self) -> int:
        rows, self._shadow_rows = self._shadow_rows, 0
        return rows

    def record_gap(self, gen: Generation, index: int, logits: torch.Tensor) -> None:
        """Half precision: output token `index` was chosen from logits [V]; keep their top-2 gap (numerics.py)."""
        if gen.top2_gap_ulps is not None:
            gen.set_gap(index, gap_from_top2(*to_list(logits.topk(2).values.double()), logits.dtype))

    def _record_gaps(self, gen: Generation, verified: Verified, rows) -> None:
        """Half precision: the round's emitted tokens (the last len(rows) of the output) came from these rows."""
        if gen.top2_gap_ulps is not None:
            first = len(gen.output_ids) - len(rows)
            for j, row in enumerate(rows):
                gen.set_gap(first + j, verified.gaps[row])

    def _emit(self, gen: Generation, tokens: list[int]) -> int:
        """Append tokens, stopping after an EOS or the stop condition. Returns how many were appended."""
        for i, tok in enumerate(tokens):
            gen.output_ids.append(tok)
            if tok in self.eos_ids or (self.stop is not None and self.stop(gen.output_ids)):
                gen.stopped = True
                return i + 1
        return len(tokens)
