"""Static-shape steps replayed as graphs: the engine's decode steps without a launch (or Python) per op.

The steps (engine/static_steps.py) are pure tensor code over a static cache — positions a device tensor, the cache
written in place at them and read up to an attended length (256 slots, doubling: static_steps.attended) under a mask,
widths padded to a few buckets (`BUCKETS`) — so their shapes change only at those lengths and a graph can hold them.
`Graphs` runs them one of two ways (engine/graph_runners.py): on CUDA captured as CUDA graphs and replayed (one launch
a step; a graph per (step, width, attended length); one static buffer per width, so any sequence of steps composes —
the whole depth for Vanilla, layers 1..E then E+1..L for any E, any skip set — on the one cache they were captured
on, each length's graphs a view of its first slots), elsewhere compiled whole by torch.compile (`fullgraph=True`; the
attended length dynamic: one graph for all).

Either way the bits are not the eager loop's (a masked attention over the whole cache reduces over other lengths; a
compiled graph reorders reductions), so engine/path_choice.py checks a run's graphs by the rule every method is held to
(del_bench/numerics.py): in float32/float64 a greedy decode equal to transformers' `generate`, in half precision
equal or departing first at a near-tie of generate's own logits — not bit equality with another kernel. Records say
`layer_path` `<loop>+compiled` and such runs pair only with Vanilla on the same path (RunKey.machine).

engine/path_choice.py makes and checks the graphs a run's setting asks for and puts them on the session's layer path
(engine/layer_path.py), which gives them the calls they can take (no token tree, no trimmed collection; a width
within the buckets) and runs the rest — prefill, trees, SWIFT's teacher-forced probe, the selections' candidate
passes — on the stack's loop. Nothing of them is stored on the model's stack: what the graphs
of one stack share (compiled step functions, captured caches, the graphs chosen per method) is kept in
static_steps.memo.
"""

from __future__ import annotations

import logging
import time

import torch

from del_bench.engine.draft_chain import DraftChain, drafts_in_chain
from del_bench.engine.graph_runners import (  # noqa: F401 (CACHE_QUANTUM: part of this module's API)
    CACHE_QUANTUM,
    TAIL,
    CompiledRunner,
    CudaGraphRunner,
    Step,
    collects_in_graph,
    with_tail,
)
from del_bench.engine.static_steps import StepFunctions, StepRows, attended, attended_lengths
from del_bench.methods.base import LAYER_SKIPPING
from del_bench.models.kv_cache import KVCache
from del_bench.models.layer_stack import LayerStack

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("off", "auto", "on", "graphs")
RECOMPILE_LIMIT = 256  # graphs of one step function in a process (a run: a few; the test suite: a few dozen)
BUCKETS = (1, 2, 4, 8, 16, 32)  # step widths (verification: d + 1 ≤ 32); a wider batch runs on the stack's loop


class CompileUnavailable(RuntimeError):
    """The graph-captured steps cannot serve this model here (the message says why)."""


def compile_setting(value) -> str:
    """The `compile` setting as written: YAML reads a bare off / on as a boolean."""
    return {False: "off", True: "on"}.get(value, value) if isinstance(value, bool) else value


def bucket_of(width: int, buckets=BUCKETS) -> int | None:
    """The smallest bucket ≥ width, None when width exceeds them all."""
    return next((b for b in buckets if b >= width), None)


GRAPH_KINDS = {"fused_cuda_graphs": "fused_graphs", "cuda_graphs": "graphs", "compiled": "compiled"}  # → layer_path


class Graphs:
    """The static steps of one LayerStack, run as graphs: captured CUDA graphs (`capture=True`, CUDA only) of the
    steps' kernels — fused by torch.compile with `backend` (inductor: `fuse`, the default) or the eager ones — or,
    without capture, the steps compiled by torch.compile with `backend` (tests pass dynamo's own).

    A graph is made on the first call of a (step, width, attended length) before `frozen` (prepare: before any timed
    decode); afterwards a call no graph was made for returns None and the stack runs its own loop. `compile_s` sums the
    seconds spent making graphs, `graphs` counts them."""

    def __init__(self, stack: LayerStack, backend="inductor", capture: bool | None = None, buckets=BUCKETS,
                 runner: type | None = None, fuse: bool = True, batch: int = 1):
        """capture: CUDA graphs (default: where the model is on CUDA), else torch.compile with `backend`. fuse: the
        captured kernels are torch.compile'd ones (without capture the steps are always compiled). runner: the class
        that captures (tests replay the CUDA-graph runner's bookkeeping on a CPU). batch: B > 1, a batch's steps
        (engine/batch.py: `rows`, on a cache of B rows), one graph per (step, width bucket) at that B."""
        self.stack, self.batch = stack, batch
        self.buckets = tuple(buckets)
        self.capture = stack.head_device.type == "cuda" if capture is None else capture
        self.functions = StepFunctions.of(stack, backend if fuse or not self.capture else None)
        self.runner = (runner or CudaGraphRunner)(self) if self.capture else CompiledRunner(self)
        self.frozen = False  # True (prepare): no graph is made inside a timed decode
        self.compile_s = 0.0
        self.declined: dict[str, int] = {}  # calls the graphs could not take, by reason (a wider batch, …)
        self.shape: StepShapes | None = None  # what prepare made the graphs for
        self.regrown: list[tuple[int, int]] = []  # (from, to) slots: a batch's captured cache grown mid-run
        self.chain: DraftChain | None = None  # the draft chains' buffers, where prepare made chains (draft_chain)
        self.chain_error: str | None = None  # why the chains could not be made (the engine reads each candidate)
        self.row_tails = False  # a batch's chains to the last layer carry the token's tail (prepare_rows)

    @property
    def kind(self) -> str:
        """fused_cuda_graphs (inductor's kernels, captured), cuda_graphs (the eager kernels, captured) or compiled."""
        if not self.capture:
            return "compiled"
        return "fused_cuda_graphs" if self.functions.fused else "cuda_graphs"

    @property
    def path(self) -> str:
        """The kind as a record's layer_path names it after the stack's loop (fused_graphs, graphs, compiled)."""
        return GRAPH_KINDS[self.kind]

    @property
    def graphs(self) -> int:
        return len(self.runner.made)

    def setup(self) -> dict:
        """What a run's setup line says of the graphs beyond their kind and count: the inductor settings their
        kernels were compiled with (inductor_options: gpt-fast's for CUDA, none elsewhere), and for captured graphs the
        captured cache's slots and the attended lengths they were made for."""
        out: dict = {"inductor_options": self.functions.options} if self.functions.fused else {}
        if self.cache is not None and self.runner.static_lengths:
            out.update(cache_slots=self.cache.max_len, attended_lengths=attended_lengths(self.cache.max_len))
        if self.chain is not None:
            out["draft_chains"] = sum(key[0][0] == "chain" for key in self.runner.made)
        if self.chain_error is not None:
            out["draft_chain_error"] = self.chain_error
        return out

    @property
    def cache(self) -> KVCache | None:
        """The cache the captured graphs write (CUDA graphs: the engine decodes in it); None when any cache works."""
        return self.runner.cache

    def cache_for(self, max_len: int) -> KVCache | None:
        """The engine's cache for a prompt needing max_len slots: the captured one where it is long enough."""
        cache = self.cache
        if cache is not None and cache.max_len < max_len:
            self.decline(f"a prompt needs {max_len} cache slots, the graphs were captured on {cache.max_len}")
            return None
        return cache

    def decline(self, reason: str, expected: bool = False) -> None:
        """Count a call the graphs leave to the stack's loop; warn once per reason unless it is expected (a prefill,
        a width or layer range no prepared shape has: AdaDecode's, a long prompt's)."""
        if reason not in self.declined and not expected:
            log.warning("graph-captured steps: %s; those calls run on the stack's loop", reason)
        self.declined[reason] = self.declined.get(reason, 0) + 1

    # ---- the stack's calls -----------------------------------------------------------------------------------
    def forward_layers(self, h: torch.Tensor, start: int, end: int, pos: int, cache: KVCache,
                       collect: list | None = None, tail: list | None = None) -> torch.Tensor | None:
        """LayerStack.forward_layers for a chain of T positions from pos through [start, end) (each layer's output
        appended to `collect` when given), or None where no graph takes it. A chain prepared whole (with its states
        kept inside it where `collect` asks for them) is one graph; any other composes single layers. A chain ending
        at the last layer whose graph carries the token's tail (prepare) appends it to `tail` when given: the
        TokenTail of its T rows. Sets the layers' lengths and counts their work as the stack's loop does."""
        if start >= end:
            return None
        chain = ("layers", start, end)
        width = self._width(h)
        need = pos + (width or 0)
        length = attended(need, cache.max_len) if width and need <= cache.max_len else 0
        made, collects = self.runner.made, collects_in_graph(chain, collect)
        plan = next(([step] for step in (chain, with_tail(chain)) if self._key(step, width, collects, length) in made),
                    [("layers", i, i + 1) for i in range(start, end)])
        if len(plan) > 1 and self._key(with_tail(plan[-1]), width, False, length) in made:  # the last with the tail
            plan[-1] = with_tail(plan[-1])
        out = self._run(plan, h, pos, cache, collect)
        if out is None:
            return None
        if self.stack.counter is not None:  # every layer of [start, end) runs once, whole
            self.stack.counter.layers += end - start
        cache.lengths[start:end] = [pos + h.shape[1]] * (end - start)
        if tail is not None and plan[-1][-1] == TAIL:
            tail.append(self.runner.tail_of(width).row(0, h.shape[1]))
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

    def _key(self, step: Step, width: int, collects: bool, length: int) -> tuple:
        """A graph's key: per attended length where the runner captures one per length (CUDA graphs)."""
        return step, width, collects, length if self.runner.static_lengths else None

    def lengths(self, max_len: int) -> list[int]:
        """The attended lengths prepare makes graphs for on a cache of max_len slots: every one for CUDA graphs; one
        (the first) where one graph serves them all."""
        lengths = attended_lengths(max_len)
        return lengths if self.runner.static_lengths else lengths[:1]

    def rows(self, start: int, end: int, h: torch.Tensor, rows: StepRows, cache: KVCache, collect: str | None,
             tail: list | None = None) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """RowSteps.run on the graphs: a batch's chain [start, end) as one graph of its (B, width bucket, attended
        length) — what the host decided for each row (StepRows) uploaded into the graph's buffers — or None where no
        graph takes it (a width beyond the buckets, a chain keeping every sublayer's state, a shape not prepared,
        another cache): RowSteps runs it eagerly. → (the output [B, T, D], each layer's output where collect asks).
        A chain to the last layer runs every row's token tail too (`row_tails`), appended to `tail` when given."""
        width = self._width(h)
        if width is None:
            self.decline(f"steps wider than {self.buckets[-1]} positions", expected=True)
            return None
        if collect == "sublayers":
            self.decline("a chain keeping every sublayer's state (a selection's)", expected=True)
            return None
        if not self.runner.takes(cache):
            return None
        if rows.reach > cache.max_len:
            self.decline(f"a step reaching slot {rows.reach - 1} of a cache of {cache.max_len}")
            return None
        length = attended(rows.reach, cache.max_len)
        step, collects = ("rows", start, end), collect is not None
        if self.row_tails and end == self.stack.num_layers:  # every row's head next: inside the graph
            step = with_tail(step)
        made = self._key(step, width, collects, length) in self.runner.made
        if not made and self.frozen:
            self.decline("steps of a shape not prepared", expected=True)
            return None
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            out = self.runner.run_rows(step, h, rows, width, length, cache, collects)
        if not made:
            self.stack.synchronize()
            self.compile_s += time.perf_counter() - t0
        if tail is not None and step[-1] == TAIL:
            tail.append(self.runner.tail_of(width))
        return out

    def _run(self, plan: list[Step], h, pos: int, cache: KVCache, collect: list | None) -> torch.Tensor | None:
        width = self._width(h)
        if width is None:
            self.decline(f"steps wider than {self.buckets[-1]} positions", expected=True)
            return None
        if pos + width > cache.max_len:
            self.decline("a padded step past the cache's last slot", expected=True)
            return None
        if not self.runner.takes(cache):
            return None
        for i in cache_layers(plan):
            if cache.lengths[i] < pos:
                raise RuntimeError(f"layer {i} holds {cache.lengths[i]} positions; cannot write at {pos}")
        length = attended(pos + width, cache.max_len)  # the slots the step attends over: every one in use
        made = self.runner.made
        missing = [s for s in plan if self._key(s, width, collects_in_graph(s, collect), length) not in made]
        if missing and self.frozen:
            self.decline("steps of a shape not prepared", expected=True)
            return None
        counter, self.stack.counter = self.stack.counter, None  # no Python-side counting inside a graph
        try:
            t0 = time.perf_counter()
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = self.runner.run(plan, h, pos, width, length, cache, collect)
            if missing:
                self.stack.synchronize()
                self.compile_s += time.perf_counter() - t0
            return out
        finally:
            self.stack.counter = counter

    # ---- before the timed decode -----------------------------------------------------------------------------
    @torch.inference_mode()  # as the engine decodes: a graph made outside it would not serve it
    def prepare(self, shape: "StepShapes", cache_len: int) -> None:
        """Make, before any timed decode, every graph a method of this shape can call at every attended length, on a
        cache of cache_len slots (CUDA graphs: the cache the engine then decodes in), then freeze."""
        cache = self.runner.cache_of(cache_len)
        D, L = self.stack.embed_weight.shape[1], self.stack.num_layers
        device = self.stack.layers[0].device
        tails = self.runner.tails and self.batch == 1 and not shape.skips  # a skipping verification: no tail
        for plan, width, collects in shape.plans(L, self.buckets):
            if tails:  # every caller of a step to the last layer runs the head next (a token, a verification)
                plan = [with_tail(step) if step[0] == "layers" and step[2] == L else step for step in plan]
            for length in self.lengths(cache.max_len):
                pos = max(0, min(length, cache.max_len) - width)  # the step's last slot: the length's last
                cache.lengths = [pos] * L
                h = torch.zeros(1, width, D, dtype=self.stack.dtype, device=device)
                self._run(plan, h, pos, cache, [] if collects else None)
        if shape.chains and self.runner.chains:
            self._prepare_chains(shape, cache)
        cache.crop(0)
        self.runner.clear(cache)
        self.shape, self.frozen = shape, True

    def _prepare_chains(self, shape: "StepShapes", cache: KVCache) -> None:
        """A draft chain (engine/draft_chain.py) for every exit layer the method may draft from and every attended
        length; where they cannot be made here (no conditional nodes: CUDA < 12.4, an older torch) none is kept, the
        reason is recorded (setup: draft_chain_error) and the engine reads each candidate, as without them."""
        counter, self.stack.counter = self.stack.counter, None  # no Python-side counting inside a graph
        t0 = time.perf_counter()
        try:
            self.chain = DraftChain(self, shape.budget, shape.vocab, shape.collects, shape.confident)
            for exit_layer in shape.exits(self.stack.num_layers):
                for length in self.lengths(cache.max_len):
                    if length > shape.budget:  # room for the budget's passes from slot 0 (the warm-up's)
                        self.runner.draft_chain(self.chain, exit_layer, length)
        except Exception as err:  # noqa: BLE001 — any failure to capture means: no chains, said so
            self.chain, self.chain_error = None, f"{type(err).__name__}: {err}"
            self.runner.made = {k: g for k, g in self.runner.made.items() if k[0][0] != "chain"}
            log.warning("graph-captured steps: no draft chains (%s); DEL and DV read each candidate", self.chain_error)
        finally:
            self.stack.counter = counter
        self.stack.synchronize()
        self.compile_s += time.perf_counter() - t0

    def draft_chain(self, exit_layer: int, pos: int, budget: int, cache: KVCache):
        """The captured draft chain for a round drafting from exit_layer with the pending token at pos and this
        budget: the graph to replay, or None (no chains, another cache, past the cache, or no graph made for it)."""
        if self.chain is None or budget > self.chain.budget or not self.runner.takes(cache):
            return None
        need = pos + budget + 1  # the budget's last pass writes slot pos + budget
        if need > cache.max_len:
            self.decline("a draft chain past the cache's last slot", expected=True)
            return None
        key = (self.chain.key(exit_layer), 1, self.chain.collects, attended(need, cache.max_len))
        graph = self.runner.made.get(key)
        if graph is None:
            self.decline("a draft chain not prepared", expected=True)
        return graph

    @torch.inference_mode()
    def prepare_rows(self, shape: "StepShapes", cache_len: int) -> None:
        """prepare for a batch of self.batch rows (engine/batch.py): every chain its rounds can call at every width
        they can take (StepShapes.row_plans) and every attended length, on a cache of B rows and cache_len + 1 slots
        (the last: RowSteps' scratch slot), then freeze."""
        cache = self.runner.cache_of(cache_len + 1)
        D, B = self.stack.embed_weight.shape[1], self.batch
        device = self.stack.layers[0].device
        self.row_tails = self.runner.tails and not shape.skips  # a skipping verification: its head after it
        for (_, start, end), width, collects in shape.row_plans(self.stack.num_layers, self.buckets):
            for length in self.lengths(cache.max_len):
                h = torch.zeros(B, width, D, dtype=self.stack.dtype, device=device)
                rows = StepRows([0] * B, [width] * B, [start] * B, [end] * B, held=length - 1)  # reach: the length
                self.rows(start, end, h, rows, cache, "layers" if collects else None)
        cache.crop(0)
        self.runner.clear(cache)
        self.shape, self.frozen = shape, True

    @torch.inference_mode()
    def grow(self, cache_len: int) -> KVCache:
        """A batch's graphs made again on a captured cache of cache_len + 1 slots or more (a request outgrew the one
        they were captured on): every graph of the shape prepared, the time in compile_s, the growth in `regrown`
        and logged. → the new cache (the caller copies its rows' filled slots into it)."""
        old = self.runner.cache
        t0 = time.perf_counter()
        self.runner, self.frozen = type(self.runner)(self), False
        self.prepare_rows(self.shape, cache_len)
        self.compile_s += time.perf_counter() - t0
        self.regrown.append((old.max_len if old is not None else 0, self.runner.cache.max_len))
        log.warning("graph-captured steps: a request needs %d cache slots, the graphs were captured on %s: made again "
                    "on %d (%.1f s)", cache_len + 1, old.max_len if old is not None else "none",
                    self.runner.cache.max_len, time.perf_counter() - t0)
        return self.runner.cache


def cache_layers(plan: list[Step]) -> list[int]:
    """The layers whose cache a plan's steps attend over (whole layers, attention sublayers)."""
    return [i for step in plan if step[0] != "mlp"
            for i in (range(step[1], step[2]) if step[0] == "layers" else (step[1],))]


class StepShapes:
    """Which graphs a method can call, from what it declares (Method.static_shape, Method.family): a fixed exit
    layer E and budget γ (LS, FS) get their two chains as one graph each; a method that keeps every layer's state
    (DEL's shadow tokens) gets its two chains for each exit layer it may choose, each keeping its states inside its
    one graph; any other early-exit method that picks E per round composes layer by layer at every width up to its
    budget + 1; a skipping draft (SWIFT, CLaSp, KnapSpec) composes sublayers at width 1 and verifies all L layers at
    every width up to its budget + 1."""

    def __init__(self, exit_layer: int | None, budget: int, skips: bool = False, collects: bool = False,
                 chains: bool = False, vocab: int | None = None, confident: bool = True):
        """collects: the method reads every layer's states (DEL's shadow tokens): its chains keep them. chains: its
        drafts can run as draft chains (draft_chain.drafts_in_chain): one per exit layer (CUDA graphs only; vocab:
        its shadow_vocab, the scale of its confidences; confident: it stops at a threshold, else at the budget)."""
        self.exit_layer, self.budget, self.skips, self.collects = exit_layer, budget, skips, collects
        self.chains, self.vocab, self.confident = chains and budget > 0 and not skips, vocab, confident

    def key(self) -> tuple:
        return self.exit_layer, self.budget, self.skips, self.collects, self.chains, self.vocab, self.confident

    @staticmethod
    def of(method, max_new_tokens: int) -> "StepShapes":
        shape = method.static_shape()
        budget = min(shape.max_draft, max(max_new_tokens - 1, 0))
        return StepShapes(shape.exit_layer, budget, skips=method.family == LAYER_SKIPPING, collects=method.wants_shadow,
                          chains=drafts_in_chain(method), vocab=method.shadow_vocab,
                          confident=method.wants_confidence)

    def exits(self, L: int) -> list[int]:
        """The exit layers a draft may leave from: the fixed one, else every layer below the last."""
        return [self.exit_layer] if self.exit_layer else list(range(1, L))

    def plans(self, L: int, buckets) -> list[tuple[list[Step], int, bool]]:
        """(steps, width, collects) to make: chains where the shape is fixed (or, keeping states, for every exit
        layer), single layers / sublayers where it is not."""
        widest = bucket_of(self.budget + 1, buckets) or buckets[-1]
        widths = [b for b in buckets if b <= widest]
        plans = [([("layers", 0, L)], 1, False)]  # Vanilla's step; any method's round with no budget left
        E = self.exit_layer
        if self.collects and not self.skips:  # every pass keeps its states: drafts 1..E, verification E+1..L
            exits = self.exits(L)
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
        """(step, width, collects) a batch of this shape's rows can call (engine/batch.py): a draft step's chain
        runs to the deepest passing row's exit (L: a row with no draft this round), a verification from the
        lowest drafting row's exit, at every width up to the budget + 1's bucket; a skipping draft's every layer
        (each row's skip set masked) and its verification, with every layer's states kept too (CLaSp's selections).
        A chain keeping every sublayer's state (KnapSpec's selections) runs eagerly."""
        widest = bucket_of(self.budget + 1, buckets) or buckets[-1]
        widths = [b for b in buckets if b <= widest] if self.budget else []
        if self.skips:
            return [(("rows", 0, L), 1, False)] + [(("rows", 0, L), b, keeps) for b in widths
                                                   for keeps in (False, True)]
        exits = self.exits(L) if self.budget else []
        keeps = self.collects
        return ([(("rows", 0, e), 1, keeps) for e in [*exits, L]]
                + [(("rows", e, L), b, keeps) for e in exits for b in widths])
