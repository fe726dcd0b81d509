"""A batch's tensor work and its accounting (a mixin of engine/batch.Batch): a step of several rows' passes on the
session's layer path (engine/layer_path.py) — a row alone in a step on the stack's own loop, several rows at once —
with each row's cache lengths set as the loop's would be; the draft head over several rows in one product; and the
loads each row shares (a sublayer computed once for all the rows that run it: ½ a layer, split between them)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from del_bench.engine.acceptance import Acceptance
from del_bench.engine.graph_runners import TokenTail
from del_bench.engine.row import Decoding, Request, RoundPlan, RowEngine
from del_bench.engine.steps import Draft, Verified
from del_bench.methods.base import SkipSet
from del_bench.models.kv_cache import TreeMask
from del_bench.models.products import products_for


@dataclass
class Pass:
    """One row's part of a step: its states h [1, T, D] at positions pos.., through layers [start, end) with skip's
    sublayers skipped (None: none), or a token tree under its mask (a tree's row runs alone)."""

    h: torch.Tensor
    pos: int
    start: int
    end: int
    skip: SkipSet | None = None
    tree: TreeMask | None = None

    def runs(self, i: int) -> tuple[bool, bool]:
        """Whether it runs layer i's attention, its MLP."""
        inside = self.start <= i < self.end
        if self.skip is None:
            return inside, inside
        return inside and i not in self.skip.attn, inside and i not in self.skip.mlp

    @property
    def layers(self) -> float:
        """The layers it loads: its range's, less ½ for each sublayer its skip set skips there."""
        if self.skip is None:
            return self.end - self.start
        inside = range(self.start, self.end)
        return self.end - self.start - (sum(i in inside for i in self.skip.attn)
                                        + sum(i in inside for i in self.skip.mlp)) / 2


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
    depth: int = 0  # an early-exit draft's passes run layers 1..depth (E; a row with no draft: EarlyExit.draft)
    stop: bool = False  # the next pass is the draft's last (its candidate stopped drafting, or ended the budget)
    window: list = field(default_factory=list)  # candidates drafted ahead of their stop decision (Method.lookahead)
    window_size: int = 1
    tail: TokenTail | None = None  # a row with no draft: its pass to the last layer carried the head (graph_runners)
    acceptance: Acceptance | None = None
    accepted: tuple[int, int] = (0, 0)  # (k accepted drafts, tokens emitted)
    selected: dict = field(default_factory=dict)


Job = Generator[Request, Any, Any]


class Slot:
    """One row of the batch: its RowEngine (on its row of the batch's cache, its reads counted in its ledger), its job
    and generation in progress, and its share of the batch's work for the current job."""

    def __init__(self, index: int, engine: RowEngine):
        self.index, self.engine = index, engine
        self.began_in = index
        self.ledger = engine.ledger
        self.job: Job | None = None
        self.run: Decoding | None = None
        self.round: RowRound | None = None
        self.start_s = 0.0  # when its job began, seconds after the batch's run began
        self.loaded_layers = 0.0  # its share of the batch's loads (½ a sublayer ÷ the rows running it)
        self.idle_layers = 0.0  # sublayers computed for it for nothing (idle in a step, masked), ½ each
        self.head_passes = 0.0  # its share of the batch's head passes
        self.rounds = 0.0  # its share of the batch's rounds (each ÷ the rows in it; a prefill, its own, whole)
        self._reads_before = 0.0  # its ledger's share when its job began

    @property
    def slot(self) -> int:
        """The slot its job began in (its method copy's: runner.decode_all); it may end in a lower one, moved down once
        no job is left to start (Batch._compact)."""
        return self.began_in

    def tally(self) -> tuple[float, float]:
        """Its job's shares of the batch's host reads and rounds (they sum over the rows to the batch's)."""
        return self.ledger.share - self._reads_before, self.rounds

    @property
    def method(self):
        return self.run.method


class BatchWork:
    """The steps, head passes and loads of a Batch (its slots, cache, layer path and stack are the Batch's)."""

    @staticmethod
    def passing(h: torch.Tensor, pos: int, start: int, end: int, skip: SkipSet | None = None,
                tree: TreeMask | None = None) -> Pass:
        return Pass(h, pos, start, end, skip, tree)

    def step(self, passes: dict[Slot, Pass], collect: str | None = None, tails: dict | None = None
             ) -> tuple[dict[Slot, torch.Tensor], dict[Slot, list[torch.Tensor]]]:
        """One batched step: each slot's pass through its layers; every other running row idles. → (each slot's
        output [1, T_r, D], each slot's states collected over its own layers: "layers" (each layer's output) or
        "sublayers" (each sublayer's), [1, T_r, D] each). tails: where the step to the last layer ran on graphs
        carrying the token's tail (a lone row's, or a batch's for every row), each slot's TokenTail goes in."""
        if len(passes) == 1 and self.path.lone_row_alone:
            return self._alone_step(*next(iter(passes.items())), collect, tails)
        if any(p.tree is not None for p in passes.values()):
            raise ValueError("a token tree's pass runs alone in its step")
        order = [s for s in self.slots[: self.running] if s in passes]  # the running rows, first (_compact)
        start, end = min(p.start for p in passes.values()), max(p.end for p in passes.values())
        done = self.path.rows(self.cache, start, end, [(s.index, passes[s]) for s in order], self.running,
                              self._held, collect, tails is not None)
        self._share(done)
        if tails is not None and done.tails:
            tails.update(zip(order, done.tails))
        for s in order:  # the layers whose attention ran hold its positions, as the loop's would
            p = passes[s]
            for i in range(p.start, p.end):
                if p.runs(i)[0]:
                    s.engine.cache.lengths[i] = p.pos + p.h.shape[1]
        return dict(zip(order, done.outputs)), dict(zip(order, done.states))

    def _alone_step(self, slot: Slot, p: Pass, collect: str | None, tails: dict | None = None):
        """A step of one row on the stack's own loop (or the graphs of one row): what it runs is its alone."""
        engine, states = slot.engine, [] if collect else None
        if p.skip is not None:
            out = engine.forward_skipping(p.h, p.pos, engine.cache, p.skip, collect=states)
        elif collect == "sublayers":
            out = engine.forward_skipping(p.h, p.pos, engine.cache, SkipSet(), collect=states)
        else:
            tail = [] if tails is not None else None
            out = engine.forward_layers(p.h, p.start, p.end, p.pos, engine.cache, collect=states, tree=p.tree,
                                        tail=tail)
            if tail:
                tails[slot] = tail[0]
        self._alone(slot, p.layers)
        return {slot: out}, {slot: states or []}

    def _share(self, done) -> None:
        """The loads of a step (layer_path.RowsStep): each sublayer computed ½ for the batch, shared by the rows that
        ran it; the other rows computed (static steps compute every running row; the graphs all B) count ½ each as idle
        work (an empty slot's in the batch's total)."""
        slots = {s.index: s for s in self.slots}
        for live, computed in zip(done.runs, done.ran):
            if not computed:
                continue
            self.loaded_layers += 0.5
            users = sum(live)
            for row, on in zip(done.rows, live):
                if on:
                    slots[row].loaded_layers += 0.5 / users
                elif done.idle_computed:
                    slots[row].idle_layers += 0.5
                    self.idle_layers += 0.5
        if self.stack.counter is not None:  # what really ran, for the tests' counter (the steps are not the loop)
            self.stack.counter.layers += sum(done.ran) / 2

    def _alone(self, slot: Slot, layers: float) -> None:
        """`layers` a row loaded on its own (its prefill, a step alone, a selection's or an optimiser's pass)."""
        self.loaded_layers += layers
        slot.loaded_layers += layers

    def _head_pass(self, slots: list[Slot]) -> None:
        self.head_passes += 1
        for slot in slots:
            slot.head_passes += 1 / len(slots)

    def head(self, slots: list[Slot], states: list[torch.Tensor], exits: list[int | None]) -> list[torch.Tensor]:
        """The draft head over several rows' newest states (each [1, 1, D], at its exit layer: its adapter where
        one is loaded; None: the own head) in one product → each row's logits [V]."""
        inputs = torch.cat([self.stack.exit_input(h, e) for h, e in zip(states, exits)], dim=1)  # [1, n, D]
        with products_for(self.stack, len(states)):
            logits = self.stack.head(inputs)[0]  # [n, V]
        self._head_pass(slots)
        return list(logits.unbind(0))
