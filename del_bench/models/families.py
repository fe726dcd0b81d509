"""Decoder families: what a Llama-shaped decoder layer changes in each family, as a small description.

LayerStack runs one decoder-layer math (layer_stack.py, the eager reference; fused_layers.cpp, the C++ loop) on the
HF model's own weights. A `Family` says which of the variations below a family's HF code applies; `resolve` reads the
numbers (window sizes, caps, scales) from the model's config once, at load, into a `LayerMath`, so the layer loop
never branches on the family per op. A model whose `model_type` no family describes is refused before decoding
(`family_of`), naming the described ones: it would otherwise load and decode with the wrong math.

Each field's exact math, with the HF line it mirrors (transformers 5.23; `x` the layer input [1, T, D], the norms'
`_norm(y)` = y · rsqrt(mean(y²) + eps)):

- qkv_bias (Qwen2): q/k/v projections carry biases (modeling_qwen2.py Qwen2Attention: `nn.Linear(..., bias=True)`);
  read from the modules themselves (`bias is not None`), the field documents it. o_proj never has one there.
- qk_norm (Qwen3, Gemma 3): after the q and k projections, per head over head_dim, before RoPE:
  `q = q_norm(q_proj(x).view(1, T, H, hd))`, `k = k_norm(k_proj(x).view(1, T, KV, hd))` (modeling_qwen3.py:244-245,
  modeling_gemma3.py:345-346); the norm is of the family's `norm` kind.
- norm "llama": `w * _norm(y.float()).to(y.dtype)` (LlamaRMSNorm: variance in float32, weight in the input dtype).
  norm "gemma": `(_norm(y.float()) * (1.0 + w.float())).type_as(y)` (modeling_gemma2.py:61, modeling_gemma3.py:148):
  in float32 even for a float64 model, the product before the cast. LayerStack keeps `1.0 + w.float()` (float32) as
  the norm tensor of a gemma family (the same bits as HF computes each call).
- embed_scale (Gemma 2/3): `h0 = embedding(ids) * embed_tokens.embed_scale.to(weight.dtype)` (modeling_gemma2.py:341,
  modeling_gemma3.py:116); embed_scale is HF's float32 buffer sqrt(D) (in float64 that is float32(√D), not √D).
- sandwich_norms (Gemma 2/3): each sublayer's output is normed before the residual add:
  `h = h + post_attention_layernorm(attn(input_layernorm(h)))`,
  `h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))` (modeling_gemma2.py:318-325). Note the
  names: in Gemma HF's `post_attention_layernorm` is the attention's output norm, `pre_feedforward_layernorm` the MLP's
  input norm (Llama's `post_attention_layernorm`).
- activation: the MLP is `down(act(gate(x)) * up(x))` with act = ACT2FN[config.hidden_act] (silu) or
  ACT2FN[config.hidden_activation] (gelu_pytorch_tanh: F.gelu(approximate="tanh")), read from `activation_key`.
- attention_softcap (Gemma 2): HF's eager attention (Gemma2PreTrainedModel._supports_sdpa = False, so `generate`
  runs it): `w = (q @ repeat_kv(k)ᵀ) * scale; w = tanh(w / cap) * cap; w = w + mask;
  softmax(w, dim=-1, dtype=float32).to(q.dtype) @ repeat_kv(v)` (modeling_gemma2.py:190-203), cap =
  config.attn_logit_softcapping. A family with it uses this eager attention whenever the cap is set.
- final_softcap (Gemma 2/3): `logits = tanh(logits / cap) * cap` after the LM head (modeling_gemma2.py:519-521), cap =
  config.final_logit_softcapping (None: off).
- sliding: which layers attend over a window of W = config.sliding_window keys: "none"; "all" (Mistral, Phi-3:
  every layer when sliding_window is set, modeling_mistral.py:353); "layer_types" (Qwen2/3 with use_sliding_window,
  Gemma 2/3 local layers: config.layer_types[i] == "sliding_attention"). A query at position p sees keys at positions
  k with p − W < k ≤ p (masking_utils.py:95 `kv_idx > q_idx - sliding_window`): the last W positions, itself included.
- query_scale (Gemma 2/3): attention scale `config.query_pre_attn_scalar ** -0.5` (modeling_gemma2.py:221), else
  `head_dim ** -0.5`.
- fused_projections (Phi-3): HF stores `qkv_proj` ([q|k|v] rows) and `gate_up_proj` ([gate|up] rows) already fused
  (modeling_phi3.py:53, 205); LayerStack takes them as they are. Phi-3 MLP is `down(up * act(gate))`, the same bits.
- rope_per_layer_type (Gemma 3): the rotary module takes the layer type, `rotary_emb(x, positions, layer_type)`
  (modeling_gemma3.py:550): local layers use rope_local_base_freq, global ones rope_theta. LayerMath.rope_kinds lists
  the rotary calls, LayerMath.rope_of_layer which one each layer uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from del_bench.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """How a family's decoder layer differs from Llama's (each field: see the module docstring for its exact math)."""

    name: str
    model_types: tuple[str, ...]  # HF config.model_type values of this family
    qkv_bias: bool = False
    qk_norm: bool = False
    norm: str = "llama"  # "llama" | "gemma"
    embed_scale: bool = False
    sandwich_norms: bool = False
    activation_key: str = "hidden_act"  # the config attribute naming the MLP activation
    attention_softcap: bool = False
    final_softcap: bool = False
    sliding: str = "none"  # "none" | "all" | "layer_types"
    query_scale: bool = False
    fused_projections: bool = False
    rope_per_layer_type: bool = False


LLAMA = Family("llama", ("llama",))
QWEN2 = Family("qwen2", ("qwen2",), qkv_bias=True, sliding="layer_types")
QWEN3 = Family("qwen3", ("qwen3",), qk_norm=True, sliding="layer_types")
MISTRAL = Family("mistral", ("mistral",), sliding="all")
GEMMA2 = Family("gemma2", ("gemma2",), norm="gemma", embed_scale=True, sandwich_norms=True,
                activation_key="hidden_activation", attention_softcap=True, final_softcap=True, sliding="layer_types",
                query_scale=True)
GEMMA3 = Family("gemma3", ("gemma3_text", "gemma3"), qk_norm=True, norm="gemma", embed_scale=True, sandwich_norms=True,
                activation_key="hidden_activation", attention_softcap=True, final_softcap=True, sliding="layer_types",
                query_scale=True, rope_per_layer_type=True)
PHI3 = Family("phi3", ("phi3",), sliding="all", fused_projections=True)

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA2, GEMMA3, PHI3)


def described_model_types() -> list[str]:
    return [t for family in FAMILIES for t in family.model_types]


def family_of(config) -> Family:
    """The family of an HF config (its model_type); ConfigError naming the described ones when none describes it."""
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ConfigError(f"model_type {model_type!r} is not a described decoder family; the engine runs "
                      f"{', '.join(described_model_types())} (del_bench/models/families.py; the README's 'Model "
                      "families' says how to add one)")


def decoder_of(model):
    """(text config, decoder: embed_tokens, layers, norm, rotary_emb) of a causal LM. Gemma 3's multimodal
    Gemma3ForConditionalGeneration keeps its text decoder in model.model.language_model and its config in text_config;
    every other described family is model.model and model.config."""
    inner = model.model
    if hasattr(inner, "language_model"):
        return model.config.get_text_config(), inner.language_model
    return model.config, inner


@dataclass(frozen=True)
class LayerMath:
    """A family resolved against one model's config: the numbers the layer loop reads, per layer where they vary."""

    family: Family
    activation: str  # the ACT2FN name: "silu", "gelu_pytorch_tanh", …
    scale: float  # the attention scale
    attention_softcap: float | None
    final_softcap: float | None
    windows: tuple[int | None, ...]  # per layer: W (sees the last W positions) or None (all)
    rope_kinds: tuple[str | None, ...]  # the rotary module's calls: the layer_type argument, None for (x, positions)
    rope_of_layer: tuple[int, ...]  # per layer: index into rope_kinds
    # Llama's math exactly: LayerStack keeps its Llama loop (and its speed) for these — Llama, Qwen2 without sliding
    # layers, Mistral and Phi-3 without a window (Phi-3's fused weights are split into the same q|k|v, gate|up)
    plain: bool


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _windows(family: Family, config) -> tuple[int | None, ...]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if family.sliding == "none" or window is None:
        return (None,) * n
    if family.sliding == "all":
        return (window,) * n
    return tuple(window if kind == "sliding_attention" else None for kind in config.layer_types[:n])


def _rope(family: Family, config) -> tuple[tuple[str | None, ...], tuple[int, ...]]:
    n = config.num_hidden_layers
    if not family.rope_per_layer_type:
        return (None,), (0,) * n
    kinds = tuple(sorted(set(config.layer_types[:n])))
    return kinds, tuple(kinds.index(kind) for kind in config.layer_types[:n])


def resolve(config) -> LayerMath:
    """The family of `config` (a decoder's text config) with its numbers read once."""
    family = family_of(config)
    partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ConfigError(f"model_type {config.model_type!r} with partial_rotary_factor={partial}: only full-width "
                          "RoPE is described (Phi-3 mini/medium; not Phi-4-mini)")
    activation = getattr(config, family.activation_key)
    scale = config.query_pre_attn_scalar**-0.5 if family.query_scale else _head_dim(config) ** -0.5
    softcap = getattr(config, "attn_logit_softcapping", None) if family.attention_softcap else None
    final = getattr(config, "final_logit_softcapping", None) if family.final_softcap else None
    windows = _windows(family, config)
    kinds, of_layer = _rope(family, config)
    plain = (not (family.qk_norm or family.embed_scale or family.sandwich_norms) and family.norm == "llama"
             and activation == "silu" and softcap is None and final is None and set(windows) == {None}
             and len(kinds) == 1 and scale == _head_dim(config) ** -0.5)
    return LayerMath(family, activation, scale, softcap, final, windows, kinds, of_layer, plain)
