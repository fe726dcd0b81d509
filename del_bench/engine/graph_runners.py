"""The two ways Graphs (engine/compiled.py) runs the static steps (engine/static_steps.py):

- CudaGraphRunner: on CUDA, captured as CUDA graphs (`torch.cuda.CUDAGraph`, one per (step, width), captured from
  the steps' kernels — inductor's fused ones, or the eager ones — before any timed decode) and replayed: one launch a
  step instead of ~20 a layer. The graphs read and write one static buffer per width (the rows' states and
  positions), so any sequence of steps composes without copies — the whole depth for Vanilla, layers 1..E then
  E+1..L for any E (DEL picks one every round), any skip set (SWIFT, CLaSp, KnapSpec drafts: sublayer steps) — and
  the cache they write is the one they were captured on (allocated at `prepare` for the run's longest prompt +
  max_new_tokens; the engine decodes in it);
- CompiledRunner: elsewhere compiled whole by torch.compile (`fullgraph=True`: a graph break is an error; inductor's
  C++ kernels on CPU), the layer's tensors passed as arguments so one graph serves every layer of a shape.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from del_bench.engine.static_steps import adopt, memo, padded
from del_bench.models.kv_cache import KVCache
from del_bench.transfer import upload

CACHE_QUANTUM = 256  # the captured cache's length is the run's longest need rounded up to this

# a step: ("layers", start, end) — whole layers [start, end) — or ("attn", i) / ("mlp", i) — one sublayer
Step = tuple


def collects_in_graph(step: Step, collect: list | None) -> bool:
    """Whether a step keeps its layers' states itself: a chain of several whole layers asked for them (DEL's passes)
    writes every layer's output into a static buffer inside its one graph. A single layer or sublayer step's output
    is the state the caller keeps."""
    return collect is not None and step[0] == "layers" and step[2] - step[1] > 1


def row_inputs(positions: list[list[int]], live: list[list[bool]] | None, width: int, start: int, end: int,
               layers: int, scratch: int) -> list[int]:
    """What a batch's step uploads into its graph's buffers: each row's positions padded to width (−1, none: the
    scratch slot), then which rows run each of the model's 2L sublayers (0 outside the chain)."""
    flat = [p if p >= 0 else scratch for row in positions for p in [*row, *[-1] * (width - len(row))]]
    B = len(positions)
    bits = [0] * (2 * layers * B)
    for i in range(2 * start, 2 * end):
        for b in range(B):
            bits[i * B + b] = 1 if live is None else int(live[i - 2 * start][b])
    return flat + bits


class CompiledRunner:
    """Graphs by torch.compile(fullgraph=True), run as they are (no capture): the layer's tensors (a Layer) and its
    cache are arguments, so one graph serves every layer of a shape (dynamo guards on shapes, not on which
    tensors)."""

    def __init__(self, graphs):
        self.graphs = graphs
        self.made: set[tuple] = set()  # (step, width, collects) keys run at least once
        self.cache = None
        self._adopted: weakref.WeakSet = weakref.WeakSet()  # caches whose length is marked dynamic
        self._rope = None

    def cache_of(self, cache_len: int) -> KVCache:
        cache = self.graphs.stack.new_cache(cache_len, batch=self.graphs.batch)
        if self.graphs.batch > 1:  # a batch's: every slot its mask covers finite (adopt)
            adopt(cache, static_addresses=True)
            self.cache = cache
        return cache

    def takes(self, cache: KVCache) -> bool:
        return True

    def clear(self, cache: KVCache) -> None:
        pass

    def run_rows(self, step: Step, h, positions, live, width: int, cache: KVCache, collects: bool):
        stack, fns = self.graphs.stack, self.graphs.functions
        B, T, _ = h.shape
        _, start, end = step
        scratch = cache.max_len - 1
        values = upload(row_inputs(positions, live, width, start, end, stack.num_layers, scratch), h.device)
        at = values[: B * width].view(B, width)
        on = (values[B * width :].view(2 * stack.num_layers, B) != 0)[2 * start : 2 * end]
        layers = range(start, end)
        states: list | None = [] if collects else None
        out = fns.rows([stack.layers[i] for i in layers], padded(h, width), at, on, [cache.k[i] for i in layers],
                       [cache.v[i] for i in layers], scratch, states)
        self.made.add((step, width, collects))
        return out[:, :T], [state[:, :T] for state in states or []]

    def run(self, plan, h, pos: int, width: int, cache: KVCache, collect) -> torch.Tensor:
        stack, fns = self.graphs.stack, self.graphs.functions
        if cache not in self._adopted:
            adopt(cache, static_addresses=False)
            self._adopted.add(cache)
        tables = stack.rope_tables()
        if tables[0] is not self._rope:  # a longer table (new_cache): its length dynamic too
            self._rope = tables[0]
            for table in tables:
                torch._dynamo.mark_dynamic(table, table.dim() - 2)
        T = h.shape[1]
        positions = torch.arange(pos, pos + width, device=h.device)[None]  # [1, width]
        x = padded(h, width)
        for step in plan:
            kind, first = step[0], step[1]
            if kind == "layers":
                layers = range(first, step[2])
                states = [] if collect is not None else None
                x = fns.chain([stack.layers[i] for i in layers], x, positions, [cache.k[i] for i in layers],
                              [cache.v[i] for i in layers], states)
                if states is not None:
                    collect.extend(state[:, :T] for state in states)
            else:
                w = stack.layers[first]
                x = fns.attention(w, x, positions, cache.k[first], cache.v[first]) if kind == "attn" else fns.mlp(w, x)
                if collect is not None:
                    collect.append(x[:, :T])
            self.made.add((step, width, collects_in_graph(step, collect)))
        return x[:, :T]


class CudaGraphRunner:
    """Graphs captured with torch.cuda.CUDAGraph from the steps' kernels (inductor's where the functions are compiled,
    else the eager ones). Each graph of a width reads and writes that width's static buffers in place — the rows'
    states [B, width, D] and positions [B, width] (B = 1, or a batch's: Graphs.batch; a batch's graphs also read
    which rows run each sublayer, [2L, B]), and for a chain that keeps its states, every layer's output
    [n, B, width, D] — and one cache, so any sequence of steps replays with one copy in and one copy out."""

    def __init__(self, graphs):
        self.graphs = graphs
        self.made: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.cache: KVCache | None = None
        self.pool = None
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.states: dict[int, torch.Tensor] = {}  # width → [L, B, width, D]: a collecting chain's layers' outputs
        self.live: torch.Tensor | None = None  # a batch's: which rows run each sublayer (_live)

    def cache_of(self, cache_len: int) -> KVCache:
        """The cache every graph is captured on (its addresses are baked into the graphs): one per stack and length,
        shared by the stack's Graphs (they never run at once; each prompt's prefill rewrites what it reads)."""
        if self.cache is None:
            length = -(-cache_len // CACHE_QUANTUM) * CACHE_QUANTUM
            stack, B = self.graphs.stack, self.graphs.batch
            caches = memo(stack).setdefault("captured_caches", {})
            if (length, B) not in caches:
                caches[length, B] = stack.new_cache(length, batch=B)
                adopt(caches[length, B], static_addresses=True)
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

    def _live(self) -> torch.Tensor:
        """A batch's [2L, B] bool: which rows run each sublayer (every width's graphs read it: a step uploads it)."""
        if self.live is None:
            stack = self.graphs.stack
            self.live = torch.ones(2 * stack.num_layers, self.graphs.batch, dtype=torch.bool,
                                   device=stack.layers[0].device)
        return self.live

    def _states(self, width: int) -> torch.Tensor:
        if width not in self.states:
            state = self._buffers(width)[0]
            self.states[width] = state.new_zeros(self.graphs.stack.num_layers, *state.shape)
        return self.states[width]

    def _graph(self, step: Step, width: int, collects: bool) -> torch.cuda.CUDAGraph:
        key = (step, width, collects)
        if key not in self.made:
            self.made[key] = self._capture(self._body(step, width, collects), width)
        return self.made[key]

    def _body(self, step: Step, width: int, collects: bool) -> Callable[[], None]:
        """The step on this width's buffers, its result written back into the state buffer (and a collecting
        chain's every layer's output into the states buffer: one stack kernel inside the graph)."""
        stack, fns, cache = self.graphs.stack, self.graphs.functions, self.cache
        kind, first = step[0], step[1]
        if kind == "rows":
            return self._rows_body(step, width, collects)
        h, positions = self._buffers(width)
        if kind == "layers":
            layers = range(first, step[2])
            ws, ks, vs = [stack.layers[i] for i in layers], [cache.k[i] for i in layers], [cache.v[i] for i in layers]
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
            k, v = cache.k[first], cache.v[first]
            return lambda: h.copy_(fns.attention(w, h, positions, k, v))
        return lambda: h.copy_(fns.mlp(w, h))

    def _rows_body(self, step: Step, width: int, collects: bool) -> Callable[[], None]:
        """A batch's chain on this width's row buffers (positions and the rows running each sublayer read from them,
        as the step uploaded them), its result written back into the state buffer, a collecting chain's every
        layer's output into the states buffer."""
        stack, fns, cache = self.graphs.stack, self.graphs.functions, self.cache
        (h, at), on = self._buffers(width), self._live()
        _, start, end = step
        layers = range(start, end)
        ws, ks, vs = [stack.layers[i] for i in layers], [cache.k[i] for i in layers], [cache.v[i] for i in layers]
        live, scratch = on[2 * start : 2 * end], cache.max_len - 1
        if not collects:
            return lambda: h.copy_(fns.rows(ws, h, at, live, ks, vs, scratch))
        kept = self._states(width)[: len(layers)]

        def chain_keeping_states():
            states: list[torch.Tensor] = []
            h.copy_(fns.rows(ws, h, at, live, ks, vs, scratch, states))
            torch.stack(states, out=kept)
        return chain_keeping_states

    def run_rows(self, step: Step, h, positions, live, width: int, cache: KVCache, collects: bool):
        B, T, _ = h.shape
        (state, at), on = self._buffers(width), self._live()
        _, start, end = step
        state[:, :T].copy_(h)  # columns T.. keep the last step's (finite) states: padding, never read by a real row
        L = self.graphs.stack.num_layers
        values = upload(row_inputs(positions, live, width, start, end, L, cache.max_len - 1), h.device)
        at.copy_(values[: B * width].view(B, width))
        on.copy_(values[B * width :].view(2 * L, B) != 0)
        self._graph(step, width, collects).replay()
        states = self._states(width)[: end - start, :, :T].clone().unbind(0) if collects else []
        return state[:, :T].clone(), list(states)

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

    def run(self, plan, h, pos: int, width: int, cache: KVCache, collect) -> torch.Tensor:
        T = h.shape[1]
        state, positions = self._buffers(width)
        state[:, :T].copy_(h)  # rows T.. keep the last step's (finite) states: padding, never read by a real row
        positions.copy_(torch.arange(pos, pos + width, device=positions.device)[None])
        for step in plan:
            collects = collects_in_graph(step, collect)
            self._graph(step, width, collects).replay()
            if collects:  # one copy of every layer's state (the buffers are the next replay's)
                collect.extend(self._states(width)[: step[2] - step[1], :, :T].clone().unbind(0))
            elif collect is not None:
                collect.append(state[:, :T].clone())  # the buffer is the next step's input
        return state[:, :T].clone()
