// Fused element-wise "glue" of a Llama decoder layer (gpu/models/llama.py): RMSNorm, the
// residual add fused with the next RMSNorm, rotate-half RoPE over the fused qkv output, and
// SiLU(gate) * up. Each replaces 5-20 small torch ops, whose ~2 us dispatch each dominates
// batch-1 decode on CPU.
//
// NOTE: every op rounds where the torch formulation in llama.py rounds (the compute dtype
// after each torch op), so bfloat16 results match torch's except where a float32 statistic
// summed in another order lands on the other side of a rounding boundary (1 ulp). The
// arithmetic is plain C++ over runs of 16 floats that -O3 -march=native vectorizes (AVX-512
// or AVX2, whatever the machine has), with no intrinsics to keep per-ISA twins of.

#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "llama_glue_core.h"

namespace {

using namespace tierserve_glue;

// Rows in parallel once there is enough work to pay for waking the pool; one row (batch-1
// decode) always runs inline on the caller's thread.
template <typename Fn>
void for_each_row(int64_t rows, int64_t row_elems, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems));
  if (rows <= grain) {
    fn(0, rows);
  } else {
    at::parallel_for(0, rows, grain, fn);
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [T, N] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), op, ": weight must be [N]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight must have x's dtype");
}

template <typename D>
void rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& y, double eps) {
  using S = typename D::scalar;
  const S* xp = reinterpret_cast<const S*>(x.data_ptr());
  const S* wp = reinterpret_cast<const S*>(weight.data_ptr());
  S* yp = reinterpret_cast<S*>(y.data_ptr());
  const int64_t n = x.size(1), xs = x.stride(0);
  for_each_row(x.size(0), n, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row<D>(xp + t * xs, wp, yp + t * n, n, float(eps));
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, weight, "llama_glue_rms_norm");
  torch::Tensor y = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<F32>(x, weight, y, eps);
  } else {
    rms_norm_rows<BF16>(x, weight, y, eps);
  }
  return y;
}

template <typename D>
void add_rms_norm_rows(const torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& weight,
                       torch::Tensor& sum, torch::Tensor& y, double eps) {
  using S = typename D::scalar;
  const S* hp = reinterpret_cast<const S*>(h.data_ptr());
  const S* dp = reinterpret_cast<const S*>(delta.data_ptr());
  const S* wp = reinterpret_cast<const S*>(weight.data_ptr());
  S* sp = reinterpret_cast<S*>(sum.data_ptr());
  S* yp = reinterpret_cast<S*>(y.data_ptr());
  const int64_t n = h.size(1), hs = h.stride(0), ds = delta.stride(0);
  for_each_row(h.size(0), n, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* a = hp + t * hs;
      const S* b = dp + t * ds;
      S* s = sp + t * n;
      for (int64_t i = 0; i < n; ++i) s[i] = D::store(D::load(a[i]) + D::load(b[i]));
      norm_row<D>(s, wp, yp + t * n, n, float(eps));
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& h, const torch::Tensor& delta,
                                                      const torch::Tensor& weight, double eps) {
  check_rows(h, weight, "llama_glue_add_rms_norm");
  check_rows(delta, weight, "llama_glue_add_rms_norm");
  TORCH_CHECK(delta.size(0) == h.size(0), "llama_glue_add_rms_norm: h and delta must have the same rows");
  torch::Tensor sum = torch::empty({h.size(0), h.size(1)}, h.options());
  torch::Tensor y = torch::empty_like(sum);
  if (h.scalar_type() == at::kFloat) {
    add_rms_norm_rows<F32>(h, delta, weight, sum, y, eps);
  } else {
    add_rms_norm_rows<BF16>(h, delta, weight, sum, y, eps);
  }
  return {sum, y};
}

template <typename D>
void rope_rows(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& q,
               torch::Tensor& k, torch::Tensor& v, int64_t heads, int64_t kv_heads) {
  using S = typename D::scalar;
  const int64_t dim = q.size(2), half = dim / 2, row = qkv.stride(0);
  const S* xp = reinterpret_cast<const S*>(qkv.data_ptr());
  const S* cp = reinterpret_cast<const S*>(cos.data_ptr());
  const S* sp = reinterpret_cast<const S*>(sin.data_ptr());
  S* qp = reinterpret_cast<S*>(q.data_ptr());
  S* kp = reinterpret_cast<S*>(k.data_ptr());
  S* vp = reinterpret_cast<S*>(v.data_ptr());
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  for_each_row(qkv.size(0), qkv.size(1), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* x = xp + t * row;
      for (int64_t h = 0; h < heads; ++h) rope_head<D>(x + h * dim, cp + t * cs, sp + t * ss, qp + (t * heads + h) * dim, half);
      x += heads * dim;
      for (int64_t h = 0; h < kv_heads; ++h) rope_head<D>(x + h * dim, cp + t * cs, sp + t * ss, kp + (t * kv_heads + h) * dim, half);
      x += kv_heads * dim;
      std::memcpy(vp + t * kv_heads * dim, x, sizeof(S) * kv_heads * dim);
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope(const torch::Tensor& qkv, const torch::Tensor& cos,
                                                             const torch::Tensor& sin, int64_t heads,
                                                             int64_t kv_heads) {
  const char* op = "llama_glue_rope";
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, op, ": qkv must be [T, (H + 2 Hkv) * D] with contiguous rows");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.stride(1) == 1 && sin.stride(1) == 1, op,
              ": cos and sin must be [T, D/2] with contiguous rows");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), op,
              ": cos and sin must have qkv's dtype");
  const int64_t tokens = qkv.size(0), dim = 2 * cos.size(1);
  TORCH_CHECK(cos.size(0) == tokens && heads > 0 && kv_heads > 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim, op,
              ": qkv's width must be (heads + 2 kv_heads) * 2 * cos.size(1)");
  torch::Tensor q = torch::empty({tokens, heads, dim}, qkv.options());
  torch::Tensor k = torch::empty({tokens, kv_heads, dim}, qkv.options());
  torch::Tensor v = torch::empty({tokens, kv_heads, dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rope_rows<F32>(qkv, cos, sin, q, k, v, heads, kv_heads);
  } else {
    rope_rows<BF16>(qkv, cos, sin, q, k, v, heads, kv_heads);
  }
  return {q, k, v};
}

template <typename D>
void silu_mul_rows(const torch::Tensor& gate_up, torch::Tensor& out) {
  using S = typename D::scalar;
  const int64_t inter = out.size(1), row = gate_up.stride(0);
  const S* gp = reinterpret_cast<const S*>(gate_up.data_ptr());
  S* op = reinterpret_cast<S*>(out.data_ptr());
  for_each_row(out.size(0), gate_up.size(1), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* g = gp + t * row;
      const S* u = g + inter;
      S* y = op + t * inter;
      silu_times_run<D>(g, u, y, inter);
    }
  });
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  const char* op = "llama_glue_silu_mul";
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, op,
              ": gate_up must be [T, 2I] with contiguous rows");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 only");
  torch::Tensor out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows<F32>(gate_up, out);
  } else {
    silu_mul_rows<BF16>(gate_up, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.def("llama_glue_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("llama_glue_add_rms_norm(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("llama_glue_rope(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("llama_glue_silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) {
  m.impl("llama_glue_rms_norm", &rms_norm);
  m.impl("llama_glue_add_rms_norm", &add_rms_norm);
  m.impl("llama_glue_rope", &rope);
  m.impl("llama_glue_silu_mul", &silu_mul);
}
