"""The decode loop: prefill, then rounds — plan → draft → verify → accept → observe — and their accounting.

The engine owns the KV cache, RNG, accounting and timing; methods only decide E, the budget and when to stop
drafting. A round (Engine._round) is a short sequence of steps:
- plan: the method's exit layer E and budget γ (or SWIFT's skip set), capped by the tokens left (budget 0 → E = L);
- draft and verify, through the round's draft shape, one file each behind the same two functions
  (draft(engine, …) → Draft, verify(engine, …) → Verified; engine/steps.py):
  engine/early_exit.py — layers 1..E and the exit head token by token, then layers E+1..L over the d + 1 positions
  in one batch (d·E + L layers a round; Vanilla is d = 0, one pass through all L);
  engine/skipping.py — SWIFT, CLaSp, KnapSpec: every layer with sublayers skipped, then all L layers from the
  embeddings (d·(L − skipped/2) + L; a token tree's siblings ride in the batch), and SWIFT's optimiser pass (probe);
  AdaDecode's layer-parallel schedule is its own loop (engine/layer_parallel.py);
- accept: greedy (_accept_greedy: the head over every row in one product, one host read for the round) or
  speculative sampling (_accept_sampling: the same, the tests and the residual draw on the device), or over a token
  tree (_accept_tree, row by row); emits; crops the cache;
- select: a layer-skip selection on the verification pass's own states (CLaSp, KnapSpec: Method.wants_states,
  engine/layer_states.py), its layers and head rows joining the round's (sel_* in the trace);
- observe: method.observe, or through DEL's shadow scoring (engine/shadow.py: the round's valid window, held back
  and scored in batches while the plan cannot change);
then the round's Round (accounting, timing, and the host reads it made: del_bench/transfer.py). The draft head
(draft_token) is the engine's, shared by the shapes. A new draft shape is a new file with those two functions, not
a copy of the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from del_bench.engine import early_exit, layer_parallel, skipping
from del_bench.engine.layer_states import LayerStates
from del_bench.engine.rounds import Generation, Round  # noqa: F401 (Round: part of this module's API)
from del_bench.engine.sampling import (
    Draws,
    Sampling,
    accept_greedy_tree,
    accept_sampling,
    accept_sampling_tree,
)
from del_bench.engine.shadow import ShadowScorer
from del_bench.engine.steps import Draft, Verified, whole  # noqa: F401 (Draft, Verified: part of this module's API)
from del_bench.methods.base import Method, Plan, RoundEvidence
from del_bench.models.kv_cache import KVCache, TreeMask
from del_bench.models.layer_math import cat_on, top_confidence
from del_bench.models.layer_stack import LayerStack
from del_bench.numerics import gap_from_top2, is_half, widened
from del_bench.transfer import Ledger, reads, to_device, to_list


@dataclass(frozen=True)
class Request:
    """What a job asks an engine to decode — Engine.generate's arguments. A job is a generator of them, sent each
    Generation back (runner.decode_one): `served` runs it on one engine, a batch runs B of them together
    (engine/lockstep.py)."""

    prompt_ids: list[int]
    method: Method
    max_new_tokens: int
    seed: int


def served(job, engine: "Engine"):
    """A job (a generator of Requests) run to its end on one engine, one generation at a time → its return value."""
    try:
        request = next(job)
        while True:
            request = job.send(engine.generate(request.prompt_ids, request.method, request.max_new_tokens,
                                               request.seed))
    except StopIteration as end:
        return end.value


@dataclass
class Decoding:
    """One generation in progress, from Engine.begin to Engine.finish: what its rounds read and write."""

    prompt_len: int
    method: Method
    max_new_tokens: int
    rng: Draws
    cache: KVCache
    gen: Generation
    t0: float  # when it began (perf_counter): its wall_s and ttft_s count from here

    @property
    def n(self) -> int:
        """The sequence length (prompt + emitted): the pending token sits at n − 1, in no layer's cache yet."""
        return self.prompt_len + len(self.gen.output_ids)

    @property
    def done(self) -> bool:
        return self.gen.stopped or len(self.gen.output_ids) >= self.max_new_tokens


@dataclass(frozen=True)
class RoundPlan:
    """The method's plan for a round, capped by the tokens left: its draft budget and exit layer E (L: no draft, the
    round is one pass through every layer), and whether it drafts at full depth with sublayers skipped (SWIFT)."""

    plan: Plan
    budget: int
    exit_layer: int
    skips: bool


@dataclass
class Acceptance:
    """A round's acceptance between its device part and its host part: `values`, what its one read brings to the host
    (token ids, in half precision each row's top-2 logits, DEL's statistics riding along), and `finish`, the host's
    part given them (emit, crop, the next pending token) → (k accepted drafts, tokens emitted). A batch reads every
    row's values in one read (engine/lockstep.py)."""

    values: torch.Tensor  # [N]
    finish: Callable[[list], tuple[int, int]]


class Engine:
    def __init__(self, stack: LayerStack, sampling: Sampling, eos_ids: set[int], stop=None,
                 shadow_with_acceptance: bool | None = None, cache: KVCache | None = None, graphs=None):
        """stop: optional callable(output_ids) → True to end generation after the latest token
        (per-task stop strings); checked token by token, so no token after the stop is kept.
        shadow_with_acceptance: DEL's shadow statistics come to the host on the round's acceptance read, scored over
        all d + 1 positions (engine/shadow.py); None: where the head is not on the CPU (a read stalls a queue there,
        and a CPU pays for the rejected positions' rows).
        cache: the KV cache to decode in (a batched row: its view of the batch's cache, engine/lockstep.py); None: one
        allocated at the first generate.
        graphs: the graph-captured steps to decode on (engine/compiled.Graphs, chosen by compiled.choose), or None:
        the stack's own layer loop (fused or eager). The engine chooses the path and calls down into it
        (forward_layers, forward_skipping); the stack never calls up into the engine."""
        self.stack = stack
        self.graphs = graphs
        self.sampling = sampling
        self.eos_ids = set(eos_ids)
        self.stop = stop
        self.device = stack.embed_weight.device  # token ids start here; logits, the RNG: stack.head_device
        # greedy in half precision: each output token's top-2 gap is recorded (Generation.top2_gap_ulps, numerics.py)
        self.track_gaps = is_half(stack.dtype) and not sampling.do_sample
        self._cache: KVCache | None = cache
        if shadow_with_acceptance is None:
            shadow_with_acceptance = stack.head_device.type != "cpu"
        self.shadow_with_acceptance = shadow_with_acceptance
        self.on_round: Callable[[Round], None] | None = None  # called as each Round is recorded (bench/syncs.py)
        # where the host reads are counted for Round.host_syncs: this thread's count, or a batched row's own ledger
        # (engine/lockstep.py: the batch's reads that carried the row's values)
        self.ledger: Ledger | None = None
        # a batched row: DEL's statistics read apart from acceptance wait for the batch's one read (ShadowScorer.due)
        self.hold_shadow_reads = False

    @property
    def cache(self) -> KVCache | None:
        """The preallocated KV cache, reused across prompts (None before the first generate): what memory reports."""
        return self._cache

    def _fresh_cache(self, max_len: int) -> KVCache:
        # One allocation reused across prompts; stale slots are overwritten before they are read. Graph-captured
        # steps (engine/compiled.py) write the cache they were captured on: the engine decodes in it where it fits
        captured = self.graphs.cache_for(max_len) if self.graphs is not None else None
        if captured is not None:
            self._cache = captured
        elif self._cache is None or self._cache.max_len < max_len:
            self._cache = self.stack.new_cache(max(max_len, 1024))
        self._cache.crop(0)
        return self._cache

    def forward_layers(self, h: torch.Tensor, start: int, end: int, pos: int, cache: KVCache,
                       collect: list | None = None, tree: TreeMask | None = None,
                       keep: int | None = None) -> torch.Tensor:
        """Layers [start, end) on h [1, T, D] (LayerStack.forward_layers' arguments and result) on this engine's
        path: its graph-captured steps where they take the call (a chain at a width they were made for; no tree, no
        trimmed collection), else the stack's loop."""
        trimmed = collect is not None and keep is not None and keep < h.shape[1]
        if self.graphs is not None and tree is None and not trimmed:
            out = self.graphs.forward_layers(h, start, end, pos, cache, collect)
            if out is not None:
                return out
        return self.stack.forward_layers(h, start, end, pos, cache, collect, tree, keep)

    def forward_skipping(self, h: torch.Tensor, pos: int, cache: KVCache, skip_attn: frozenset[int],
                         skip_mlp: frozenset[int], write: bool = True, collect: list | None = None) -> torch.Tensor:
        """Every layer on h with the named sublayers skipped (LayerStack.forward_skipping's arguments and result) on
        this engine's path: its graph-captured sublayer steps where they fit a drafting pass, else the stack's loop."""
        if self.graphs is not None and write:
            out = self.graphs.forward_skipping(h, pos, cache, skip_attn, skip_mlp, collect)
            if out is not None:
                return out
        return self.stack.forward_skipping(h, pos, cache, skip_attn, skip_mlp, write, collect)

    @property
    def layer_path(self) -> str:
        """What decodes: the stack's loop (fused, eager), and the graphs' kind where this engine runs them."""
        return self.stack.layer_path + (f"+{self.graphs.path}" if self.graphs is not None else "")

    @property
    def rng_device(self) -> torch.device:
        """Where the sampling RNG lives: beside the logits it samples from (the head's device; torch draws with a
        generator on the tensor's own device only)."""
        return self.stack.head_device

    def take_pending(self, gen: Generation) -> torch.Tensor:
        """The pending token [1, 1] on the device: where the last acceptance kept it, else sent from the host."""
        pending, self._pending = self._pending, None
        return pending if pending is not None else self.ids([gen.output_ids[-1]])

    def ids(self, ids: list[int]) -> torch.Tensor:
        """Token ids [1, T] where the embedding lives."""
        return to_device([ids], self.device)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], method: Method, max_new_tokens: int, seed: int,
                 draws: Draws | None = None) -> Generation:
        """Decode up to max_new_tokens (never more) or through the first EOS. Timed end to end.
        draws: where the random draws come from (tests enumerate them); default a torch.Generator seeded by seed."""
        run = self.begin(prompt_ids, method, max_new_tokens, seed, draws)
        if max_new_tokens > 0:
            self.prefill(run, prompt_ids)
            if method.schedule == "layer_parallel":  # AdaDecode: its own step (engine/layer_parallel.py)
                layer_parallel.decode(self, run.prompt_len, run.cache, run.gen, method, max_new_tokens, run.rng)
            while not run.done:
                self._round(run)
        return self.finish(run)

    def begin(self, prompt_ids: list[int], method: Method, max_new_tokens: int, seed: int,
              draws: Draws | None = None, t0: float | None = None) -> Decoding:
        """A generation's start: its RNG, cache, the method started, the shadow scorer; its clock starts now (the
        device synchronised first), or at t0 (a batched row: when its slot took it)."""
        L = self.stack.num_layers
        rng = draws or Draws(torch.Generator(device=self.rng_device).manual_seed(seed))
        cache = self._fresh_cache(len(prompt_ids) + max_new_tokens + 1)
        method.start(L)
        # DEL's shadow tokens: scoring, deferral
        self.shadow = ShadowScorer(self.stack, self.shadow_with_acceptance, self.hold_shadow_reads)
        self._pending: torch.Tensor | None = None  # the pending token [1, 1] where it is already on the device
        self._reads_at = self._reads()  # host reads before the current round (Round.host_syncs)
        gen = Generation(output_ids=[], top2_gap_ulps=[] if self.track_gaps else None)
        self.stack.synchronize()
        return Decoding(len(prompt_ids), method, max_new_tokens, rng, cache, gen,
                        time.perf_counter() if t0 is None else t0)

    def prefill(self, run: Decoding, prompt_ids: list[int]) -> None:
        """The prompt through every layer and its first token (round 0); ttft_s: when it is on the host."""
        self._prefill(prompt_ids, run.cache, run.gen, run.method, run.rng)
        run.gen.ttft_s = time.perf_counter() - run.t0  # the first token is on the host: its read waited for the device

    def finish(self, run: Decoding) -> Generation:
        """A generation's end: rounds whose shadow scoring was held back are scored (inside the timed region, as
        without deferral), then its wall time."""
        gen = run.gen
        if run.max_new_tokens > 0 and self.shadow.deferred:
            t = time.perf_counter()
            self.shadow.flush(run.method)
            if self.shadow.due is not None:  # a batched row's: read now, its own (the batch has moved on)
                self.shadow.settle(to_list(self.shadow.due.values.flatten()))
            gen.rounds[-1].policy_s += time.perf_counter() - t
            gen.rounds[-1].shadow_rows += self.shadow.take_rows()
            gen.rounds[-1].host_syncs += self._take_reads()
        self.stack.synchronize()
        gen.wall_s = time.perf_counter() - run.t0
        return gen

    def _reads(self) -> int:
        """Host reads so far, as Round.host_syncs counts them: this thread's, or the row's ledger (a batched row)."""
        return reads() if self.ledger is None else self.ledger.count

    def _take_reads(self) -> int:
        """Host reads since the last call (the round just recorded: Round.host_syncs)."""
        now = self._reads()
        count, self._reads_at = now - self._reads_at, now
        return count

    def append_round(self, gen: Generation, record: Round) -> None:
        """Record a round (every schedule's rounds come through here) with the host reads it made."""
        record.host_syncs = self._take_reads()
        gen.rounds.append(record)
        if self.on_round is not None:
            self.on_round(record)

    def _prefill(self, prompt_ids, cache, gen, method: Method, rng) -> None:
        t = time.perf_counter()
        st, L = self.stack, self.stack.num_layers
        layers = [] if method.wants_shadow else None  # each layer's last w positions [1, w, D]: the shadow window
        w = min(method.prefill_window, len(prompt_ids))
        h = self.forward_layers(st.embed(self.ids(prompt_ids)), 0, L, 0, cache, collect=layers, keep=w)  # [1, P, D]
        logits = st.logits(h[:, -1:])[0, -1]  # [V]
        if self.sampling.do_sample:
            token = rng.sample(self.sampling.probs(logits))  # [1]
        else:
            token = logits.argmax(-1, keepdim=True)  # [1]
        # one read: the token (and greedy in half precision its top-2 logits, for its gap); it stays on the device
        (first,), gaps = self._read_targets(token, logits[None])
        self._emit(gen, [first])
        if gaps:
            gen.set_gap(0, gaps[0])
        self._pending = token.view(1, 1)
        t_policy = time.perf_counter()
        head_rows = 1
        if layers is not None:
            method.observe_prefill(self.shadow.prefill(layers, h, w, method.shadow_vocab))
            head_rows += w  # the shadow window's targets
        self.append_round(gen, Round(0, None, 0, 0, 0, 1, L, head_rows, verify_s=t_policy - t,
                                     policy_s=time.perf_counter() - t_policy, shadow_rows=self.shadow.take_rows()))

    def plan_round(self, run: Decoding) -> RoundPlan:
        """The method's plan, its budget capped by the tokens left (a round emits at most d + 1 tokens: d ≤ left − 1
        never overshoots); budget 0 → E = L, the round is one pass through every layer."""
        plan = run.method.plan()
        left = run.max_new_tokens - len(run.gen.output_ids)
        skips = plan.skip is not None and not plan.exit_layer  # SWIFT: full depth, sublayers skipped
        budget = min(plan.max_draft, left - 1) if plan.exit_layer or skips else 0
        E = plan.exit_layer if budget > 0 and not skips else self.stack.num_layers
        return RoundPlan(plan, budget, E, skips)

    def _round(self, run: Decoding) -> None:
        """One round: plan → draft → verify → accept → observe, then its Round. n = seq length (prompt +
        emitted); the pending token (the last emitted) sits at position n − 1, in no layer's cache yet."""
        n, cache, gen, method, rng = run.n, run.cache, run.gen, run.method, run.rng
        t = time.perf_counter()
        pending, self._pending = self._pending, None  # [1, 1] where the last acceptance kept it on the device
        probed = skipping.probe(self, method, n, gen, cache)  # the optimiser's pass, if the method asks for one (SWIFT)
        rp = self.plan_round(run)
        E = rp.exit_layer
        t_draft = time.perf_counter()
        if rp.skips:
            draft = skipping.draft(self, gen.output_ids[-1], n - 1, rp.plan.skip, rp.budget, cache, method, rng)
            t_verify = time.perf_counter()
            verified = skipping.verify(self, gen.output_ids[-1], draft, n - 1, cache, keep=method.wants_states())
        else:
            token = pending if pending is not None else self.ids([gen.output_ids[-1]])
            draft = early_exit.draft(self, token, n - 1, E, rp.budget, cache, method, rng)
            # with no draft budget the single pass through all L layers is the verification itself
            t_verify = t_draft if rp.budget == 0 else time.perf_counter()
            verified = early_exit.verify(self, draft, E, n - 1, cache)
        k, emitted = self._accept(draft, verified, n, cache, gen, rng, method, E)
        t_observe = time.perf_counter()
        selected = self.observe_round(run, rp, draft, verified, k, n)
        self.record_round(run, rp, draft, verified, k, emitted, probed, selected,
                          (t, t_draft, t_verify, t_observe, time.perf_counter()))

    def observe_round(self, run: Decoding, rp: RoundPlan, draft: Draft, verified: Verified, k: int, n: int) -> dict:
        """After acceptance: the method's layer-skip selection (→ its trace fields, sel_*), then its evidence."""
        selected = self._select(run.method, verified, k, n - 1, run.cache)
        d = len(draft.drafts)
        evidence = RoundEvidence(exit_layer=rp.plan.exit_layer if d else None, drafted=d, accepted=k,
                                 budget_capped=rp.budget < rp.plan.max_draft)
        self._observe(run.method, evidence, draft, verified, rp.exit_layer)
        return selected

    def record_round(self, run: Decoding, rp: RoundPlan, draft: Draft, verified: Verified, k: int, emitted: int,
                     probed: dict, selected: dict, times: tuple[float, ...]) -> None:
        """The round's Round: its accounting (the paper's loaded layers, head rows), timings — times: when it began,
        drafting, verification and observation began, and when it ended — its trace and host reads."""
        t, t_draft, t_verify, t_observe, t_end = times
        L, E, skips, plan = self.stack.num_layers, rp.exit_layer, rp.skips, rp.plan
        d = len(draft.drafts)
        extra = probed.get("opt_loaded_layers", 0) + selected.get("sel_loaded_layers", 0)  # the policy's own passes
        # + the look-ahead's passes through layers 1..E for candidates past the stop (early_exit.draft_ahead)
        loaded = (d * plan.skip.layers(L) if skips else (d + draft.wasted) * E) + L + extra
        trace = {**plan.trace, **probed, **selected}
        if draft.confidences:
            trace["draft_confidences"] = draft.confidences
        if draft.wasted:
            trace["lookahead_wasted"] = draft.wasted
        if verified.siblings is not None:  # a token tree: its size; did a sibling (not the chain) end the path
            trace["tree_siblings"] = sum(map(len, verified.siblings.tokens))
            trace["tree_leaf_accepted"] = verified.leaf is not None
        self.append_round(run.gen, Round(
            round=len(run.gen.rounds), exit_layer=E if d and not skips else None, budget=rp.budget, drafted=d,
            accepted=k, emitted=emitted, loaded_layers=whole(loaded),
            head_calls=draft.candidates + len(verified.rows) + probed.get("opt_head_calls", 0)
            + selected.get("sel_head_calls", 0),
            # keep_drafting is the method's time, not drafting's; the optimiser's pass is in policy_s (t_draft − t)
            draft_s=t_verify - t_draft - draft.keep_s, verify_s=t_observe - t_verify,
            policy_s=(t_draft - t) + draft.keep_s + (t_end - t_observe),
            adapter_rows=draft.candidates if self.stack.has_adapter(E) else 0,
            shadow_rows=self.shadow.take_rows(), trace=trace,
        ))

    # ---- the draft head, shared by the draft shapes ---------------------------------------------------
    def draft_token(self, draft: Draft, method: Method, rng, on_host: bool = False) -> tuple[int | None, bool]:
        """The draft head on the newest layer-E state: a candidate token, and whether to keep drafting
        after it (method.keep_drafting, for methods that want confidence). Returns (None, False) when
        the candidate that stopped drafting is dropped (drop_stopped_draft: DEL's Algorithm 1), and (-1, True) for a
        candidate left on the device (no confidence to read, not on_host: drafted by id, read at acceptance).
        on_host: the caller needs the token itself now (SWIFT: its siblings and the next draft's input)."""
        token, top, q = self.draft_head(draft, rng, method)
        if method.wants_confidence:
            # one read: the token and its confidence (a token id is exact in float64)
            candidate, confidence = to_list(torch.cat([token.double(), top.double()[None]]))
            return self.judge(draft, method, token, q, int(candidate), confidence)
        candidate = to_list(token)[0] if on_host else -1  # -1: on the device until the host needs it
        self.keep_candidate(draft, token, q, candidate)
        return candidate, True

    def judge(self, draft: Draft, method: Method, token: torch.Tensor, q: torch.Tensor | None, candidate: int,
              confidence: float) -> tuple[int | None, bool]:
        """draft_token once the candidate and its confidence are on the host: the method's stop decision, and the
        candidate joins the draft unless dropped → (candidate, or None: dropped; keep drafting after it)."""
        keep = self.decide(draft, method, candidate, confidence)
        if keep is None:  # Algorithm 1: the candidate that stopped drafting is dropped
            return None, False
        self.keep_candidate(draft, token, q, candidate)
        return candidate, keep

    def draft_head(self, draft: Draft, rng, method: Method) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                      torch.Tensor | None]:
        """The draft head on the newest layer-E state, all on the device: (the candidate token [1], its confidence []
        where the method stops on one, the warped draft distribution q [V] when sampling)."""
        logits = self.stack.exit_logits(draft.exit_states[-1], draft.exit_layer)[0, -1]  # [V]
        return self.candidate_of(draft, logits, rng, method)

    def candidate_of(self, draft: Draft, logits: torch.Tensor, rng, method: Method) -> tuple[
            torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """draft_head from the draft head's logits [V] (a batch computes every row's in one product)."""
        draft.logits = logits
        draft.candidates += 1
        if self.sampling.do_sample:  # q: the warped draft distribution [V]
            q = self.sampling.probs(logits)
            token = rng.sample(q)  # [1]
        else:
            q, token = None, logits.argmax(-1, keepdim=True)  # [1]
        # the draft distribution's top probability: it does not depend on which token was sampled, so stopping on it
        # keeps speculative sampling exact. On τ's scale, as shadow confidences are computed: in float32 for
        # half-precision models (numerics.widened), and with shadow_vocab=K normalised over the first K ids and the
        # top token (top_confidence) — both must compare like with like
        top = None
        if method.wants_confidence:
            top = top_confidence(q if q is not None else widened(logits).softmax(-1), method.shadow_vocab)
        return token, top, q

    def decide(self, draft: Draft, method: Method, candidate: int, confidence: float) -> bool | None:
        """The method's stop decision on a candidate read with its confidence: True (keep drafting after it), False
        (keep it, stop after), None (stop, and the candidate is dropped: drop_stopped_draft). Timed as policy."""
        draft.confidences.append(confidence)
        tp = time.perf_counter()
        keep = method.keep_drafting(len(draft.ids), confidence)
        draft.keep_s += time.perf_counter() - tp
        return None if not keep and method.drop_stopped_draft else keep

    @staticmethod
    def keep_candidate(draft: Draft, token: torch.Tensor, q: torch.Tensor | None, candidate: int) -> None:
        """A candidate joins the draft (its id on the host too where it was read: candidate ≥ 0)."""
        draft.ids.append(token)
        if candidate >= 0:
            draft.drafts.append(candidate)
        draft.draft_probs.append(q)

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
        return {**trace, "sel_loaded_layers": whole(states.loaded_layers), "sel_head_calls": states.head_rows,
                "sel_s": time.perf_counter() - t}

    # ---- verify, accept, observe --------------------------------------------------------------------
    def _accept(self, draft: Draft, verified: Verified, n: int, cache, gen: Generation, rng, method: Method,
                E: int) -> tuple[int, int]:
        """Accept a prefix of the drafts (greedy: the verifier's argmax; sampling: speculative sampling)
        and emit it with the verifier's next token; crop the cache to the kept positions.
        Returns (k accepted drafts, tokens emitted: fewer than k + 1 after an EOS or a stop)."""
        if verified.siblings is not None:
            return self._accept_tree(draft, verified, n, cache, gen, rng)
        acceptance = self.acceptance(draft, verified, n, cache, gen, rng, method, E, self._verified_logits(verified))
        return acceptance.finish(to_list(acceptance.values))

    def acceptance(self, draft: Draft, verified: Verified, n: int, cache, gen: Generation, rng, method: Method,
                   E: int, logits: torch.Tensor) -> Acceptance:
        """_accept over a chain, its device part done (logits [d+1, V]: the verifier's head over every row) and its
        host part waiting for the values its one read brings."""
        # DEL's shadow statistics, scored once the targets are known to ride on the round's read (ShadowScorer.ride)
        def ride() -> torch.Tensor | None:
            return self.shadow.ride(method, draft, verified, E)

        if not self.sampling.do_sample:
            return self._accept_greedy(draft, verified, n, cache, gen, ride, logits)
        return self._accept_sampling(draft, verified, n, cache, gen, rng, ride, logits)

    def _accept_greedy(self, draft: Draft, verified: Verified, n: int, cache, gen: Generation, ride,
                       logits: torch.Tensor) -> Acceptance:
        """acceptance, greedy over a chain, in one host read: their argmax (targets) on the device, then the drafts
        still on the device, the targets and (half precision) each row's top-2 logits come to the host together. The
        next pending token stays on the device (targets[k])."""
        d = len(draft.ids)
        targets = verified.targets = logits.argmax(-1)  # [d+1]
        unread = len(draft.drafts) < d  # drafts left on the device: read them with the targets
        values, parse = self._read_values(torch.cat([torch.cat(draft.ids).to(targets.device), targets]) if unread
                                          else targets, logits, ride())  # [2d+1] or [d+1] ids (+ gaps, rider)

        def finish(read: list) -> tuple[int, int]:
            targets_host, gaps = parse(read)
            if unread:
                draft.drafts, targets_host = targets_host[:d], targets_host[d:]
            k = next((i for i, (x, t) in enumerate(zip(draft.drafts, targets_host)) if x != t), d)
            verified.rows = dict(enumerate(targets_host))
            if gaps:
                verified.gaps = dict(enumerate(gaps))
            emitted = self._emit(gen, draft.drafts[:k] + [targets_host[k]])
            self._record_gaps(gen, verified, range(emitted))  # token j of the round came from row j
            cache.crop(n + k)  # keep the pending token and the accepted drafts; the new pending is targets[k]
            self._pending = targets[k : k + 1].view(1, 1)
            return k, emitted

        return Acceptance(values, finish)

    def _accept_sampling(self, draft: Draft, verified: Verified, n: int, cache, gen: Generation, rng, ride,
                         logits: torch.Tensor) -> Acceptance:
        """acceptance, sampling over a chain, in one host read: speculative sampling on the device
        (sampling.accept_sampling), then the drafts, each row's greedy token (what shadow scoring compares with), k
        and the next token come to the host together. The next token stays on the device as the pending one."""
        d = len(draft.ids)
        drafts = torch.cat(draft.ids).to(logits.device) if d else logits.new_zeros(0, dtype=torch.long)  # [d]
        q = torch.stack(draft.draft_probs) if d else None  # [d, V]
        k, token = accept_sampling(drafts, q, logits, self.sampling, rng)  # [], [1]
        verified.targets = logits.argmax(-1)  # [d+1]
        values, parse = self._read_values(torch.cat([drafts, verified.targets, k.view(1), token]), logits, ride())

        def finish(read: list) -> tuple[int, int]:
            read, _ = parse(read)
            draft.drafts, verified.rows = read[:d], dict(enumerate(read[d : 2 * d + 1]))
            k = read[-2]
            emitted = self._emit(gen, draft.drafts[:k] + [read[-1]])
            cache.crop(n + k)  # keep the pending token and the accepted drafts; the new pending is the token
            self._pending = token.view(1, 1)
            return k, emitted

        return Acceptance(values, finish)

    def _verified_logits(self, verified: Verified) -> torch.Tensor:
        """The verifier's logits of every row, [T, V]: one product, or row by row where each row must keep a decode
        step's bits (LayerStack.exact_rows: CPU half precision, whose GEMM rounds by the row count)."""
        if self.stack.exact_rows:
            return torch.cat([verified.head(verified.h[:, i : i + 1])[0] for i in range(verified.h.shape[1])])
        return verified.head(verified.h)[0]

    def _read_targets(self, values: torch.Tensor, logits: torch.Tensor,
                      rider: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
        """values: token ids [N] (device), logits: [T, V] the rows the last T of them came from → (the ids on the
        host, and greedy in half precision each row's top-2 gap: numerics.gap_from_top2) in one read, which also
        carries rider (float64 [R], ShadowScorer.ride) to the shadow scorer when given."""
        values, parse = self._read_values(values, logits, rider)
        return parse(to_list(values))

    def _read_values(self, values: torch.Tensor, logits: torch.Tensor,
                     rider: torch.Tensor | None) -> tuple[torch.Tensor, Callable[[list], tuple[list[int], list]]]:
        """_read_targets in two parts: what to read (the ids as they are, or with the gaps' top-2 logits and the
        rider all in float64: token ids are exact there) and how to take it apart once read."""
        if not self.track_gaps and rider is None:
            return values, lambda read: (read, [])
        parts = [values.double()]
        if self.track_gaps:
            parts.append(logits.topk(2, dim=-1).values.double().flatten())  # [T·2]
        if rider is not None:
            parts.append(rider)
        count = values.numel()

        def parse(read: list) -> tuple[list[int], list[float]]:
            if rider is not None:
                self.shadow.received(read[len(read) - rider.numel() :])
            ids, pairs = [int(x) for x in read[:count]], read[count:]
            if not self.track_gaps:
                return ids, []
            return ids, [gap_from_top2(pairs[2 * i], pairs[2 * i + 1], logits.dtype) for i in range(logits.shape[0])]

        return torch.cat(parts), parse

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
        """Hand the method its evidence; with shadow tokens, through ShadowScorer (which may hold it back)."""
        if draft.early is None:
            method.observe(evidence)
        else:
            self.shadow.observe(method, evidence, draft, verified, E)

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
