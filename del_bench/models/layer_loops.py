"""The loops over a LayerStack's decoder layers (a mixin of models/layer_stack.LayerStack): one row's pass through
layers [a, b) — the eager Python loop, or the fused C++ loop (models/fused.py) with the same ops on the same tensors
— the same with sublayers skipped (SWIFT's draft model), a selection's candidate branches, and several rows of a
batch at once on the fused loop (each row its own positions and sublayers). Every layer writes its keys and values
into the stack's preallocated cache (models/kv_cache.py) and runs on its own device (device_map)."""

from __future__ import annotations

import platform
import statistics

import torch

from del_bench.models.kv_cache import KVCache, TreeMask
from del_bench.models.layer_math import Layer, moved, seconds_of
from del_bench.models.products import COPIED, FEW_ROWS, LAYER_SHAPES, WT_X, X_WT, packed
from del_bench.numerics import HALF_DTYPES


class LayerLoops:
    """LayerStack's passes over its layers (the stack holds the weights, caches' layout, rotary tables and the layer
    math these call: _attention's projections, attend_layer, mlp), the fused loop's setup, and their timing."""

    def use_loop(self, ext, setup_s: float) -> None:
        """Run the decoder layers on the fused C++ loop `ext` (models/fused.py), or on the eager Python loop (None);
        `layer_path` names it, `layer_setup_s` is what building, loading and checking it took (apart from any
        decode)."""
        self.fused, self.layer_path, self.layer_setup_s = ext, "eager" if ext is None else "fused", setup_s

    def _fused_layer(self, i: int, rows: int) -> tuple[torch.Tensor, ...]:
        """Layer i's 6 tensors for the fused loop at `rows` rows (fused_layers.cpp's `product` reads the layout from
        each matrix: [out, in] as stored computes W @ Xᵀ, the transposed view [in, out] x @ Wᵀ)."""
        lay = self.layers[i]

        def oriented(weight: torch.Tensor, shape: str) -> torch.Tensor:
            return weight.t() if self.dtype in HALF_DTYPES or self.products[shape].at(rows) == X_WT else weight

        return (lay.w_in_norm, oriented(lay.w_qkv, "qkv"), oriented(lay.w_o, "o"), lay.w_post_norm,
                oriented(lay.w_gate_up, "gate_up"), oriented(lay.w_down, "down"))

    def _fused_family_args(self) -> tuple:
        """The fused loop's last six arguments, what the family adds to Llama's layer (fused_layers.cpp
        forward_layers): per layer its optional tensors (an empty tensor where it has none), its window (0: none) and
        rotary table, then the family's norm, activation and soft cap. Empty lists for Llama's layer, whose loop runs
        Llama's ops unchanged."""
        extras = [(lay.b_qkv, lay.w_q_norm, lay.w_k_norm, lay.b_o, lay.w_attn_out_norm, lay.b_gate_up, lay.b_down,
                   lay.w_mlp_out_norm) for lay in self.layers]
        none = torch.empty(0)
        present = any(t is not None for layer in extras for t in layer)
        flat = [none if t is None else t for layer in extras for t in layer] if present else []
        windows = [lay.window or 0 for lay in self.layers]
        ropes = [lay.rope for lay in self.layers]
        return (flat, windows if any(windows) else [], ropes if any(ropes) else [], self.math.family.norm == "gemma",
                self.math.activation == "gelu_pytorch_tanh", self.math.attention_softcap or 0.0)

    # ---- costs (the engine measures its own path: engine/costs.py) -------------------------
    def cost_device(self) -> str:
        """What a measured cost depends on besides the model: the devices (a GPU's name; the CPU's and torch's threads),
        the dtype and the decoder-layer loop. A costs.json recording another is never reused
        (session.measured_costs)."""
        names = [torch.cuda.get_device_name(d) if d.type == "cuda" else
                 f"cpu {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
                 for d in self.devices]
        return f"{' + '.join(dict.fromkeys(names))}, {str(self.dtype).removeprefix('torch.')}, {self.layer_path} layers"

    def seconds(self, fn, reps: int, warmup: int = 1) -> list[float]:
        """Seconds of each of `reps` calls of fn after `warmup` untimed ones, every device synchronised around each."""
        return seconds_of(fn, reps, warmup, self.synchronize)

    def forward_layers(self, h: torch.Tensor, start: int, end: int, pos: int, cache: KVCache,
                       collect: list | None = None, tree: TreeMask | None = None,
                       keep: int | None = None) -> torch.Tensor:
        """Run 0-based layers [start, end) on h: [1, T, D] holding positions pos .. pos+T-1.

        Each layer writes its keys/values at those positions and attends to [0, pos+T). With `collect`,
        every layer's output [1, T, D] is appended to it (DEL's shadow tokens read them); with `keep` too, only
        its last `keep` positions [1, keep, D], copied, so no layer's whole output outlives the next layer (DEL's
        prefill: (L−1)·w·D kept of a P-token prompt, not (L−1)·P·D). With `tree`, the T tokens are a token tree:
        slots pos .. pos+T-1 still, but RoPE positions and the mask from the tree."""
        T = h.shape[1]
        trim = collect is not None and keep is not None and keep < T
        cos, sin, mask = self.rope_and_mask(pos, T, h.device, tree)
        if self.fused is not None and start < end:
            if not trim:
                return self._forward_fused(h, start, end, pos, cache, collect, cos, sin, mask)
            for i in range(start, end):  # one layer a call, so each layer's whole output can go
                h = self._forward_fused(h, i, i + 1, pos, cache, None, cos, sin, mask)
                collect.append(h[:, -keep:].clone())
            return h
        for i in range(start, end):
            if cache.lengths[i] < pos:
                raise RuntimeError(f"layer {i} holds {cache.lengths[i]} positions; cannot write at {pos}")
            if cos.device != self.layers[i].device:  # device_map: the layers moved on to another device
                cos, sin, mask = moved(self.layers[i].device, cos, sin, mask)
            h = self._layer(i, h, pos, cos, sin, mask, cache)
            cache.lengths[i] = pos + T
            if collect is not None:
                collect.append(h[:, -keep:].clone() if trim else h)  # a clone: a view would keep all T rows alive
        return h

    def _forward_fused(self, h, start, end, pos, cache: KVCache, collect, cos, sin, mask) -> torch.Tensor:
        """forward_layers through the C++ loop (fused_layers.cpp): the same ops on the same tensors, one call."""
        short = min(cache.lengths[start:end])
        if short < pos:
            raise RuntimeError(f"layer {cache.lengths.index(short, start)} holds {short} positions; cannot write at "
                               f"{pos}")
        T = h.shape[1]
        if self.counter is not None:  # the C++ loop runs every layer of [start, end) once, whole
            self.counter.layers += end - start
        weights = self._fused_weights[min(T, 2)]  # the layouts of one row, or of several
        outs = self.fused.forward_layers(h[0], weights, cache.k, cache.v, start, end, pos, cos, sin, mask,
                                         self.n_heads, self.n_kv_heads, self.head_dim, self.eps, self.scale,
                                         collect is not None, self.exact_rows, *self._fused_family)  # each [T, D]
        cache.lengths[start:end] = [pos + T] * (end - start)
        if collect is None:
            return outs[0][None]
        collect.extend(out[None] for out in outs)  # [1, T, D] per layer
        return collect[-1]

    def forward_rows(self, hs: list[torch.Tensor], rows: list[int], positions: list[int], start: int, end: int,
                     runs: list[list[bool]], cache: KVCache, collect: bool = False
                     ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Several rows of a batch through layers [start, end) on the fused loop (fused_layers.cpp forward_rows): row
        r's states hs[r] [1, T_r, D] at positions positions[r].. in the batch cache's row rows[r]; runs: per sublayer
        (layer start + j's attention at 2j, its MLP at 2j + 1) whether each row runs it — one that idles is not
        computed. The products run over every running row's positions at once; each row's RoPE, cache write and
        attention are the single-row loop's on its slice. → (each row's output [1, T_r, D], with `collect` each row's
        output of every layer). Its cache lengths and its work's counting are the caller's (a batch's)."""
        lens = [h.shape[1] for h in hs]
        x = torch.cat([h[0] for h in hs])  # [N, D]
        at = torch.cat([torch.arange(p, p + T) for p, T in zip(positions, lens)]).to(self._cos.device)  # [N]
        cos, sin = self.rope_rows(at)  # [Rk, N, 1, hd]
        weights, packed = self._rows_weights(x.shape[0])
        outs = self.fused.forward_rows(x, weights, packed, cache.k, cache.v, start, end, rows, positions, lens,
                                       torch.tensor(runs, dtype=torch.bool).view(-1, len(hs)), cos, sin, self.n_heads,
                                       self.n_kv_heads, self.head_dim, self.eps, self.scale, collect, self.exact_rows,
                                       *self._fused_family)  # [N, D] each

        def split(out: torch.Tensor) -> list[torch.Tensor]:
            return [part[None] for part in out.split(lens)]  # [1, T_r, D] each

        parts = [split(out) for out in outs]
        states = [[layer[r] for layer in parts] for r in range(len(hs))] if collect else [[] for _ in hs]
        return split(outs[-1]), states

    def _rows_weights(self, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The fused loop's matrices for a step of `rows` positions and, 4 a layer, the copies it multiplies by instead
        (oneDNN's or the panels: products.pack; an empty tensor where none): up to FEW_ROWS the verification batches'
        layouts; wider, a batch's (`wide_products`, timed by tune_rows at its width: products_for's rule)."""
        wide = self.wide_products
        if wide is None or rows <= max(FEW_ROWS):
            return self._fused_weights[2], []
        if getattr(self, "_wide_fused", (None,))[0] is not wide:
            def oriented(weight: torch.Tensor, shape: str) -> torch.Tensor:  # a copied layout's: [out, in], its N
                return weight if wide[shape].many in (WT_X, *COPIED) else weight.t()

            none = torch.empty(0)
            weights = [t for lay in self.layers for t in (
                lay.w_in_norm, oriented(lay.w_qkv, "qkv"), oriented(lay.w_o, "o"), lay.w_post_norm,
                oriented(lay.w_gate_up, "gate_up"), oriented(lay.w_down, "down"))]
            copies = [packed(getattr(lay, f"w_{shape}"), wide[shape].many) if wide[shape].many in COPIED else None
                      for lay in self.layers for shape in LAYER_SHAPES]
            self._wide_fused = (wide, weights, [none if c is None else c for c in copies])
        return self._wide_fused[1], self._wide_fused[2]

    def forward_skipping(self, h: torch.Tensor, pos: int, cache: KVCache, skip_attn: frozenset[int],
                         skip_mlp: frozenset[int], write: bool = True, collect: list | None = None) -> torch.Tensor:
        """All layers on h: [1, T, D] (positions pos .. pos+T-1) with the sublayers named in skip_attn / skip_mlp
        (0-based layer indices) skipped: SWIFT's draft model. A skipped sublayer is a pure passthrough (no norm,
        no projection, no KV write); a layer's other sublayer still runs.

        write=True (drafting): each attention that runs writes its KV at those positions and attends to every
        entry its layer holds before them, so a draft sees the committed (full-model) KV plus this round's earlier
        drafts in the layers whose attention it runs (the only layers it reads). Layers whose attention is skipped
        keep their lengths. Verification later rewrites every layer at every drafted position.
        write=False (the optimiser's teacher-forced pass over committed tokens): nothing is written; each
        attention sees its layer's cached entries [0, pos) and the new keys of this pass (causally).
        collect: the state after every sublayer, skipped or not, is appended ([1, T, D] each, 2·L of them: layer i's
        attention then its MLP) — with nothing skipped, the full model's sublayer states (KnapSpec's selection)."""
        T = h.shape[1]
        cos, sin, mask = self.rope_and_mask(pos, T, h.device)
        for i in range(self.num_layers):
            if cos.device != self.layers[i].device:  # device_map: the layers moved on to another device
                cos, sin, mask = moved(self.layers[i].device, cos, sin, mask)
            if i not in skip_attn:
                if cache.lengths[i] < pos:
                    raise RuntimeError(f"layer {i} holds {cache.lengths[i]} positions; cannot attend at {pos}")
                h = self._attention(i, h, pos, cos, sin, mask, cache, write)
                if write:
                    cache.lengths[i] = pos + T
            if collect is not None:
                collect.append(h)
            if i not in skip_mlp:
                h = self.layer_mlp(i, h)
            if collect is not None:
                collect.append(h)
        return h

    def forward_branches(self, h: torch.Tensor, sublayers: range, pos: int, cache: KVCache,
                         tree: TreeMask) -> torch.Tensor:
        """Sublayers `sublayers` (sublayer s: layer s // 2's attention for even s, its MLP for odd s) on h: [1, T, D], a
        batch of independent branches (tree: TreeMask.branches) from position pos, writing nothing: each branch's
        attention sees the layer's cached prefix [0, pos) and its own earlier tokens. A layer-skip selection's
        candidate draft models (CLaSp, KnapSpec) run here, all candidates of one step in one batch."""
        cos, sin, mask = self.rope_and_mask(pos, h.shape[1], h.device, tree)
        for s in sublayers:
            i = s // 2
            if s % 2 == 0:
                if cache.lengths[i] < pos:
                    raise RuntimeError(f"layer {i} holds {cache.lengths[i]} positions; cannot attend at {pos}")
                h = self._attention(i, h, pos, cos, sin, mask, cache, write=False)
            else:
                h = self.layer_mlp(i, h)
        return h

    @torch.inference_mode()
    def measure_sublayers(self, contexts, warmup: int = 5, reps: int = 10) -> list[list[float]]:
        """[[n, attention seconds, MLP seconds], …]: one token through layer 0's attention at n cached positions and
        through its MLP (mean of `reps` after `warmup`), for each n in contexts — KnapSpec's latency model. Only
        layer 0's cache is allocated (a long context costs one layer's KV, not L)."""
        longest = max(contexts)
        self._ensure_rope(longest + 1)
        cache = KVCache(self, longest + 1, num_layers=1)
        cache.k[0].normal_()
        cache.v[0].normal_()
        x = self.embed(torch.zeros(1, 1, dtype=torch.long, device=self.embed_weight.device))  # [1, 1, D]

        def mean_s(fn) -> float:
            return statistics.fmean(self.seconds(fn, reps, warmup))

        out = []
        for n in sorted(contexts):
            cache.lengths[0] = n
            cos, sin, mask = self.rope_and_mask(n, 1, x.device)
            attn = mean_s(lambda n=n, cos=cos, sin=sin, mask=mask: self._attention(0, x, n, cos, sin, mask, cache,
                                                                                   write=False))
            mlp = mean_s(lambda: self.layer_mlp(0, x))
            out.append([float(n), attn, mlp])
        return out

    def _layer(self, i, h, pos, cos, sin, mask, cache: KVCache) -> torch.Tensor:
        return self.layer_mlp(i, self._attention(i, h, pos, cos, sin, mask, cache))

    def attention_inputs(self, i, h, cos, sin, mask):
        """Layer i's tensors, and h, the RoPE tables and the mask on its device (only multi-device models move);
        counts the attention sublayer while counting. → (layer, h, cos, sin, mask)"""
        w = self.layers[i]
        if self.counter is not None:
            self.counter.layers += 0.5
        if h.device != w.device:  # multi-device (device_map) models only
            h, cos, sin = h.to(w.device), cos.to(w.device), sin.to(w.device)
            mask = None if mask is None else mask.to(w.device)
        return w, h, cos, sin, mask

    def _attention(self, i, h, pos, cos, sin, mask, cache: KVCache, write: bool = True) -> torch.Tensor:
        """h + attention(norm(h)) for layer i; with write=False the new keys/values stay out of the cache."""
        w, h, cos, sin, mask = self.attention_inputs(i, h, cos, sin, mask)
        q, k_new, v_new = self.project_qkv(w, h, cos, sin)
        return self.attention_out(w, self.attend_cached(i, w, q, k_new, v_new, pos, mask, cache, write), h)

    def attend_cached(self, i, w: Layer, q, k_new, v_new, pos: int, mask, cache: KVCache,
                       write: bool = True) -> torch.Tensor:
        """q [1, H, T, hd] (positions pos..) over layer i's cached keys [0, pos) and its own k_new, v_new
        [1, KV, T, hd]: written into the cache first, or (write=False) joined to the cached prefix unwritten →
        [1, H, T, hd]."""
        end = pos + q.shape[2]
        if write:
            cache.k[i][:, :, pos:end] = k_new
            cache.v[i][:, :, pos:end] = v_new
            k, v = cache.k[i][:, :, :end], cache.v[i][:, :, :end]  # [1, KV, end, hd]
        else:  # the cached prefix [0, pos) and this pass's own keys, [1, KV, end, hd]
            k = torch.cat([cache.k[i][:, :, :pos], k_new], dim=2)
            v = torch.cat([cache.v[i][:, :, :pos], v_new], dim=2)
        return self._attend_layer(w, q, k, v, mask, pos)
