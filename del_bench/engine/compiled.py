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
from del_bench.models.kv_cache import KVCache
from del_bench.models.layer_stack import LayerStack
from del_bench.numerics import compare, gap_ulps, is_half
from del_bench.transfer import upload

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("off", "auto", "on", "graphs")
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


def grouped_attention(q, k, v, bias, scale: float) -> torch.Tensor:
    """SDPA's math as grouped matrix products: q [B, H, T, hd] over k, v [B, KV, S, hd] with an additive mask bias
    [B, 1, T, S] (0 where a key is seen, −inf where not) → [B, H, T, hd]; query head h reads key head h // (H / KV),
    as repeat_kv pairs them. On this CPU at 8 rows over a few hundred keys ~0.6 of SDPA's time (its kernel's fixed
    cost per call dominates there); its rounding is its own, held to the token rule like every kernel of the steps."""
    B, H, T, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    G = H // KV
    scores = torch.matmul(q.reshape(B, KV, G * T, hd), k.transpose(-1, -2)) * scale  # [B, KV, G·T, S]
    probs = (scores.view(B, KV, G, T, S) + bias[:, :, None]).softmax(-1)  # [B, KV, G, T, S]
    return torch.matmul(probs.view(B, KV, G * T, S), v).view(B, H, T, hd)


def bucket_of(width: int, buckets=BUCKETS) -> int | None:
    """The smallest bucket ≥ width, None when width exceeds them all."""
    return next((b for b in buckets if b >= width), None)


class StaticSteps:
    """The step functions of one LayerStack over a static cache: pure tensor code (no host read, no Python-side
    state), so a graph can capture them. h [B, T, D], positions [B, T] (long, on the layers' device)."""

    def __init__(self, stack: LayerStack):
        self.stack = stack

    def attention(self, w, h, positions, cos, sin, k, v, mask=None, write=None) -> torch.Tensor:
        """h + attention(norm(h)) of the layer w: its new keys and values written at each row's positions into k, v
        [B, KV, S, hd] (the layer's static cache), then the queries over the whole cache under static_mask (or
        `mask`, made once for a chain). write [B, T]: the slots written where they are not the positions (a batch's
        rows that idle in this layer write only a scratch slot, RowSteps)."""
        st = self.stack
        q, k_new, v_new = st.project_qkv(w, h, cos, sin)  # q [B, H, T, hd]; k_new, v_new [B, KV, T, hd]
        at = positions if write is None else write
        index = at[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # [B, KV, T, hd]
        k.scatter_(2, index, k_new)
        v.scatter_(2, index, v_new)
        if mask is None:
            mask = static_mask(positions, k.shape[2], w.window)
        if mask.dtype == torch.bool:
            attn = st.attend_static(w, q, k, v, mask)  # [B, H, T, hd]
        else:  # an additive mask: RowSteps' eager steps on a CPU
            attn = grouped_attention(q, k, v, mask, st.scale)
        return st.attention_out(w, attn, h)

    def attention_at(self, w, h, positions, k, v) -> torch.Tensor:
        """attention, its rotary tables read at the positions (one sublayer as a step of its own)."""
        cos, sin = self.stack.rope_at(positions)
        return self.attention(w, h, positions, cos, sin, k, v)

    def mlp(self, w, h) -> torch.Tensor:
        return self.stack.mlp(w, h)

    def layer(self, w, h, positions, k, v) -> torch.Tensor:
        """One whole layer, its rotary tables read at the positions: the unit a chain repeats (compiled once per
        width, it serves every layer: the layer's tensors are arguments)."""
        cos, sin = self.stack.rope_at(positions)
        return self.mlp(w, self.attention(w, h, positions, cos, sin, k, v))

    def layers(self, ws, h, positions, ks, vs) -> torch.Tensor:
        """A chain of whole layers (ws, their caches ks, vs)."""
        for w, k, v in zip(ws, ks, vs):
            h = self.layer(w, h, positions, k, v)
        return h

    # ---- a batch's rows in lockstep (engine/lockstep.py): each row its own positions, and its own sublayers ------
    def masked_layer(self, w, h, positions, cos, sin, k, v, mask, scratch: int, attn_live, mlp_live,
                     states: list | None = None, sublayers: bool = False, runs: tuple[bool, bool] = (True, True)
                     ) -> torch.Tensor:
        """One layer for B rows of which only some run each sublayer: attn_live, mlp_live [B] bool (None: every row).
        A row that idles keeps its state and writes its keys only into the scratch slot, which no row's mask reaches
        (RowSteps): its own positions keep what its earlier passes wrote. Every row is computed (static shapes); an
        idle row's result is dropped by a select, not by a branch. states: the output appended (with `sublayers`,
        the attention's too). runs: whether any row runs the attention, the MLP (host-known: one no row runs is not
        computed)."""
        if runs[0]:
            write = positions if attn_live is None else torch.where(attn_live[:, None], positions, scratch)  # [B, T]
            out = self.attention(w, h, positions, cos, sin, k, v, mask, write)
            h = out if attn_live is None else torch.where(attn_live[:, None, None], out, h)  # [B, T, D]
        if sublayers:
            states.append(h)
        if runs[1]:
            out = self.mlp(w, h)
            h = out if mlp_live is None else torch.where(mlp_live[:, None, None], out, h)
        if states is not None:
            states.append(h)
        return h

    def rows_layer(self, w, h, positions, attn_live, mlp_live, k, v, scratch: int) -> torch.Tensor:
        """masked_layer with its rotary tables and mask made inside (the unit a compiled batched chain repeats)."""
        cos, sin = self.stack.rope_at(positions)
        mask = static_mask(positions, k.shape[2], w.window)
        return self.masked_layer(w, h, positions, cos, sin, k, v, mask, scratch, attn_live, mlp_live)

    def rows(self, ws, h, positions, live, ks, vs, scratch: int, states: list | None = None,
             sublayers: bool = False, runs: list[bool] | None = None, grouped: bool = False) -> torch.Tensor:
        """Whole layers ws for B rows (h [B, T, D], positions [B, T]), each row running the sublayers live marks: per
        sublayer (layer j's attention at 2j, its MLP at 2j + 1) a [B] bool, or None where every row runs it (live
        None: every row runs every one). The rotary tables and masks are made once for the chain. runs: whether any
        row runs each sublayer (host-known: one no row runs is not computed at all). grouped: attention as
        grouped_attention (an additive mask), not the stack's attend_static."""
        cos, sin = self.stack.rope_at(positions)
        masks: dict = {}
        for j, (w, k, v) in enumerate(zip(ws, ks, vs)):
            if w.window not in masks:
                seen = static_mask(positions, k.shape[2], w.window)  # [B, 1, T, S]
                masks[w.window] = torch.zeros(seen.shape, dtype=h.dtype).masked_fill_(~seen, -torch.inf) \
                    if grouped else seen
            attn_live, mlp_live = (None, None) if live is None else (live[2 * j], live[2 * j + 1])
            h = self.masked_layer(w, h, positions, cos, sin, k, v, masks[w.window], scratch, attn_live, mlp_live,
                                  states, sublayers, (True, True) if runs is None else (runs[2 * j], runs[2 * j + 1]))
        return h


class StepFunctions:
    """What a runner calls for a step: StaticSteps' own functions (`backend` None: the eager kernels, op by op) or
    the same functions compiled by torch.compile (`backend`: inductor fuses each layer's norms, RoPE, cache writes,
    mask and residual adds into a few kernels beside the matrix products and the attention). One compiled function
    per step kind, guarded on shapes only, so a width's graph serves every layer (the layer's tensors are arguments):
    compile time grows with the widths, not the layers."""

    def __init__(self, steps: StaticSteps, backend=None):
        self.steps, self.backend = steps, backend

        def made(fn):
            return fn if backend is None else torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)

        self.layer, self.attention, self.mlp = made(steps.layer), made(steps.attention_at), made(steps.mlp)
        self.rows_layer = made(steps.rows_layer)

    @staticmethod
    def of(stack: LayerStack, backend=None) -> "StepFunctions":
        """One set of functions per stack and backend: every Graphs of a stack (one per method a bench runs) shares
        its compiled functions, so each (function, width) compiles once per stack, not once per method."""
        made = stack.__dict__.setdefault("_step_functions", {})  # (a cycle through the stack: collected with it)
        if backend not in made:
            made[backend] = StepFunctions(StaticSteps(stack), backend)
        return made[backend]

    @property
    def fused(self) -> bool:
        return self.backend is not None

    def chain(self, ws, h, positions, ks, vs, states: list | None = None) -> torch.Tensor:
        """Whole layers ws (their caches ks, vs) in order, each output appended to `states` when given. Unfused, the
        rotary tables are read once for the chain; fused, inside each layer's kernels."""
        if self.fused:
            def layer(w, x, k, v):
                return self.layer(w, x, positions, k, v)
        else:
            steps = self.steps
            cos, sin = steps.stack.rope_at(positions)

            def layer(w, x, k, v):
                return steps.mlp(w, steps.attention(w, x, positions, cos, sin, k, v))
        for w, k, v in zip(ws, ks, vs):
            h = layer(w, h, k, v)
            if states is not None:
                states.append(h)
        return h

    def rows(self, ws, h, positions, live, ks, vs, scratch: int, states: list | None = None) -> torch.Tensor:
        """A batch's chain (StaticSteps.rows; live [2n, B] bool). Unfused, the rotary tables and masks are made once
        for the chain; fused, inside each layer's kernels (rows_layer: one compiled function per (B, width))."""
        if not self.fused:
            return self.steps.rows(ws, h, positions, live, ks, vs, scratch, states)
        for j, (w, k, v) in enumerate(zip(ws, ks, vs)):
            h = self.rows_layer(w, h, positions, live[2 * j], live[2 * j + 1], k, v, scratch)
            if states is not None:
                states.append(h)
        return h


ROW_QUANTUM = 64  # RowSteps' eager steps attend over the cache's slots up to the rows' furthest, rounded up to this


class RowSteps:
    """A batch's steps (engine/lockstep.py): B rows through whole layers [start, end) at once on the batch's cache
    [B, KV, S, hd] (a row of it each), each row at its own positions and running its own sublayers — an early-exit
    row only the layers up to its exit, a skipping draft only those its skip set keeps, a row with nothing to do
    none — as one [B, T, D] step. A row's position −1 (no position: padding beyond its width, or a row that idles)
    and a sublayer it idles in write the scratch slot, the cache's last, beyond every real position: never inside any
    real query's mask, and overwritten before a real position reaches it (RowSteps sizes the cache one slot past the
    longest sequence).

    Run eagerly (StaticSteps' functions: on a CPU over the cache's slots up to the rows' furthest only, and a sublayer
    no row runs not computed) or on `graphs` (engine/compiled.Graphs: captured per (B, width bucket) on CUDA, one
    replay a chain; a call they cannot take runs eagerly). What the host decided — positions, which rows run which
    sublayers — goes to the device in one upload a step, without a sync (transfer.upload)."""

    def __init__(self, stack: LayerStack, cache: KVCache, graphs: "Graphs | None" = None):
        self.stack, self.cache, self.graphs = stack, cache, graphs
        self.steps = StaticSteps(stack)

    def run(self, start: int, end: int, h: torch.Tensor, positions: list[list[int]], live: list[list[bool]] | None,
            held: int, collect: str | None = None) -> tuple[torch.Tensor, list[torch.Tensor], list[bool], int]:
        """h [m, T, D], the first m ≤ B rows of the batch (the running ones: Lockstep keeps them first), through
        layers [start, end); positions: each row's T slots (−1: none); live: per sublayer (2(end − start), attention
        then MLP of each layer) which of the m rows run it (None: all of them); held: the slots any row holds or
        writes (the scratch slot lies beyond them all: an idle row must not overwrite its own earlier positions);
        collect: "layers" (each layer's output [m, T, D]) or "sublayers" (each sublayer's). → (the output [m, T, D],
        the states collected, which sublayers were computed, for how many rows: m eagerly, B on the graphs, whose
        shapes are the batch's)."""
        runs = [True] * (2 * (end - start)) if live is None else [any(row) for row in live]
        B, m = self.cache.k[0].shape[0], h.shape[0]
        if self.graphs is not None:
            full = padded_rows(h, B)  # the rows beyond m: idle, their keys to the scratch slot
            rows = None if live is None and m == B else [[*(row if live else [True] * m), *[False] * (B - m)]
                                                           for row in (live or [None] * len(runs))]
            out = self.graphs.rows(start, end, full, [*positions, *[[-1] * h.shape[1]] * (B - m)], rows, self.cache,
                                   collect)
            if out is not None:
                return out[0][:m], [state[:m] for state in out[1]], [True] * len(runs), B
        out, states = self._eager(start, end, h, positions, live, runs, held, collect)
        return out, states, runs, m

    def _eager(self, start, end, h, positions, live, runs, held: int, collect) -> tuple[torch.Tensor, list]:
        B, T, _ = h.shape
        reach = max(held, max(p for row in positions for p in row) + 1) + 1  # every slot in use, then the scratch
        S = min(self.cache.max_len, -(-reach // ROW_QUANTUM) * ROW_QUANTUM)
        scratch = S - 1
        if S < reach:
            raise RuntimeError(f"a batched step reaches slot {reach - 1} of a cache of {S}")
        flat = [p if p >= 0 else scratch for row in positions for p in row]
        bits = [] if live is None else [int(x) for row in live for x in row]
        values = upload(flat + bits, h.device)  # one upload: positions [B·T], then live [2n·B]
        at = values[: B * T].view(B, T)
        rows = None
        if live is not None:
            flags = values[B * T :].view(len(live), B) != 0  # [2n, B]
            rows = [None if all(row) else flags[i] for i, row in enumerate(live)]
        ks = [k[:B, :, :S] for k in self.cache.k[start:end]]  # [B, KV, S, hd] views: its rows, the slots they reach
        vs = [v[:B, :, :S] for v in self.cache.v[start:end]]
        states: list[torch.Tensor] | None = [] if collect else None
        with self.stack.products_for(B * T):
            out = self.steps.rows(self.stack.layers[start:end], h, at, rows, ks, vs, scratch, states,
                                  sublayers=collect == "sublayers", runs=runs, grouped=self.grouped)
        return out, states or []

    @property
    def grouped(self) -> bool:
        """Attention as grouped_attention: on a CPU, in float32/float64 (half precision keeps SDPA's rounding), for a
        family whose attention is SDPA's (not Gemma 2's soft cap)."""
        st = self.stack
        return (st.head_device.type == "cpu" and not is_half(st.dtype)
                and type(st).attend_static is LayerStack.attend_static)


# a step: ("layers", start, end) — whole layers [start, end) — or ("attn", i) / ("mlp", i) — one sublayer
Step = tuple
GRAPH_KINDS = {"fused_cuda_graphs": "fused_graphs", "cuda_graphs": "graphs", "compiled": "compiled"}  # → layer_path


def collects_in_graph(step: Step, collect: list | None) -> bool:
    """Whether a step keeps its layers' states itself: a chain of several whole layers asked for them (DEL's passes)
    writes every layer's output into a static buffer inside its one graph. A single layer or sublayer step's output
    is the state the caller keeps."""
    return collect is not None and step[0] == "layers" and step[2] - step[1] > 1


class Graphs:
    """The static steps of one LayerStack, run as graphs: captured CUDA graphs (`capture=True`, CUDA only) of the
    steps' kernels — fused by torch.compile with `backend` (inductor: `fuse`, the default) or the eager ones — or,
    without capture, the steps compiled by torch.compile with `backend` (tests pass dynamo's own).

    A graph is made on the first call of a (step, width) before `frozen` (prepare: before any timed decode);
    afterwards a call no graph was made for returns None and the stack runs its own loop. `compile_s` sums the
    seconds spent making graphs, `graphs` counts them."""

    def __init__(self, stack: LayerStack, backend="inductor", capture: bool | None = None, buckets=BUCKETS,
                 runner: type | None = None, fuse: bool = True, batch: int = 1):
        """capture: CUDA graphs (default: where the model is on CUDA), else torch.compile with `backend`. fuse: the
        captured kernels are torch.compile'd ones (without capture the steps are always compiled). runner: the class
        that captures (tests replay the CUDA-graph runner's bookkeeping on a CPU). batch: B > 1, a batch's steps
        (engine/lockstep.py: `rows`, on a cache of B rows), one graph per (step, width bucket) at that B."""
        self.stack, self.batch = stack, batch
        self.steps = StaticSteps(stack)
        self.buckets = tuple(buckets)
        self.capture = stack.head_device.type == "cuda" if capture is None else capture
        self.functions = StepFunctions.of(stack, backend if fuse or not self.capture else None)
        self.runner = (runner or _CudaGraphs)(self) if self.capture else _Compiled(self)
        self.frozen = False  # True (prepare): no graph is made inside a timed decode
        self.compile_s = 0.0
        self.declined: dict[str, int] = {}  # calls the graphs could not take, by reason (a wider batch, …)

    @property
    def kind(self) -> str:
        """fused_cuda_graphs (inductor's kernels, captured), cuda_graphs (the eager kernels, captured) or compiled."""
        if not self.capture:
            return "compiled"
        return "fused_cuda_graphs" if self.functions.fused else "cuda_graphs"

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
        appended to `collect` when given), or None where no graph takes it. A chain prepared whole (with its states
        kept inside it where `collect` asks for them) is one graph; any other composes single layers. Sets the
        layers' lengths and counts their work as the stack's loop does."""
        if start >= end:
            return None
        chain = ("layers", start, end)
        if (chain, self._width(h), collects_in_graph(chain, collect)) in self.runner.made:
            plan = [chain]
        else:
            plan = [("layers", i, i + 1) for i in range(start, end)]
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

    def rows(self, start: int, end: int, h: torch.Tensor, positions: list[list[int]], live: list[list[bool]] | None,
             cache: KVCache, collect: str | None) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """RowSteps.run on the graphs: a batch's chain [start, end) as one graph of its (B, width bucket) — its
        positions and which rows run which sublayers uploaded into the graph's buffers — or None where no graph takes
        it (a width beyond the buckets, a chain keeping every sublayer's state, a shape not prepared, another
        cache): RowSteps runs it eagerly. → (the output [B, T, D], each layer's output where collect asks)."""
        width = self._width(h)
        if width is None:
            self._decline(f"steps wider than {self.buckets[-1]} positions", expected=True)
            return None
        if collect == "sublayers":
            self._decline("a chain keeping every sublayer's state (a selection's)", expected=True)
            return None
        if not self.runner.takes(cache):
            return None
        step, collects = ("rows", start, end), collect is not None
        made = (step, width, collects) in self.runner.made
        if not made and self.frozen:
            self._decline("steps of a shape not prepared", expected=True)
            return None
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            out = self.runner.run_rows(step, h, positions, live, width, cache, collects)
        if not made:
            self.stack.synchronize()
            self.compile_s += time.perf_counter() - t0
        return out

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
        missing = [s for s in plan if (s, width, collects_in_graph(s, collect)) not in self.runner.made]
        if missing and self.frozen:
            self._decline("steps of a shape not prepared", expected=True)
            return None
        counter, self.stack.counter = self.stack.counter, None  # no Python-side counting inside a graph
        try:
            t0 = time.perf_counter()
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
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
        for plan, width, collects in shape.plans(self.stack.num_layers, self.buckets):
            cache.crop(0)
            h = torch.zeros(1, width, D, dtype=self.stack.dtype, device=device)
            self._run(plan, h, 0, cache, [] if collects else None)
        cache.crop(0)
        self.runner.clear(cache)
        self.frozen = True

    @torch.inference_mode()
    def prepare_rows(self, shape: "StepShapes", cache_len: int) -> None:
        """prepare for a batch of self.batch rows (engine/lockstep.py): every chain its rounds can call at every width
        they can take (StepShapes.row_plans), on a cache of B rows and cache_len + 1 slots (the last: RowSteps'
        scratch slot), then freeze."""
        cache = self.runner.cache_of(cache_len + 1)
        D, B = self.stack.embed_weight.shape[1], self.batch
        device = self.stack.layers[0].device
        for (_, start, end), width, collects in shape.row_plans(self.stack.num_layers, self.buckets):
            h = torch.zeros(B, width, D, dtype=self.stack.dtype, device=device)
            self.rows(start, end, h, [list(range(width))] * B, None, cache, "layers" if collects else None)
        cache.crop(0)
        self.runner.clear(cache)
        self.frozen = True


def _row_inputs(positions: list[list[int]], live: list[list[bool]] | None, width: int, start: int, end: int,
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


class _Compiled:
    """Graphs by torch.compile(fullgraph=True), run as they are (no capture): the layer's tensors (a Layer) and its
    cache are arguments, so one graph serves every layer of a shape (dynamo guards on shapes, not on which
    tensors)."""

    def __init__(self, graphs: Graphs):
        self.graphs = graphs
        self.made: set[tuple] = set()  # (step, width, collects) keys run at least once
        self.cache = None
        self._adopted: weakref.WeakSet = weakref.WeakSet()  # caches whose length is marked dynamic
        self._rope = None

    def cache_of(self, cache_len: int) -> KVCache:
        cache = self.graphs.stack.new_cache(cache_len, batch=self.graphs.batch)
        if self.graphs.batch > 1:  # a batch's: every slot its mask covers finite (_adopt)
            _adopt(cache, static_addresses=True)
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
        values = upload(_row_inputs(positions, live, width, start, end, stack.num_layers, scratch), h.device)
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
            _adopt(cache, static_addresses=False)
            self._adopted.add(cache)
        if stack._cos is not self._rope:  # a longer table (new_cache): its length dynamic too
            self._rope = stack._cos
            for table in _rope_tables(stack):
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


class _CudaGraphs:
    """Graphs captured with torch.cuda.CUDAGraph from the steps' kernels (inductor's where the functions are compiled,
    else the eager ones). Each graph of a width reads and writes that width's static buffers in place — the rows'
    states [B, width, D] and positions [B, width] (B = 1, or a batch's: Graphs.batch; a batch's graphs also read
    which rows run each sublayer, [2L, B]), and for a chain that keeps its states, every layer's output
    [n, B, width, D] — and one cache, so any sequence of steps replays with one copy in and one copy out."""

    def __init__(self, graphs: Graphs):
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
            caches = stack.__dict__.setdefault("_captured_caches", {})
            if (length, B) not in caches:
                caches[length, B] = stack.new_cache(length, batch=B)
                _adopt(caches[length, B], static_addresses=True)
            self.cache = caches[length, B]
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
        values = upload(_row_inputs(positions, live, width, start, end, L, cache.max_len - 1), h.device)
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


def padded_rows(h: torch.Tensor, rows: int) -> torch.Tensor:
    """h [m, T, D] → [rows, T, D] (zero rows appended)."""
    m, T, D = h.shape
    return h if m == rows else torch.cat([h, h.new_zeros(rows - m, T, D)])


def padded(h: torch.Tensor, width: int) -> torch.Tensor:
    """h [B, T, D] → [B, width, D] (zero rows appended)."""
    B, T, D = h.shape
    return h if T == width else torch.cat([h, h.new_zeros(B, width - T, D)], dim=1)


class StepShapes:
    """Which graphs a method can call, from what it declares (Method.static_shape, Method.family): a fixed exit
    layer E and budget γ (LS, FS) get their two chains as one graph each; a method that keeps every layer's state
    (DEL's shadow tokens) gets its two chains for each exit layer it may choose, each keeping its states inside its
    one graph; any other early-exit method that picks E per round composes layer by layer at every width up to its
    budget + 1; a skipping draft (SWIFT, CLaSp, KnapSpec) composes sublayers at width 1 and verifies all L layers at
    every width up to its budget + 1."""

    def __init__(self, exit_layer: int | None, budget: int, skips: bool = False, collects: bool = False):
        """collects: the method reads every layer's states (DEL's shadow tokens): its chains keep them."""
        self.exit_layer, self.budget, self.skips, self.collects = exit_layer, budget, skips, collects

    def key(self) -> tuple:
        return self.exit_layer, self.budget, self.skips, self.collects

    @staticmethod
    def of(method, max_new_tokens: int) -> "StepShapes":
        shape = method.static_shape()
        budget = min(shape.max_draft, max(max_new_tokens - 1, 0))
        return StepShapes(shape.exit_layer, budget, skips=method.family == LAYER_SKIPPING, collects=method.wants_shadow)

    def plans(self, L: int, buckets) -> list[tuple[list[Step], int, bool]]:
        """(steps, width, collects) to make: chains where the shape is fixed (or, keeping states, for every exit
        layer), single layers / sublayers where it is not."""
        widest = bucket_of(self.budget + 1, buckets) or buckets[-1]
        widths = [b for b in buckets if b <= widest]
        plans = [([("layers", 0, L)], 1, False)]  # Vanilla's step; any method's round with no budget left
        E = self.exit_layer
        if self.collects and not self.skips:  # every pass keeps its states: drafts 1..E, verification E+1..L
            exits = [E] if E else range(1, L)
            plans += [([("layers", 0, L)], 1, True)] + [([("layers", 0, e)], 1, True) for e in exits]
            if self.budget:
                plans += [([("layers", e, L)], b, True) for e in exits for b in widths]
        elif E:
            plans += [([("layers", 0, E)], 1, False)] + [([("layers", E, L)], b, False) for b in widths]
        elif self.budget and not self.skips:  # E chosen per round: layer by layer
            plans += [([("layers", i, i + 1) for i in range(L)], b, False) for b in widths]
        if self.skips and self.budget:  # drafts: sublayer steps; verification: the chain, or with the states a
            sublayers = [(kind, i) for i in range(L) for kind in ("attn", "mlp")]  # selection keeps (CLaSp: every
            plans += [(sublayers, 1, False)]  # layer's, KnapSpec: every sublayer's) step by step
            plans += [(plan, b, False) for b in widths
                      for plan in ([("layers", 0, L)], [("layers", i, i + 1) for i in range(L)], sublayers)]
        return plans


    def row_plans(self, L: int, buckets) -> list[tuple[Step, int, bool]]:
        """(step, width, collects) a batch of this shape's rows can call (engine/lockstep.py): a draft step's chain
        runs to the deepest passing row's exit (L: a row with no draft this round), a verification from the
        lowest drafting row's exit, at every width up to the budget + 1's bucket; a skipping draft's every layer
        (each row's skip set masked) and its verification, with every layer's states kept too (CLaSp's selections).
        A chain keeping every sublayer's state (KnapSpec's selections) runs eagerly."""
        widest = bucket_of(self.budget + 1, buckets) or buckets[-1]
        widths = [b for b in buckets if b <= widest] if self.budget else []
        if self.skips:
            return [(("rows", 0, L), 1, False)] + [(("rows", 0, L), b, keeps) for b in widths
                                                   for keeps in (False, True)]
        exits = ([self.exit_layer] if self.exit_layer else list(range(1, L))) if self.budget else []
        keeps = self.collects
        return ([(("rows", 0, e), 1, keeps) for e in [*exits, L]]
                + [(("rows", e, L), b, keeps) for e in exits for b in widths])


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
    """Install (stack.compiled) the graph-captured steps for `setting` and return what the run's setup records: the
    setting, whether they run, how (`graph_kind`), compile_s (making the graphs and checking them, apart from any
    decode), the graphs made, and why not where they do not run (`reason`; `fallbacks`: kinds tried first).

    - off: the stack's loop.
    - on: the fused graphs — on CUDA inductor's kernels captured as CUDA graphs, elsewhere torch.compile'd steps — or
      an error (CompileUnavailable) where they cannot be made or are not lossless.
    - graphs: CUDA graphs of the eager kernels (unfused; CUDA only), or an error.
    - auto, the default: on CUDA the fused graphs where they are made and lossless, else the unfused ones, else the
      stack's loop, each refusal logged and recorded; elsewhere the stack's loop (compiled steps are no faster than
      the fused C++ loop on a CPU and cost minutes to compile: `make bench-compile`).
    cache_len: the slots the run's longest prompt needs (prompt + max_new_tokens + 1): CUDA graphs are captured on
    one cache that long."""
    stack.compiled = None
    graphs, info = pick(stack, setting, method, max_new_tokens, cache_len, backend, capture, runner)
    if graphs is not None:
        stack.compiled = graphs
    return info


def pick(stack: LayerStack, setting: str, method, max_new_tokens: int, cache_len: int, backend="inductor",
         capture: bool | None = None, runner: type | None = None, batch: int = 1,
         checked: Callable | None = None) -> tuple[Graphs | None, dict]:
    """The graphs `setting` asks for, by _choose's rules — one prompt at a time, or (batch B > 1) a batch's, checked
    by `checked` (engine/lockstep.check_rows) — made and checked, or None, with what the setup line records."""
    setting = compile_setting(setting)
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"compile={setting!r}: choose one of {', '.join(COMPILE_CHOICES)}")
    info: dict = {"compile": setting, "compiled": False}
    on_cuda = stack.head_device.type == "cuda" if capture is None else capture
    if setting == "off":
        return None, info
    if setting == "auto" and not on_cuda:
        return None, {**info, "reason": "auto makes graphs on CUDA only (compile=on compiles them here)"}
    if setting == "graphs" and not on_cuda:
        raise CompileUnavailable("compile=graphs captures CUDA graphs: the model is not on CUDA")
    tries = {"on": [True], "graphs": [False], "auto": [True, False]}[setting]  # fuse, in order
    t0 = time.perf_counter()
    for fuse in tries:
        try:
            graphs = _made(stack, method, max_new_tokens, cache_len, backend, capture, runner, fuse, batch, checked)
        except CompileUnavailable as err:
            if setting != "auto":
                raise
            info.setdefault("fallbacks", []).append(str(err))
            log.warning("compile=auto: %s graphs not used: %s", "fused" if fuse else "unfused", err)
            continue
        graphs.declined.clear()  # from here on: the run's own calls
        return graphs, {**info, "compiled": True, "graph_kind": graphs.kind, "compile_s": time.perf_counter() - t0,
                        "graphs": graphs.graphs}
    log.warning("compile=auto: decoding without the graph-captured steps (records say so)")
    return None, {**info, "compile_s": time.perf_counter() - t0, "reason": info["fallbacks"][-1]}


def _made(stack: LayerStack, method, max_new_tokens: int, cache_len: int, backend, capture, runner,
          fuse: bool, batch: int = 1, checked: Callable | None = None) -> Graphs:
    """Graphs made for the method's shapes (a batch's: their rows' chains) and checked against `generate` (a batch's
    by `checked`), or CompileUnavailable saying why not."""
    reason = unsupported(stack)
    if reason:
        raise CompileUnavailable(reason)
    graphs = Graphs(stack, backend=backend, capture=capture, runner=runner, fuse=fuse, batch=batch)
    shape = StepShapes.of(method, max_new_tokens)
    try:
        if batch > 1:
            graphs.prepare_rows(shape, max(cache_len, 64))
            departure = checked(stack, graphs, method)
        else:
            graphs.prepare(shape, max(cache_len, 64))
            departure = check(stack, graphs, method)
    except Exception as err:  # a graph break (fullgraph), an unsupported op, a capture failure: all mean "not these"
        raise CompileUnavailable(f"making the graphs failed ({type(err).__name__}: {err})") from err
    if departure:
        raise CompileUnavailable(departure)
    return graphs
