"""The round driver: B rows (B ≥ 1) of one batch advance through each round together, lossless per row.

Every decode goes through here — engine/decode.Engine.generate is a batch of one, `batch_size: B` a batch of B. Each
row is a slot holding a RowEngine (engine/row.py) on its row of the batch's cache [B, KV, max_len, hd] (KVCache.row):
its
prefill, its plan, the host part of its acceptance, its observation and records are that row's own code. What the
batch does is the tensor work between them, for every row at once. A round (Batch._round):
- plan: every row's method plans for itself (its E, budget, skip set; SWIFT's optimiser pass first, on its row);
- draft and verify: the round's draft shape (engine/steps.DraftShape: engine/early_exit.py, engine/skipping.py, …),
  the shape of each row's method, for all its rows at once — each draft step one pass of every row still drafting
  (`step`), each row running only its own layers (its exit layer's, its skip set's), one head product for every row
  drafting, one read of their candidates where the method stops on confidence; one verification step;
- accept: the head over every row's verified positions in one product, each row's acceptance on the device (greedy or
  speculative sampling, its own RNG) and one host read for the whole batch, then each row's host part (a token
  tree's rows are read row by row: engine/acceptance.py);
- observe: each row's selection and evidence (DEL's statistics scored per row, read for every row in one read where
  they are read apart from the acceptance, as on a CPU), then each row's Round.
A shape that is not draft/verify rounds (AdaDecode's layer walk, engine/layer_parallel.py) runs its own step instead.
A row whose generation ends leaves at the round's end, and its slot takes its job's next generation (a multi-turn
sample's next turn) or the next job at once, prefilled alone on its row before the next round (continuous batching).

Jobs are generators: `decode(slot, job)` yields Requests (engine/decode.Request) and is sent each Generation back —
no threads; the batch drives them at round boundaries.

A step's passes run on the session's layer path (engine/layer_path.py): a row alone in a step on the stack's own loop
(so a batch of one decodes exactly as one prompt alone always did), several rows as static-shape steps
(static_steps.RowSteps) — each row's positions and sublayers as data, a row idling in a sublayer computed and dropped,
its keys written only to a scratch slot — or on graphs made for the batch.

Accounting. Each row records what it records alone — its rounds' loaded layers (d·E + L), head rows, reads (the
batch's reads that carried its values: transfer.Ledger). The batch's own: each sublayer a step computes is loaded
once (½ layer) for all its rows; the rows that run it share that load (`Slot.loaded_layers`: the shares sum to the
batch's), the rows computed in it for nothing (idle, masked) count it as `idle_layers` — a shared step's price in loaded
layers; a prefill, a selection's or an optimiser's pass is its row's alone."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from del_bench.engine import acceptance, skipping
from del_bench.engine.batch_work import BatchWork, Job, RowRound, Slot
from del_bench.engine.layer_path import LayerPath
from del_bench.engine.row import Decoding, Request, RowEngine
from del_bench.engine.sampling import Sampling
from del_bench.engine.steps import shape_named
from del_bench.models.kv_cache import KVCache
from del_bench.models.layer_math import joined
from del_bench.models.layer_stack import LayerStack
from del_bench.models.products import products_for
from del_bench.transfer import charged, reads, to_list

_NO_JOB = object()  # the jobs are over (a job may be anything, None too)


class Batch(BatchWork):
    """B slots over one LayerStack and one cache: `run` decodes jobs B at a time (continuous batching) and returns the
    batch's counts. Build once per run (decode.Engine keeps its batch of one)."""

    def __init__(self, stack: LayerStack, size: int, sampling: Sampling, eos_ids: set[int], stop=None,
                 cache_len: int = 1024, shadow_with_acceptance: bool | None = None, path: LayerPath | None = None,
                 engines: list[RowEngine] | None = None):
        """cache_len: the longest sequence a row reaches (prompt + max_new_tokens + 1); the cache holds one slot more
        (the scratch slot, static_steps.RowSteps). path: the session's layer path (None: the stack's own loop).
        engines: the rows' engines (a batch of one around an existing decode.Engine), else made here."""
        self.stack, self.size = stack, size
        self.path = path if path is not None else engines[0].path if engines else LayerPath(stack)
        engines = engines or [RowEngine(stack, sampling, eos_ids, stop, shadow_with_acceptance, self.path)
                              for _ in range(size)]
        self.slots = [Slot(r, engine) for r, engine in enumerate(engines)]
        self._scratch = 1 if size > 1 else 0  # several rows' steps write an idle row's keys to a last, scratch slot
        self._floor = cache_len + self._scratch  # the cache is made at the first request, at least this long
        self.cache: KVCache | None = None
        self._t0 = 0.0
        self._held = 0  # the round's: how many slots its rows hold or may write (RowSteps.run)
        self.loaded_layers = self.idle_layers = self.head_passes = 0.0
        self.rounds = 0

    @classmethod
    def of(cls, engine: RowEngine, cache_len: int = 1024) -> "Batch":
        """A batch of one whose row is `engine` (Engine.generate, a run at batch_size 1)."""
        return cls(engine.stack, 1, engine.sampling, engine.eos_ids, cache_len=cache_len, engines=[engine])

    @property
    def engines(self) -> list[RowEngine]:
        return [slot.engine for slot in self.slots]

    # ---- running jobs ------------------------------------------------------------------------------------------
    def run(self, jobs: Iterable, decode: Callable[[Slot, Any], Job]) -> dict:
        """decode(slot, job) — a generator of Requests — for every job: a slot takes the next job as soon as its last
        one ends. Returns the batch's counts: wall_s (its start to the last row's end), loaded_layers (each sublayer
        computed ½, for all rows; prefills and policy passes whole), idle_layers, head_passes, rounds, reads (the
        batch's host reads, prefills included)."""
        self._jobs, self._decode = iter(jobs), decode
        self.loaded_layers = self.idle_layers = self.head_passes = 0.0
        self.rounds, reads_before = 0, reads()
        for slot in self.slots:
            slot.job = slot.run = None
        self._t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                self._admit(self.slots)
                while True:
                    running = [s for s in self.slots if s.run is not None]
                    if not running:
                        break
                    self._round(running)
                    self.rounds += 1
                    self._admit([s for s in running if s.run.done])
                    self._compact()
        finally:
            for slot in self.slots:  # an error: every job closed (their contexts exit), the batch reusable
                if slot.job is not None:
                    slot.job.close()
                slot.job = slot.run = slot.round = None
        return {"wall_s": self.elapsed(), "loaded_layers": self.loaded_layers, "idle_layers": self.idle_layers,
                "head_passes": self.head_passes, "rounds": self.rounds, "reads": reads() - reads_before}

    def elapsed(self) -> float:
        """Seconds since the current run began (the device synchronised first)."""
        self.stack.synchronize()
        return time.perf_counter() - self._t0

    def _admit(self, slots: list[Slot]) -> None:
        """At a round boundary: each slot whose generation ended hands it to its job and starts the job's next
        request, or its next job's first (prefilled on its row alone); a slot with no job left idles. Every row
        admitted at this boundary starts its clock here (its ttft_s and wall_s count the others' prefills too)."""
        t0 = time.perf_counter()
        for slot in slots:
            request = self._next_request(slot)
            while request is not None:
                self._fit(len(request.prompt_ids) + request.max_new_tokens + 1)
                run = slot.engine.begin(request, t0)
                if request.max_new_tokens <= 0:  # nothing to decode: its (empty) generation goes straight back
                    request = self._send(slot, self._finish(slot, run))
                    continue
                with charged([slot.ledger]):
                    slot.engine.prefill(run, request.prompt_ids)
                self._alone(slot, self.stack.num_layers)
                slot.rounds += 1  # round 0, its own
                slot.run = run
                if run.done:  # its first token ended it (an EOS, a budget of 1)
                    request = self._send(slot, self._finish(slot, run))
                    continue
                break

    @property
    def running(self) -> int:
        """How many rows are running: the first slots (_compact)."""
        return sum(s.run is not None for s in self.slots)

    def _compact(self) -> None:
        """The running rows into the lowest slots, so that the steps (on a CPU) run over them alone: a row above an
        empty slot moves down — its cache row's filled slots copied, its slot's view re-pointed (its engine, ledger
        and job go with it). Only once no job is left to start (a slot is empty only then), so a job's method copy is
        never another running job's."""
        while True:
            empty = next((s for s in self.slots if s.run is None), None)
            top = next((s for s in reversed(self.slots) if s.run is not None), None)
            if empty is None or top is None or empty.index > top.index:
                return
            held = top.run.n  # its positions before the pending token's
            for k in self.cache.k + self.cache.v:
                k[empty.index, :, :held] = k[top.index, :, :held]
            self.slots[empty.index], self.slots[top.index] = top, empty
            empty.index, top.index = top.index, empty.index
            for slot in (empty, top):
                self._row(slot)

    def _next_request(self, slot: Slot) -> Request | None:
        """The slot's job's next request: after its finished generation, or a new job's first (None: no job left)."""
        if slot.run is not None:
            return self._send(slot, self._finish(slot, slot.run))
        return self._start_job(slot)

    def _start_job(self, slot: Slot) -> Request | None:
        while True:
            job = next(self._jobs, _NO_JOB)
            if job is _NO_JOB:
                return None
            slot.start_s, slot.began_in = time.perf_counter() - self._t0, slot.index
            slot.loaded_layers = slot.idle_layers = slot.head_passes = slot.rounds = 0.0
            slot._reads_before = slot.ledger.share
            slot.job = self._decode(slot, job)
            try:
                return next(slot.job)
            except StopIteration:  # a job that decodes nothing
                slot.job = None

    def _send(self, slot: Slot, generation) -> Request | None:
        """Hand the job its generation: its next request, or (the job done) the next job's first."""
        try:
            return slot.job.send(generation)
        except StopIteration:
            slot.job = None
            return self._start_job(slot)

    def _finish(self, slot: Slot, run: Decoding):
        slot.run, slot.round = None, None
        with charged([slot.ledger]):
            return slot.engine.finish(run)

    def reserve(self, length: int) -> None:
        """Room for `length` slots in every row (mid-round too: a token tree's siblings)."""
        if self.cache.max_len < length + self._scratch:
            self._fit(length)

    def _fit(self, length: int) -> None:
        """A cache of at least length slots for every row (+ the scratch slot): the path's (LayerPath.cache — a batch
        of one goes back to the graphs' captured cache whenever a request fits it), a longer one replacing it with
        every row's filled positions copied and its view re-pointed."""
        need = length + self._scratch
        cache = self.path.cache(self.size, need, self._floor, self.cache)
        if cache is self.cache:
            return
        if self.cache is not None and any(s.run is not None for s in self.slots):  # live rows: their positions move
            kept = self.cache.max_len - self._scratch  # not the old scratch slot
            for old, new in zip(self.cache.k + self.cache.v, cache.k + cache.v):
                new[:, :, :kept] = old[:, :, :kept]
            if self.size == 1:  # its one row decodes in the cache itself: its lengths go along
                cache.lengths = list(self.cache.lengths)
        self.cache = cache
        for slot in self.slots:
            slot.engine.cache = self._row(slot)

    def _row(self, slot: Slot):
        """The slot's view of the cache (its earlier view re-pointed); a batch of one decodes in the cache itself (the
        one CUDA graphs were captured on)."""
        if self.size == 1:
            return self.cache
        return self.cache.row(slot.index, slot.engine.cache)

    # ---- one round ---------------------------------------------------------------------------------------------
    def _round(self, slots: list[Slot]) -> None:
        t = time.perf_counter()
        shapes: dict = {}
        for slot in slots:
            shapes.setdefault(shape_named(slot.method.draft_shape), []).append(slot)
            slot.rounds += 1 / len(slots)
        rounds = [s for shape, group in shapes.items() if shape.rounds for s in group]
        for slot in rounds:
            self._plan(slot)
        # the slots rows hold or may write this round: each row's sequence and its draft budget's positions beyond
        self._held = max(s.run.n + (s.round.plan.budget if s.round is not None else 0) for s in slots)
        for shape, group in shapes.items():
            if not shape.rounds:
                shape.step(self, group)
        if not rounds:
            return
        t_draft = time.perf_counter()
        for shape, group in shapes.items():
            if shape.rounds:
                shape.draft(self, group)
        t_verify = time.perf_counter()
        for shape, group in shapes.items():
            if shape.rounds:
                shape.verify(self, group)
        self._accept(rounds)
        t_observe = time.perf_counter()
        for slot in rounds:
            r = slot.round
            with charged([slot.ledger]):
                r.selected = slot.engine.observe_round(slot.run, r.plan, r.draft, r.verified, r.accepted[0], r.n)
            self._alone(slot, r.selected.get("sel_loaded_layers", 0))
        self._settle_statistics(rounds)
        times = (t, t_draft, t_verify, t_observe, time.perf_counter())
        for slot in rounds:
            r = slot.round
            slot.engine.record_round(slot.run, r.plan, r.draft, r.verified, *r.accepted, r.probed, r.selected, times)

    def _plan(self, slot: Slot) -> None:
        """The row's plan (after its optimiser's pass, SWIFT's probe, run on its row alone)."""
        run, engine = slot.run, slot.engine
        with charged([slot.ledger]):
            probed = skipping.probe(engine, run.method, run.n, run.gen, run.cache)
        self._alone(slot, probed.get("opt_loaded_layers", 0))
        slot.round = RowRound(engine.plan_round(run), probed, run.n)
        slot.round.pending = slot.round.token = engine.take_pending(run.gen)
        slot.round.pos = run.n - 1

    def _accept(self, slots: list[Slot]) -> None:
        """The head over every row's verified positions in one product, each row's acceptance on the device, one host
        read for the whole batch, then each row's host part (emit, crop, its next pending token); a token tree's row
        row by row."""
        chains = [s for s in slots if s.round.verified.siblings is None]
        for slot in slots:
            if slot.round.verified.siblings is not None:
                with charged([slot.ledger]):
                    slot.round.accepted = acceptance.tree(slot.engine, slot.run, slot.round.draft,
                                                          slot.round.verified)
        if not chains:
            return
        logits = self._verifier_logits(chains)
        self._head_pass(chains)
        for slot, rows in zip(chains, logits):
            r = slot.round
            r.acceptance = acceptance.chain(slot.engine, slot.run, r.draft, r.verified, r.plan.exit_layer, rows)
        values = [s.round.acceptance.values for s in chains]
        floating = any(v.is_floating_point() for v in values)
        with charged([s.ledger for s in chains]):  # one read, every row's values
            read = to_list(joined([v.double() if floating else v for v in values]))
        start = 0
        for slot, v in zip(chains, values):  # each row's part (its ids made ints again by its parse)
            part = read[start : start + v.numel()]
            start += v.numel()
            slot.round.accepted = slot.round.acceptance.finish(part)

    def _verifier_logits(self, slots: list[Slot]) -> list[torch.Tensor]:
        """Each row's verifier logits [T_r, V]: where its step's graph ran the head (Verified.tail), those; the
        others' in one product (row by row where each row must keep a decode step's bits: exact_rows)."""
        todo = [s for s in slots if s.round.verified.tail is None]
        if self.stack.exact_rows:  # each row a decode step's bits (half precision on a CPU)
            computed = [acceptance.verified_logits(s.engine, s.round.verified) for s in todo]
        elif todo:
            hs = [s.round.verified.h for s in todo]  # [1, T_r, D] each: normed
            sizes = [h.shape[1] for h in hs]
            with products_for(self.stack, sum(sizes)):
                computed = self.stack.head(joined(hs, dim=1))[0].split(sizes)  # [T_r, V] each
        else:
            computed = []
        rest, out = iter(computed), []
        for slot in slots:
            tail = slot.round.verified.tail
            if tail is not None and self.stack.counter is not None:  # the head's rows, as stack.head counts them
                self.stack.counter.head_rows += tail.logits.shape[0]
            out.append(next(rest) if tail is None else tail.logits)
        return out

    def _settle_statistics(self, slots: list[Slot]) -> None:
        """DEL's statistics scored apart from the acceptance read (a CPU's way: ShadowScorer), every row's that
        scored this round brought to the host in one read, then handed to each row's method."""
        due = [(s, s.engine.shadow.due) for s in slots if s.engine.shadow.due is not None]
        if not due:
            return
        with charged([s.ledger for s, _ in due]):
            read = to_list(torch.cat([pending.values.flatten() for _, pending in due]))
        start = 0
        for slot, pending in due:
            count = pending.values.numel()
            slot.engine.shadow.settle(read[start : start + count])
            start += count
