"""The thread scheduler: batched decoding (`batch_size` = B > 1) for the methods lockstep (engine/lockstep.py, the
tensor path every other method takes) does not serve — AdaDecode, SWIFT's token tree, DEL's look-ahead stop reads, a
model over several devices (lockstep.serves says why) — B prompts decoded together, each by the unchanged Engine,
lossless per row.

Every row (a slot) runs `Engine.generate` — its rounds, methods, sampling, accounting, shadow scoring, all as at
B = 1 — in a Python thread of its own, on a `RowStack`: the LayerStack as that row sees it. A RowStack hands every
call to the real stack except the weight-bound ones — a pass through layers (forward_layers, forward_skipping), the
LM head (head, logits, exit_logits) and DEL's shadow scoring (shadow_tokens) — which it posts to the `Batch` and
waits for. The Batch runs them for all rows at once (ragged_rows.attention_rows, mlp_rows, head_rows: the products
over every row's positions concatenated, RoPE, the cache write and the attention per row), so a layer's weights are
read once for every row that runs it, whatever each row's width, positions, exit layer, skip set or token tree.

Threads take turns, never run together: the Batch resumes each runnable row in slot order and waits until it has
posted a call or finished, then runs one step. So nothing is shared concurrently (the stack's memos, its work counter,
the method copies), and what runs when is fixed by the rows' own computations: outputs and records never depend on
thread timing (a test decodes the same batch twice and compares every record).

A step serves the pending calls at the lowest point of the model, all together: a pass's point is its next layer, a
head or shadow call's is after the last layer (the head, then shadow scoring). A pass advances one layer a step (its
attention sublayer for the rows that run it, then its MLP for those that do), so rows whose passes overlap share each
layer they have in common — DEL's rows at different exit layers, SWIFT's or CLaSp's at different skip sets, a
drafting row beside a verifying one — and a row below the others runs alone until it reaches them. A row alone at
the bottom with no other pass ahead of it before its end runs its whole pass through the stack's own loop (fused where
it is built). Every call is served within one sweep up the model: a row's calls rise through the layers between two
head calls, and the head waits only for passes below it.

Accounting beside the rows' own: each step that runs a sublayer loads it once (½ layer) for all its rows, each head
step is one head pass; a row's share of the batch's loads (a step's load ÷ the rows in it) is kept per job
(`Row.loaded_layers`, `Row.head_passes`), so the batch's loads are the sum of its rows' shares.

Each row keeps its own RNG stream (its generate's seed), its own Engine (its pending token, shadow scorer, host-read
count: del_bench/transfer.py counts per thread) and decodes in its own view of one shared KV cache
[B, KV, max_len, hd] (KVCache.row), which grows for a longer prompt (views re-pointed, contents kept). B = 1 never
comes here: the runner decodes one prompt at a time without threads, exactly as before. Jobs are the same
generators of requests as lockstep's: each row's thread runs its job, decoding each request with its Engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from del_bench.engine.decode import Engine, Request, served
from del_bench.engine.sampling import Sampling
from del_bench.models.kv_cache import KVCache, TreeMask
from del_bench.models.layer_stack import LayerStack
from del_bench.models.ragged_rows import RaggedRow, attention_rows, head_rows, mlp_rows

HEAD_RANK = {"head": 1, "shadow": 2}  # after the last layer: the head, then shadow scoring


class _Aborted(Exception):
    """Raised in a row's thread to unwind it when the batch stops on an error elsewhere."""


@dataclass(eq=False)
class _Pass:
    """One row's pass through layers [layer, end) in flight: its state (row.h) after the layers run so far."""

    slot: int
    row: RaggedRow
    layer: int  # the next layer to run
    end: int
    skip_attn: frozenset[int] = frozenset()
    skip_mlp: frozenset[int] = frozenset()
    collect: list | None = None  # each layer's output (forward_layers) or each sublayer's (per_sublayer)
    per_sublayer: bool = False  # forward_skipping: the state after every sublayer slot, skipped or not
    keep: int | None = None  # forward_layers' keep: collect only the last `keep` positions, copied
    tree: TreeMask | None = None

    @property
    def trim(self) -> bool:
        return self.collect is not None and self.keep is not None and self.keep < self.row.h.shape[1]

    def skip_idle_layers(self) -> None:
        """Advance past layers whose two sublayers this pass skips (nothing to run, only states to collect)."""
        while self.layer < self.end and self.layer in self.skip_attn and self.layer in self.skip_mlp:
            if self.collect is not None:
                self.collect += [self.row.h, self.row.h]
            self.layer += 1

    @property
    def done(self) -> bool:
        return self.layer >= self.end


@dataclass(eq=False)
class _Call:
    """A row's call waiting for the batch: kind "layers" (a _Pass), "head" (normed states [1, T, D]) or "shadow"."""

    row: Row
    kind: str
    payload: Any
    key: tuple = ()  # calls of one kind run together only with an equal key (shadow scoring's settings)
    result: Any = None
    served: bool = False


class Row:
    """One slot of the batch: its Engine (on its RowStack, in its cache view) and, for its current job, when the job
    began (seconds after the batch began) and its share of the batch's loads."""

    def __init__(self, slot: int, engine: Engine):
        self.slot, self.engine = slot, engine
        self.start_s = 0.0
        self.loaded_layers = 0.0  # Σ over the batch's sublayer steps it took part in: ½ ÷ the rows in the step
        self.head_passes = 0.0  # Σ over the head steps it took part in: 1 ÷ the rows in the step
        self.call: _Call | None = None
        self.turn = threading.Semaphore(0)
        self.finished = False

    def begin(self, now_s: float) -> None:
        self.start_s, self.loaded_layers, self.head_passes = now_s, 0.0, 0.0

    @staticmethod
    def tally(rounds: list[dict]) -> tuple[float, float]:
        """Its job's host reads and rounds (a row of this scheduler reads alone: its rounds' own)."""
        return sum(r["host_syncs"] for r in rounds), len(rounds)

    def generate(self, prompt_ids: list[int], method, max_new_tokens: int, seed: int) -> Request:
        """What a job yields to have its row decode a prompt (it is sent the Generation back)."""
        return Request(prompt_ids, method, max_new_tokens, seed)


class RowStack:
    """The LayerStack as one row of a batch sees it: the real stack's attributes and methods, except the weight-bound
    calls, which the Batch runs for every row at once (module docstring). No graph-captured steps (B = 1 only)."""

    compiled = None

    def __init__(self, batch: Batch, slot: int):
        self._batch, self._slot = batch, slot
        self._stack = batch.stack

    def __getattr__(self, name: str):
        return getattr(self._stack, name)

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """The row's view of the shared cache, grown to max_len where it is shorter: one row (a row holds no batch)."""
        if batch != 1:
            raise ValueError(f"a batched row's cache is its one row of the batch's cache, not {batch} rows")
        return self._batch.grow(max_len)[self._slot]

    def forward_layers(self, h: torch.Tensor, start: int, end: int, pos: int, cache: KVCache,
                       collect: list | None = None, tree: TreeMask | None = None,
                       keep: int | None = None) -> torch.Tensor:
        if start >= end:
            return h
        cos, sin, mask = self._stack.rope_and_mask(pos, h.shape[1], h.device, tree)
        return self._pass(_Pass(self._slot, RaggedRow(h, pos, cache, cos, sin, mask), start, end, collect=collect,
                                keep=keep, tree=tree))

    def forward_skipping(self, h: torch.Tensor, pos: int, cache: KVCache, skip_attn: frozenset[int],
                         skip_mlp: frozenset[int], write: bool = True, collect: list | None = None) -> torch.Tensor:
        cos, sin, mask = self._stack.rope_and_mask(pos, h.shape[1], h.device)
        return self._pass(_Pass(self._slot, RaggedRow(h, pos, cache, cos, sin, mask, write), 0,
                                self._stack.num_layers, frozenset(skip_attn), frozenset(skip_mlp), collect,
                                per_sublayer=True))

    def _pass(self, p: _Pass) -> torch.Tensor:
        p.skip_idle_layers()
        return p.row.h if p.done else self._batch.call(self._slot, "layers", p)

    def forward_branches(self, h: torch.Tensor, sublayers: range, pos: int, cache: KVCache,
                         tree: TreeMask) -> torch.Tensor:
        """A layer-skip selection's candidate passes (CLaSp, KnapSpec: every 64 rounds): run here, the row's own;
        their loads count whole in the batch's and the row's share."""
        self._batch.loaded_alone(self._slot, len(sublayers) / 2)
        return self._stack.forward_branches(h, sublayers, pos, cache, tree)

    def head(self, h_normed: torch.Tensor) -> torch.Tensor:
        return self._batch.call(self._slot, "head", h_normed)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self._stack.norm(h))

    def exit_logits(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        return self.head(self._stack.exit_input(h, layer))

    def shadow_tokens(self, states: torch.Tensor, targets: torch.Tensor | None = None, vocab: int | None = None,
                      chunk: int = 64, layers: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        key = (vocab, chunk, targets is None, layers is None)
        return self._batch.call(self._slot, "shadow", (states, targets, layers), key)


class Batch:
    """B slots over one LayerStack: `run` decodes jobs B at a time (continuous batching) and returns the batch's
    counts. Build once per run; each `run` starts the rows' threads and joins them."""

    def __init__(self, stack: LayerStack, size: int, sampling: Sampling, eos_ids: set[int], stop=None,
                 cache_len: int = 1024, shadow_with_acceptance: bool | None = None):
        self.stack, self.size = stack, size
        self.cache = stack.new_cache(cache_len, batch=size)  # [B, KV, max_len, hd] a layer
        self.views = [self.cache.row(r) for r in range(size)]
        self.rows = [Row(r, Engine(RowStack(self, r), sampling, eos_ids, stop, shadow_with_acceptance,
                                   cache=self.views[r])) for r in range(size)]
        self._back = threading.Semaphore(0)  # a row hands the turn back to the batch (its own `turn`: the batch to it)
        self._t0 = 0.0

    def grow(self, max_len: int) -> list[KVCache]:
        """The row views, over a shared cache at least max_len long: a longer one replaces it, every row's filled
        positions copied and its view re-pointed (a row holds its view, never the tensors across calls)."""
        if self.cache.max_len < max_len:
            bigger = self.stack.new_cache(max_len, batch=self.size)
            for old, new in zip(self.cache.k + self.cache.v, bigger.k + bigger.v):
                new[:, :, : self.cache.max_len] = old
            self.cache = bigger
            for r, view in enumerate(self.views):
                self.cache.row(r, view)
        return self.views

    def elapsed(self) -> float:
        """Seconds since the current run began (the device synchronised first)."""
        self.stack.synchronize()
        return time.perf_counter() - self._t0

    # ---- running jobs ------------------------------------------------------------------------------------------
    def run(self, jobs: Iterable, decode: Callable[[Row, Any], Any]) -> dict:
        """decode(row, job) — a job: a generator of Requests (engine/lockstep.py) — for every job, in the rows'
        threads, each request decoded by the row's Engine: a slot takes the next job as soon as its last one ends
        (continuous batching). Returns the batch's counts: wall_s (first job's start to the last one's end),
        loaded_layers (each sublayer step ½, whatever its rows), head_passes, steps."""
        self._jobs, self._decode = iter(jobs), decode
        self._error: BaseException | None = None
        self._aborting = False
        self.loaded_layers, self.head_passes, self.steps = 0.0, 0, 0
        self._back = threading.Semaphore(0)  # fresh each run: an aborted run may leave turns released
        for row in self.rows:
            row.call, row.finished, row.turn = None, False, threading.Semaphore(0)
        threads = [threading.Thread(target=self._row_main, args=(row,), name=f"batch-row-{row.slot}", daemon=True)
                   for row in self.rows]
        self._t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        try:
            with torch.inference_mode():  # thread-local, as the rows' generate is: the steps run in this thread
                runnable = list(self.rows)
                while True:
                    for row in runnable:
                        self._resume(row)
                    if self._error is not None:
                        raise self._error
                    pending = [row.call for row in self.rows if row.call is not None and not row.call.served]
                    if not pending:
                        break
                    runnable = self._step(pending)
                    self.steps += 1
        except BaseException:
            self._abort()
            raise
        finally:
            for thread in threads:
                thread.join()
        return {"wall_s": self.elapsed(), "loaded_layers": self.loaded_layers, "head_passes": self.head_passes,
                "steps": self.steps}

    def _row_main(self, row: Row) -> None:
        row.turn.acquire()
        try:
            while not self._aborting:
                job = next(self._jobs, None)
                if job is None:
                    break
                row.begin(time.perf_counter() - self._t0)
                served(self._decode(row, job), row.engine)
        except _Aborted:
            pass
        except BaseException as err:  # the batch raises it in the caller's thread
            if self._error is None:
                self._error = err
        finally:
            row.finished, row.call = True, None
            self._back.release()

    def _resume(self, row: Row) -> None:
        """Give row the turn until it posts its next call or finishes."""
        if row.finished:
            return
        row.turn.release()
        self._back.acquire()

    def _abort(self) -> None:
        """Unwind every row: each one waiting for its turn wakes and raises _Aborted (or, before its first job,
        ends); one still running raises at its next call. The threads are then joined."""
        self._aborting = True
        for row in self.rows:
            if not row.finished:
                row.turn.release()

    def call(self, slot: int, kind: str, payload, key: tuple = ()) -> Any:
        """From a row's thread: post the call, hand the turn back, and wait for the step that serves it."""
        row = self.rows[slot]
        if self._aborting:
            raise _Aborted()
        row.call = call = _Call(row, kind, payload, key)
        self._back.release()
        row.turn.acquire()
        row.call = None
        if self._aborting:
            raise _Aborted()
        return call.result

    # ---- one step ----------------------------------------------------------------------------------------------
    def _point(self, call: _Call) -> tuple:
        """Where in the model a call waits: a pass at its next layer, the head and shadow calls after the last."""
        if call.kind == "layers":
            return call.payload.layer, 0
        return self.stack.num_layers, HEAD_RANK[call.kind]

    def _step(self, pending: list[_Call]) -> list[Row]:
        """Serve the calls at the lowest point (pending is in slot order, and so is every group). → the rows whose
        call is served, in slot order."""
        first = min(pending, key=self._point)  # the first in slot order among the lowest
        group = [c for c in pending if self._point(c) == self._point(first) and c.key == first.key]
        if first.kind == "layers":
            ahead = [c.payload.layer for c in pending if c.kind == "layers" and c not in group]
            self._layer_step([c.payload for c in group], min(ahead, default=self.stack.num_layers))
            for c in group:
                c.served, c.result = c.payload.done, c.payload.row.h
        else:
            results = self._head_step(group) if first.kind == "head" else self._shadow_step(group)
            for c, result in zip(group, results):
                c.served, c.result = True, result
        return [c.row for c in group if c.served]

    def _layer_step(self, passes: list[_Pass], ahead: int) -> None:
        """Layer i (every pass is there) for each pass: its attention, then its MLP, each over the rows that run it.
        A lone forward_layers pass with nobody before `ahead` (the next pass's layer) runs up to there in one call."""
        st, i = self.stack, passes[0].layer
        p = passes[0]
        if len(passes) == 1 and not p.per_sublayer:
            end = min(p.end, ahead)
            p.row.h = st.forward_layers(p.row.h, i, end, p.row.pos, p.row.cache, collect=p.collect, tree=p.tree,
                                        keep=p.keep)
            self._share(passes, end - i)
            p.layer = end
            return
        attention = [p for p in passes if i not in p.skip_attn]
        if attention:
            attention_rows(st, i, [p.row for p in attention])
            self._share(attention, 0.5)
        for p in passes:
            if p.per_sublayer and p.collect is not None:
                p.collect.append(p.row.h)
        mlp = [p for p in passes if i not in p.skip_mlp]
        if mlp:
            mlp_rows(st, i, [p.row for p in mlp])
            self._share(mlp, 0.5)
        for p in passes:
            if p.collect is not None:  # as forward_layers / forward_skipping collect (a trimmed copy with keep)
                p.collect.append(p.row.h[:, -p.keep :].clone() if p.trim and not p.per_sublayer else p.row.h)
            p.layer += 1
            p.skip_idle_layers()

    def loaded_alone(self, slot: int, layers: float) -> None:
        """`layers` one row loaded outside any batched step (its turn: the Batch waits)."""
        self.loaded_layers += layers
        self.rows[slot].loaded_layers += layers

    def _share(self, passes: list[_Pass], layers: float) -> None:
        """`layers` loaded once for these passes' rows: the batch's count, each row's share."""
        self.loaded_layers += layers
        for p in passes:
            self.rows[p.slot].loaded_layers += layers / len(passes)

    def _head_step(self, group: list[_Call]) -> list[torch.Tensor]:
        self.head_passes += 1
        for c in group:
            c.row.head_passes += 1 / len(group)
        return head_rows(self.stack, [c.payload for c in group])

    def _shadow_step(self, group: list[_Call]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """DEL's shadow scoring of several rows' states in one call (their rows concatenated, then split)."""
        vocab, chunk, no_targets, no_layers = group[0].key
        states = [c.payload[0] for c in group]  # each [N_r, D]
        tokens, confidence = self.stack.shadow_tokens(
            torch.cat(states), None if no_targets else torch.cat([c.payload[1] for c in group]), vocab, chunk,
            None if no_layers else torch.cat([c.payload[2] for c in group]))
        sizes = [s.shape[0] for s in states]
        return list(zip(tokens.split(sizes), confidence.split(sizes)))
