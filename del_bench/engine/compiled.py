"""Static-shape steps replayed as graphs: the engine's decode steps without a launch (or Python) per op.

The eager loop writes the KV cache through Python-int slices and attends over keys [0, pos + T): every new position
is a new shape, so a graph would have to be rebuilt (or guard on the position) each token. Here the shapes never
change (`StaticSteps`):

- positions are a device tensor [B, T] (each row its own: B = 1 in today's engine, the batch dimension is there for
  batched decoding); the KV cache is the engine's preallocated one (LayerStack.new_cache: [B, KV, max_len, hd] a
  layer), written with `scatter_` at each row's positions and read whole under a mask [B, 1, T, max_len]
  (`static_mask`: key slot j is seen by the query at position p iff j ≤ p, and for a windowed layer j > p − W), so
  stale or padded slots beyond p never are;
- a step is a sublayer (attention: the cache write and the masked attention; MLP) or a chain of whole layers, at a
  width T padded to the next of a few buckets (`BUCKETS`; padded rows write KV past the last real position, which the
  next real step overwrites before any query's mask reaches it).

The layer math is LayerStack's own public per-layer functions — `project_qkv`, `attend_static`, `attention_out`,
`mlp`, `rope_at` — which the eager loop runs too and FamilyLayerStack overrides, so every described family (biases,
q/k norms, sandwich norms, windows, soft caps, per-layer rotary tables) runs here with no second copy of its math.

Two ways to run the steps (`Graphs`):
- on CUDA, captured as CUDA graphs (`torch.cuda.CUDAGraph`, one per (step, width), captured from the eager kernels
  before any timed decode) and replayed: one launch a step instead of ~20 a layer. The graphs read and write one
  static buffer per width (the rows' states and positions), so any sequence of steps composes without copies — the
  whole depth for Vanilla, layers 1..E then E+1..L for any E (DEL picks one every round), any skip set (SWIFT,
  CLaSp, KnapSpec drafts: sublayer steps) — and the cache they write is the one they were captured on
  (`Graphs.cache`, allocated at `prepare` for the run's longest prompt + max_new_tokens; the engine decodes in it);
- elsewhere compiled whole by torch.compile (`fullgraph=True`: a graph break is an error; inductor's C++ kernels on
  CPU), the layer's tensors passed as arguments so one graph serves every layer of a shape.

Either way the bits are not the eager loop's (a masked attention over the whole cache reduces over other lengths; a
compiled graph reorders reductions), so `check` holds a run's graphs to the rule every method is held to
(del_bench/numerics.py): in float32/float64 a greedy decode equal to transformers' `generate`, in half precision
equal or departing first at a near-tie of generate's own logits — not bit equality with another kernel. Records say
`layer_path` `<loop>+compiled` and such runs pair only with Vanilla on the same path (RunKey.machine).

`LayerStack.forward_layers` / `forward_skipping` hand the steps the calls they can take (no token tree, no trimmed
collection; a width within the buckets): prefill, trees, SWIFT's teacher-forced probe and the selections' candidate
passes stay on the stack's loop.
"""

from __future__ import annotations

import copy
import logging
import time
import weakref
from collections.abc import Callable

import torch

from del_bench.methods.base import LAYER_SKIPPING
from del_bench.models.layer_stack import KVCache, LayerStack
from del_bench.numerics import compare, gap_ulps, is_half

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("off", "auto", "on")
RECOMPILE_LIMIT = 256  # graphs of one step function in a process (a run: a few; the test suite: a few dozen)
BUCKETS = (1, 2, 4, 8, 16, 32)  # step widths (verification: d + 1 ≤ 32); a wider batch runs on the stack's loop
CACHE_QUANTUM = 256  # the captured cache's length is the run's longest need rounded up to this


class CompileUnavailable(RuntimeError):
    """The graph-captured steps cannot serve this model here (the message says why)."""


def compile_setting(value) -> str:
    """The `compile` setting as written: YAML reads a bare off / on as a boolean."""
    return {False: "off", True: "on"}.get(value, value) if isinstance(value, bool) else value


def static_mask(positions: torch.Tensor, max_len: int, window: int | None = None) -> torch.Tensor:
    """[B, 1, T, max_len] bool: the query at positions[b, t] sees key slot j iff j ≤ positions[b, t] (a chain's causal
    mask over the whole static cache) and, with a window W, j > positions[b, t] − W (the last W positions, itself
    included: masking_utils' sliding_window_overlay)."""
    keys = torch.arange(max_len, device=positions.device)  # [S]
    query = positions[:, None, :, None]  # [B, 1, T, 1]
    seen = keys <= query
    return seen if window is None else seen & (keys > query - window)


def bucket_of(width: int, buckets=BUCKETS) -> int | None:
    """The smallest bucket ≥ width, None when width exceeds them all."""
    return next((b for b in buckets if b >= width), None)


class StaticSteps:
    """The step functions of one LayerStack over a static cache: pure tensor code (no host read, no Python-side
    state), so a graph can capture them. h [B, T, D], positions [B, T] (long, on the layers' device)."""

    def __init__(self, stack: LayerStack):
        self.stack = stack

    def attention(self, w, h, positions, cos, sin, k, v) -> torch.Tensor:
        """h + attention(norm(h)) of the layer w: its new keys and values written at each row's positions into k, v
        [B, KV, S, hd] (the layer's static cache), then the queries over the whole cache under static_mask."""
        st = self.stack
        q, k_new, v_new = st.project_qkv(w, h, cos, sin)  # q [B, H, T, hd]; k_new, v_new [B, KV, T, hd]
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # [B, KV, T, hd]
        k.scatter_(2, index, k_new)
        v.scatter_(2, index, v_new)
        attn = st.attend_static(w, q, k, v, static_mask(positions, k.shape[2], w.window))  # [B, H, T, hd]
        return st.attention_out(w, attn, h)

    def attention_at(self, w, h, positions, k, v) -> torch.Tensor:
        """attention, its rotary tables read at the positions (one sublayer as a step of its own)."""
        cos, sin = self.stack.rope_at(positions)
        return self.attention(w, h, positions, cos, sin, k, v)

    def mlp(self, w, h) -> torch.Tensor:
        return self.stack.mlp(w, h)

    def layers(self, ws, h, positions, ks, vs) -> torch.Tensor:
        """A chain of whole layers (ws, their caches ks, vs), the rotary tables read once."""
        cos, sin = self.stack.rope_at(positions)
        for w, k, v in zip(ws, ks, vs):
            h = self.mlp(w, self.attention(w, h, positions, cos, sin, k, v))
        return h


# a step: ("layers", start, end) — whole layers [start, end) — or ("attn", i) / ("mlp", i) — one sublayer
Step = tuple


class Graphs:
    """The static steps of one LayerStack, run as graphs: captured CUDA graphs (`capture=True`, CUDA only) or
    torch.compile'd functions (`backend`: inductor, or any torch.compile backend — tests pass dynamo's own).

    A graph is made on the first call of a (step, width) before `frozen` (prepare: before any timed decode);
    afterwards a call no graph was made for returns None and the stack runs its own loop. `compile_s` sums the
    seconds spent making graphs, `graphs` counts them."""

    def __init__(self, stack: LayerStack, backend="inductor", capture: bool | None = None, buckets=BUCKETS,
                 runner: type | None = None):
        """capture: CUDA graphs (default: where the model is on CUDA), else torch.compile with `backend`. runner: the
        class that captures (tests replay the CUDA-graph runner's bookkeeping on a CPU)."""
        self.stack = stack
        self.steps = StaticSteps(stack)
        self.buckets = tuple(buckets)
        self.capture = stack.head_device.type == "cuda" if capture is None else capture
        self.runner = (runner or _CudaGraphs)(self) if self.capture else _Compiled(self, backend)
        self.frozen = False  # True (prepare): no graph is made inside a timed decode
        self.compile_s = 0.0
        self.declined: dict[str, int] = {}  # calls the graphs could not take, by reason (a wider batch, …)

    @property
    def graphs(self) -> int:
        return len(self.runner.made)

    @property
    def cache(self) -> KVCache | None:
        """The cache the captured graphs write (CUDA graphs: the engine decodes in it); None when any cache works."""
        return self.runner.cache

    def cache_for(self, max_len: int) -> KVCache | None:
        """The engine's cache for a prompt needing max_len slots: the captured one where it is long enough."""
        cache = self.cache
        if cache is not None and cache.max_len < max_len:
            self._decline(f"a prompt needs {max_len} cache slots, the graphs were captured on {cache.max_len}")
            return None
        return cache

    def _decline(self, reason: str, expected: bool = False) -> None:
        """Count a call the graphs leave to the stack's loop; warn once per reason unless it is expected (a prefill,
        a width or layer range no prepared shape has: AdaDecode's, a long prompt's)."""
        if reason not in self.declined and not expected:
            log.warning("graph-captured steps: %s; those calls run on the stack's loop", reason)
        self.declined[reason] = self.declined.get(reason, 0) + 1

    # ---- the stack's calls -----------------------------------------------------------------------------------
    def forward_layers(self, h: torch.Tensor, start: int, end: int, pos: int, cache: KVCache,
                       collect: list | None = None) -> torch.Tensor | None:
        """LayerStack.forward_layers for a chain of T positions from pos through [start, end) (each layer's output
        appended to `collect` when given), or None where no graph takes it. Sets the layers' lengths and counts
        their work as the stack's loop does."""
        if start >= end:
            return None
        if collect is None and (("layers", start, end), self._width(h)) in self.runner.made:
            plan = [("layers", start, end)]  # a prepared chain: one graph
        else:
            plan = [("layers", i, i + 1) for i in range(start, end)]  # composed layer by layer
        out = self._run(plan, h, pos, cache, collect)
        if out is None:
            return None
        if self.stack.counter is not None:  # every layer of [start, end) runs once, whole
            self.stack.counter.layers += end - start
        cache.lengths[start:end] = [pos + h.shape[1]] * (end - start)
        return out

    def forward_skipping(self, h: torch.Tensor, pos: int, cache: KVCache, skip_attn: frozenset[int],
                         skip_mlp: frozenset[int], collect: list | None = None) -> torch.Tensor | None:
        """LayerStack.forward_skipping (write=True): every layer with the named sublayers skipped, composed from
        sublayer steps; every sublayer's output appended to `collect` where nothing is skipped (a verification that
        keeps them); None where no graph takes it."""
        L = self.stack.num_layers
        plan = [(kind, i) for i in range(L) for kind, skipped in (("attn", skip_attn), ("mlp", skip_mlp))
                if i not in skipped]
        if not plan or (collect is not None and len(plan) < 2 * L):
            return None
        out = self._run(plan, h, pos, cache, collect)
        if out is None:
            return None
        if self.stack.counter is not None:
            self.stack.counter.layers += len(plan) / 2
        for i in range(L):
            if i not in skip_attn:
                cache.lengths[i] = pos + h.shape[1]
        return out

    def _width(self, h: torch.Tensor) -> int | None:
        return bucket_of(h.shape[1], self.buckets)

    def _run(self, plan: list[Step], h, pos: int, cache: KVCache, collect: list | None) -> torch.Tensor | None:
        width = self._width(h)
        if width is None:
            self._decline(f"steps wider than {self.buckets[-1]} positions", expected=True)
            return None
        if pos + width > cache.max_len:
            self._decline("a padded step past the cache's last slot", expected=True)
            return None
        if not self.runner.takes(cache):
            return None
        for i in _cache_layers(plan):
            if cache.lengths[i] < pos:
                raise RuntimeError(f"layer {i} holds {cache.lengths[i]} positions; cannot write at {pos}")
        missing = [s for s in plan if (s, width) not in self.runner.made]
        if missing and self.frozen:
            self._decline("steps of a shape not prepared", expected=True)
            return None
        counter, self.stack.counter = self.stack.counter, None  # no Python-side counting inside a graph
        try:
            t0 = time.perf_counter()
            out = self.runner.run(plan, h, pos, width, cache, collect)
            if missing:
                self.stack.synchronize()
                self.compile_s += time.perf_counter() - t0
            return out
        finally:
            self.stack.counter = counter

    # ---- before the timed decode -----------------------------------------------------------------------------
    @torch.inference_mode()  # as the engine decodes: a graph made outside it would not serve it
    def prepare(self, shape: "StepShapes", cache_len: int) -> None:
        """Make, before any timed decode, every graph a method of this shape can call, on a cache of cache_len slots
        (CUDA graphs: the cache the engine then decodes in), then freeze."""
        cache = self.runner.cache_of(cache_len)
        D = self.stack.embed_weight.shape[1]
        device = self.stack.layers[0].device
        for plan, width in shape.plans(self.stack.num_layers, self.buckets):
            cache.crop(0)
            h = torch.zeros(1, width, D, dtype=self.stack.dtype, device=device)
            counter, self.stack.counter = self.stack.counter, None
            try:
                t0 = time.perf_counter()
                self.runner.run(plan, h, 0, width, cache, None)
                self.stack.synchronize()
                self.compile_s += time.perf_counter() - t0
            finally:
                self.stack.counter = counter
        cache.crop(0)
        self.runner.clear(cache)
        self.frozen = True


class _Compiled:
    """Graphs by torch.compile(fullgraph=True): the layer's tensors (a _Layer) and its cache are arguments, so one
    graph serves every layer of a shape (dynamo guards on shapes, not on which tensors)."""

    def __init__(self, graphs: Graphs, backend):
        self.graphs = graphs
        self.made: set[tuple] = set()  # (step, width) keys run at least once
        self.cache = None
        self._adopted: weakref.WeakSet = weakref.WeakSet()  # caches whose length is marked dynamic
        self._rope = None
        options = {"fullgraph": True, "dynamic": False, "backend": backend}
        steps = graphs.steps
        self._layers = torch.compile(steps.layers, **options)
        self._attn = torch.compile(steps.attention_at, **options)
        self._mlp = torch.compile(steps.mlp, **options)

    def cache_of(self, cache_len: int) -> KVCache:
        return self.graphs.stack.new_cache(cache_len)

    def takes(self, cache: KVCache) -> bool:
        return True

    def clear(self, cache: KVCache) -> None:
        pass

    def run(self, plan, h, pos: int, width: int, cache: KVCache, collect) -> torch.Tensor:
        stack = self.graphs.stack
        if cache not in self._adopted:
            _adopt(cache, static_addresses=False)
            self._adopted.add(cache)
        if stack._cos is not self._rope:  # a longer table (new_cache): its length dynamic too
            self._rope = stack._cos
            for table in _rope_tables(stack):
                torch._dynamo.mark_dynamic(table, table.dim() - 2)
        T = h.shape[1]
        positions = torch.arange(pos, pos + width, device=h.device)[None]  # [1, width]
        x = _padded(h, width)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            for step in plan:
                kind, first = step[0], step[1]
                if kind == "layers":
                    layers = range(first, step[2])
                    x = self._layers([stack.layers[i] for i in layers], x, positions, [cache.k[i] for i in layers],
                                     [cache.v[i] for i in layers])
                elif kind == "attn":
                    x = self._attn(stack.layers[first], x, positions, cache.k[first], cache.v[first])
                else:
                    x = self._mlp(stack.layers[first], x)
                self.made.add((step, width))
                if collect is not None:
                    collect.append(x[:, :T])
        return x[:, :T]


class _CudaGraphs:
    """Graphs captured with torch.cuda.CUDAGraph from the eager kernels of the static steps. Each graph of a width
    reads and writes that width's static buffers in place — the rows' states [1, width, D] and positions [1, width]
    — and one cache, so any sequence of steps replays with one copy in and one copy out."""

    def __init__(self, graphs: Graphs):
        self.graphs = graphs
        self.made: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.cache: KVCache | None = None
        self.pool = None
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cache_of(self, cache_len: int) -> KVCache:
        """The cache every graph is captured on (its addresses are baked into the graphs): one per stack and length,
        shared by the stack's Graphs (they never run at once; each prompt's prefill rewrites what it reads)."""
        if self.cache is None:
            length = -(-cache_len // CACHE_QUANTUM) * CACHE_QUANTUM
            stack = self.graphs.stack
            caches = stack.__dict__.setdefault("_captured_caches", {})
            if length not in caches:
                caches[length] = stack.new_cache(length)
                _adopt(caches[length], static_addresses=True)
            self.cache = caches[length]
            self._tables = _rope_tables(stack)  # a longer table later must not free the one the graphs read
        return self.cache

    def takes(self, cache: KVCache) -> bool:
        if cache is self.cache:
            return True
        self.graphs._decline("a cache other than the one the graphs were captured on")
        return False

    def clear(self, cache: KVCache) -> None:
        """Zero the slots capture wrote (finite garbage, but never-written slots must hold no NaN: _adopt)."""
        for k, v in zip(cache.k, cache.v):
            k.zero_()
            v.zero_()

    def _buffers(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        if width not in self.buffers:
            stack = self.graphs.stack
            device = stack.layers[0].device
            D = stack.embed_weight.shape[1]
            self.buffers[width] = (torch.zeros(1, width, D, dtype=stack.dtype, device=device),
                                   torch.zeros(1, width, dtype=torch.long, device=device))
        return self.buffers[width]

    def _graph(self, step: Step, width: int) -> torch.cuda.CUDAGraph:
        key = (step, width)
        if key not in self.made:
            self.made[key] = self._capture(self._body(step, width), width)
        return self.made[key]

    def _body(self, step: Step, width: int) -> Callable[[], None]:
        """The step on this width's buffers, its result written back into the state buffer."""
        stack, steps, cache = self.graphs.stack, self.graphs.steps, self.cache
        h, positions = self._buffers(width)
        kind, first = step[0], step[1]
        if kind == "layers":
            layers = range(first, step[2])
            ws, ks, vs = [stack.layers[i] for i in layers], [cache.k[i] for i in layers], [cache.v[i] for i in layers]
            return lambda: h.copy_(steps.layers(ws, h, positions, ks, vs))
        w = stack.layers[first]
        if kind == "attn":
            k, v = cache.k[first], cache.v[first]
            return lambda: h.copy_(steps.attention_at(w, h, positions, k, v))
        return lambda: h.copy_(steps.mlp(w, h))

    def _capture(self, body: Callable[[], None], width: int) -> torch.cuda.CUDAGraph:
        """Warm the body up on a side stream (cuBLAS workspaces, lazily loaded kernels), then capture it into a
        graph sharing one memory pool with the others (they never run concurrently)."""
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
            self._graph(step, width).replay()
            if collect is not None:
                collect.append(state[:, :T].clone())  # the buffer is the next step's input
        return state[:, :T].clone()


def _cache_layers(plan: list[Step]) -> list[int]:
    """The layers whose cache a plan's steps attend over (whole layers, attention sublayers)."""
    return [i for step in plan if step[0] != "mlp"
            for i in (range(step[1], step[2]) if step[0] == "layers" else (step[1],))]


def _rope_tables(stack: LayerStack) -> list[torch.Tensor]:
    """The rotary tables rope_at reads (a family with several rotary kinds: its stacked tables)."""
    kinds = getattr(stack, "_rope_kinds_cos", None)
    return [stack._cos, stack._sin] if kinds is None else [stack._rope_kinds_cos, stack._rope_kinds_sin]


def _adopt(cache: KVCache, static_addresses: bool) -> None:
    """A cache's first use by the graphs. Its slots never written (new_cache allocates with torch.empty) are zeroed: a
    masked key gets weight 0, but 0 · NaN is NaN, so garbage there would reach every output through the attention's
    product with V. Slots once written (prefill, a cropped draft, a padded row) hold finite values."""
    for k, v, length in zip(cache.k, cache.v, cache.lengths):
        k[:, :, length:].zero_()
        v[:, :, length:].zero_()
        if not static_addresses:
            for t in (k, v):
                torch._dynamo.mark_dynamic(t, 2)  # one graph for every cache length


def _padded(h: torch.Tensor, width: int) -> torch.Tensor:
    """h [1, T, D] → [1, width, D] (zero rows appended)."""
    T = h.shape[1]
    return h if T == width else torch.cat([h, h.new_zeros(1, width - T, h.shape[2])], dim=1)


class StepShapes:
    """Which graphs a method can call, from what it declares (Method.static_shape, Method.family): a fixed exit
    layer E and budget γ (LS, FS) get their two chains as one graph each; any other early-exit method (DEL picks E
    each round) composes layer by layer at every width up to its budget + 1; a skipping draft (SWIFT, CLaSp,
    KnapSpec) composes sublayers at width 1 and verifies all L layers at every width up to its budget + 1."""

    def __init__(self, exit_layer: int | None, budget: int, skips: bool = False, collects: bool = False):
        """collects: the method reads every layer's states (DEL's shadow tokens), so its chains run layer by layer."""
        self.exit_layer, self.budget, self.skips, self.collects = exit_layer, budget, skips, collects

    def key(self) -> tuple:
        return self.exit_layer, self.budget, self.skips, self.collects

    @staticmethod
    def of(method, max_new_tokens: int) -> "StepShapes":
        shape = method.static_shape()
        budget = min(shape.max_draft, max(max_new_tokens - 1, 0))
        return StepShapes(shape.exit_layer, budget, skips=method.family == LAYER_SKIPPING, collects=method.wants_shadow)

    def plans(self, L: int, buckets) -> list[tuple[list[Step], int]]:
        """(steps, width) to make: chains where the shape is fixed, single layers / sublayers where it is not."""
        widest = bucket_of(self.budget + 1, buckets) or buckets[-1]
        widths = [b for b in buckets if b <= widest]
        plans = [([("layers", 0, L)], 1)]  # Vanilla's step; any method's round with no budget left
        E = self.exit_layer
        if E and not self.collects:
            plans += [([("layers", 0, E)], 1)] + [([("layers", E, L)], b) for b in widths]
        elif self.budget and not self.skips:  # E chosen per round, or every layer's state kept: layer by layer
            plans += [([("layers", i, i + 1) for i in range(L)], b) for b in widths]
        if self.skips and self.budget:  # drafts: sublayer steps; verification: the chain, or with the states a
            sublayers = [(kind, i) for i in range(L) for kind in ("attn", "mlp")]  # selection keeps (CLaSp: every
            plans += [(sublayers, 1)]  # layer's, KnapSpec: every sublayer's) step by step
            plans += [(plan, b) for b in widths
                      for plan in ([("layers", 0, L)], [("layers", i, i + 1) for i in range(L)], sublayers)]
        return plans


def unsupported(stack: LayerStack) -> str | None:
    """Why the graph-captured steps cannot run this stack (None: they can). Half precision on a CPU can: its eager
    loop verifies row by row for a decode step's bits (LayerStack.exact_rows), the graphs attend the rows as one
    batch, and check holds them to the near-tie rule like any other kernel."""
    if len({lay.device for lay in stack.layers} | {stack.head_device}) > 1:
        return "the model spans several devices (device_map): a graph moves no tensor between them"
    return None


@torch.inference_mode()
def generate_reference(model, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy `generate` on the model's own modules: its tokens and the top-2 gap (ulps of the model's
    dtype) of each — the reference `check` holds the graphs to (no EOS: exactly `tokens` tokens)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                         min_new_tokens=tokens, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [gap_ulps(step[0], dtype=model.dtype) for step in out.logits]


@torch.inference_mode()
def check(stack: LayerStack, graphs: Graphs, method, tokens: int = 16, prompt: int = 6) -> str | None:
    """A short greedy decode of random ids with `method` (a copy) on the graphs, against `generate` on the same
    weights: None when it is lossless by the project's rule (float32/float64: equal; half precision: equal or first
    departing at a near-tie of generate's logits, numerics.compare), else what departed."""
    from del_bench.engine.decode import Engine  # the engine imports the stack, which holds these graphs
    from del_bench.engine.sampling import Sampling

    ids = torch.randint(0, stack.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    reference, gaps = generate_reference(stack.model, ids, tokens)
    stack.compiled = graphs
    try:
        output = Engine(stack, Sampling(), set()).generate(ids, copy.deepcopy(method), tokens, 0).output_ids
    finally:
        stack.compiled = None  # the caller installs the choice
    verdict = compare(output, reference, gaps if is_half(stack.dtype) else None)
    if verdict.kind in ("equal", "near_tie"):
        return None
    gap = "" if verdict.gap is None else f" (generate's top-2 gap {verdict.gap} ulps)"
    where = f"at token {verdict.position}{gap}"
    return f"a greedy decode on the graphs departs from generate's {where}: {output} vs {reference}"


def choose(stack: LayerStack, setting: str, method, max_new_tokens: int, cache_len: int = 1024,
           backend: str = "inductor", capture: bool | None = None, runner: type | None = None) -> dict:
    """The graphs for `setting` (see _choose), made and checked once per stack and method configuration: a bench
    resumes its interleaved runs a prompt at a time, and each resume asks again (the setup line says `reused`)."""
    setting = compile_setting(setting)
    shape = StepShapes.of(method, max_new_tokens)
    key = (setting, capture, runner, str(backend), shape.key(), -(-max(cache_len, 64) // CACHE_QUANTUM),
           type(method).__name__, repr(sorted(method.describe().items())))
    made = stack.__dict__.setdefault("_chosen_graphs", {})
    if key in made and setting in COMPILE_CHOICES:
        graphs, info = made[key]
        stack.compiled = graphs
        if graphs is not None:
            graphs.declined.clear()
        return {**info, "compile_s": 0.0, "reused": True}
    info = _choose(stack, setting, method, max_new_tokens, cache_len, backend, capture, runner)
    made[key] = (stack.compiled, info)
    return info


def _choose(stack: LayerStack, setting: str, method, max_new_tokens: int, cache_len: int, backend, capture,
            runner) -> dict:
    """Install (stack.compiled) the graph-captured steps for `setting` — off; on (CUDA graphs on CUDA, torch.compile
    elsewhere; an error where they cannot be made or are not lossless); auto, the default (on CUDA: CUDA graphs where
    they are made and lossless, else the stack's loop with the reason logged; elsewhere the stack's loop: compiled
    graphs are no faster than the fused C++ loop on a CPU and cost minutes to compile, `make bench-compile`) — and
    return what the run's setup records: the setting, whether they run, how (cuda_graphs | compiled), compile_s
    (making the graphs and checking them, apart from any decode), graphs made and the reason when they do not run.
    cache_len: the slots the run's longest prompt needs (prompt + max_new_tokens + 1): CUDA graphs are captured on
    one cache that long."""
    setting = compile_setting(setting)
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"compile={setting!r}: choose one of {', '.join(COMPILE_CHOICES)}")
    stack.compiled = None
    info: dict = {"compile": setting, "compiled": False}
    if setting == "off":
        return info
    if setting == "auto" and not (stack.head_device.type == "cuda" if capture is None else capture):
        info["reason"] = "auto makes graphs on CUDA only (compile=on compiles them here)"
        return info
    t0 = time.perf_counter()
    try:
        reason = unsupported(stack)
        if reason:
            raise CompileUnavailable(reason)
        graphs = Graphs(stack, backend=backend, capture=capture, runner=runner)
        info["graph_kind"] = "cuda_graphs" if graphs.capture else "compiled"
        try:
            graphs.prepare(StepShapes.of(method, max_new_tokens), max(cache_len, 64))
            departure = check(stack, graphs, method)
        except Exception as err:  # a graph break (fullgraph), an unsupported op, a capture failure: all mean "off"
            raise CompileUnavailable(f"making the graphs failed ({type(err).__name__}: {err})") from err
        if departure:
            raise CompileUnavailable(departure)
    except CompileUnavailable as err:
        info.update(compile_s=time.perf_counter() - t0, reason=str(err))
        if setting == "on":
            raise
        log.warning("compile=auto: decoding without the graph-captured steps (records say so): %s", err)
        return info
    graphs.declined.clear()  # from here on: the run's own calls
    stack.compiled = graphs
    info.update(compiled=True, compile_s=time.perf_counter() - t0, graphs=graphs.graphs)
    return info
