"""The ways Graphs (engine/compiled.py) runs the static steps (engine/static_steps.py):

- CudaGraphRunner: on CUDA, captured as CUDA graphs (`torch.cuda.CUDAGraph`, one per (step, width, attended length),
  captured from the steps' kernels — inductor's fused ones, or the eager ones — before any timed decode) and
  replayed: one launch a step instead of ~20 a layer. The graphs read and write one static buffer per width (the
  rows' states and positions), so any sequence of steps composes without copies — the whole depth for Vanilla,
  layers 1..E then E+1..L for any E (DEL picks one every round), any skip set (SWIFT, CLaSp, KnapSpec drafts:
  sublayer steps) — and the cache they write is the one they were captured on (allocated at `prepare` for the run's
  longest prompt + max_new_tokens; the engine decodes in it), each graph attending over a view of its first slots
  (static_steps.attended: the smallest of 256, 512, … that holds every slot in use). A step that ends at the last
  layer carries the token's tail too (`TokenTail`: the final norm, the LM head, each row's argmax and top-2 logits
  into static buffers; a batch's for every row): a Vanilla token, a verification, one replay with nothing after it
  but the read;
- CompiledRunner: elsewhere compiled whole by torch.compile (`fullgraph=True`: a graph break is an error; inductor's
  C++ kernels on CPU), the layer's tensors passed as arguments so one graph serves every layer of a shape, and the
  attended length marked dynamic so one graph serves every length too;
- RecordedRunner: the CUDA-graph runner's bookkeeping on any device, each capture recorded as its body and run again
  on every replay (as a CUDA graph replays its kernels on the same buffers), a conditional node's flag tested by the
  host: how the tests and `bench graph-reads` check on a CPU what CUDA graphs would run and read.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from del_bench.engine.static_steps import CACHE_QUANTUM, StepRows, adopt, live_sublayers, memo, padded, row_positions
from del_bench.models.kv_cache import KVCache
from del_bench.models.layer_stack import verifier_logits
from del_bench.models.products import products_for
from del_bench.transfer import upload

__all__ = ["CACHE_QUANTUM", "CompiledRunner", "CudaGraphRunner", "RecordedRunner", "Step", "TokenTail",
           "collects_in_graph", "with_tail"]

# a step: ("layers", start, end) — whole layers [start, end) — or ("attn", i) / ("mlp", i) — one sublayer; a batch's:
# ("rows", start, end); ("layers", start, L, "tail"): layers [start, L) and then the token's tail (TokenTail)
Step = tuple
TAIL = "tail"


def with_tail(step: Step) -> Step:
    """The step with the token's tail after it (a step ending at the last layer)."""
    return step if step[-1] == TAIL else (*step, TAIL)


@dataclass
class TokenTail:
    """What the tail of a step ending at the last layer leaves for acceptance, its T real rows (views of the width's
    static buffers, valid until that width's next replay: the round's acceptance reads them first): the final
    norm's states, the verifier's logits, each row's greedy token and top-2 logits — the ops the engine ran after the
    step (EarlyExit.verify, Batch._accept, acceptance.read_values), the same kernels, captured."""

    normed: torch.Tensor  # [1, T, D]
    logits: torch.Tensor  # [T, V]
    targets: torch.Tensor  # [T] long
    top2: torch.Tensor  # [T, 2] the two largest logits (the near-tie gap, half precision)

    def row(self, r: int, T: int) -> "TokenTail":
        """Row r's first T positions of a tail of all B rows ([B, width, …] buffers)."""
        return TokenTail(self.normed[r : r + 1, :T], self.logits[r, :T], self.targets[r, :T].clone(),
                         self.top2[r, :T])


def collects_in_graph(step: Step, collect: list | None) -> bool:
    """Whether a step keeps its layers' states itself: a chain of several whole layers asked for them (DEL's passes)
    writes every layer's output into a static buffer inside its one graph. A single layer or sublayer step's output
    is the state the caller keeps."""
    return collect is not None and step[0] == "layers" and step[2] - step[1] > 1


def attended_views(cache: KVCache, layers, length: int, dynamic: bool) -> tuple[list, list]:
    """Each layer's keys and values [B, KV, length, hd]: views of the cache's first `length` slots (dynamic: their
    length marked dynamic, so one compiled graph serves every attended length)."""
    ks, vs = [cache.k[i][:, :, :length] for i in layers], [cache.v[i][:, :, :length] for i in layers]
    if dynamic:
        for t in (*ks, *vs):
            torch._dynamo.mark_dynamic(t, 2)
    return ks, vs


class CompiledRunner:
    """Graphs by torch.compile(fullgraph=True), run as they are (no capture): the layer's tensors (a Layer) and its
    cache are arguments, so one graph serves every layer of a shape (dynamo guards on shapes, not on which
    tensors), and every attended length (marked dynamic)."""

    static_lengths = False  # one graph for every attended length
    chains = False  # no draft chains (engine/draft_chain.py): nothing to branch on without a capture
    tails = False  # the token's tail runs after the step, as on the stack's loop (its bits: a compiled head's differ)

    def __init__(self, graphs):
        self.graphs = graphs
        self.made: set[tuple] = set()  # (step, width, collects, None) keys run at least once
        self.cache = None
        self._adopted: weakref.WeakSet = weakref.WeakSet()  # caches whose slots were zeroed
        self._rope = None

    def cache_of(self, cache_len: int) -> KVCache:
        cache = self.graphs.stack.new_cache(cache_len, batch=self.graphs.batch)
        if self.graphs.batch > 1:  # a batch's: every slot its mask covers finite (adopt)
            adopt(cache)
            self.cache = cache
        return cache

    def takes(self, cache: KVCache) -> bool:
        return True

    def clear(self, cache: KVCache) -> None:
        pass

    def _tables(self) -> None:
        tables = self.graphs.stack.rope_tables()
        if tables[0] is not self._rope:  # a longer table (new_cache): its length dynamic too
            self._rope = tables[0]
            for table in tables:
                torch._dynamo.mark_dynamic(table, table.dim() - 2)

    def run_rows(self, step: Step, h, rows: StepRows, width: int, length: int, cache: KVCache, collects: bool):
        stack, fns = self.graphs.stack, self.graphs.functions
        B, T, _ = h.shape
        _, start, end = step
        self._tables()
        first, count, lo, hi = upload(rows.values(), h.device).view(4, B)  # one upload: 4B ints
        at = row_positions(first, count, width, length - 1)  # [B, width]
        live = live_sublayers(lo, hi, None if rows.skips is None else rows.skips.keep, start, end)  # [2n, B]
        layers = range(start, end)
        ks, vs = attended_views(cache, layers, length, dynamic=True)
        states: list | None = [] if collects else None
        out = fns.rows([stack.layers[i] for i in layers], padded(h, width), at, live, ks, vs, states)
        self.made.add((step, width, collects, None))
        return out[:, :T], [state[:, :T] for state in states or []]

    def run(self, plan, h, pos: int, width: int, length: int, cache: KVCache, collect) -> torch.Tensor:
        stack, fns = self.graphs.stack, self.graphs.functions
        if cache not in self._adopted:
            adopt(cache)
            self._adopted.add(cache)
        self._tables()
        T = h.shape[1]
        positions = torch.arange(pos, pos + width, device=h.device)[None]  # [1, width]
        x = padded(h, width)
        for step in plan:
            kind, first = step[0], step[1]
            if kind == "layers":
                layers = range(first, step[2])
                states = [] if collect is not None else None
                ks, vs = attended_views(cache, layers, length, dynamic=True)
                x = fns.chain([stack.layers[i] for i in layers], x, positions, ks, vs, states)
                if states is not None:
                    collect.extend(state[:, :T] for state in states)
            else:
                w = stack.layers[first]
                if kind == "attn":
                    (k,), (v,) = attended_views(cache, [first], length, dynamic=True)
                    x = fns.attention(w, x, positions, k, v)
                else:
                    x = fns.mlp(w, x)
                if collect is not None:
                    collect.append(x[:, :T])
            self.made.add((step, width, collects_in_graph(step, collect), None))
        return x[:, :T]


class CudaGraphRunner:
    """Graphs captured with torch.cuda.CUDAGraph from the steps' kernels (inductor's where the functions are compiled,
    else the eager ones), one per (step, width, attended length). Each graph of a width reads and writes that width's
    static buffers in place — the rows' states [B, width, D] and positions [B, width] (B = 1, or a batch's:
    Graphs.batch; a batch's graphs read instead each row's first position, count and layers [4, B] and the round's
    skip sets [B, 2L], and make the positions and each sublayer's rows from them), and for a chain that keeps its
    states, every layer's output [n, B, width, D] — and one cache, so any sequence of steps replays with one copy in
    and one copy out."""

    static_lengths = True  # a graph per attended length: each reads its own view of the captured cache
    chains = True  # draft chains (engine/draft_chain.py), their candidates' work in conditional nodes
    tails = True  # steps ending at the last layer carry the token's tail (TokenTail; a skipping shape's do not)

    def __init__(self, graphs):
        self.graphs = graphs
        self.made: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.cache: KVCache | None = None
        self.pool = None
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.states: dict[int, torch.Tensor] = {}  # width → [L, B, width, D]: a collecting chain's layers' outputs
        self.row_values: torch.Tensor | None = None  # a batch's [4, B]: first, count, lo, hi (StepRows)
        self.keep: torch.Tensor | None = None  # a batch's [B, 2L] bool: the sublayers each row's skip set keeps
        self._keep_from = None  # the RowSkips (or None: every sublayer) keep holds now
        self.tail_buffers: dict[int, TokenTail] = {}  # width → the tail's outputs, all `width` rows

    def cache_of(self, cache_len: int) -> KVCache:
        """The cache every graph is captured on (its addresses are baked into the graphs): one per stack and length,
        shared by the stack's Graphs (they never run at once; each prompt's prefill rewrites what it reads)."""
        if self.cache is None:
            length = -(-cache_len // CACHE_QUANTUM) * CACHE_QUANTUM
            stack, B = self.graphs.stack, self.graphs.batch
            caches = memo(stack).setdefault("captured_caches", {})
            if (length, B) not in caches:
                caches[length, B] = stack.new_cache(length, batch=B)
                adopt(caches[length, B])
            self.cache = caches[length, B]
            self._tables = stack.rope_tables()  # a longer table later must not free the one the graphs read
        return self.cache

    def takes(self, cache: KVCache) -> bool:
        if cache is self.cache:
            return True
        self.graphs.decline("a cache other than the one the graphs were captured on")
        return False

    def clear(self, cache: KVCache) -> None:
        """Zero the slots capture wrote (finite garbage, but never-written slots must hold no NaN: adopt)."""
        for k, v in zip(cache.k, cache.v):
            k.zero_()
            v.zero_()

    def _buffers(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This width's rows' states [B, width, D] and positions [B, width] (B: 1, or a batch's: Graphs.batch)."""
        if width not in self.buffers:
            stack, B = self.graphs.stack, self.graphs.batch
            device = stack.layers[0].device
            D = stack.embed_weight.shape[1]
            self.buffers[width] = (torch.zeros(B, width, D, dtype=stack.dtype, device=device),
                                   torch.zeros(B, width, dtype=torch.long, device=device))
        return self.buffers[width]

    def _row_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's [4, B] long (each row's first position, count, lo, hi) and [B, 2L] bool (its skip set's kept
        sublayers): every width's graphs read them; a step uploads the first, a skipping round the second."""
        if self.row_values is None:
            stack, B = self.graphs.stack, self.graphs.batch
            device = stack.layers[0].device
            self.row_values = torch.zeros(4, B, dtype=torch.long, device=device)
            self.keep = torch.ones(B, 2 * stack.num_layers, dtype=torch.bool, device=device)
        return self.row_values, self.keep

    def _states(self, width: int) -> torch.Tensor:
        if width not in self.states:
            state = self._buffers(width)[0]
            self.states[width] = state.new_zeros(self.graphs.stack.num_layers, *state.shape)
        return self.states[width]

    def _graph(self, step: Step, width: int, collects: bool, length: int) -> torch.cuda.CUDAGraph:
        key = (step, width, collects, length)
        if key not in self.made:
            self.made[key] = self._capture(self._body(step, width, collects, length), width)
        return self.made[key]

    def _body(self, step: Step, width: int, collects: bool, length: int) -> Callable[[], None]:
        """The step on this width's buffers over the cache's first `length` slots, its result written back into the
        state buffer (and a collecting chain's every layer's output into the states buffer: one stack kernel inside
        the graph)."""
        stack, fns, cache = self.graphs.stack, self.graphs.functions, self.cache
        kind, first = step[0], step[1]
        if step[-1] == TAIL:
            layers, tail = self._body(step[:-1], width, collects, length), self._tail_body(width)

            def layers_then_tail():
                layers()
                tail()
            return layers_then_tail
        if kind == "rows":
            return self._rows_body(step, width, collects, length)
        h, positions = self._buffers(width)
        if kind == "layers":
            layers = range(first, step[2])
            ws = [stack.layers[i] for i in layers]
            ks, vs = attended_views(cache, layers, length, dynamic=False)
            if not collects:
                return lambda: h.copy_(fns.chain(ws, h, positions, ks, vs))
            kept = self._states(width)[: len(layers)]

            def chain_keeping_states():
                states: list[torch.Tensor] = []
                h.copy_(fns.chain(ws, h, positions, ks, vs, states))
                torch.stack(states, out=kept)
            return chain_keeping_states
        w = stack.layers[first]
        if kind == "attn":
            (k,), (v,) = attended_views(cache, [first], length, dynamic=False)
            return lambda: h.copy_(fns.attention(w, h, positions, k, v))
        return lambda: h.copy_(fns.mlp(w, h))

    def _tail(self, width: int) -> TokenTail:
        """This width's tail buffers, every row's: [B, width, …] (B: 1, or a batch's)."""
        if width not in self.tail_buffers:
            state = self._buffers(width)[0]  # [B, width, D]
            B, V = state.shape[0], self.graphs.stack.head_weight.shape[0]
            self.tail_buffers[width] = TokenTail(torch.zeros_like(state), state.new_zeros(B, width, V),
                                                 torch.zeros(B, width, dtype=torch.long, device=state.device),
                                                 state.new_zeros(B, width, 2))
        return self.tail_buffers[width]

    def _tail_body(self, width: int) -> Callable[[], None]:
        """The token's tail on this width's state buffer, every row's: the final norm, the LM head as acceptance runs
        it (layer_stack.verifier_logits, the rows of the batch as one), each row's argmax and top-2 logits."""
        stack, h, out = self.graphs.stack, self._buffers(width)[0], self._tail(width)
        B, D = h.shape[0], h.shape[2]

        def tail():
            normed = stack.norm(h)  # [B, width, D]
            with products_for(stack, B * width):  # counted where acceptance takes them
                logits = verifier_logits(stack, normed.view(1, B * width, D), counted=False)  # [B·width, V]
            out.normed.copy_(normed)
            out.logits.copy_(logits.view(B, width, -1))
            out.targets.copy_(out.logits.argmax(-1))
            out.top2.copy_(out.logits.topk(2, dim=-1).values)
        return tail

    def tail_of(self, width: int) -> TokenTail:
        """The last replayed tail of this width, every row's (TokenTail.row: one row's)."""
        return self._tail(width)

    def _rows_body(self, step: Step, width: int, collects: bool, length: int) -> Callable[[], None]:
        """A batch's chain on this width's row buffers: the positions and which rows run each sublayer made from the
        row buffers the step uploaded into, its result written back into the state buffer, a collecting chain's
        every layer's output into the states buffer."""
        stack, fns, cache = self.graphs.stack, self.graphs.functions, self.cache
        h = self._buffers(width)[0]
        values, keep = self._row_buffers()
        _, start, end = step
        layers = range(start, end)
        ws = [stack.layers[i] for i in layers]
        ks, vs = attended_views(cache, layers, length, dynamic=False)
        kept = self._states(width)[: len(layers)] if collects else None

        def chain():
            first, count, lo, hi = values
            at = row_positions(first, count, width, length - 1)  # [B, width]
            live = live_sublayers(lo, hi, keep, start, end)  # [2n, B]
            states: list[torch.Tensor] | None = [] if collects else None
            h.copy_(fns.rows(ws, h, at, live, ks, vs, states))
            if collects:
                torch.stack(states, out=kept)
        return chain

    def run_rows(self, step: Step, h, rows: StepRows, width: int, length: int, cache: KVCache, collects: bool):
        B, T, _ = h.shape
        state = self._buffers(width)[0]
        values, keep = self._row_buffers()
        start, end = step[1], step[2]
        state[:, :T].copy_(h)  # columns T.. keep the last step's (finite) states: padding, never read by a real row
        values.copy_(upload(rows.values(), h.device).view(4, B))
        if rows.skips is not self._keep_from:  # a skipping round's skip sets, or every sublayer: once a change
            if rows.skips is None:
                keep.fill_(True)
            else:
                keep.copy_(rows.skips.keep)
            self._keep_from = rows.skips
        self._graph(step, width, collects, length).replay()
        states = self._states(width)[: end - start, :, :T].clone().unbind(0) if collects else []
        return state[:, :T].clone(), list(states)

    def draft_chain(self, chain, exit_layer: int, length: int) -> torch.cuda.CUDAGraph:
        """The draft chain from exit_layer over the cache's first `length` slots (DraftChain.body), captured once: a
        round's whole draft in one replay."""
        key = (chain.key(exit_layer), 1, chain.collects, length)
        if key not in self.made:
            chain.prime()
            self.made[key] = self._capture(chain.body(self.when, exit_layer, length), 1)
        return self.made[key]

    @staticmethod
    def when(flag: torch.Tensor, body: Callable[[], None]) -> None:
        """body under the device's flag (a bool []): inside a capture, a CUDA graph conditional node (CUDA ≥ 12.4:
        on replay the device runs it iff the flag holds then, no host read); outside one (the warm-up), the host
        tests the flag."""
        if torch.cuda.is_current_stream_capturing():
            graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
            graph.begin_capture_to_if_node(flag)
            try:
                body()
            finally:
                graph.end_capture_to_conditional_node()
        elif bool(flag):
            body()

    def _capture(self, body: Callable[[], None], width: int) -> torch.cuda.CUDAGraph:
        """Warm the body up on a side stream (cuBLAS workspaces, lazily loaded kernels, a compiled body's first
        call), then capture it into a graph sharing one memory pool with the others (they never run concurrently)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body()
        return graph

    def run(self, plan, h, pos: int, width: int, length: int, cache: KVCache, collect) -> torch.Tensor:
        T = h.shape[1]
        state, positions = self._buffers(width)
        state[:, :T].copy_(h)  # rows T.. keep the last step's (finite) states: padding, never read by a real row
        torch.arange(pos, pos + width, out=positions[0])  # B = 1: one launch, no copy
        for step in plan:
            collects = collects_in_graph(step, collect)
            self._graph(step, width, collects, length).replay()
            if collects:  # one copy of every layer's state (the buffers are the next replay's)
                collect.extend(self._states(width)[: step[2] - step[1], :, :T].clone().unbind(0))
            elif collect is not None:
                collect.append(state[:, :T].clone())  # the buffer is the next step's input
        return state[:, :T].clone()


class RecordedRunner(CudaGraphRunner):
    """CudaGraphRunner with each capture replaced by a recording: the body runs once where CUDA would warm it up and
    capture it, then again on every replay, on the same static buffers and cache; a draft chain's conditional node
    is the host's test of its flag (on a CPU, host memory: nothing waits). Decodes as the CUDA graphs would — the same
    steps, buffers, composition and host reads — on any device, eagerly (no speed claimed)."""

    replays = 0  # recordings replayed, all instances together
    replaying = False  # a recording is running now (its ops are the graph's kernels, not the host's launches)

    def _capture(self, body: Callable[[], None], width: int):
        body()  # capture's warm-up writes, as on CUDA
        return _Recording(body)

    @staticmethod
    def when(flag: torch.Tensor, body: Callable[[], None]) -> None:
        if bool(flag):
            body()


class _Recording:
    def __init__(self, body: Callable[[], None]):
        self.body = body

    def replay(self) -> None:
        RecordedRunner.replaying = True
        try:
            self.body()
        finally:
            RecordedRunner.replaying = False
        RecordedRunner.replays += 1
