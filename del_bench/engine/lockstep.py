"""Batched decoding as tensors (`batch_size` = B > 1): B rows advance through a round together, lossless per row.

The rows are slots of one batch. Each slot holds a batch-1 Engine on its row of the batch's static cache
[B, KV, max_len, hd] (KVCache.row): its prefill, its rounds' plans, acceptance and bookkeeping (emitting, cropping,
observing, recording each Round) are the batch-1 engine's own code, per row. What the batch does together is the
tensor work between them. A round (Lockstep._round):
- plan: every row's method plans for itself (its E, budget, skip set; SWIFT's optimiser pass first, on its row);
- draft: the round's draft shape for all rows at once (engine/early_exit.py draft_rows, engine/skipping.py
  draft_rows): each draft step is one [B, 1] pass through the layers the deepest row needs — each row running only
  its own (its exit layer's, its skip set's), the rest idling, masked — one head product for every row drafting, and
  where the method stops on confidence one read of every row's candidate;
- verify: one [B, width] pass (width: the widest row's d + 1; its own on a CPU, a bucket on the graphs), each row from
  its own exit layer;
- accept: the head over every row's verified positions in one product, each row's acceptance (greedy or speculative
  sampling, its own RNG) on the device, and one host read for the whole batch; then each row's host part;
- observe: each row's selection and evidence (DEL's statistics scored per row; where they are read apart from the
  acceptance, as on a CPU, one read for every row that scores them), then each row's Round.
A row whose generation ends leaves at the round's end, and its slot takes its job's next generation (a multi-turn
sample's next turn) or the next job at once, prefilled alone on its row before the next round (continuous batching).

Jobs are generators: `decode(slot, job)` yields Requests (generate's arguments: `slot.generate(…)`) and is sent each
Generation back — no threads; the batch drives them at round boundaries (engine/batch.py's thread scheduler runs the
same jobs for the methods lockstep does not serve: `serves`).

The steps (static_steps.RowSteps) take each row's positions and which sublayers it runs as data, so the shapes are
static: a row that idles in a layer (past its exit, in a sublayer its skip set skips, done drafting, or an empty slot)
is computed and dropped, its keys written only to a scratch slot. On CUDA the steps are graphs captured per (B, width
bucket) (compiled.Graphs.rows); on a CPU they run eagerly over the batch's products (products.products_for).

Accounting. Each row records what it records alone — its rounds' loaded layers (d·E + L), head rows, reads (the
batch's reads that carried its values: transfer.Ledger). The batch's own: each sublayer a step computes is loaded
once (½ layer) for all B rows; the rows that run it share that load (`Slot.loaded_layers`: the shares sum to the
batch's), the rows computed in it for nothing (idle, masked) count it as `idle_layers` — lockstep's price in loaded
layers; a prefill, a selection's or an optimiser's pass is its row's alone.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from del_bench.engine import compiled, early_exit, skipping
from del_bench.engine.decode import Acceptance, Decoding, Engine, Request, RoundPlan
from del_bench.engine.sampling import Sampling
from del_bench.engine.static_steps import RowSkips, RowSteps, StepRows, padded
from del_bench.engine.steps import Draft, Verified
from del_bench.methods.base import Method
from del_bench.models.kv_cache import KVCache
from del_bench.models.layer_stack import LayerStack
from del_bench.models.products import products_for
from del_bench.numerics import compare, is_half
from del_bench.transfer import Ledger, charged, reads, to_list

Job = Generator[Request, Any, Any]


def serves(method: Method, stack: LayerStack) -> str | None:
    """Why lockstep cannot decode this method on this stack (None: it can). Those left to the thread scheduler
    (engine/batch.py): AdaDecode, whose step walks the layers deciding at each exit head on a host read and batches
    each row's deferred positions at the layer they owe (a row's control flow per layer, not per round); SWIFT's
    token tree (its siblings drawn on the host, a tree mask per row, acceptance read row by row); look-ahead stop
    reads (a row's drafting K candidates past its stop); a model spread over several devices."""
    why = serves_method(method)
    if why is not None:
        return why
    if len({lay.device for lay in stack.layers} | {stack.head_device}) > 1:
        return "the model spans several devices (device_map)"
    return None


def serves_method(method: Method) -> str | None:
    """serves' reasons of the method alone (config.validate asks it before a model loads)."""
    if method.schedule != "rounds":
        return "its schedule is not draft/verify rounds (AdaDecode's layer-parallel steps)"
    if getattr(method, "tree", False):
        return "SWIFT's token tree (siblings drawn on the host, a tree mask and acceptance row by row)"
    if method.wants_confidence and method.lookahead > 1:
        return "the look-ahead stop reads (K candidates drafted past a row's stop)"
    return None


def compile_refused(setting: str, method: str, why: str) -> str:
    """Why compile=on|graphs is refused for a batch of `method` (config.validate before a model loads; the session
    where the stack is why: several devices)."""
    return (f"compile={setting}: a batch of method={method} runs on the thread scheduler (lockstep does not serve "
            f"{why}), on the stack's layer loop: use compile=auto or off, or batch_size=1")


def choose_graphs(stack: LayerStack, setting: str, method, max_new_tokens: int, cache_len: int, batch: int,
                  backend: str = "inductor", capture: bool | None = None, runner: type | None = None
                  ) -> tuple[compiled.Graphs | None, dict]:
    """A batch's graph-captured steps for `setting` (compiled.choose's rules: CUDA graphs per (B, width bucket) on
    CUDA, fused or not; compiled under `on` elsewhere), made, checked row by row (check_rows) and returned — not
    installed on the stack — with what the setup line records; None: RowSteps' eager steps. cache_len: the longest
    sequence a row reaches."""
    return compiled.pick(stack, setting, method, max_new_tokens, cache_len, backend, capture, runner, batch,
                         check_rows)


@torch.inference_mode()
def check_rows(stack: LayerStack, graphs: compiled.Graphs, method, tokens: int = 16) -> str | None:
    """compiled.check for a batch's graphs: B rows of random prompts of different lengths decoded together on them,
    greedy, each row held to `generate` on its prompt by the same rule (None: lossless; else what departed)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, stack.vocab_size, (4 + 3 * (b % 4),), generator=generator).tolist()
               for b in range(graphs.batch)]  # of different lengths, all within the smallest cache the graphs take
    batch = Lockstep(stack, graphs.batch, Sampling(), set(), cache_len=graphs.cache.max_len - 1, graphs=graphs)
    outputs: dict = {}

    def decode(slot, i):
        outputs[i] = (yield slot.generate(prompts[i], copy.deepcopy(method), tokens, 0)).output_ids

    batch.run(range(len(prompts)), decode)
    for i, prompt in enumerate(prompts):
        reference, gaps = compiled.generate_reference(stack.model, prompt, tokens)
        verdict = compare(outputs[i], reference, gaps if is_half(stack.dtype) else None)
        if verdict.kind not in ("equal", "near_tie"):
            return (f"row {i} of a batch on the graphs departs from generate's at token {verdict.position}: "
                    f"{outputs[i]} vs {reference}")
    return None


@dataclass
class RowRound:
    """One row's round in flight: its plan, draft and verification, and what its steps leave for the next phase."""

    plan: RoundPlan
    probed: dict
    n: int  # the sequence length at the round's start: the pending token sits at n − 1
    draft: Draft = field(default_factory=Draft)
    verified: Verified | None = None
    pending: torch.Tensor | None = None  # [1, 1] ids: the round's first token (the last emitted), on the device
    token: torch.Tensor | None = None  # [1, 1] ids: the next token through the draft's layers
    pos: int = 0  # its position
    depth: int = 0  # an early-exit draft's passes run layers 1..depth (E; a row with no draft: see draft_rows)
    stop: bool = False  # the next pass is the draft's last (its candidate stopped drafting, or ended the budget)
    acceptance: Acceptance | None = None
    accepted: tuple[int, int] = (0, 0)  # (k accepted drafts, tokens emitted)
    selected: dict = field(default_factory=dict)


class Slot:
    """One row of the batch: its Engine (on its row of the batch's cache, its reads counted in its ledger), its job
    and generation in progress, and its share of the batch's work for the current job."""

    def __init__(self, index: int, engine: Engine):
        self.index, self.engine = index, engine
        self.began_in = index
        self.ledger = engine.ledger = Ledger()
        self.job: Job | None = None
        self.run: Decoding | None = None
        self.round: RowRound | None = None
        self.start_s = 0.0  # when its job began, seconds after the batch's run began
        self.loaded_layers = 0.0  # its share of the batch's loads (½ a sublayer ÷ the rows running it)
        self.idle_layers = 0.0  # sublayers computed for it for nothing (idle in a step, masked), ½ each
        self.head_passes = 0.0  # its share of the batch's head passes
        self.rounds = 0.0  # its share of the batch's rounds (each ÷ the rows in it; a prefill, its own, whole)
        self._reads_before = 0.0  # its ledger's share when its job began

    def generate(self, prompt_ids: list[int], method: Method, max_new_tokens: int, seed: int) -> Request:
        """What a job yields to have its slot decode a prompt (it is sent the Generation back)."""
        return Request(prompt_ids, method, max_new_tokens, seed)

    @property
    def slot(self) -> int:
        """The slot its job began in (its method copy's: runner.decode_batched); it may end in a lower one, moved down
        once no job is left to start (_compact)."""
        return self.began_in

    def tally(self, rounds: list[dict]) -> tuple[float, float]:
        """Its job's shares of the batch's host reads and rounds (they sum over the rows to the batch's)."""
        return self.ledger.share - self._reads_before, self.rounds

    @property
    def method(self) -> Method:
        return self.run.method


class Lockstep:
    """B slots over one LayerStack and one static cache: `run` decodes jobs B at a time (continuous batching) and
    returns the batch's counts. Build once per run."""

    def __init__(self, stack: LayerStack, size: int, sampling: Sampling, eos_ids: set[int], stop=None,
                 cache_len: int = 1024, shadow_with_acceptance: bool | None = None, graphs=None):
        """cache_len: the longest sequence a row reaches (prompt + max_new_tokens + 1); the cache holds one slot more
        (the scratch slot). graphs: compiled.Graphs made for this batch (CUDA graphs), or None: eager steps."""
        self.stack, self.size, self.graphs = stack, size, graphs
        self.cache = graphs.cache if graphs is not None else _zeroed(stack.new_cache(cache_len + 1, batch=size))
        self.steps = RowSteps(stack, self.cache, graphs)
        self.slots = [Slot(r, Engine(stack, sampling, eos_ids, stop, shadow_with_acceptance, cache=self.cache.row(r)))
                      for r in range(size)]
        for slot in self.slots:
            slot.engine.hold_shadow_reads = True  # read once for the batch (_settle_statistics)
        self._t0 = 0.0
        self._held = 0  # the round's: how many slots its rows hold or may write (RowSteps.run)

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

    @property
    def rows(self) -> list[Slot]:
        return self.slots

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
                run = slot.engine.begin(request.prompt_ids, request.method, request.max_new_tokens, request.seed,
                                        t0=t0)
                if request.max_new_tokens <= 0:  # nothing to decode: its (empty) generation goes straight back
                    request = self._send(slot, slot.engine.finish(run))
                    continue
                self._fit(run.prompt_len + request.max_new_tokens + 1)
                with charged([slot.ledger]):
                    slot.engine.prefill(run, request.prompt_ids)
                self._alone(slot, self.stack.num_layers)
                slot.rounds += 1  # round 0, its own
                slot.run = run
                if run.done:  # its first token ended it (an EOS, a budget of 1)
                    request = self._send(slot, self._finish(slot))
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
                self.cache.row(slot.index, slot.engine.cache)

    def _next_request(self, slot: Slot) -> Request | None:
        """The slot's job's next request: after its finished generation, or a new job's first (None: no job left)."""
        if slot.run is not None:
            return self._send(slot, self._finish(slot))
        return self._start_job(slot)

    def _start_job(self, slot: Slot) -> Request | None:
        while True:
            job = next(self._jobs, None)
            if job is None:
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

    def _finish(self, slot: Slot):
        run, slot.run, slot.round = slot.run, None, None
        with charged([slot.ledger]):
            return slot.engine.finish(run)

    def _fit(self, length: int) -> None:
        """A cache of at least length + 1 slots (the last is the scratch slot): a longer one replaces it, every row's
        filled positions copied and its view re-pointed — on graphs, the one their graphs are made again on
        (Graphs.grow: recorded and logged, never a silent fall to eager steps)."""
        if self.cache.max_len >= length + 1:
            return
        if self.graphs is not None:
            bigger = self.graphs.grow(length)
        else:
            bigger = _zeroed(self.stack.new_cache(length + 1, batch=self.size))
        for old, new in zip(self.cache.k + self.cache.v, bigger.k + bigger.v):
            new[:, :, : self.cache.max_len - 1] = old[:, :, :-1]  # not the old scratch slot
        self.cache = self.steps.cache = bigger
        for slot in self.slots:
            self.cache.row(slot.index, slot.engine.cache)

    # ---- one round ---------------------------------------------------------------------------------------------
    def _round(self, slots: list[Slot]) -> None:
        t = time.perf_counter()
        for slot in slots:
            self._plan(slot)
            slot.rounds += 1 / len(slots)
        # the slots rows hold or may write this round: each row's sequence and its draft budget's positions beyond
        self._held = max(s.run.n + s.round.plan.budget for s in slots)
        skips = {s.round.plan.skips for s in slots}
        if len(skips) > 1:
            raise RuntimeError("a batch's rows plan rounds of different draft shapes (one method a batch)")
        shape = skipping if skips.pop() else early_exit
        t_draft = time.perf_counter()
        shape.draft_rows(self, slots)
        t_verify = time.perf_counter()
        shape.verify_rows(self, slots)
        self._accept(slots)
        t_observe = time.perf_counter()
        for slot in slots:
            r = slot.round
            with charged([slot.ledger]):
                r.selected = slot.engine.observe_round(slot.run, r.plan, r.draft, r.verified, r.accepted[0], r.n)
            self._alone(slot, r.selected.get("sel_loaded_layers", 0))
        self._settle_statistics(slots)
        times = (t, t_draft, t_verify, t_observe, time.perf_counter())
        for slot in slots:
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
        read for the whole batch, then each row's host part (emit, crop, its next pending token)."""
        hs = [s.round.verified.h for s in slots]  # [1, T_r, D] each: normed
        sizes = [h.shape[1] for h in hs]
        with products_for(self.stack, sum(sizes)):
            logits = self.stack.head(torch.cat(hs, dim=1))[0].split(sizes)  # [T_r, V] each
        self._head_pass(slots)
        for slot, rows in zip(slots, logits):
            r, run = slot.round, slot.run
            for i in range(len(run.cache.lengths)):  # the row's layers hold its verified positions (the steps wrote)
                run.cache.lengths[i] = r.n + len(r.draft.ids)
            r.acceptance = slot.engine.acceptance(r.draft, r.verified, r.n, run.cache, run.gen, run.rng, run.method,
                                                  r.plan.exit_layer, rows)
        values = [s.round.acceptance.values for s in slots]
        floating = any(v.is_floating_point() for v in values)
        with charged([s.ledger for s in slots]):  # one read, every row's values
            read = to_list(torch.cat([v.double() if floating else v for v in values]))
        start = 0
        for slot, v in zip(slots, values):
            part = read[start : start + v.numel()]
            start += v.numel()
            if floating and not v.is_floating_point():
                part = [int(x) for x in part]
            slot.round.accepted = slot.round.acceptance.finish(part)

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

    # ---- the batch's steps and their accounting ----------------------------------------------------------------
    def step(self, start: int, end: int, inputs: dict[Slot, tuple[torch.Tensor, int]],
             spans: dict[Slot, tuple[int, int]], collect: str | None = None, skips: RowSkips | None = None
             ) -> tuple[dict[Slot, torch.Tensor], list[torch.Tensor]]:
        """One batched step: each slot of `inputs` — (h [1, T_r, D], its first position) — through the layers
        spans[slot] = [lo, hi) of [start, end), with `skips` (skips_of: a skipping draft's) only the sublayers its
        skip set keeps; every other row idles. What the step uploads is each row's first position, width and span
        (StepRows): the device makes the positions and masks. → (each slot's output [1, T_r, D], the states
        collected [B, W, D] each: "layers" or "sublayers")."""
        W = max(h.shape[1] for h, _ in inputs.values())
        some = next(iter(inputs.values()))[0]
        rows = self.slots[: self.running]  # the running rows, first (_compact): the step's batch on a CPU
        h = torch.cat([padded(inputs[s][0], W) if s in inputs else some.new_zeros(1, W, some.shape[2])
                       for s in rows])  # [m, W, D]
        idle = (0, 0)
        step = StepRows([inputs[s][1] if s in inputs else 0 for s in rows],
                        [inputs[s][0].shape[1] if s in inputs else 0 for s in rows],
                        [spans.get(s, idle)[0] for s in rows], [spans.get(s, idle)[1] for s in rows],
                        held=self._held, skips=skips)
        out, states, ran, computed = self.steps.run(start, end, h, step, collect)
        self._share(step, start, end, ran, computed)
        return {s: out[s.index : s.index + 1, : inputs[s][0].shape[1]] for s in inputs}, states

    def skips_of(self, slots: list[Slot]) -> RowSkips:
        """The skip sets of a skipping round's rows (their plans'), on the device once a round (RowSkips; a row not
        among `slots` keeps every sublayer, and idles by its span)."""
        planned = {s.index: s.round.plan.plan.skip for s in slots}
        skips = [(frozenset(planned[i].attn), frozenset(planned[i].mlp)) if i in planned else (frozenset(),) * 2
                 for i in range(self.size)]
        return RowSkips.of(skips, self.size, self.stack.num_layers, self.stack.layers[0].device)

    def _share(self, step: StepRows, start: int, end: int, ran: list[bool], computed: int) -> None:
        """The loads of a step: each sublayer computed ½ for the batch, shared by the rows that ran it; the other
        rows computed (the graphs compute all B) count ½ each as idle work (an empty slot's in the batch's total)."""
        users = step.users(start, end)
        loads = [0.5 / u if done and u else 0.0 for u, done in zip(users, ran)]
        done = sum(ran)
        self.loaded_layers += 0.5 * done
        for b, slot in enumerate(self.slots[:computed]):
            mine = step.sublayers_of(b, start, end) if b < step.rows else range(0)
            share = sum(loads[mine.start : mine.stop]) if isinstance(mine, range) else sum(loads[j] for j in mine)
            slot.loaded_layers += share
            slot.idle_layers += 0.5 * (done - len(mine))
            self.idle_layers += 0.5 * (done - len(mine))
        if self.stack.counter is not None:  # what really ran, for the tests' counter (the steps are not the loop)
            self.stack.counter.layers += done / 2

    def _alone(self, slot: Slot, layers: float) -> None:
        """`layers` a row loaded on its own (its prefill, a selection's or an optimiser's pass)."""
        self.loaded_layers += layers
        slot.loaded_layers += layers

    def _head_pass(self, slots: list[Slot]) -> None:
        self.head_passes += 1
        for slot in slots:
            slot.head_passes += 1 / len(slots)

    def head(self, slots: list[Slot], states: list[torch.Tensor], exits: list[int]) -> list[torch.Tensor]:
        """The draft head over several rows' newest states (each [1, 1, D], at its exit layer: its adapter where
        one is loaded) in one product → each row's logits [V]."""
        inputs = torch.cat([self.stack.exit_input(h, e) for h, e in zip(states, exits)], dim=1)  # [1, n, D]
        with products_for(self.stack, len(states)):
            logits = self.stack.head(inputs)[0]  # [n, V]
        self._head_pass(slots)
        return list(logits.unbind(0))


def _zeroed(cache: KVCache) -> KVCache:
    """A cache whose every slot holds 0: a masked key gets weight 0, but 0 · NaN is NaN, so the garbage torch.empty
    may leave must never sit in the slots a batched step's mask covers."""
    for k, v in zip(cache.k, cache.v):
        k.zero_()
        v.zero_()
    return cache
