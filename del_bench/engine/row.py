"""One row's decoding: the RowEngine — what a generation reads and writes on the host, round after round.

The round driver is the batch (engine/batch.py): B rows (B = 1 too: engine/decode.Engine.generate is a batch of one)
go through each round together — plan → draft → verify → accept → observe → record — and the batch's tensor work
between those phases is done for every row at once (the draft shapes: engine/early_exit.py, skipping.py,
layer_parallel.py). What is each row's own lives here, on the row's RowEngine: its prefill, its plan (the method's,
capped by the tokens left), the host part of its acceptance (emit, crop, the next pending token: engine/acceptance.py),
its observation (the method's evidence; DEL's shadow scoring, engine/shadow.py; a layer-skip selection) and its
records — one Round a round, with its accounting, timings and the host reads it took part in (del_bench/transfer.py).

The engine owns the KV cache (a row of its batch's), the RNG, accounting and timing; methods only decide E, the
budget and when to stop drafting. Never emits more than `max_new_tokens`; stops at EOS and at the task's stop
strings, token by token."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from del_bench.engine import acceptance
from del_bench.engine.layer_path import LayerPath
from del_bench.engine.layer_states import LayerStates
from del_bench.engine.rounds import Generation, Round  # noqa: F401 (Round: part of this module's API)
from del_bench.engine.sampling import Draws, Sampling
from del_bench.engine.shadow import ShadowScorer
from del_bench.engine.steps import Draft, Verified, whole  # noqa: F401 (Draft, Verified: part of this module's API)
from del_bench.methods.base import Method, Plan, RoundEvidence, SkipSet
from del_bench.models.kv_cache import KVCache, TreeMask
from del_bench.models.layer_math import cat_on
from del_bench.models.layer_stack import LayerStack
from del_bench.numerics import is_half
from del_bench.transfer import Ledger, to_device, to_list


@dataclass(frozen=True)
class Request:
    """What a job asks its row to decode — decode.Engine.generate's arguments. A job is a generator of them, sent each
    Generation back (runner.decode_one); the batch runs B of them together (engine/batch.py)."""

    prompt_ids: list[int]
    method: Method
    max_new_tokens: int
    seed: int
    draws: Draws | None = None  # where the random draws come from (tests enumerate them); None: seeded by seed


@dataclass
class Decoding:
    """One generation in progress, from RowEngine.begin to RowEngine.finish: what its rounds read and write."""

    prompt_len: int
    method: Method
    max_new_tokens: int
    rng: Draws
    cache: KVCache
    gen: Generation
    t0: float  # when it began (perf_counter): its wall_s and ttft_s count from here
    owed: int = 0  # positions whose deeper layers are still deferred (AdaDecode): it ends only once none is
    shape_state: object = None  # what its draft shape keeps across its steps (AdaDecode's deferred states)

    @property
    def n(self) -> int:
        """The sequence length (prompt + emitted): the pending token sits at n − 1, in no layer's cache yet."""
        return self.prompt_len + len(self.gen.output_ids)

    @property
    def done(self) -> bool:
        return (self.gen.stopped or len(self.gen.output_ids) >= self.max_new_tokens) and not self.owed


@dataclass(frozen=True)
class RoundPlan:
    """The method's plan for a round, capped by the tokens left: its draft budget and exit layer E (L: no draft, the
    round is one pass through every layer), and whether it drafts at full depth with sublayers skipped (SWIFT)."""

    plan: Plan
    budget: int
    exit_layer: int
    skips: bool


class RowEngine:
    """One row of a batch: its cache row, ledger of host reads, and the host side of its generation's rounds."""

    def __init__(self, stack: LayerStack, sampling: Sampling, eos_ids: set[int], stop=None,
                 shadow_with_acceptance: bool | None = None, path: LayerPath | None = None):
        """stop: optional callable(output_ids) → True to end generation after the latest token
        (per-task stop strings); checked token by token, so no token after the stop is kept.
        shadow_with_acceptance: DEL's shadow statistics come to the host on the round's acceptance read, scored over
        all d + 1 positions (engine/shadow.py); None: where the head is not on the CPU (a read stalls a queue there,
        and a CPU pays for the rejected positions' rows).
        path: how its passes run (engine/layer_path.py, chosen once per session); None: the stack's own loop."""
        self.stack = stack
        self.path = path if path is not None else LayerPath(stack)
        self.sampling = sampling
        self.eos_ids = set(eos_ids)
        self.stop = stop
        self.device = stack.embed_weight.device  # token ids start here; logits, the RNG: stack.head_device
        # greedy in half precision: each output token's top-2 gap is recorded (Generation.top2_gap_ulps, numerics.py)
        self.track_gaps = is_half(stack.dtype) and not sampling.do_sample
        if shadow_with_acceptance is None:
            shadow_with_acceptance = stack.head_device.type != "cpu"
        self.shadow_with_acceptance = shadow_with_acceptance
        self.on_round: Callable[[Round], None] | None = None  # called as each Round is recorded (bench/syncs.py)
        self.ledger = Ledger()  # the host reads this row took part in (Round.host_syncs; the batch charges it)
        self.cache: KVCache | None = None  # its row of the batch's cache (set by the batch that decodes it)

    @property
    def layer_path(self) -> str:
        return self.path.name

    @property
    def rng_device(self) -> torch.device:
        """Where the sampling RNG lives: beside the logits it samples from (the head's device; torch draws with a
        generator on the tensor's own device only)."""
        return self.stack.head_device

    def forward_layers(self, h: torch.Tensor, start: int, end: int, pos: int, cache: KVCache,
                       collect: list | None = None, tree: TreeMask | None = None,
                       keep: int | None = None, tail: list | None = None) -> torch.Tensor:
        """Layers [start, end) on this row's h [1, T, D] alone, on its path (LayerPath.one)."""
        return self.path.one(h, start, end, pos, cache, collect, tree, keep, tail)

    def forward_skipping(self, h: torch.Tensor, pos: int, cache: KVCache, skip: SkipSet, write: bool = True,
                         collect: list | None = None) -> torch.Tensor:
        """Every layer on this row's h alone with skip's sublayers skipped, on its path (LayerPath.skipping)."""
        return self.path.skipping(h, pos, cache, skip, write, collect)

    def ids(self, ids: list[int]) -> torch.Tensor:
        """Token ids [1, T] where the embedding lives."""
        return to_device([ids], self.device)

    # ---- a generation's start and end ------------------------------------------------------------------------
    def begin(self, request: Request, t0: float) -> Decoding:
        """A generation's start in this row's cache: its RNG, the method started, the shadow scorer; its clock
        started at t0 (when its slot took it: its wall_s and ttft_s count the batch's other prefills too)."""
        rng = request.draws or Draws(torch.Generator(device=self.rng_device).manual_seed(request.seed))
        self.cache.crop(0)  # one allocation reused across prompts: stale slots are overwritten before they are read
        request.method.start(self.stack.num_layers)
        self.shadow = ShadowScorer(self.stack, self.shadow_with_acceptance, hold_reads=True)  # DEL's shadow tokens
        self.pending: torch.Tensor | None = None  # the pending token [1, 1] where it is already on the device
        self._reads_at = self.ledger.count  # host reads before the current round (Round.host_syncs)
        gen = Generation(output_ids=[], top2_gap_ulps=[] if self.track_gaps else None)
        self.stack.synchronize()
        return Decoding(len(request.prompt_ids), request.method, request.max_new_tokens, rng, self.cache, gen, t0)

    def prefill(self, run: Decoding, prompt_ids: list[int]) -> None:
        """The prompt through every layer and its first token (round 0); ttft_s: when it is on the host."""
        t = time.perf_counter()
        st, L, method = self.stack, self.stack.num_layers, run.method
        layers = [] if method.wants_shadow else None  # each layer's last w positions [1, w, D]: the shadow window
        w = min(method.prefill_window, len(prompt_ids))
        h = self.forward_layers(st.embed(self.ids(prompt_ids)), 0, L, 0, run.cache, collect=layers, keep=w)
        logits = st.logits(h[:, -1:])[0, -1]  # [V]
        if self.sampling.do_sample:
            token = run.rng.sample(self.sampling.probs(logits))  # [1]
        else:
            token = logits.argmax(-1, keepdim=True)  # [1]
        # one read: the token (and greedy in half precision its top-2 logits, for its gap); it stays on the device
        (first,), gaps = acceptance.read_targets(self, token, logits[None])
        self.emit(run.gen, [first])
        if gaps:
            run.gen.set_gap(0, gaps[0])
        self.pending = token.view(1, 1)
        run.gen.ttft_s = time.perf_counter() - run.t0  # the first token is on the host: its read waited for the device
        t_policy = time.perf_counter()
        head_rows = 1
        if layers is not None:
            method.observe_prefill(self.shadow.prefill(layers, h, w, method.shadow_vocab))
            head_rows += w  # the shadow window's targets
        self.append_round(run.gen, Round(0, None, 0, 0, 0, 1, L, head_rows, verify_s=t_policy - t,
                                         policy_s=time.perf_counter() - t_policy, shadow_rows=self.shadow.take_rows()))

    def finish(self, run: Decoding) -> Generation:
        """A generation's end: rounds whose shadow scoring was held back are scored (inside the timed region, as
        without deferral), then its wall time."""
        gen = run.gen
        if run.max_new_tokens > 0 and self.shadow.deferred:
            t = time.perf_counter()
            self.shadow.flush(run.method)
            if self.shadow.due is not None:  # read now, its own (its batch has moved on)
                self.shadow.settle(to_list(self.shadow.due.values.flatten()))
            gen.rounds[-1].policy_s += time.perf_counter() - t
            gen.rounds[-1].shadow_rows += self.shadow.take_rows()
            gen.rounds[-1].host_syncs += self._take_reads()
        self.stack.synchronize()
        gen.wall_s = time.perf_counter() - run.t0
        return gen

    def take_pending(self, gen: Generation) -> torch.Tensor:
        """The pending token [1, 1] on the device: where the last acceptance kept it, else sent from the host."""
        pending, self.pending = self.pending, None
        return pending if pending is not None else self.ids([gen.output_ids[-1]])

    def _take_reads(self) -> int:
        """Host reads since the last call (the round just recorded: Round.host_syncs)."""
        now = self.ledger.count
        count, self._reads_at = now - self._reads_at, now
        return count

    def append_round(self, gen: Generation, record: Round) -> None:
        """Record a round (every schedule's rounds come through here) with the host reads it took part in."""
        record.host_syncs = self._take_reads()
        gen.rounds.append(record)
        if self.on_round is not None:
            self.on_round(record)

    # ---- a round, the row's own parts --------------------------------------------------------------------------
    def plan_round(self, run: Decoding) -> RoundPlan:
        """The method's plan, its budget capped by the tokens left (a round emits at most d + 1 tokens: d ≤ left − 1
        never overshoots); budget 0 → E = L, the round is one pass through every layer."""
        plan = run.method.plan()
        left = run.max_new_tokens - len(run.gen.output_ids)
        skips = plan.skip is not None and not plan.exit_layer  # SWIFT: full depth, sublayers skipped
        budget = min(plan.max_draft, left - 1) if plan.exit_layer or skips else 0
        E = plan.exit_layer if budget > 0 and not skips else self.stack.num_layers
        return RoundPlan(plan, budget, E, skips)

    def observe_round(self, run: Decoding, rp: RoundPlan, draft: Draft, verified: Verified, k: int, n: int) -> dict:
        """After acceptance: the method's layer-skip selection (→ its trace fields, sel_*), then its evidence."""
        selected = self._select(run.method, verified, k, n - 1, run.cache)
        d = len(draft.drafts)
        evidence = RoundEvidence(exit_layer=rp.plan.exit_layer if d else None, drafted=d, accepted=k,
                                 budget_capped=rp.budget < rp.plan.max_draft)
        if draft.early is None:
            run.method.observe(evidence)
        else:  # through the shadow scorer, which may hold it back
            self.shadow.observe(run.method, evidence, draft, verified, rp.exit_layer)
        return selected

    def record_round(self, run: Decoding, rp: RoundPlan, draft: Draft, verified: Verified, k: int, emitted: int,
                     probed: dict, selected: dict, times: tuple[float, ...]) -> None:
        """The round's Round: its accounting (the paper's loaded layers, head rows), timings — times: when it began,
        drafting, verification and observation began, and when it ended — its trace and host reads."""
        t, t_draft, t_verify, t_observe, t_end = times
        L, E, skips, plan = self.stack.num_layers, rp.exit_layer, rp.skips, rp.plan
        d = len(draft.drafts)
        extra = probed.get("opt_loaded_layers", 0) + selected.get("sel_loaded_layers", 0)  # the policy's own passes
        # + the look-ahead's passes through layers 1..E for candidates past the stop (EarlyExit.draft)
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

    # ---- emitting ----------------------------------------------------------------------------------------------
    def emit(self, gen: Generation, tokens: list[int]) -> int:
        """Append tokens, stopping after an EOS or the stop condition. Returns how many were appended."""
        for i, tok in enumerate(tokens):
            gen.output_ids.append(tok)
            if tok in self.eos_ids or (self.stop is not None and self.stop(gen.output_ids)):
                gen.stopped = True
                return i + 1
        return len(tokens)

    def record_gap(self, gen: Generation, index: int, logits: torch.Tensor) -> None:
        """Half precision: output token `index` was chosen from logits [V]; keep their top-2 gap (numerics.py)."""
        if gen.top2_gap_ulps is not None:
            gen.set_gap(index, acceptance.gap_of(logits))

    def record_gaps(self, gen: Generation, verified: Verified, rows) -> None:
        """Half precision: the round's emitted tokens (the last len(rows) of the output) came from these rows."""
        if gen.top2_gap_ulps is not None:
            first = len(gen.output_ids) - len(rows)
            for j, row in enumerate(rows):
                gen.set_gap(first + j, verified.gaps[row])
