// The decoder-layer loop of LayerStack.forward_layers in C++ (del_bench/models/fused.py builds it).
//
// The same ATen ops, in the same order, on the same tensors as the eager Python loop (layer_stack.py
// _attention / _mlp), so the results are the same bits (fused.py checks that on the machine at hand before it is
// used). What it removes is the Python around each op: on a 2-core CPU that is ~100 µs per layer, more than the
// matmuls of a small model's layer take. Bias-free Llama layers on one device only (fused.py says why not otherwise).
#include <torch/extension.h>

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

// layer_stack._linear without a bias: x [T, in] times weight [out, in]ᵀ (+ residual [T, out]) → [T, out]. On CPU
// as weight @ Xᵀ with X at least two rows (MKL's few-column GEMM streams these matrices fastest: see _linear) and the
// residual joined in one addmm; in half precision HF's x @ Wᵀ and a separate add, which round as HF does.
Tensor product(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& residual) {
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  if (!x.is_cpu() || half) {
    Tensor y = at::mm(x, weight.t());
    return residual ? *residual + y : y;
  }
  const int64_t T = x.size(0);
  Tensor rows = T > 1 ? x : x.expand({2, x.size(1)}).contiguous();  // [T', in], T' >= 2
  Tensor y = residual ? at::addmm(residual->t(), weight, rows.t()) : at::mm(weight, rows.t());  // [out, T']
  return y.narrow(1, 0, T).t().contiguous();
}

// layer_stack._attend: SDPA of q [1, H, T, hd] over k, v [1, KV, pos+T, hd]. No mask over several queries: from an
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

// h: [T, D] the states of positions pos .. pos+T-1. weights: 6 per layer, in order (matrices [out, in], HF's layout)
//   in_norm [D], qkv [(H+2·KV)·hd, D], o [D, H·hd], post_norm [D], gate_up [2·I, D], down [D, I].
// k, v: every layer's cache [1, KV, max_len, hd], written at pos .. pos+T-1 in place.
// cos, sin: [T, 1, hd] (sin signed: rotate_half(x)·sin == roll(x, hd/2)·(sign·sin)); mask: [T, pos+T] bool, or none
// (one query, a causal chain from an empty cache, or a chain attended row by row: see attend).
// Returns the last layer's output [T, D], or with `collect` every layer's output (end - start of them).
std::vector<Tensor> forward_layers(Tensor h, const std::vector<Tensor>& weights, const std::vector<Tensor>& k,
                                   const std::vector<Tensor>& v, int64_t start, int64_t end, int64_t pos,
                                   const Tensor& cos, const Tensor& sin, const c10::optional<Tensor>& mask,
                                   int64_t H, int64_t KV, int64_t hd, double eps, double scale, bool collect,
                                   bool exact) {
  const int64_t T = h.size(0);
  std::vector<Tensor> outputs;
  for (int64_t i = start; i < end; ++i) {
    const Tensor* w = &weights[6 * i];
    // attention: h + o(attend(rope(q), rope(k), v)), q|k|v from one matmul
    Tensor x = rms_norm(h, w[0], eps);
    Tensor qkv = product(x, w[1], c10::nullopt).view({T, H + 2 * KV, hd});
    Tensor qk = qkv.narrow(1, 0, H + KV);
    qk = qk * cos + at::roll(qk, {hd / 2}, {-1}) * sin;                                       // [T, H+KV, hd]
    k[i].narrow(2, pos, T).copy_(qk.narrow(1, H, KV).transpose(0, 1).unsqueeze(0));        // [1, KV, T, hd]
    v[i].narrow(2, pos, T).copy_(qkv.narrow(1, H + KV, KV).transpose(0, 1).unsqueeze(0));
    Tensor q = qk.narrow(1, 0, H).transpose(0, 1).unsqueeze(0);                             // [1, H, T, hd]
    Tensor attn = attend(q, k[i].narrow(2, 0, pos + T), v[i].narrow(2, 0, pos + T), mask, pos, scale, KV != H,
                         exact);
    h = product(attn[0].transpose(0, 1).reshape({T, H * hd}), w[2], h);
    // MLP: h + down(silu(gate) · up), gate|up from one matmul
    x = rms_norm(h, w[3], eps);
    Tensor gate_up = product(x, w[4], c10::nullopt);                                       // [T, 2·I]
    const int64_t I = gate_up.size(1) / 2;
    h = product(at::silu(gate_up.narrow(1, 0, I)) * gate_up.narrow(1, I, I), w[5], h);
    if (collect) outputs.push_back(h);
  }
  if (!collect) outputs.push_back(h);
  return outputs;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward_layers", &forward_layers, "LayerStack.forward_layers' decoder-layer loop");
}
