"""Static-shape decode steps that compile whole (torch.compile, fullgraph=True): issue 26's graph-capturable round.

The eager engine writes the KV cache through Python-int slices and attends over keys [0, pos + T): every new
position is a new shape, so a compiled graph would recompile (or guard on the position) each token. Here the
positions are a device tensor and the shapes never change:

- the KV cache is the engine's own preallocated one (LayerStack.new_cache: [1, KV, max_len, hd] per layer), written
  with index_copy_ at the step's positions and read whole, under a mask [T, max_len] (key j is seen by the query at
  position p iff j ≤ p: stale or padded slots beyond p never are);
- a draft step: one position through layers [0, E) and the exit head of layer E → (layer-E state, logits, argmax),
  E fixed per graph (a static int: one graph per E used); E = L is Vanilla's step (the final norm and head);
- a verify step: d + 1 positions through layers [E, L), then the final norm and the head over every row →
  (logits, argmax), padded to the next of a few bucket widths (one graph per (E, bucket)); padded rows write KV in
  slots past the last valid position, which the next step overwrites before any query sees them.

The layer math is LayerStack's own (its weights, _project_qkv, _attention_out, _mlp, rope_at, norm and heads): only
the cache write and SDPA over the static cache are this module's. In float64 the compiled steps give the eager
path's greedy tokens (tests/test_compiled.py); their bits differ (inductor reorders reductions), so a run that
uses them is recorded apart (layer_path "+compiled"), and `compile: auto` uses them only where a short greedy decode
matches the eager one on the model at hand and they are faster.

`Compiled.forward_layers` serves the engine's own calls (LayerStack.forward_layers hands it the ones it can take: no
collected states, no tree, a width within the buckets); everything else (prefill, DEL's shadow states, SWIFT) stays
on the stack's loop. On CUDA the steps are compiled with mode="reduce-overhead" (CUDA graphs: one replay per step,
no launches from Python) — untested here, no GPU in the suite; on CPU inductor's default (C++/OpenMP kernels).
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
import weakref

import torch
import torch.nn.functional as F

from del_bench.models.layer_stack import KVCache, LayerStack

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("off", "auto", "on")
RECOMPILE_LIMIT = 256  # graphs of one step function in a process (a run: a few; the test suite: a few dozen)
BUCKETS = (1, 2, 4, 8)  # verification widths (d + 1 ≤ 8: LS's γ ≤ 7); a wider batch runs on the stack's loop


class CompileUnavailable(RuntimeError):
    """The compiled steps cannot serve this model here (the message says why)."""


def compile_setting(value) -> str:
    """The `compile` setting as written: YAML reads a bare off / on as a boolean."""
    return {False: "off", True: "on"}.get(value, value) if isinstance(value, bool) else value


def default_mode(device: torch.device) -> str | None:
    """torch.compile's mode: CUDA graphs on CUDA (the steps' shapes and cache addresses are fixed, so one capture per
    graph replays every token without per-kernel launches); inductor's default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


def static_mask(positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """[T, max_len] bool: query at position positions[i] sees key slot j iff j ≤ positions[i] (a chain's causal mask,
    bottom-right aligned, over the whole static cache)."""
    keys = torch.arange(max_len, device=positions.device)
    return keys[None, :] <= positions[:, None]


def bucket_of(width: int, buckets=BUCKETS) -> int | None:
    """The smallest bucket ≥ width, None when width exceeds them all."""
    return next((b for b in buckets if b >= width), None)


class Compiled:
    """The compiled draft and verify steps of one LayerStack over a KVCache (the engine's, or any from new_cache).

    Graphs compile on first use of each (step, E, width) and are reused for every later position; `compile_s` sums the
    seconds the first calls took (compilation, apart from decoding)."""

    def __init__(self, stack: LayerStack, backend: str = "inductor", mode: str | None = "default",
                 buckets=BUCKETS):
        self.stack = stack
        self.buckets = tuple(buckets)
        self.mode = default_mode(stack.head_device) if mode == "default" else mode
        options = {"fullgraph": True, "dynamic": False, "backend": backend}
        if self.mode is not None and backend == "inductor":
            options["mode"] = self.mode
        # one compiled callable per step; E and the layer range are static ints: dynamo guards on them, one graph each
        self._draft = torch.compile(self._draft_step, **options)
        self._verify = torch.compile(self._verify_step, **options)
        self._layers = torch.compile(self._layers_step, **options)
        self._seen: set[tuple] = set()  # graph keys compiled
        self._caches: weakref.WeakSet = weakref.WeakSet()  # caches whose length is marked dynamic
        self._rope = None  # the RoPE table last marked dynamic
        self.frozen = False  # True (prepare): forward_layers compiles nothing new, so no timed decode pays a compile
        self.compile_s = 0.0

    # ---- the traced functions ------------------------------------------------------------------------------------
    def _run_layers(self, h, positions, start: int, end: int, k_cache: list, v_cache: list) -> torch.Tensor:
        """h [1, T, D] at positions [T] through 0-based layers [start, end): LayerStack's layer math, KV written with
        index_copy_ at the positions, SDPA over the whole static cache under static_mask."""
        st = self.stack
        cos, sin = st.rope_at(positions)  # [1, T, 1, hd]
        mask = static_mask(positions, k_cache[0].shape[2])  # [T, max_len]
        for i in range(start, end):
            w = st.layers[i]
            q, k_new, v_new = st._project_qkv(w, h, cos, sin)  # q [1, H, T, hd]; k_new, v_new [1, KV, T, hd]
            k_cache[i].index_copy_(2, positions, k_new)
            v_cache[i].index_copy_(2, positions, v_new)
            attn = F.scaled_dot_product_attention(q, k_cache[i], v_cache[i], attn_mask=mask, scale=st.scale,
                                                  enable_gqa=st.n_kv_heads != st.n_heads)  # [1, H, T, hd]
            h = st._mlp(i, st._attention_out(w, attn, h))
        return h

    def _draft_step(self, ids, positions, exit_layer: int, k_cache: list, v_cache: list):
        """ids [1, 1] at positions [1] → (layer-E state [1, 1, D], logits [1, V], greedy token [1])."""
        h = self._run_layers(self.stack.embed(ids), positions, 0, exit_layer, k_cache, v_cache)
        logits = self.stack.exit_logits(h, exit_layer)[0]  # [1, V]
        return h, logits, logits.argmax(-1)

    def _verify_step(self, states, positions, exit_layer: int, k_cache: list, v_cache: list):
        """states [1, B, D] (layer-E states, padded) at positions [B] → (logits [B, V], greedy tokens [B])."""
        h = self._run_layers(states, positions, exit_layer, self.stack.num_layers, k_cache, v_cache)
        logits = self.stack.logits(h)[0]  # [B, V]
        return logits, logits.argmax(-1)

    def _layers_step(self, h, positions, start: int, end: int, k_cache: list, v_cache: list):
        return self._run_layers(h, positions, start, end, k_cache, v_cache)

    # ---- calls ---------------------------------------------------------------------------------------------------
    def _call(self, key: tuple, cache: KVCache, fn, *args):
        """fn(*args, cache.k, cache.v), timing the first call of each graph key as compilation. The cache's length
        (dim 2) and the RoPE tables' are marked dynamic: one graph serves every cache the engine allocates."""
        if cache not in self._caches:
            self._adopt(cache)
        if self.stack._cos is not self._rope:  # a longer table (new_cache): its length dynamic too
            self._rope = self.stack._cos
            torch._dynamo.mark_dynamic(self.stack._cos, 0)
            torch._dynamo.mark_dynamic(self.stack._sin, 0)
        # the graph never sees a WorkCounter (LayerStack.counting): its Python-side counts would be guards (one
        # recompile per count); forward_layers counts the layers it runs, outside
        counter, self.stack.counter = self.stack.counter, None
        try:
            if key in self._seen:
                return self._kept(fn(*args, cache.k, cache.v))
            t0 = time.perf_counter()
            # every graph of a step function is a cache entry of its one code object (dynamo's recompile limit, 8,
            # counts them all, over every Compiled in the process): a new graph here is a new shape, not a recompile
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = fn(*args, cache.k, cache.v)
            self.stack.synchronize()
            self.compile_s += time.perf_counter() - t0
            self._seen.add(key)
            return self._kept(out)
        finally:
            self.stack.counter = counter

    def _kept(self, out):
        """A graph's outputs, safe to keep across steps: a CUDA graph replays into the same output buffers, so the
        engine's kept states (a round's layer-E states) are copied out of them (untested here: no GPU)."""
        if self.mode != "reduce-overhead":
            return out
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

    def _adopt(self, cache: KVCache) -> None:
        """A cache's first use here. Its slots never written (new_cache allocates with torch.empty) are zeroed: a
        masked key gets weight 0, but 0 · NaN is NaN, so garbage there would reach every output through SDPA's
        product with V. Slots once written (prefill, a cropped draft, a padded row) hold finite values."""
        for k, v, length in zip(cache.k, cache.v, cache.lengths):
            k[:, :, length:].zero_()
            v[:, :, length:].zero_()
            for t in (k, v):
                torch._dynamo.mark_dynamic(t, 2)
                if self.mode == "reduce-overhead":  # CUDA graphs replay mutated inputs only at fixed addresses
                    torch._dynamo.mark_static_address(t)
        self._caches.add(cache)

    def draft(self, ids: torch.Tensor, positions: torch.Tensor, exit_layer: int, cache: KVCache):
        """One token ids [1, 1] at positions [1] (a device tensor) through layers 1..E and E's exit head: (layer-E
        state [1, 1, D], logits [1, V], greedy token [1]). Writes layers [0, E)'s KV; cache.lengths are the caller's."""
        return self._call(("draft", exit_layer), cache, self._draft, ids, positions, exit_layer)

    def verify(self, states: torch.Tensor, positions: torch.Tensor, exit_layer: int, cache: KVCache):
        """states [1, T, D] (layer-E states) at positions [T] through layers E+1..L, the final norm and the head over
        every row: (logits [T, V], greedy tokens [T]). T is padded to its bucket (positions continue past the last)."""
        T = states.shape[1]
        B = bucket_of(T, self.buckets)
        if B is None:
            raise ValueError(f"a verification of {T} positions exceeds the largest bucket {self.buckets[-1]}")
        states, positions = self._padded(states, positions, B)
        logits, tokens = self._call(("verify", exit_layer, B), cache, self._verify, states, positions, exit_layer)
        return logits[:T], tokens[:T]

    def forward_layers(self, h: torch.Tensor, start: int, end: int, pos: int, cache: KVCache) -> torch.Tensor | None:
        """LayerStack.forward_layers for a chain of T positions from pos through [start, end), where a graph takes it
        (T within the buckets, the padded slots within the cache; once `frozen`, only graphs compiled before): None
        otherwise, and the caller runs its own loop. Sets the layers' lengths as forward_layers does."""
        T = h.shape[1]
        B = bucket_of(T, self.buckets)
        key = ("layers", start, end, B)
        if B is None or pos + B > cache.max_len or start >= end or (self.frozen and key not in self._seen):
            return None
        short = min(cache.lengths[start:end])
        if short < pos:
            raise RuntimeError(f"layer {cache.lengths.index(short, start)} holds {short} positions; cannot write at "
                               f"{pos}")
        if self.stack.counter is not None:  # every layer of [start, end) runs once, whole
            self.stack.counter.layers += end - start
        positions = torch.arange(pos, pos + B, device=h.device)  # [B]
        h, _ = self._padded(h, positions, B)
        out = self._call(key, cache, self._layers, h, positions, start, end)
        cache.lengths[start:end] = [pos + T] * (end - start)
        return out[:, :T]

    @torch.inference_mode()  # as the engine decodes: a graph compiled outside it would recompile (a guard on it)
    def prepare(self, exit_layer: int | None, max_draft: int, cache_len: int = 1024) -> None:
        """Compile, before any timed decode, the engine's graphs for a method drafting at a fixed exit layer E (None:
        Vanilla's only) with up to max_draft tokens a round: all L layers at one position (Vanilla, and a round with
        no budget left), layers 1..E at one position, E+1..L at each bucket up to max_draft + 1; then freeze. On a
        scratch cache made here, in inference mode like the engine's (a graph guards on both)."""
        cache = self.stack.new_cache(cache_len)
        L = self.stack.num_layers
        shapes = [(0, L, 1)]
        if exit_layer:
            widest = bucket_of(max_draft + 1, self.buckets) or self.buckets[-1]
            shapes += [(0, exit_layer, 1)] + [(exit_layer, L, B) for B in self.buckets if B <= widest]
        D = self.stack.embed_weight.shape[1]
        for start, end, width in shapes:
            cache.crop(0)
            h = torch.zeros(1, width, D, dtype=self.stack.dtype, device=self.stack.layers[start].device)
            self.forward_layers(h, start, end, 0, cache)
        cache.crop(0)
        self.frozen = True

    @staticmethod
    def _padded(h: torch.Tensor, positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h [1, T, D] → [1, width, D] (zero rows appended) and positions [T] → [width] (continuing by one)."""
        T = h.shape[1]
        if T == width:
            return h, positions
        pad = width - T
        h = torch.cat([h, h.new_zeros(1, pad, h.shape[2])], dim=1)
        if positions.shape[0] < width:
            positions = torch.cat([positions, positions[-1] + torch.arange(1, pad + 1, device=positions.device)])
        return h, positions


def unsupported(stack: LayerStack) -> str | None:
    """Why the compiled steps cannot run this stack (None: they can)."""
    if type(stack) is not LayerStack:
        return f"{type(stack).__name__}: the steps run the Llama layer math (LayerStack._project_qkv) only"
    if stack.exact_rows:
        return ("half precision on CPU verifies row by row, each row a decode step's bits (LayerStack.exact_rows): "
                "a static graph attends the rows as one batch")
    if len({lay.device for lay in stack.layers} | {stack.head_device}) > 1:
        return "the model spans several devices (device_map): a graph moves no tensor between them"
    return None


@torch.inference_mode()
def check(stack: LayerStack, steps: Compiled, method, tokens: int = 12, prompt: int = 5) -> str | None:
    """A short greedy decode of random ids with `method` (a copy) both ways — the stack's own loop, then with the
    compiled steps — None when the tokens agree, else what differed. Tokens, not bits: inductor reorders reductions."""
    from del_bench.engine.decode import Engine  # the engine imports the stack, which holds these steps
    from del_bench.engine.sampling import Sampling

    ids = torch.randint(0, stack.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    outputs = []
    for use in (None, steps):
        stack.compiled = use
        try:
            outputs.append(Engine(stack, Sampling(), set()).generate(ids, copy.deepcopy(method), tokens, 0).output_ids)
        finally:
            stack.compiled = None  # the caller installs the choice
    if outputs[0] != outputs[1]:
        return f"a greedy decode departs from the {stack.layer_path} loop's (tokens {outputs[1]} vs {outputs[0]})"
    return None


@torch.inference_mode()
def step_seconds(stack: LayerStack, steps: Compiled | None, context: int = 128, reps: int = 10) -> float:
    """Median seconds of one position through all L layers at `context` cached positions: with `steps` (compiled),
    or the stack's own loop (None)."""
    cache = stack.new_cache(context + 1)
    stack.compiled = None
    stack.forward_layers(stack.embed(torch.zeros(1, context, dtype=torch.long)), 0, stack.num_layers, 0, cache)
    x = stack.embed(torch.zeros(1, 1, dtype=torch.long))  # [1, 1, D]
    stack.compiled = steps
    try:
        return statistics.median(stack._seconds(lambda: stack.forward_layers(x, 0, stack.num_layers, context, cache),
                                                reps, warmup=2))
    finally:
        stack.compiled = None


def choose(stack: LayerStack, setting: str, method, max_new_tokens: int, backend: str = "inductor") -> dict:
    """Install (stack.compiled) the compiled steps for `setting` — off; on (an error where they cannot be compiled
    or depart from the stack's loop); auto (used where they compile, agree and one position through all layers is
    faster than the stack's loop here, else the stack's loop with the reason logged) — and return what the run's
    setup records: the setting, whether they run, compile_s (compiling the graphs and checking them, apart from any
    decode), the per-step milliseconds both ways (auto) and the reason when they do not run."""
    setting = compile_setting(setting)
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"compile={setting!r}: choose one of {', '.join(COMPILE_CHOICES)}")
    stack.compiled = None
    info: dict = {"compile": setting, "compiled": False}
    if setting == "off":
        return info
    t0 = time.perf_counter()
    try:
        reason = unsupported(stack)
        if reason:
            raise CompileUnavailable(reason)
        steps = Compiled(stack, backend=backend)
        shape = method.static_shape()  # a fixed exit layer and budget (LS, FS, DV, DEL-γ): their graphs; else Vanilla's
        budget = min(shape.max_draft, max(max_new_tokens - 1, 0)) if shape else 0
        exit_layer = shape.exit_layer if shape else None
        try:
            steps.prepare(exit_layer, budget)
            mismatch = check(stack, steps, method)
        except Exception as err:  # a graph break (fullgraph), an unsupported op, a compiler failure: all mean "off"
            raise CompileUnavailable(f"compiling the steps failed ({type(err).__name__}: {err})") from err
        if mismatch:
            raise CompileUnavailable(mismatch)
        if setting == "auto":
            eager_s, compiled_s = step_seconds(stack, None), step_seconds(stack, steps)
            info["step_ms"] = {stack.layer_path: 1e3 * eager_s, "compiled": 1e3 * compiled_s}
            if compiled_s >= eager_s:
                raise CompileUnavailable(f"one position through the layers takes {1e3 * compiled_s:.2f} ms compiled, "
                                         f"{1e3 * eager_s:.2f} ms on the {stack.layer_path} loop")
    except CompileUnavailable as err:
        info.update(compile_s=time.perf_counter() - t0, reason=str(err))
        if setting == "on":
            raise
        log.warning("compile=auto: decoding without the compiled steps (same tokens, records say so): %s", err)
        return info
    stack.compiled = steps
    info.update(compiled=True, compile_s=time.perf_counter() - t0, graphs=len(steps._seen))
    return info
