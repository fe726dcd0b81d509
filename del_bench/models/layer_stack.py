"""LayerStack: a Llama-family causal LM seen as embed → layers [a, b) → norm → head.

Everything that walks layers goes through here. The stack reads the HF model's own weights (no copies: the fused
q|k|v and gate|up matrices, laid out for one-row products, become the storage the HF modules view) and runs the
decoder-layer math itself with a preallocated per-layer KV cache. Why not call the HF modules: on a
2-core CPU their per-call overhead (cache objects, mask building, kwargs plumbing) costs ~20 ms per
token on SmolLM2 against a ~42 ms matmul floor. The math is HF's op for op (same RMSNorm order, the
model's own rotary module, SDPA); tests/test_engine.py proves the greedy outputs token-identical to
`model.generate` in float64.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from del_bench.models import shadow_scoring
from del_bench.models.families import LayerMath, decoder_of, resolve
from del_bench.models.kv_cache import KVCache, TreeMask, WorkCounter
from del_bench.models.layer_loops import LayerLoops
from del_bench.models.layer_math import (
    Layer,
    attend,
    attend_softcapped,
    fuse_rows,
    gemma_rms_norm,
    linear,
    rms_norm,
    softcapped,
    synchronize,
    windowed,
)
from del_bench.models.loading import check_resident
from del_bench.models.products import (
    X_WT_COPY,
    Products,
    time_products,
)
from del_bench.models.products import choose as choose_products
from del_bench.numerics import HALF_DTYPES


class LayerStack(LayerLoops):
    def __new__(cls, model: nn.Module, products: str = "wt_x"):
        """A model of a family whose layer math is not Llama's (families.py) gets a FamilyLayerStack, whose layer
        methods apply its family's math: the choice is made once here, so the Llama loop has no per-op branch. A
        model_type no family describes is refused here (ConfigError naming the described ones)."""
        if cls is LayerStack and not resolve(decoder_of(model)[0]).plain:
            cls = FamilyLayerStack
        return super().__new__(cls)

    def __init__(self, model: nn.Module, products: str = "wt_x"):
        """The stack runs the eager loop until another is installed (use_loop; engine/path_choice.stack_of chooses).
        products: the matrix products' layout — wt_x (tuned by hand), x_wt (HF's) or auto (timed here, per shape
        class: models/products.py); `products` holds the choice and its timings (the run's setup records them)."""
        check_resident(model)  # offloaded or meta weights: one clear error here, not a device mismatch mid-decode
        config, inner = decoder_of(model)  # Gemma 3's multimodal model: its text decoder
        self.model = model
        self.config = config
        self.math: LayerMath = resolve(config)  # the family's variations and numbers, read once
        self._rms = gemma_rms_norm if self.math.family.norm == "gemma" else rms_norm
        self.num_layers: int = config.num_hidden_layers
        self.n_heads: int = config.num_attention_heads
        self.n_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps: float = config.rms_norm_eps
        self.scale = self.math.scale  # head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
        self.dtype = inner.embed_tokens.weight.dtype
        # half precision on CPU: a chain over a cache attends row by row, each row a decode step's bits (attend). Not
        # on CUDA, where the GEMMs' kernels change with the row count too and a launch per row would cost more
        self.exact_rows = self.dtype in HALF_DTYPES and inner.embed_tokens.weight.device.type == "cpu"
        head = model.get_output_embeddings()
        # One device rule (device_map across GPUs): each layer runs where its weights live, its KV cache beside it;
        # token ids start on the embedding's device; everything after the layers — the final norm, exit adapters,
        # the head, shadow states and their scoring, the sampling RNG — on the head's device. One device: all one.
        self.head_device = head.weight.device
        self.norm_weight = self._norm_tensor(inner.norm).to(self.head_device)  # [D]: a copy only if it lived elsewhere
        # [V, D], HF's own storage (a tied embedding's too): linear's products read it as they read the layers'
        self.head_weight = head.weight.detach()
        self.head_bias = None if head.bias is None else head.bias.detach()
        self.embed_weight = inner.embed_tokens.weight.detach()
        # Gemma: HF's own float32 buffer √D in the weights' dtype (float32(√D) in float64: HF's bits, not √D's)
        scale = getattr(inner.embed_tokens, "embed_scale", None) if self.math.family.embed_scale else None
        self._embed_scale = None if scale is None else scale.to(self.embed_weight)
        self.vocab_size = self.head_weight.shape[0]
        self.layers = [self._wrap(layer, i) for i, layer in enumerate(inner.layers[: self.num_layers])]
        self._rotary = inner.rotary_emb
        self._cos = self._sin = torch.empty(0)
        self.adapters = None  # ExitAdapters (del_bench/models/exit_adapters.py): the early-exit heads, or own head
        self.counter: WorkCounter | None = None  # set only while counting (tests); None: no counting at all
        self.use_products(self._choose_products(products))
        self.wide_products: Products | None = None  # a batch's width (tune_rows): batched decoding's ragged steps
        self._fused_family = self._fused_family_args()
        self.use_loop(None, 0.0)

    def use_products(self, chosen: Products) -> None:
        """Run the matrix products in `chosen`'s layouts (at load; a resumed run: the layouts its first session chose,
        so that one run's records are one layout's bits). The head's one-row copy and the fused loop's matrices
        follow."""
        self.products = chosen
        # a single head row as x @ W_t from a [D, V] copy where that layout was chosen: a second copy, so only then
        self.head_t = self.head_weight.t().contiguous() if chosen["head"].one == X_WT_COPY else None
        # the fused loop's arguments: 6 tensors per layer (fused_layers.cpp), in one flat list per row class (one row,
        # several), each matrix in that row class's layout: HF's [out, in] for wt_x, its transposed view for x_wt
        self._fused_weights = {rows: [t for i in range(self.num_layers) for t in self._fused_layer(i, rows)]
                               for rows in (1, 2)}

    def _choose_products(self, setting: str) -> Products:
        """The products' layout for `setting` (models/products.choose): under auto, timed on this stack's own
        matrices, at the thread count, dtype and device at hand."""
        with torch.inference_mode():
            return choose_products(setting, self.dtype, time_products(self))

    @contextmanager
    def counting(self) -> Iterator[WorkCounter]:
        """Count the layers, sublayers and head rows this stack executes inside the block (tests)."""
        self.counter = WorkCounter()
        try:
            yield self.counter
        finally:
            self.counter = None

    def set_adapters(self, adapters) -> None:
        """Draft heads (and shadow tokens) of layers with an adapter become head(norm(h) @ A + b); None: own head."""
        if adapters is not None:
            adapters = adapters.to(self.dtype, self.head_device)
        self.adapters = adapters

    @property
    def devices(self) -> list[torch.device]:
        """Every device the stack computes on (several under a device_map), each once."""
        return list(dict.fromkeys([self.embed_weight.device, *(lay.device for lay in self.layers), self.head_device]))

    def synchronize(self) -> None:
        """Wait for the queued kernels of every device the stack uses, before reading a clock (no-op on CPU)."""
        for device in self.devices:
            synchronize(device)

    def _wrap(self, layer: nn.Module, index: int) -> Layer:
        """Layer `index`'s tensors, read from its family's modules (families.py)."""
        family = self.math.family
        attn, mlp = layer.self_attn, layer.mlp
        if family.fused_projections:  # Phi-3 stores q|k|v and gate|up fused already, in this layout
            qkv, gate_up = [attn.qkv_proj], [mlp.gate_up_proj]
        else:
            qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        w_qkv, b_qkv = fuse_rows(qkv)
        w_gate_up, b_gate_up = fuse_rows(gate_up)
        w_o, b_o = fuse_rows([attn.o_proj])
        w_down, b_down = fuse_rows([mlp.down_proj])
        # the MLP's input norm: Llama's post_attention_layernorm; with sandwich norms that name is the attention's
        # output norm, and the MLP's input norm is pre_feedforward_layernorm
        sandwich = family.sandwich_norms
        mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        return Layer(
            w_in_norm=self._norm_tensor(layer.input_layernorm),
            w_qkv=w_qkv,
            b_qkv=b_qkv,
            w_o=w_o,
            b_o=b_o,
            w_post_norm=self._norm_tensor(mlp_norm),
            w_gate_up=w_gate_up,
            b_gate_up=b_gate_up,
            w_down=w_down,
            b_down=b_down,
            device=w_qkv.device,
            w_q_norm=self._norm_tensor(attn.q_norm) if family.qk_norm else None,
            w_k_norm=self._norm_tensor(attn.k_norm) if family.qk_norm else None,
            w_attn_out_norm=self._norm_tensor(layer.post_attention_layernorm) if sandwich else None,
            w_mlp_out_norm=self._norm_tensor(layer.post_feedforward_layernorm) if sandwich else None,
            window=self.math.windows[index],
            rope=self.math.rope_of_layer[index],
        )

    def _norm_tensor(self, norm: nn.Module) -> torch.Tensor:
        """The tensor self._rms applies: the weight itself (Llama), or Gemma's 1 + w in float32 (HF computes
        `1.0 + self.weight.float()` at every call: the same bits, once)."""
        weight = norm.weight.detach()
        return 1.0 + weight.float() if self.math.family.norm == "gemma" else weight

    # ---- pieces -----------------------------------------------------------------------------
    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """A KV cache of max_len positions (batch rows: a batched run's shared cache, KVCache.row)."""
        self._ensure_rope(max_len)
        return KVCache(self, max_len, batch=batch)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [1, T] → h: [1, T, D]"""
        return F.embedding(ids.to(self.embed_weight.device), self.embed_weight)

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h.to(self.norm_weight.device), self.norm_weight, self.eps)

    def head(self, h_normed: torch.Tensor) -> torch.Tensor:
        """h_normed: [1, T, D] → logits [1, T, V] (the model's own LM head, full vocabulary): T head rows."""
        if self.counter is not None:
            self.counter.head_rows += h_normed.shape[:-1].numel()
        return self.head_logits(h_normed)

    def head_logits(self, h_normed: torch.Tensor) -> torch.Tensor:
        """head, uncounted (shadow scoring counts its rows as shadow rows)."""
        h_normed = h_normed.to(self.head_weight.device)
        if self.head_t is None or h_normed.shape[1] > 1:
            return linear(h_normed, self.head_weight, self.head_bias, layout=self.products["head"])
        logits = h_normed @ self.head_t  # [1, 1, V]
        return logits if self.head_bias is None else logits + self.head_bias

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))

    def exit_input(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """h: [..., D] pre-norm state after 1-based `layer` → the head's input: norm(h), through the layer's exit
        adapter when one is loaded (norm(h) @ A + b)."""
        hn = self.norm(h)
        if self.adapters is None:
            return hn
        if self.counter is not None and layer in self.adapters.index:
            self.counter.adapter_rows += hn.shape[-2]
        return self.adapters.apply(hn, layer)

    def has_adapter(self, layer: int) -> bool:
        return self.adapters is not None and layer in self.adapters.index

    def exit_logits(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """The early-exit head at 1-based `layer`: h [1, T, D] → logits [1, T, V] (own head, or its adapter)."""
        return self.head(self.exit_input(h, layer))

    def exit_rows(self, states: torch.Tensor, layers: torch.Tensor | None) -> torch.Tensor:
        """states [N, D] (pre-norm), layers [N] (1-based layer of each row, or None: own head) → head inputs [N, D]."""
        hn = self.norm(states[None])[0]
        if self.adapters is None or layers is None:
            return hn
        out = hn.clone()
        for layer in layers.unique().tolist():
            if layer in self.adapters.index:
                rows = layers == layer
                out[rows] = self.adapters.apply(hn[rows], layer)
        return out

    def _ensure_rope(self, max_len: int) -> None:
        """cos/sin tables for positions [0, max_len) from the model's own rotary module."""
        if self._cos.shape[0] >= max_len:
            return
        probe = self.embed_weight[:1]
        positions = torch.arange(max_len, device=probe.device)[None]
        cos, sin = self._rotary(probe, positions)  # [1, S, hd]
        # rotate_half(x)·sin == roll(x, hd/2)·(sign·sin) with sign = [-1]*hd/2 + [1]*hd/2: negation is
        # exact, so this is HF's result with one op fewer per layer
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin)
        self._cos, self._sin = cos[0], sin[0] * sign

    # ---- pieces the loops share ----------------------------------------------------------------
    def shadow_tokens(self, states: torch.Tensor, targets: torch.Tensor | None = None, vocab: int | None = None,
                      chunk: int = 64, layers: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """DEL's shadow tokens of states [N, D] (models/shadow_scoring.py): ([N] ids, [N] confidences)."""
        return shadow_scoring.shadow_tokens(self, states, targets, vocab, chunk, layers)

    def rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, N, 1, hd] at positions [N] (the fused loop's tables: one per rotary kind)."""
        return self._cos[positions][None, :, None, :], self._sin[positions][None, :, None, :]

    def rope_and_mask(self, pos: int, T: int, device, tree: TreeMask | None = None):
        """cos, sin [1, T, 1, hd] (broadcast over heads; sin signed, see _ensure_rope) and the attention mask
        [T, pos+T] of T new positions from pos. A chain: positions pos.., bottom-right-aligned causal mask (query i
        sees keys 0..pos+i). No mask (None) where SDPA needs none, as HF's sdpa_attention_forward passes none, so that
        SDPA may choose its flash / memory-efficient kernels (and rounds as HF's call does): a single query sees every
        cached key; a prefill from an empty cache (pos 0) is `is_causal`; with `exact_rows`, a chain over a cache runs
        row by row (see attend). A tree: positions pos + depth, each node sees the prefix, its ancestors and itself."""
        if tree is None:
            cos, sin = self._cos[pos : pos + T], self._sin[pos : pos + T]
            mask = None
            # is_causal would be top-left aligned here: wrong with a cache (docs/design.md §2.7), so a mask or rows
            if T > 1 and pos > 0 and not self.exact_rows:
                keys = torch.arange(pos + T, device=device)
                mask = keys[None, :] <= (pos + torch.arange(T, device=device))[:, None]
        else:
            positions = pos + tree.depth.to(device)  # [T]
            cos, sin = self._cos[positions], self._sin[positions]
            prefix = torch.ones(T, pos, dtype=torch.bool, device=device)
            mask = torch.cat([prefix, tree.ancestors.to(device)], dim=1)
        return cos[None, :, None, :], sin[None, :, None, :], mask

    def rope_tables(self) -> list[torch.Tensor]:
        """The rotary tables rope_at reads (the static-shape steps mark their length dynamic, and CUDA graphs keep
        them alive): cos and sin [S, hd]; a family with several rotary kinds, its stacked [R, S, hd]."""
        return [self._cos, self._sin]

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, hd] at positions [B, T] given as a device tensor (no host read): the tables of
        rope_and_mask for a static-shape step (engine/compiled.py), each row at its own positions; the tables must
        cover them (new_cache)."""
        return self._cos[positions][:, :, None, :], self._sin[positions][:, :, None, :]

    # ---- one decoder layer's math: the eager loop above and the static-shape steps (engine/compiled.py) both run
    # these, on h [B, T, D] (the eager loop: B = 1); FamilyLayerStack overrides them with its family's variations
    def project_qkv(self, w: Layer, h, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention's inputs for h [B, T, D]: q [B, H, T, hd] and the new keys, values [B, KV, T, hd], RoPE applied
        (cos, sin [B or 1, T, 1, hd]). Apart from the cache write and the attention so that a static-shape step
        (positions as a tensor) runs these same ops."""
        B, T, H, KV, hd = h.shape[0], h.shape[1], self.n_heads, self.n_kv_heads, self.head_dim
        x = rms_norm(h, w.w_in_norm, self.eps)
        qkv = linear(x, w.w_qkv, w.b_qkv, layout=self.products["qkv"]).view(B, T, H + 2 * KV, hd)
        # RoPE on q and k together: [B, T, H+KV, hd]; same elementwise ops as apply_rotary_pos_emb
        qk = qkv[:, :, : H + KV]
        qk = qk * cos + torch.roll(qk, hd // 2, dims=-1) * sin
        return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), qkv[:, :, H + KV :].transpose(1, 2)

    def _attend_layer(self, w: Layer, q, k, v, mask, pos: int) -> torch.Tensor:
        """q [1, H, T, hd] (positions pos..) over the keys and values [1, KV, S, hd] a cached chain reads: attend."""
        return attend(q, k, v, mask, pos, self.scale, self.n_kv_heads != self.n_heads, self.exact_rows)

    def attend_static(self, w: Layer, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, hd] over a whole static cache k, v [B, KV, S, hd] under mask [B, 1, T, S] (static_mask: the
        causal and, for a windowed layer, the window's bounds, per row) → [B, H, T, hd]: the static-shape steps'
        attention, SDPA with an explicit mask as HF's sdpa_attention_forward calls it with one."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                              enable_gqa=self.n_kv_heads != self.n_heads)

    def attention_out(self, w: Layer, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + o_proj(attn): attn [B, H, T, hd] → [B, T, D]."""
        B, T = h.shape[0], h.shape[1]
        return linear(attn.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim), w.w_o, w.b_o, residual=h,
                       layout=self.products["o"])

    def mlp(self, w: Layer, h: torch.Tensor) -> torch.Tensor:
        """h + MLP(norm(h)) for the layer w: [B, T, D] → [B, T, D]."""
        x = rms_norm(h, w.w_post_norm, self.eps)
        gate, up = linear(x, w.w_gate_up, w.b_gate_up, layout=self.products["gate_up"]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, w.w_down, w.b_down, residual=h, layout=self.products["down"])

    def mlp_inputs(self, i, h):
        """Layer i's tensors and h on its device; counts the MLP sublayer while counting. → (layer, h)"""
        w = self.layers[i]
        if self.counter is not None:
            self.counter.layers += 0.5
        return w, (h if h.device == w.device else h.to(w.device))

    def layer_mlp(self, i, h) -> torch.Tensor:
        """h + MLP(norm(h)) for layer i (counted, on its device)."""
        return self.mlp(*self.mlp_inputs(i, h))


class FamilyLayerStack(LayerStack):
    """A LayerStack of a family whose layer math is not Llama's (families.py; LayerStack.__new__ chooses it): each
    method below is Llama's plus what the family's LayerMath switches on, per layer where it varies (the q/k norms,
    sandwich norms, window, rotary table live on Layer). The reference for the fused loop, which takes the same
    per-layer extras (_fused_family_args)."""

    def __init__(self, model: nn.Module, products: str = "wt_x"):
        from transformers.activations import ACT2FN  # the MLP activation HF's own modules use

        self._act = ACT2FN[resolve(decoder_of(model)[0]).activation]
        self._window_memo: tuple = ()
        super().__init__(model, products)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [1, T] → h: [1, T, D], times Gemma's embedding scale (HF: embedding(ids) * embed_scale)."""
        h = F.embedding(ids.to(self.embed_weight.device), self.embed_weight)
        return h if self._embed_scale is None else h * self._embed_scale

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        return self._rms(h.to(self.norm_weight.device), self.norm_weight, self.eps)

    def head_logits(self, h_normed: torch.Tensor) -> torch.Tensor:
        logits = super().head_logits(h_normed)
        cap = self.math.final_softcap
        return logits if cap is None else softcapped(logits, cap)

    def _ensure_rope(self, max_len: int) -> None:
        """Each of LayerMath.rope_kinds from the model's own rotary module (Gemma 3: `rotary_emb(x, positions,
        layer_type)`): _rope_kinds_cos/_sin [R, S, hd]; _cos/_sin stay the first's [S, hd]."""
        if self._cos.shape[0] >= max_len:
            return
        probe = self.embed_weight[:1]
        positions = torch.arange(max_len, device=probe.device)[None]
        tables = [self._rotary(probe, positions, *(() if kind is None else (kind,))) for kind in self.math.rope_kinds]
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(tables[0][1])  # see LayerStack._ensure_rope
        self._rope_kinds_cos = torch.stack([cos[0] for cos, _ in tables])  # [R, S, hd]
        self._rope_kinds_sin = torch.stack([sin[0] * sign for _, sin in tables])
        self._cos, self._sin = self._rope_kinds_cos[0], self._rope_kinds_sin[0]

    def rope_and_mask(self, pos: int, T: int, device, tree: TreeMask | None = None):
        """LayerStack's, with cos, sin [R, T, 1, hd]: one table per rotary kind (a layer reads cos[Layer.rope])."""
        _, _, mask = super().rope_and_mask(pos, T, device, tree)
        positions = torch.arange(pos, pos + T) if tree is None else pos + tree.depth
        positions = positions.to(self._rope_kinds_cos.device)
        return self._rope_kinds_cos[:, positions, None, :], self._rope_kinds_sin[:, positions, None, :], mask

    def rope_tables(self) -> list[torch.Tensor]:
        return [self._rope_kinds_cos, self._rope_kinds_sin]

    def rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """LayerStack's, with cos, sin [R, N, 1, hd]: one table per rotary kind."""
        return self._rope_kinds_cos[:, positions, None, :], self._rope_kinds_sin[:, positions, None, :]

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """LayerStack's, with cos, sin [R, B, T, 1, hd]: one table per rotary kind (a layer reads cos[Layer.rope])."""
        return self._rope_kinds_cos[:, positions, None, :], self._rope_kinds_sin[:, positions, None, :]

    def project_qkv(self, w: Layer, h, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """LayerStack's, the family's way: q/k biases (in w_qkv's bias), q/k norms, the layer's rotary table
        (cos, sin [R, …, T, 1, hd] → cos[w.rope])."""
        B, T, H, KV, hd = h.shape[0], h.shape[1], self.n_heads, self.n_kv_heads, self.head_dim
        qkv = linear(self._rms(h, w.w_in_norm, self.eps), w.w_qkv, w.b_qkv, layout=self.products["qkv"])
        qkv = qkv.view(B, T, H + 2 * KV, hd)
        q, k_new, v_new = qkv[:, :, :H], qkv[:, :, H : H + KV], qkv[:, :, H + KV :]
        if w.w_q_norm is not None:  # Qwen3, Gemma 3: per head over head_dim, before RoPE
            q, k_new = self._rms(q, w.w_q_norm, self.eps), self._rms(k_new, w.w_k_norm, self.eps)
        cos, sin = cos[w.rope], sin[w.rope]  # [(B,) T, 1, hd]: this layer's rotary table
        q = (q * cos + torch.roll(q, hd // 2, dims=-1) * sin).transpose(1, 2)  # [B, H, T, hd]
        k_new = (k_new * cos + torch.roll(k_new, hd // 2, dims=-1) * sin).transpose(1, 2)  # [B, KV, T, hd]
        return q, k_new, v_new.transpose(1, 2)

    def attention_out(self, w: Layer, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """LayerStack's, with the sandwich norm on the attention's output where the family has one."""
        B, T = h.shape[0], h.shape[1]
        out = attn.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if w.w_attn_out_norm is None:
            return linear(out, w.w_o, w.b_o, residual=h, layout=self.products["o"])
        return h + self._rms(linear(out, w.w_o, w.b_o, layout=self.products["o"]), w.w_attn_out_norm, self.eps)

    def attend_static(self, w: Layer, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        """LayerStack's (the window is in the mask: static_mask), or the soft-capped eager attention under it."""
        cap = self.math.attention_softcap
        if cap is not None:
            return attend_softcapped(q, k, v, mask, 0, self.scale, cap)
        return super().attend_static(w, q, k, v, mask)

    def _attend_layer(self, w: Layer, q, k, v, mask, pos: int) -> torch.Tensor:
        """q [1, H, T, hd] over k, v [1, KV, S, hd] with the layer's window (where it reaches back past key 0) and the
        family's attention (SDPA, or the soft-capped eager attention)."""
        T, S = q.shape[2], k.shape[2]
        if w.window is not None and pos + T > w.window:
            if T == 1:  # one query: its window is the last `window` keys
                k, v = k[:, :, S - w.window :], v[:, :, S - w.window :]
                mask = None if mask is None else mask[:, S - w.window :]
            else:
                mask = self._window_mask(mask, pos, T, S, w.window, q.device)
        cap = self.math.attention_softcap
        if cap is not None:
            return attend_softcapped(q, k, v, mask, pos, self.scale, cap)
        return attend(q, k, v, mask, pos, self.scale, self.n_kv_heads != self.n_heads, self.exact_rows)

    def _window_mask(self, mask, pos: int, T: int, S: int, window: int, device) -> torch.Tensor:
        """windowed, computed once per forward call and window (the layers of a call share mask, pos and T)."""
        key = (mask, pos, T, S, window, device)
        memo = self._window_memo
        if memo and memo[0] is mask and memo[1:-1] == key[1:]:
            return memo[-1]
        made = windowed(mask, pos, T, S, window, device)
        self._window_memo = (*key, made)
        return made

    def mlp(self, w: Layer, h: torch.Tensor) -> torch.Tensor:
        """LayerStack's: the family's activation and, with sandwich norms, its output norm."""
        x = self._rms(h, w.w_post_norm, self.eps)
        gate, up = linear(x, w.w_gate_up, w.b_gate_up, layout=self.products["gate_up"]).chunk(2, dim=-1)
        act = self._act(gate) * up
        if w.w_mlp_out_norm is None:
            return linear(act, w.w_down, w.b_down, residual=h, layout=self.products["down"])
        return h + self._rms(linear(act, w.w_down, w.b_down, layout=self.products["down"]), w.w_mlp_out_norm, self.eps)


def verifier_logits(stack: LayerStack, h_normed: torch.Tensor, counted: bool = True) -> torch.Tensor:
    """h_normed: [1, T, D] verified rows → logits [T, V]: one product, or row by row where each row must keep a decode
    step's bits (LayerStack.exact_rows: CPU half precision, whose GEMM may round by the row count). counted: as
    LayerStack.head (else head_logits: the caller counts the rows)."""
    head = stack.head if counted else stack.head_logits
    if stack.exact_rows:
        return torch.cat([head(h_normed[:, i : i + 1])[0] for i in range(h_normed.shape[1])])
    return head(h_normed)[0]
