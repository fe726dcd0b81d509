"""Static-shape steps: the engine's decode steps as pure tensor code over a static cache, so that a graph can capture
them (engine/compiled.py) and a batch's rows can run them together (RowSteps, driven by engine/batch.py through its
layer path, engine/layer_path.py).

The eager loop writes the KV cache through Python-int slices and attends over keys [0, pos + T): every new position
is a new shape, so a graph would have to be rebuilt (or guard on the position) each token. Here the shapes change
only at a few lengths:

- positions are a device tensor [B, T] (each row its own); the KV cache is the engine's preallocated one
  (LayerStack.new_cache: [B, KV, max_len, hd] a layer), written in place at each row's positions (`write_slots`:
  index_put_, so a compiled step stores T positions, never a copy of the cache) and read up to an attended length
  (`attended`: 256 slots, doubling, up to the cache's length — the smallest that holds every slot in use) under a
  mask [B, 1, T, S] (`static_mask`: key slot j is seen by the query at position p iff j ≤ p, and for a windowed
  layer j > p − W), so stale or padded slots beyond p never are;
- a step is a sublayer (attention: the cache write and the masked attention; MLP) or a chain of whole layers, at a
  width T padded to the next of a few buckets (padded rows write KV past the last real position, which the next real
  step overwrites before any query's mask reaches it).

The layer math is LayerStack's own public per-layer functions — `project_qkv`, `attend_static`, `attention_out`,
`mlp`, `rope_at` — which the eager loop runs too and FamilyLayerStack overrides, so every described family (biases,
q/k norms, sandwich norms, windows, soft caps, per-layer rotary tables) runs here with no second copy of its math.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate

import torch

from del_bench.models.kv_cache import KVCache
from del_bench.models.layer_stack import LayerStack
from del_bench.models.products import products_for
from del_bench.numerics import is_half
from del_bench.transfer import upload

CACHE_QUANTUM = 256  # a captured cache's length is a multiple of it; the attended lengths start at it and double
# what inductor is asked for when it compiles the steps for CUDA: gpt-fast's settings (inductor_options)
CUDA_INDUCTOR_OPTIONS = {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True, "fx_graph_cache": True}


def attended_lengths(max_len: int) -> list[int]:
    """The lengths a step attends over on a cache of max_len slots: CACHE_QUANTUM, doubling, below max_len, then
    max_len itself — a graph per length at most, each reading at most twice the slots in use (past the first)."""
    lengths, length = [], CACHE_QUANTUM
    while length < max_len:
        lengths.append(length)
        length *= 2
    return [*lengths, max_len]


def attended(need: int, max_len: int) -> int:
    """The slots a step attends over when it uses slots [0, need): the smallest attended length ≥ need."""
    if need > max_len:
        raise ValueError(f"a step using {need} slots of a cache of {max_len}")
    return next(length for length in attended_lengths(max_len) if length >= need)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """new [B, KV, T, hd] into cache [B, KV, S, hd] at each row's slots [B, T], in place: index_put_, which inductor
    keeps in place (a compiled step stores T positions). scatter_ would not be: functionalised, it becomes an
    out-of-place scatter into a copy of the whole layer's cache and a copy back, every step
    (tests/test_step_kernels.py)."""
    rows = torch.arange(cache.shape[0], device=slots.device)[:, None]  # [B, 1]
    cache[rows, :, slots] = new.transpose(1, 2)  # [B, T, KV, hd]: the indexed dimensions come first


def static_mask(positions: torch.Tensor, length: int, window: int | None = None, idle: bool = False) -> torch.Tensor:
    """[B, 1, T, length] bool: the query at positions[b, t] sees key slot j iff j ≤ positions[b, t] (a chain's causal
    mask over the attended slots) and, with a window W, j > positions[b, t] − W (the last W positions, itself
    included: masking_utils' sliding_window_overlay). idle: a query at the last slot (a batch's scratch slot: a row
    or column with no position) sees that slot alone, so it reads no real key."""
    keys = torch.arange(length, device=positions.device)  # [S]
    query = positions[:, None, :, None]  # [B, 1, T, 1]
    seen = keys <= query
    if window is not None:
        seen = seen & (keys > query - window)
    if idle:
        seen = seen & ((query < length - 1) | (keys == length - 1))
    return seen


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


# ---- a batch's step as the host decides it, made into masks on the device ---------------------------------------
@dataclass
class RowSkips:
    """A skipping round's skip sets, one per row of the batch: on the host (which sublayers a row runs: the steps'
    host-known sublayers and the batch's accounting) and on the device as keep [B, 2L] bool (sublayer 2i: layer i's
    attention, 2i + 1: its MLP), uploaded once a round."""

    attn: list[frozenset[int]]
    mlp: list[frozenset[int]]
    keep: torch.Tensor  # [B, 2L] bool

    @staticmethod
    def of(skips: list[tuple[frozenset[int], frozenset[int]]], rows: int, layers: int, device) -> "RowSkips":
        """skips: (attention, MLP) layers each of the first rows skips; the rows beyond keep every sublayer."""
        skips = [*skips, *[(frozenset(), frozenset())] * (rows - len(skips))]
        bits = [int(i not in part) for attn, mlp in skips for i in range(layers) for part in (attn, mlp)]
        keep = upload(bits, device).view(rows, 2 * layers) != 0
        return RowSkips([a for a, _ in skips], [m for _, m in skips], keep)


@dataclass
class StepRows:
    """One batched step as the host decides it, per row b: its positions first[b] … first[b] + count[b] − 1 (count 0:
    none, a row with nothing to do), the layers [lo[b], hi[b]) it runs, and within them, where `skips` is given (a
    skipping draft's step), only the sublayers its skip set keeps. held: the slots any row holds or may write this
    round (the scratch slot must lie beyond them). Uploaded as 4B ints a step (`values`); the positions [B, T] and
    which rows run each sublayer [2n, B] are made from them on the device (row_positions, live_sublayers)."""

    first: list[int]
    count: list[int]
    lo: list[int]
    hi: list[int]
    held: int = 0
    skips: RowSkips | None = None

    def __post_init__(self):
        """A row with no position runs no layer (its span emptied): the host's counts and the device's masks agree."""
        self.lo = [lo if c else 0 for lo, c in zip(self.lo, self.count)]
        self.hi = [hi if c else 0 for hi, c in zip(self.hi, self.count)]

    @property
    def rows(self) -> int:
        return len(self.first)

    @property
    def reach(self) -> int:
        """The slots a step needs: every slot in use, then the scratch slot."""
        return max(self.held, max(f + c for f, c in zip(self.first, self.count))) + 1

    def values(self) -> list[int]:
        return [*self.first, *self.count, *self.lo, *self.hi]

    def padded(self, rows: int) -> "StepRows":
        """The same step over `rows` rows: those beyond idle (no position, no layer)."""
        extra = [0] * (rows - self.rows)
        return StepRows([*self.first, *extra], [*self.count, *extra], [*self.lo, *extra], [*self.hi, *extra],
                        self.held, self.skips)

    def users(self, start: int, end: int) -> list[int]:
        """How many rows run each sublayer of layers [start, end) (2i − 2·start: layer i's attention, then its MLP):
        the rows' layer ranges counted as intervals, then each row's skipped sublayers taken off."""
        edges = [0] * (end - start + 1)
        for lo, hi in zip(self.lo, self.hi):
            a, z = max(lo, start), min(hi, end)
            if a < z:
                edges[a - start] += 1
                edges[z - start] -= 1
        users = [u for u in accumulate(edges[:-1]) for _ in (0, 1)]
        if self.skips is not None:
            for b in range(self.rows):
                a, z = max(self.lo[b], start), min(self.hi[b], end)
                if a >= z:
                    continue
                for kind, part in enumerate((self.skips.attn[b], self.skips.mlp[b])):
                    for i in part:
                        if a <= i < z:
                            users[2 * (i - start) + kind] -= 1
        return users

    def sublayers_of(self, b: int, start: int, end: int) -> range | list[int]:
        """The sublayers of [start, end) (indexed as `users` indexes them) row b runs: a range, or with skips the
        ones of it its skip set keeps."""
        a, z = max(self.lo[b], start), min(self.hi[b], end)
        if a >= z:
            return range(0)
        span = range(2 * (a - start), 2 * (z - start))
        if self.skips is None:
            return span
        parts = (self.skips.attn[b], self.skips.mlp[b])
        return [j for j in span if start + j // 2 not in parts[j % 2]]


def row_positions(first: torch.Tensor, count: torch.Tensor, width: int, scratch: int) -> torch.Tensor:
    """first, count [B] → positions [B, width]: row b's first + t for t < count[b], else the scratch slot (none)."""
    t = torch.arange(width, device=first.device)  # [W]
    return torch.where(t < count[:, None], first[:, None] + t, scratch)


def live_sublayers(lo: torch.Tensor, hi: torch.Tensor, keep: torch.Tensor | None, start: int, end: int
                   ) -> torch.Tensor:
    """lo, hi [B] (each row's layers), keep [B, 2L] bool or None → [2n, B] bool: which rows run each sublayer of
    layers [start, end) (2j: layer start + j's attention, 2j + 1: its MLP)."""
    layer = torch.arange(start, end, device=lo.device)[:, None]  # [n, 1]
    live = ((lo <= layer) & (layer < hi)).repeat_interleave(2, dim=0)  # [2n, B]
    return live if keep is None else live & keep[:, 2 * start : 2 * end].T


def inductor_options(backend, device_type: str) -> dict:
    """What inductor is asked for when it compiles the steps for `device_type`. On CUDA gpt-fast's settings:
    coordinate-descent tuning of the Triton kernels — with it inductor also lowers a single-row product (a width-1
    step's GEMV) as a reduction it tunes and fuses with its neighbours' pointwise work, instead of a cuBLAS kernel
    beside separate ones — unique kernel names (a profile tells the kernels apart), and the FX graph cache (a later
    process reuses the compiled graphs). Elsewhere none: on a CPU coordinate descent changes nothing there and the
    defaults compile fastest."""
    return dict(CUDA_INDUCTOR_OPTIONS) if backend == "inductor" and device_type == "cuda" else {}


class StaticSteps:
    """The step functions of one LayerStack over a static cache: pure tensor code (no host read, no Python-side
    state), so a graph can capture them. h [B, T, D], positions [B, T] (long, on the layers' device); k, v: each layer's
    cache up to the attended length (a view of the static cache)."""

    def __init__(self, stack: LayerStack):
        self.stack = stack

    def attention(self, w, h, positions, cos, sin, k, v, mask=None, write=None) -> torch.Tensor:
        """h + attention(norm(h)) of the layer w: its new keys and values written at each row's positions into k, v
        [B, KV, S, hd] (the layer's cache up to the attended length), then the queries over those S slots under
        static_mask (or `mask`, made once for a chain). write [B, T]: the slots written where they are not the
        positions (a batch's rows that idle in this layer write only the scratch slot, RowSteps)."""
        st = self.stack
        q, k_new, v_new = st.project_qkv(w, h, cos, sin)  # q [B, H, T, hd]; k_new, v_new [B, KV, T, hd]
        at = positions if write is None else write
        write_slots(k, at, k_new)
        write_slots(v, at, v_new)
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

    # ---- a batch's rows in one step (engine/batch.py): each row its own positions, and its own sublayers ---------
    # positions at the scratch slot — the attended view's last, beyond every slot a row holds — mark a row or column
    # with none; a row that idles in a sublayer writes its keys there too, and a query there sees that slot alone
    def masked_layer(self, w, h, positions, cos, sin, k, v, mask, attn_live, mlp_live,
                     states: list | None = None, sublayers: bool = False, runs: tuple[bool, bool] = (True, True)
                     ) -> torch.Tensor:
        """One layer for B rows of which only some run each sublayer: attn_live, mlp_live [B] bool (None: every row).
        A row that idles keeps its state and writes its keys only into the scratch slot (k's last), which no real
        query's mask reaches (RowSteps): its own positions keep what its earlier passes wrote. Every row is computed
        (static shapes); an idle row's result is dropped by a select, not by a branch. states: the output appended
        (with `sublayers`, the attention's too). runs: whether any row runs the attention, the MLP (host-known: one
        no row runs is not computed)."""
        if runs[0]:
            scratch = k.shape[2] - 1
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

    def rows_layer(self, w, h, positions, attn_live, mlp_live, k, v) -> torch.Tensor:
        """masked_layer with its rotary tables and mask made inside (the unit a compiled batched chain repeats)."""
        cos, sin = self.stack.rope_at(positions)
        mask = static_mask(positions, k.shape[2], w.window, idle=True)
        return self.masked_layer(w, h, positions, cos, sin, k, v, mask, attn_live, mlp_live)

    def rows(self, ws, h, positions, live, ks, vs, states: list | None = None, sublayers: bool = False,
             runs: list[bool] | None = None, grouped: bool = False) -> torch.Tensor:
        """Whole layers ws for B rows (h [B, T, D], positions [B, T]), each row running the sublayers live marks: per
        sublayer (layer j's attention at 2j, its MLP at 2j + 1) a [B] bool, or None where every row runs it (live
        None: every row runs every one). The rotary tables and masks are made once for the chain. runs: whether any
        row runs each sublayer (host-known: one no row runs is not computed at all). grouped: attention as
        grouped_attention (an additive mask), not the stack's attend_static."""
        cos, sin = self.stack.rope_at(positions)
        masks: dict = {}
        for j, (w, k, v) in enumerate(zip(ws, ks, vs)):
            if w.window not in masks:
                seen = static_mask(positions, k.shape[2], w.window, idle=True)  # [B, 1, T, S]
                masks[w.window] = torch.zeros(seen.shape, dtype=h.dtype).masked_fill_(~seen, -torch.inf) \
                    if grouped else seen
            attn_live, mlp_live = (None, None) if live is None else (live[2 * j], live[2 * j + 1])
            h = self.masked_layer(w, h, positions, cos, sin, k, v, masks[w.window], attn_live, mlp_live, states,
                                  sublayers, (True, True) if runs is None else (runs[2 * j], runs[2 * j + 1]))
        return h


class StepFunctions:
    """What a runner calls for a step: StaticSteps' own functions (`backend` None: the eager kernels, op by op) or
    the same functions compiled by torch.compile (`backend`: inductor fuses each layer's norms, RoPE, cache writes,
    mask and residual adds into a few kernels beside the matrix products and the attention; for CUDA with
    inductor_options). One compiled function per step kind, guarded on shapes only, so a width's graph serves every
    layer (the layer's tensors are arguments): compile time grows with the widths and attended lengths, not the
    layers."""

    def __init__(self, steps: StaticSteps, backend=None, device_type: str | None = None):
        """device_type: what the functions are compiled for (default: where the stack's layers are)."""
        self.steps, self.backend = steps, backend
        self.options = inductor_options(backend, device_type or steps.stack.layers[0].device.type)
        extra = {"options": self.options} if self.options else {}

        def made(fn):
            return fn if backend is None else torch.compile(fn, fullgraph=True, dynamic=False, backend=backend,
                                                            **extra)

        self.layer, self.attention, self.mlp = made(steps.layer), made(steps.attention_at), made(steps.mlp)
        self.rows_layer = made(steps.rows_layer)

    @staticmethod
    def of(stack: LayerStack, backend=None) -> "StepFunctions":
        """One set of functions per stack and backend: every Graphs of a stack (one per method a bench runs) shares
        its compiled functions, so each (function, shape) compiles once per stack, not once per method."""
        made = memo(stack).setdefault("step_functions", {})
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

    def rows(self, ws, h, positions, live, ks, vs, states: list | None = None) -> torch.Tensor:
        """A batch's chain (StaticSteps.rows; live [2n, B] bool, made on the device: live_sublayers). Unfused, the
        rotary tables and masks are made once for the chain; fused, inside each layer's kernels (rows_layer: one
        compiled function per (B, width, attended length))."""
        if not self.fused:
            return self.steps.rows(ws, h, positions, live, ks, vs, states)
        for j, (w, k, v) in enumerate(zip(ws, ks, vs)):
            h = self.rows_layer(w, h, positions, live[2 * j], live[2 * j + 1], k, v)
            if states is not None:
                states.append(h)
        return h


ROW_QUANTUM = 64  # RowSteps' eager steps attend over the cache's slots up to the rows' furthest, rounded up to this


class RowSteps:
    """A batch's steps (engine/batch.py): B rows through whole layers [start, end) at once on the batch's cache
    [B, KV, S, hd] (a row of it each), each row at its own positions and running its own sublayers — an early-exit
    row only the layers up to its exit, a skipping draft only those its skip set keeps, a row with nothing to do
    none — as one [B, T, D] step. A row's or column's missing position and a sublayer a row idles in write the
    scratch slot, the last the step attends over, beyond every slot any row holds or writes this round: never inside
    any real query's mask, and overwritten before a real position reaches it (the batch's cache has one slot past the
    longest sequence).

    Run eagerly (StaticSteps' functions: on a CPU over the cache's slots up to the rows' furthest only, and a sublayer
    no row runs not computed) or on `graphs` (engine/compiled.Graphs: captured per (B, width bucket, attended length)
    on CUDA, one replay a chain; a call they cannot take runs eagerly). What the host decided (StepRows: each row's
    first position, how many, its layers) goes to the device in one upload of 4B ints a step, without a sync
    (transfer.upload); a skipping round's skip sets once a round (RowSkips); the positions and each sublayer's rows
    are made from them on the device."""

    def __init__(self, stack: LayerStack, cache: KVCache, graphs=None):
        self.stack, self.cache, self.graphs = stack, cache, graphs
        self.steps = StaticSteps(stack)

    def run(self, start: int, end: int, h: torch.Tensor, rows: StepRows, collect: str | None = None,
            tail: list | None = None) -> tuple[torch.Tensor, list[torch.Tensor], list[int], int]:
        """h [m, T, D], the first m ≤ B rows of the batch (the running ones: the Batch keeps them first), through
        layers [start, end) as `rows` says (m rows); collect: "layers" (each layer's output [m, T, D]) or "sublayers"
        (each sublayer's). → (the output [m, T, D], the states collected, which sublayers were computed (2(end −
        start) of them, attention then MLP of each layer), for how many rows: m eagerly, B on the graphs, whose shapes
        are the batch's). tail: where the graphs ran the token's tail, it is appended (compiled.Graphs.rows)."""
        users = rows.users(start, end)
        B, m = self.cache.k[0].shape[0], h.shape[0]
        if self.graphs is not None:
            out = self.graphs.rows(start, end, padded_rows(h, B), rows.padded(B), self.cache, collect, tail)
            if out is not None:
                return out[0][:m], [state[:m] for state in out[1]], [True] * len(users), B
        out, states = self._eager(start, end, h, rows, users, collect)
        return out, states, [u > 0 for u in users], m

    def _eager(self, start, end, h, rows: StepRows, users: list[int], collect) -> tuple[torch.Tensor, list]:
        B, T, _ = h.shape
        reach = rows.reach
        S = min(self.cache.max_len, -(-reach // ROW_QUANTUM) * ROW_QUANTUM)
        if S < reach:
            raise RuntimeError(f"a batched step reaches slot {reach - 1} of a cache of {S}")
        first, count, lo, hi = upload(rows.values(), h.device).view(4, B)  # one upload: 4B ints
        at = row_positions(first, count, T, S - 1)  # [B, T]
        keep = None if rows.skips is None else rows.skips.keep[:B]
        live = live_sublayers(lo, hi, keep, start, end)  # [2n, B]
        per = [None if u == B else live[j] for j, u in enumerate(users)]
        ks = [k[:B, :, :S] for k in self.cache.k[start:end]]  # [B, KV, S, hd] views: its rows, the slots they reach
        vs = [v[:B, :, :S] for v in self.cache.v[start:end]]
        states: list[torch.Tensor] | None = [] if collect else None
        with products_for(self.stack, B * T):
            out = self.steps.rows(self.stack.layers[start:end], h, at, per, ks, vs, states,
                                  sublayers=collect == "sublayers", runs=[u > 0 for u in users], grouped=self.grouped)
        return out, states or []

    @property
    def grouped(self) -> bool:
        """Attention as grouped_attention: on a CPU, in float32/float64 (half precision keeps SDPA's rounding), for a
        family whose attention is SDPA's (not Gemma 2's soft cap)."""
        st = self.stack
        return (st.head_device.type == "cpu" and not is_half(st.dtype)
                and type(st).attend_static is LayerStack.attend_static)


MEMO_STACKS = 4  # stacks whose graphs, caches and step functions are kept (memo)
_MEMO: OrderedDict[int, tuple[LayerStack, dict]] = OrderedDict()


def memo(stack: LayerStack) -> dict:
    """What the graphs of one stack share — compiled step functions, the caches CUDA graphs are captured on, the graphs
    chosen per method configuration — kept here, not on the model's stack, for the last MEMO_STACKS stacks used (a
    bench interleaves one or two models; tests build many small ones): each entry holds its stack, whose weights the
    graphs read anyway."""
    entry = _MEMO.pop(id(stack), None)
    if entry is None or entry[0] is not stack:
        entry = (stack, {})
    _MEMO[id(stack)] = entry
    while len(_MEMO) > MEMO_STACKS:
        _MEMO.popitem(last=False)
    return entry[1]


def adopt(cache: KVCache) -> None:
    """A cache's first use by the graphs. Its slots never written (new_cache allocates with torch.empty) are zeroed: a
    masked key gets weight 0, but 0 · NaN is NaN, so garbage there would reach every output through the attention's
    product with V. Slots once written (prefill, a cropped draft, a padded row) hold finite values."""
    for k, v, length in zip(cache.k, cache.v, cache.lengths):
        k[:, :, length:].zero_()
        v[:, :, length:].zero_()


def padded_rows(h: torch.Tensor, rows: int) -> torch.Tensor:
    """h [m, T, D] → [rows, T, D] (zero rows appended)."""
    m, T, D = h.shape
    return h if m == rows else torch.cat([h, h.new_zeros(rows - m, T, D)])


def padded(h: torch.Tensor, width: int) -> torch.Tensor:
    """h [B, T, D] → [B, width, D] (zero rows appended)."""
    B, T, D = h.shape
    return h if T == width else torch.cat([h, h.new_zeros(B, width - T, D)], dim=1)
