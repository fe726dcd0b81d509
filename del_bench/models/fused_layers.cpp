// The decoder-layer loop of LayerStack.forward_layers in C++ (del_bench/models/fused.py builds it).
//
// The same ATen ops, in the same order, on the same tensors as the eager Python loop (layer_stack.py
// _attention / _mlp), so the results are the same bits (fused.py checks that on the machine at hand before it is
// used). What it removes is the Python around each op: on a 2-core CPU that is ~100 µs per layer, more than the
// matmuls of a small model's layer take. The layer of every described family (models/families.py: Llama's, plus the
// family's biases, q/k norms, Gemma's norms, sandwich norms, activation, soft cap, windows and rotary tables), on one
// device only (fused.py says why not otherwise).
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

using torch::Tensor;

// layer_stack.rms_norm, branch for branch (LlamaRMSNorm's bits: variance in float32, weight in the input dtype)
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  if (x.scalar_type() != at::kFloat) {
    Tensor x32 = x.to(at::kFloat);
    Tensor normed = x.is_cpu() ? at::rms_norm(x32, {x.size(-1)}, c10::nullopt, eps)
                               : x32 * at::rsqrt(x32.pow(2).mean(-1, true) + eps);
    return weight * normed.to(x.scalar_type());
  }
  if (x.is_cpu()) return at::rms_norm(x, {x.size(-1)}, weight, eps);
  return weight * (x * at::rsqrt(x.pow(2).mean(-1, true) + eps));
}

// layer_stack.gemma_rms_norm (Gemma2RMSNorm's bits): everything in float32 — a float64 model's states go down to
// float32 and back — with `one_plus_w` = 1 + w.float() [D] (or [hd]), computed once at load
Tensor gemma_norm(const Tensor& x, const Tensor& one_plus_w, double eps) {
  Tensor x32 = x.to(at::kFloat);
  Tensor normed = x.is_cpu() ? at::rms_norm(x32, {x.size(-1)}, c10::nullopt, eps)
                             : x32 * at::rsqrt(x32.pow(2).mean(-1, true) + eps);
  return (normed * one_plus_w).to(x.scalar_type());
}

// layer_math.linear without a bias (models/products.product): x [T, in] times a matrix (+ residual [T, out]) →
// [T, out], in the layout LayerStack chose for this product at this row count, which the matrix carries:
// - HF's [out, in] as stored: wt_x, W @ Xᵀ with X at least two rows (MKL's few-column GEMM), the residual joined in
//   one addmm;
// - its transposed view [in, out] (strides (1, in)): x_wt, HF's x @ Wᵀ, the residual joined in one addmm, but in half
//   precision (always x_wt) added as its own op, which rounds as HF does.
Tensor product(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& residual) {
  if (weight.stride(1) != 1) {  // x_wt: weight is Wᵀ, a view
    const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
    if (residual && !half) return at::addmm(*residual, x, weight);
    Tensor y = at::mm(x, weight);
    return residual ? *residual + y : y;
  }
  const int64_t T = x.size(0);
  Tensor rows = T > 1 ? x : x.expand({2, x.size(1)}).contiguous();  // [T', in], T' >= 2
  Tensor y = residual ? at::addmm(residual->t(), weight, rows.t()) : at::mm(weight, rows.t());  // [out, T']
  return y.narrow(1, 0, T).t().contiguous();
}

// layer_math.attend: SDPA of q [1, H, T, hd] over k, v [1, KV, pos+T, hd]. No mask over several queries: from an
// empty cache is_causal, over a cache row by row (each row the single-query call of a decode step); a tree with
// `exact` row by row too, each node over the keys its mask row selects.
Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& mask, int64_t pos,
              double scale, bool gqa, bool exact) {
  const int64_t T = q.size(2);
  if (exact && mask && T > 1) {
    std::vector<Tensor> rows;
    for (int64_t i = 0; i < T; ++i) {
      Tensor keys = (*mask)[i].nonzero().squeeze(1);  // node i's key slots: the prefix, then its ancestors
      rows.push_back(at::scaled_dot_product_attention(q.narrow(2, i, 1), k.index_select(2, keys),
                                                      v.index_select(2, keys), c10::nullopt, 0.0, false, scale, gqa));
    }
    return at::cat(rows, 2);
  }
  if (!mask && T > 1 && pos > 0) {
    std::vector<Tensor> rows;
    for (int64_t i = 0; i < T; ++i)
      rows.push_back(at::scaled_dot_product_attention(q.narrow(2, i, 1), k.narrow(2, 0, pos + i + 1),
                                                      v.narrow(2, 0, pos + i + 1), c10::nullopt, 0.0, false, scale,
                                                      gqa));
    return at::cat(rows, 2);
  }
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, !mask && T > 1, scale, gqa);
}

// A family's optional tensors per layer (LayerStack._fused_family), in this order; an empty tensor where the layer has
// none. A model with none of them (Llama) passes no extras at all and runs the Llama ops, unchanged.
enum Extra { QKV_BIAS, Q_NORM, K_NORM, O_BIAS, ATTN_OUT_NORM, GATE_UP_BIAS, DOWN_BIAS, MLP_OUT_NORM, EXTRAS };

bool has(const Tensor* e, Extra which) { return e != nullptr && e[which].numel() > 0; }

// What a family changes in the layer's math beyond its tensors (all false / 0: Llama's)
struct Family {
  bool gemma_norm;  // every norm (the q/k norms too) is gemma_norm, its weights 1 + w in float32
  bool gelu_tanh;   // the MLP's activation is gelu_pytorch_tanh, not silu
  double softcap;   // attention logits soft-capped, tanh(s / cap) · cap, in HF's eager attention (Gemma 2); 0: none
};

Tensor norm(const Tensor& x, const Tensor& weight, double eps, const Family& f) {
  return f.gemma_norm ? gemma_norm(x, weight, eps) : rms_norm(x, weight, eps);
}

// layer_math.causal: [T, S] bool, query i (position pos + i) sees keys 0 .. pos + i
Tensor causal(int64_t pos, int64_t T, int64_t S, const at::Device& device) {
  auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  return at::arange(S, longs).unsqueeze(0) <= (at::arange(T, longs) + pos).unsqueeze(1);
}

// layer_math.windowed: the mask of T queries from slot pos over S keys (none: a causal chain) restricted to a sliding
// window, keys at positions p − window < k ≤ p for the query at position p; a query's position is pos + the keys it
// sees among slots pos.. − 1 (a tree node's depth), a slot before pos holds its own
Tensor windowed(const c10::optional<Tensor>& mask, int64_t pos, int64_t T, int64_t S, int64_t window,
                const at::Device& device) {
  Tensor m = mask ? *mask : causal(pos, T, S, device);
  Tensor query_pos = m.narrow(1, pos, S - pos).sum(-1) + (pos - 1);                   // [T]
  Tensor key_pos = at::cat({at::arange(pos, query_pos.options()), query_pos});         // [S]
  return m & (key_pos.unsqueeze(0) > (query_pos - window).unsqueeze(1));
}

// layer_math.attend_softcapped (HF's eager attention with Gemma 2's logit soft cap): q [1, H, T, hd] over k, v
// [1, KV, S, hd]: softmax(cap · tanh(q kᵀ · scale / cap), masked) in float32, cast back, times v
Tensor attend_softcapped(const Tensor& q, const Tensor& k, const Tensor& v, c10::optional<Tensor> mask, int64_t pos,
                         double scale, double cap) {
  const int64_t T = q.size(2), S = k.size(2), groups = q.size(1) / k.size(1);
  Tensor keys = k.repeat_interleave(groups, 1), values = v.repeat_interleave(groups, 1);  // repeat_kv: [1, H, S, hd]
  Tensor weights = at::matmul(q, keys.transpose(2, 3)) * scale;                            // [1, H, T, S]
  weights = at::tanh(weights / cap) * cap;
  if (!mask && T > 1) mask = causal(pos, T, S, q.device());
  if (mask) weights = weights.masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(weights, -1, at::kFloat).to(q.scalar_type()), values);
}

// The windowed masks of one forward_layers call, one per window size: its layers share the mask, pos and T
struct WindowMasks {
  std::vector<std::pair<int64_t, Tensor>> made;

  Tensor get(const c10::optional<Tensor>& mask, int64_t pos, int64_t T, int64_t S, int64_t window,
             const at::Device& device) {
    for (const auto& [w, m] : made)
      if (w == window) return m;
    made.emplace_back(window, windowed(mask, pos, T, S, window, device));
    return made.back().second;
  }
};

// layer_stack.FamilyLayerStack._attend_layer: the layer's window (where it reaches back past key 0: one query reads
// the last `window` keys, several get a windowed mask), then SDPA (attend) or the soft-capped attention
Tensor attend_layer(const Tensor& q, Tensor k, Tensor v, c10::optional<Tensor> mask, int64_t pos, double scale,
                    bool gqa, bool exact, int64_t window, WindowMasks& masks, const Family& f) {
  const int64_t T = q.size(2), S = k.size(2);
  if (window > 0 && pos + T > window) {
    if (T == 1) {
      k = k.narrow(2, S - window, window);
      v = v.narrow(2, S - window, window);
      if (mask) mask = mask->narrow(1, S - window, window);
    } else {
      mask = masks.get(mask, pos, T, S, window, q.device());
    }
  }
  if (f.softcap > 0) return attend_softcapped(q, k, v, mask, pos, scale, f.softcap);
  return attend(q, k, v, mask, pos, scale, gqa, exact);
}

// product (+ bias) (+ residual): layer_math.linear, the bias added as its own op, then the residual
Tensor biased_product(const Tensor& x, const Tensor& weight, const Tensor* e, Extra bias,
                      const c10::optional<Tensor>& residual) {
  if (!has(e, bias)) return product(x, weight, residual);
  Tensor y = product(x, weight, c10::nullopt) + e[bias];
  return residual ? *residual + y : y;
}

// An output projection joined to the residual h: in one product (Llama), or after its bias and the family's
// sandwich norm (Gemma 2/3: h + norm(o(x)))
Tensor residual_product(const Tensor& h, const Tensor& x, const Tensor& weight, const Tensor* e, Extra bias,
                        Extra out_norm, double eps, const Family& f) {
  if (!has(e, out_norm)) return biased_product(x, weight, e, bias, h);
  return h + norm(biased_product(x, weight, e, bias, c10::nullopt), e[out_norm], eps, f);
}

// One layer's attention inputs and settings that do not change along the loop
struct Attention {
  int64_t pos, H, KV, hd;
  double eps, scale;
  bool exact;
  const c10::optional<Tensor>& mask;
};

// h + attention(norm(h)) of one layer: q|k|v from one matmul (+ bias), q/k norms over each head (Qwen3, Gemma 3), RoPE
// on q and k together (cos, sin [T, 1, hd]: the layer's table), its keys and values written into its cache k, v at
// pos .. pos+T-1, attention over the cache within its window (0: none)
Tensor attention_sublayer(const Tensor& h, const Tensor* w, const Tensor* e, const Tensor& k, const Tensor& v,
                          const Tensor& cos, const Tensor& sin, int64_t window, const Attention& a,
                          WindowMasks& masks, const Family& f) {
  const int64_t T = h.size(0), H = a.H, KV = a.KV, hd = a.hd;
  Tensor qkv = biased_product(norm(h, w[0], a.eps, f), w[1], e, QKV_BIAS, c10::nullopt).view({T, H + 2 * KV, hd});
  Tensor qk = qkv.narrow(1, 0, H + KV);
  if (has(e, Q_NORM))  // [T, H, hd] and [T, KV, hd], each head normed over hd
    qk = at::cat({norm(qk.narrow(1, 0, H), e[Q_NORM], a.eps, f), norm(qk.narrow(1, H, KV), e[K_NORM], a.eps, f)}, 1);
  qk = qk * cos + at::roll(qk, {hd / 2}, {-1}) * sin;                                         // [T, H+KV, hd]
  k.narrow(2, a.pos, T).copy_(qk.narrow(1, H, KV).transpose(0, 1).unsqueeze(0));             // [1, KV, T, hd]
  v.narrow(2, a.pos, T).copy_(qkv.narrow(1, H + KV, KV).transpose(0, 1).unsqueeze(0));
  Tensor q = qk.narrow(1, 0, H).transpose(0, 1).unsqueeze(0);                                // [1, H, T, hd]
  Tensor keys = k.narrow(2, 0, a.pos + T), values = v.narrow(2, 0, a.pos + T);
  Tensor attn = window == 0 && f.softcap == 0
                    ? attend(q, keys, values, a.mask, a.pos, a.scale, KV != H, a.exact)
                    : attend_layer(q, keys, values, a.mask, a.pos, a.scale, KV != H, a.exact, window, masks, f);
  return residual_product(h, attn[0].transpose(0, 1).reshape({T, H * hd}), w[2], e, O_BIAS, ATTN_OUT_NORM, a.eps,
                          f);
}

// h + MLP(norm(h)) of one layer: down(act(gate) · up), gate|up from one matmul
Tensor mlp_sublayer(const Tensor& h, const Tensor* w, const Tensor* e, double eps, const Family& f) {
  Tensor gate_up = biased_product(norm(h, w[3], eps, f), w[4], e, GATE_UP_BIAS, c10::nullopt);  // [T, 2·I]
  const int64_t I = gate_up.size(1) / 2;
  Tensor gate = gate_up.narrow(1, 0, I);
  Tensor act = f.gelu_tanh ? at::gelu(gate, "tanh") : at::silu(gate);
  return residual_product(h, act * gate_up.narrow(1, I, I), w[5], e, DOWN_BIAS, MLP_OUT_NORM, eps, f);
}

// h: [T, D] the states of positions pos .. pos+T-1. weights: 6 per layer, in order (matrices in their product layout)
//   in_norm [D], qkv [(H+2·KV)·hd, D], o [D, H·hd], post_norm (the MLP's input norm) [D], gate_up [2·I, D],
//   down [D, I].
// k, v: every layer's cache [1, KV, max_len, hd], written at pos .. pos+T-1 in place.
// cos, sin: [R, T, 1, hd], one table per rotary kind (sin signed: rotate_half(x)·sin == roll(x, hd/2)·(sign·sin));
// mask: [T, pos+T] bool, or none (one query, a causal chain from an empty cache, or a chain attended row by row: see
// attend).
// The family's (LayerStack._fused_family; all empty / false / 0 for Llama's layer): extras, none or EXTRAS per layer
// (see Extra: qkv bias [(H+2·KV)·hd], q/k norms [hd], o bias [D], the attention output's norm [D], gate|up bias
// [2·I], down bias [D], the MLP output's norm [D]); windows, per layer W (0: none) or none; ropes, per layer its
// table in cos, sin, or none (all the first); gemma_norm, gelu_tanh, softcap (see Family).
// Returns the last layer's output [T, D], or with `collect` every layer's output (end - start of them).
std::vector<Tensor> forward_layers(Tensor h, const std::vector<Tensor>& weights, const std::vector<Tensor>& k,
                                   const std::vector<Tensor>& v, int64_t start, int64_t end, int64_t pos,
                                   const Tensor& cos, const Tensor& sin, const c10::optional<Tensor>& mask,
                                   int64_t H, int64_t KV, int64_t hd, double eps, double scale, bool collect,
                                   bool exact, const std::vector<Tensor>& extras, const std::vector<int64_t>& windows,
                                   const std::vector<int64_t>& ropes, bool gemma_norm, bool gelu_tanh,
                                   double softcap) {
  const Family family{gemma_norm, gelu_tanh, softcap};
  const Attention attention{pos, H, KV, hd, eps, scale, exact, mask};
  const std::vector<Tensor> cos_of = cos.unbind(0), sin_of = sin.unbind(0);  // [T, 1, hd] per table
  WindowMasks masks;
  std::vector<Tensor> outputs;
  for (int64_t i = start; i < end; ++i) {
    const Tensor* w = &weights[6 * i];
    const Tensor* e = extras.empty() ? nullptr : &extras[EXTRAS * i];
    const int64_t rope = ropes.empty() ? 0 : ropes[i];
    h = attention_sublayer(h, w, e, k[i], v[i], cos_of[rope], sin_of[rope], windows.empty() ? 0 : windows[i],
                           attention, masks, family);
    h = mlp_sublayer(h, w, e, eps, family);
    if (collect) outputs.push_back(h);
  }
  if (!collect) outputs.push_back(h);
  return outputs;
}

// The positions (rows of x) of the rows a sublayer runs for: every row's span where all run (an empty tensor), else
// the concatenated spans of those whose flag is set
Tensor rows_running(const std::vector<int64_t>& offsets, const std::vector<int64_t>& lens,
                    const at::TensorAccessor<bool, 1>& runs, bool& all, bool& none, const at::Device& device) {
  std::vector<int64_t> index;
  all = true;
  none = true;
  for (size_t r = 0; r < lens.size(); ++r) {
    if (!runs[r]) {
      all = false;
      continue;
    }
    none = false;
    for (int64_t t = 0; t < lens[r]; ++t) index.push_back(offsets[r] + t);
  }
  if (all || none) return Tensor();
  return at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(device);
}

// products.product's onednn layout: x [T, in] times a weight's oneDNN blocked copy `packed` (+ residual [T, out]), the
// residual joined in the same kernel (mkldnn::_linear_pointwise, as torch.ops.mkldnn calls it from Python)
Tensor onednn_product(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& residual) {
  if (residual) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary");
    torch::jit::Stack stack{x, *residual, packed, c10::IValue(), std::string("add")};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, c10::IValue(), std::string("none"), c10::List<c10::optional<c10::Scalar>>(),
                          c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// ---- products.py's panels layout: W [N, K] float32 copied into 32-column panels [⌈N/32⌉, K, 32] (zero-padded), each
// read start to end once for all the rows: every output a plain sum over k in order, so a row's product is the same
// bits whatever rows share the step (no GEMM blocking by the row count). For the few rows of a batch's step, where
// MKL's GEMM packs W again on every call. Written with GCC's vector extension, compiled for AVX-512, AVX2 and plain
// x86-64 (elsewhere the compiler's baseline), the one the CPU runs chosen at load.
typedef float f32x16 __attribute__((vector_size(64)));

#define PANEL_KERNEL(SUFFIX, TARGET)                                                                              \
  template <int R>                                                                                                \
  TARGET static inline void panel_rows_##SUFFIX(const float* x, int64_t K, const float* panel, float* y,          \
                                                int64_t N) {                                                      \
    f32x16 acc[R][2];                                                                                             \
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = f32x16{};                                                 \
    for (int64_t k = 0; k < K; k++) {                                                                             \
      f32x16 lo, hi;                                                                                              \
      __builtin_memcpy(&lo, panel + k * 32, 64);                                                                  \
      __builtin_memcpy(&hi, panel + k * 32 + 16, 64);                                                             \
      _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                       \
        f32x16 xk = f32x16{} + x[i * K + k];                                                                      \
        acc[i][0] += xk * lo;                                                                                     \
        acc[i][1] += xk * hi;                                                                                     \
      }                                                                                                           \
    }                                                                                                             \
    for (int i = 0; i < R; i++) {                                                                                 \
      __builtin_memcpy(y + i * N, &acc[i][0], 64);                                                                \
      __builtin_memcpy(y + i * N + 16, &acc[i][1], 64);                                                           \
    }                                                                                                             \
  }                                                                                                               \
  TARGET static void panels_##SUFFIX(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,   \
                                     int64_t first, int64_t last) {                                              \
    for (int64_t p = first; p < last; p++) {                                                                      \
      const float* panel = w + p * 32 * K;                                                                        \
      float* out = y + p * 32;                                                                                    \
      int64_t m = 0;                                                                                              \
      for (; m + 8 <= M; m += 8) panel_rows_##SUFFIX<8>(x + m * K, K, panel, out + m * N, N);                     \
      for (; m + 4 <= M; m += 4) panel_rows_##SUFFIX<4>(x + m * K, K, panel, out + m * N, N);                     \
      for (; m < M; m++) panel_rows_##SUFFIX<1>(x + m * K, K, panel, out + m * N, N);                             \
    }                                                                                                             \
  }

#if defined(__x86_64__)
PANEL_KERNEL(avx512, __attribute__((target("avx512f,fma"))))
PANEL_KERNEL(avx2, __attribute__((target("avx2,fma"))))
#endif
PANEL_KERNEL(baseline, )

// W [N, K] → its panels [⌈N/32⌉, K, 32]
Tensor panel_weights(const Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.device().is_cpu(),
              "panels: a float32 CPU matrix");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + 31) / 32;
  Tensor padded = at::zeros({P * 32, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, 32, K}).transpose(1, 2).contiguous();  // [P, K, 32]
}

// x [M, K] times W [N, K]ᵀ from W's panels (+ residual [M, N], added after: the product rounded, then the sum, as HF)
Tensor panel_product(const Tensor& x, const Tensor& panels, int64_t N, const c10::optional<Tensor>& residual) {
  Tensor rows = x.contiguous();
  const int64_t M = rows.size(0), K = rows.size(1), P = panels.size(0);
  TORCH_CHECK(rows.scalar_type() == at::kFloat && panels.size(1) == K, "panels: float32 rows of the matrix's width");
  Tensor y = at::empty({M, P * 32}, rows.options());
#if defined(__x86_64__)
  static auto kernel = __builtin_cpu_supports("avx512f") ? panels_avx512
                       : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? panels_avx2
                                                                                           : panels_baseline;
#else
  static auto kernel = panels_baseline;
#endif
  const float* xs = rows.data_ptr<float>();
  const float* ws = panels.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, P, 4, [&](int64_t first, int64_t last) { kernel(xs, M, K, ws, P * 32, ys, first, last); });
  Tensor out = P * 32 == N ? y : y.narrow(1, 0, N).contiguous();
  return residual ? out.add_(*residual) : out;
}

// A wide step's product: the weight's copy where the batch's width chose one (`packed`: panels [P, K, 32] or oneDNN's
// blocked copy), else `product`
Tensor wide_product(const Tensor& x, const Tensor& weight, const Tensor& packed, const c10::optional<Tensor>& residual) {
  if (!packed.defined() || packed.numel() == 0) return product(x, weight, residual);
  return packed.dim() == 3 ? panel_product(x, packed, weight.size(0), residual) : onednn_product(x, packed, residual);
}

// The running rows' attention, one query a row, in one call: their cache rows consecutive (first, …), each row's
// new key and value written at its position, each row attending over its own keys (those past it masked) — what
// attend computes for each alone, up to the order of a masked softmax's sums. q: [n, H, hd]; kn, vn: [n, KV, hd].
Tensor attend_one_each(const Tensor& q, const Tensor& kn, const Tensor& vn, const Tensor& k, const Tensor& v,
                       int64_t first, const std::vector<int64_t>& positions, double scale, bool gqa) {
  const int64_t n = q.size(0);
  auto longs = at::TensorOptions().dtype(at::kLong).device(q.device());
  Tensor at = at::tensor(positions, at::TensorOptions().dtype(at::kLong)).to(q.device());  // [n]
  Tensor rows = at::arange(n, longs);
  Tensor kb = k.narrow(0, first, n), vb = v.narrow(0, first, n);  // [n, KV, S, hd]: the rows' caches, views
  using torch::indexing::Slice;
  kb.index_put_({rows, Slice(), at}, kn);  // [n, KV, hd] at each row's position
  vb.index_put_({rows, Slice(), at}, vn);
  const int64_t S = *std::max_element(positions.begin(), positions.end()) + 1;
  Tensor seen = (at::arange(S, longs).unsqueeze(0) <= at.unsqueeze(1)).view({n, 1, 1, S});  // [n, 1, 1, S]
  return at::scaled_dot_product_attention(q.unsqueeze(2), kb.narrow(2, 0, S), vb.narrow(2, 0, S), seen, 0.0, false,
                                          scale, gqa)
      .squeeze(2);  // [n, H, hd]
}

// Several rows of a batch (each a sequence of its own: its cache row, its positions) through layers [start, end), a
// row running only the sublayers its flags say: the products over all the running rows' positions at once (at a
// batch's width, in the layouts tune_rows chose: `packed`, 4 a layer — q|k|v, o, gate|up, down — a oneDNN copy or
// an empty tensor), each row's RoPE, cache write and attention its own — the single-row ops (attention_sublayer) on
// its slice, or, where every running row has one position, no window and no soft cap, and their cache rows follow
// one another (a batch decoding), all their attention in one masked call (attend_one_each). A row that idles in a
// sublayer is not computed there.
// x: [N, D] the rows' positions stacked (row r: lens[r] of them from its offset); k, v: every layer's cache
// [B, KV, max_len, hd], row r's in row rows[r], written at pos[r] .. pos[r] + lens[r] − 1; runs: [2·(end − start),
// R] bool on the CPU (layer start + j's attention at 2j, its MLP at 2j + 1); cos, sin: [Rk, N, 1, hd] each
// position's own. Weights and the family's as forward_layers'. Returns x after the last layer [N, D], or with
// `collect` after every layer.
std::vector<Tensor> forward_rows(Tensor x, const std::vector<Tensor>& weights, const std::vector<Tensor>& packed,
                                 const std::vector<Tensor>& k, const std::vector<Tensor>& v, int64_t start,
                                 int64_t end, const std::vector<int64_t>& rows, const std::vector<int64_t>& pos,
                                 const std::vector<int64_t>& lens, const Tensor& runs, const Tensor& cos,
                                 const Tensor& sin, int64_t H, int64_t KV, int64_t hd, double eps, double scale,
                                 bool collect, bool exact, const std::vector<Tensor>& extras,
                                 const std::vector<int64_t>& windows, const std::vector<int64_t>& ropes,
                                 bool gemma_norm, bool gelu_tanh, double softcap) {
  const Family family{gemma_norm, gelu_tanh, softcap};
  const c10::optional<Tensor> no_mask;
  std::vector<int64_t> offsets(lens.size(), 0);
  for (size_t r = 1; r < lens.size(); ++r) offsets[r] = offsets[r - 1] + lens[r - 1];
  auto flags = runs.accessor<bool, 2>();
  const Tensor none_packed;
  std::vector<Tensor> outputs;
  for (int64_t i = start; i < end; ++i) {
    const int64_t j = i - start;
    const Tensor* w = &weights[6 * i];
    const Tensor* pk = packed.empty() ? nullptr : &packed[4 * i];
    const Tensor* e = extras.empty() ? nullptr : &extras[EXTRAS * i];
    const int64_t rope = ropes.empty() ? 0 : ropes[i];
    const int64_t window = windows.empty() ? 0 : windows[i];
    bool all, none;
    // the attention: qkv over the running rows' positions at once, then each row's own RoPE, write and attention
    Tensor index = rows_running(offsets, lens, flags[2 * j], all, none, x.device());
    if (!none) {
      Tensor h = all ? x : x.index_select(0, index);  // [n, D]
      Tensor cs = all ? cos[rope] : cos[rope].index_select(0, index);  // [n, 1, hd]
      Tensor sn = all ? sin[rope] : sin[rope].index_select(0, index);
      const int64_t n = h.size(0);
      Tensor normed = norm(h, w[0], eps, family);
      Tensor qkv = (pk && !has(e, QKV_BIAS) ? wide_product(normed, w[1], pk[0], c10::nullopt)
                                            : biased_product(normed, w[1], e, QKV_BIAS, c10::nullopt))
                       .view({n, H + 2 * KV, hd});
      Tensor qk = qkv.narrow(1, 0, H + KV);
      if (has(e, Q_NORM))
        qk = at::cat({norm(qk.narrow(1, 0, H), e[Q_NORM], eps, family),
                      norm(qk.narrow(1, H, KV), e[K_NORM], eps, family)}, 1);
      qk = qk * cs + at::roll(qk, {hd / 2}, {-1}) * sn;  // [n, H+KV, hd]
      std::vector<int64_t> running, positions;
      bool one_each = window == 0 && softcap == 0 && !exact;
      for (size_t r = 0; r < lens.size(); ++r) {
        if (!flags[2 * j][r]) continue;
        one_each = one_each && lens[r] == 1 && rows[r] == (running.empty() ? rows[r] : rows[running.back()] + 1);
        running.push_back(r);
        positions.push_back(pos[r]);
      }
      Tensor attended;
      if (one_each && running.size() > 1) {
        attended = attend_one_each(qk.narrow(1, 0, H), qk.narrow(1, H, KV), qkv.narrow(1, H + KV, KV), k[i], v[i],
                                   rows[running[0]], positions, scale, KV != H)
                       .reshape({n, H * hd});
      } else {
        std::vector<Tensor> attn;
        int64_t at_ = 0;
        for (int64_t r : running) {
          const int64_t T = lens[r], p = pos[r];
          Tensor kr = k[i][rows[r]].unsqueeze(0), vr = v[i][rows[r]].unsqueeze(0);  // [1, KV, S, hd]
          kr.narrow(2, p, T).copy_(qk.narrow(0, at_, T).narrow(1, H, KV).transpose(0, 1).unsqueeze(0));
          vr.narrow(2, p, T).copy_(qkv.narrow(0, at_, T).narrow(1, H + KV, KV).transpose(0, 1).unsqueeze(0));
          Tensor q = qk.narrow(0, at_, T).narrow(1, 0, H).transpose(0, 1).unsqueeze(0);  // [1, H, T, hd]
          Tensor keys = kr.narrow(2, 0, p + T), values = vr.narrow(2, 0, p + T);
          WindowMasks masks;
          Tensor a = window == 0 && softcap == 0
                         ? attend(q, keys, values, no_mask, p, scale, KV != H, exact)
                         : attend_layer(q, keys, values, no_mask, p, scale, KV != H, exact, window, masks, family);
          attn.push_back(a[0].transpose(0, 1).reshape({T, H * hd}));
          at_ += T;
        }
        attended = at::cat(attn, 0);
      }
      Tensor out = pk && !has(e, O_BIAS) && !has(e, ATTN_OUT_NORM)
                       ? wide_product(attended, w[2], pk[1], h)
                       : residual_product(h, attended, w[2], e, O_BIAS, ATTN_OUT_NORM, eps, family);
      x = all ? out : x.index_copy(0, index, out);
    }
    index = rows_running(offsets, lens, flags[2 * j + 1], all, none, x.device());
    if (!none) {
      Tensor h = all ? x : x.index_select(0, index);
      Tensor out;
      if (pk && e == nullptr) {  // Llama's MLP, its products in the batch's layouts
        Tensor gate_up = wide_product(norm(h, w[3], eps, family), w[4], pk[2], c10::nullopt);  // [n, 2·I]
        const int64_t I = gate_up.size(1) / 2;
        Tensor gate = gate_up.narrow(1, 0, I);
        Tensor act = family.gelu_tanh ? at::gelu(gate, "tanh") : at::silu(gate);
        out = wide_product(act * gate_up.narrow(1, I, I), w[5], pk[3], h);
      } else {
        out = mlp_sublayer(h, w, e, eps, family);
      }
      x = all ? out : x.index_copy(0, index, out);
    }
    if (collect) outputs.push_back(x);
  }
  if (!collect) outputs.push_back(x);
  return outputs;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward_layers", &forward_layers, "LayerStack.forward_layers' decoder-layer loop");
  m.def("forward_rows", &forward_rows, "a batch's rows through the layers, each its own positions and sublayers");
  m.def("panel_weights", &panel_weights, "a float32 matrix's 32-column panels (products.py's panels layout)");
  m.def("panel_product", &panel_product, "rows times a matrix from its panels (+ a residual)");
}
