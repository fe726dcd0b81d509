"""The layer path: how a session's passes through the decoder layers run — the one object the batch that decodes
(engine/batch.py) calls for every pass, chosen once when the session is built (engine/path_choice.py decides; no other
module does).

The paths, and who takes which call:
- the stack's own loop (models/fused.py's C++ loop where it builds and matches the eager loop bit for bit, else the
  eager Python loop): a lone row's pass — a prefill, a batch of one, a row alone in a step — runs here;
- the static steps run eagerly (engine/static_steps.RowSteps): several rows in one step, each at its own positions
  and running its own sublayers, the rest masked;
- graphs (engine/compiled.py): on CUDA the steps captured as CUDA graphs of inductor's fused kernels or of the eager
  ones, per (rows, width bucket); elsewhere the steps compiled by torch.compile. A call the graphs cannot take (a
  token tree, a width beyond the buckets) runs on the loop above, counted as declined.
Records name the path (`name`: `fused`, `eager`, `fused+fused_graphs`, …) and the setup line says how it was chosen
(`info`: the settings, the graphs made, every fallback)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from del_bench.engine.static_steps import RowSkips, RowSteps, StepRows, padded
from del_bench.methods.base import SkipSet
from del_bench.models.kv_cache import KVCache, TreeMask
from del_bench.models.layer_stack import LayerStack


class LayerPath:
    """The passes of one session on one stack: `one` and `skipping` for a lone row (on the graphs where they take it,
    else the stack's loop), `rows` for several rows at once (RowSteps: eagerly, or on a batch's graphs)."""

    def __init__(self, stack: LayerStack, graphs=None, info: dict | None = None):
        """graphs: engine/compiled.Graphs made and checked by path_choice.choose (None: none); info: what the setup line
        records of the choice."""
        self.stack, self.graphs = stack, graphs
        self.info = info if info is not None else {"compiled": False}
        self._row_steps: RowSteps | None = None
        self._skips: tuple | None = None  # the last skip sets on the device: (the sets, RowSkips)

    @property
    def name(self) -> str:
        """What records call it (SampleRecord.layer_path): the stack's loop, and the graphs' kind where they run."""
        return self.stack.layer_path + (f"+{self.graphs.path}" if self.graphs is not None else "")

    @property
    def rows_on_graphs(self) -> bool:
        """Several rows' steps run on graphs made for a batch (compiled.Graphs(batch=B > 1)): a lone row too."""
        return self.graphs is not None and self.graphs.batch > 1

    def cache(self, rows: int, length: int, floor: int = 0, current: KVCache | None = None) -> KVCache:
        """A cache of `rows` rows and at least `length` slots to decode in: the one the graphs were captured on where
        they write a fixed one and it is long enough (a batch's graphs are made again on a longer one where a request
        outgrows it: compiled.Graphs.grow, logged and listed in its `regrown`); else `current` where it is long enough
        and not the captured one; else a new one of max(length, floor) slots, every slot zeroed (a masked key gets
        weight 0, but 0 · NaN is NaN: torch.empty's garbage must never sit under a batched step's mask)."""
        if self.rows_on_graphs:
            captured = self.graphs.cache
            return captured if captured.max_len >= length else self.graphs.grow(length - 1)
        captured = self.graphs.cache_for(length) if self.graphs is not None else None
        if captured is not None and captured.k[0].shape[0] == rows:
            return captured
        if current is not None and current.max_len >= length and (self.graphs is None or current is not
                                                                     self.graphs.cache):
            return current
        cache = self.stack.new_cache(max(length, floor), batch=rows)
        for k, v in zip(cache.k, cache.v):
            k.zero_()
            v.zero_()
        return cache

    # ---- a lone row ------------------------------------------------------------------------------------------
    def one(self, h: torch.Tensor, start: int, end: int, pos: int, cache: KVCache, collect: list | None = None,
            tree: TreeMask | None = None, keep: int | None = None, tail: list | None = None) -> torch.Tensor:
        """Layers [start, end) on one row's h [1, T, D] (LayerStack.forward_layers' arguments and result): on the
        graphs where they take the call (a chain at a width they were made for; no tree, no trimmed collection),
        else the stack's loop. tail: where the graphs' step carried the token's tail, its TokenTail is appended
        (graph_runners; the stack's loop leaves the head to the caller)."""
        trimmed = collect is not None and keep is not None and keep < h.shape[1]
        if self.graphs is not None and self.graphs.batch == 1 and tree is None and not trimmed:
            out = self.graphs.forward_layers(h, start, end, pos, cache, collect, tail)
            if out is not None:
                return out
        return self.stack.forward_layers(h, start, end, pos, cache, collect, tree, keep)

    def skipping(self, h: torch.Tensor, pos: int, cache: KVCache, skip: SkipSet, write: bool = True,
                 collect: list | None = None) -> torch.Tensor:
        """Every layer on one row's h with skip's sublayers skipped (LayerStack.forward_skipping's arguments and
        result): on the graphs' sublayer steps where they take a drafting pass, else the stack's loop."""
        attn, mlp = frozenset(skip.attn), frozenset(skip.mlp)
        if self.graphs is not None and self.graphs.batch == 1 and write:
            out = self.graphs.forward_skipping(h, pos, cache, attn, mlp, collect)
            if out is not None:
                return out
        return self.stack.forward_skipping(h, pos, cache, attn, mlp, write, collect)

    # ---- several rows ----------------------------------------------------------------------------------------
    @property
    def lone_row_alone(self) -> bool:
        """A row alone in a step runs on the stack's own loop (or graphs of one row), not on graphs made for a batch."""
        return not self.rows_on_graphs

    def rows(self, cache: KVCache, start: int, end: int, passes: list, running: int, held: int,
             collect: str | None, tails: bool = False) -> RowsStep:
        """Several rows' passes (each (its row in the cache, a batch_work.Pass)) through layers [start, end) at once:
        on the fused loop only the passing rows, each only its own sublayers (LayerStack.forward_rows: a row that
        idles is not computed; per-sublayer states are not kept there), else as static steps over the first
        `running` rows (RowSteps, eagerly or on a batch's graphs: a row that idles is computed and dropped). held: the
        slots any row holds or writes (RowSteps' scratch slot lies beyond). tails: the caller takes each pass's token
        tail where a batch's graph ran it (RowsStep.tails)."""
        n = end - start
        if self.stack.fused is not None and not self.rows_on_graphs and collect != "sublayers":
            runs = [[p.runs(start + j)[kind] for _, p in passes] for j in range(n) for kind in (0, 1)]  # [2n][R]
            outs, states = self.stack.forward_rows([p.h for _, p in passes], [r for r, _ in passes],
                                                   [p.pos for _, p in passes], start, end, runs, cache,
                                                   collect == "layers")
            return RowsStep(outs, [self._own(p, start, s) for (_, p), s in zip(passes, states)],
                            [r for r, _ in passes], runs, [any(r) for r in runs], idle_computed=False)
        W = max(p.h.shape[1] for _, p in passes)
        by_row = dict(passes)
        some = passes[0][1].h
        h = torch.cat([padded(by_row[r].h, W) if r in by_row else some.new_zeros(1, W, some.shape[2])
                       for r in range(running)])  # [m, W, D]
        step = StepRows([by_row[r].pos if r in by_row else 0 for r in range(running)],
                        [by_row[r].h.shape[1] if r in by_row else 0 for r in range(running)],
                        [by_row[r].start if r in by_row else 0 for r in range(running)],
                        [by_row[r].end if r in by_row else 0 for r in range(running)],
                        held=held, skips=self._row_skips(cache, by_row, running))
        steps = self._row_steps
        if steps is None or steps.cache is not cache or steps.graphs is not self.graphs:
            steps = self._row_steps = RowSteps(self.stack, cache, self.graphs if self.rows_on_graphs else None)
        tail: list | None = [] if tails else None
        out, states, ran, computed = steps.run(start, end, h, step, collect, tail)
        per = 2 if collect == "sublayers" else 1
        outs, kept = [], []
        for r, p in passes:
            T = p.h.shape[1]
            outs.append(out[r : r + 1, :T])
            own = states[per * (p.start - start) : per * (p.end - start)]  # its own layers' states
            kept.append([state[r : r + 1, :T] for state in own])
        runs = [[by_row[r].runs(start + j)[kind] if r in by_row else False for r in range(computed)]
                for j in range(n) for kind in (0, 1)]  # [2n][computed rows]
        done = RowsStep(outs, kept, list(range(computed)), runs, ran)
        if tail:  # every row's tail: each pass's own rows
            done.tails = [tail[0].row(r, p.h.shape[1]) for r, p in passes]
        return done

    def _row_skips(self, cache: KVCache, by_row: dict, running: int) -> RowSkips | None:
        """The rows' skip sets on the device (RowSkips), uploaded again only where a passing row's set differs from
        the one there (a row's set holds for its round; an idling row's does not matter): once a round at most."""
        if not any(p.skip is not None for p in by_row.values()):
            return None
        rows = cache.k[0].shape[0]
        sets = list(self._skips[0]) if self._skips is not None else [(frozenset(), frozenset())] * rows
        for r, p in by_row.items():
            sets[r] = (frozenset(p.skip.attn), frozenset(p.skip.mlp)) if p.skip else (frozenset(), frozenset())
        if self._skips is None or self._skips[0] != sets:
            self._skips = (sets, RowSkips.of(sets, rows, self.stack.num_layers, self.stack.layers[0].device))
        return self._skips[1]

    @staticmethod
    def _own(p, start: int, states: list) -> list:
        """A pass's states kept over its own layers only (a step's states span the union of its passes')."""
        return states[p.start - start : p.end - start]


@dataclass
class RowsStep:
    """What a step of several rows did: each pass's output and states (in the passes' order), and for the accounting
    the rows in the step, which of them ran each sublayer ([2n][len(rows)]), which sublayers were computed, and
    whether a row idling in a computed sublayer was computed too (static steps: computed and dropped)."""

    outputs: list[torch.Tensor]
    states: list[list[torch.Tensor]]
    rows: list[int]
    runs: list[list[bool]]
    ran: list[bool]
    idle_computed: bool = True
    tails: list | None = None  # each pass's TokenTail, where a batch's graph ran the head (graph_runners)
