// A MoE layer's routed experts for a step of a few tokens (decode), in one native call:
// group the (token, slot) pairs by expert, each touched expert's SwiGLU MLP over its tokens,
// each token's outputs times its routing weights summed. `moe: cpu` (gpu/moe/cpu_moe.py).
//
// A decode step of 32 tokens routed top-6 over 40 experts touches every expert with ~5
// tokens each: the time is one read of the touched experts' weights (and, at 5 rows, the
// products), where torch's grouped path runs ~10 ops per expert (gather, two GEMMs, silu,
// mul, scatter). Here each weight row is read once for all the tokens of its expert
// (dense_gemv_core.h's few-row kernels: float32 widened, or for bfloat16 on AVX512-BF16
// the pairs kernel, x and the activations kept in bf16), in two parallel regions a layer:
//   1. threads split the experts' intermediate columns: gate and up rows j of every
//      touched expert, then silu(gate) * up for its tokens (llama_glue_core.h's, rounded to
//      the dtype as F.silu and the product are);
//   2. threads split the hidden columns: down rows c of every touched expert, each token's
//      outputs (rounded to the dtype, as the linear's are) times its weights added into a
//      float32 sum in ascending expert order, rounded to the dtype once at the end.
// NOTE: a row's arithmetic in the AVX-512 kernels does not depend on the rows beside it,
// so there a token's output does not depend on which tokens share its experts
// (`moe_experts_row_invariant`); the AVX2 kernel's does (like dense_gemv), so the op is for
// outside deterministic mode, like every kernel here. Not torch's sum order or SiLU bits:
// close to `moe: torch`, not equal.

#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dense_gemv_core.h"
#include "llama_glue_core.h"
#include "quant_gemv_core.h"

namespace {

using tierserve_dense::kMaxRows;

// The pairs of a step grouped by expert: pair p (in expert order, tokens ascending within an
// expert) is token `token[p]` with routing weight `weight[p]`; expert e's pairs are
// [start[e], start[e + 1]). `touched`: the experts with at least one pair, ascending.
struct Groups {
  std::vector<int64_t> token;
  std::vector<float> weight;
  std::vector<int64_t> start;
  std::vector<int64_t> touched;
};

template <class S>
Groups group(const int64_t* experts, const S* weights, int64_t tokens, int64_t k, int64_t num_experts) {
  Groups g;
  g.start.assign(num_experts + 1, 0);
  for (int64_t i = 0; i < tokens * k; ++i) {
    TORCH_CHECK(experts[i] >= 0 && experts[i] < num_experts, "moe_experts: expert index out of range");
    ++g.start[experts[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    if (g.start[e + 1] > 0) g.touched.push_back(e);
    g.start[e + 1] += g.start[e];
  }
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  g.token.resize(tokens * k);
  g.weight.resize(tokens * k);
  for (int64_t i = 0; i < tokens * k; ++i) {  // (token, slot) order: tokens ascend within an expert
    const int64_t p = next[experts[i]]++;
    g.token[p] = i / k;
    g.weight[p] = static_cast<float>(weights[i]);
  }
  return g;
}

// The step's (token, slot) pairs grouped, after the checks both ops share: x [T, H] float32
// or bfloat16, experts [T, k] int64, weights [T, k] in x's dtype.
Groups step_groups(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights, int64_t num_experts) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "moe_experts: x is float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && experts.dim() == 2 && experts.size(0) == x.size(0) && weights.sizes() == experts.sizes(),
              "moe_experts: x [T, H], experts and weights [T, k]");
  TORCH_CHECK(experts.scalar_type() == at::kLong && weights.scalar_type() == dtype,
              "moe_experts: int64 experts, weights in x's dtype");
  const at::Tensor chosen = experts.contiguous(), scale = weights.contiguous();
  const int64_t tokens = x.size(0), k = experts.size(1);
  if (dtype == at::kFloat) return group(chosen.data_ptr<int64_t>(), scale.data_ptr<float>(), tokens, k, num_experts);
  return group(chosen.data_ptr<int64_t>(), scale.data_ptr<c10::BFloat16>(), tokens, k, num_experts);
}

// Each pair's row of x (already in the kernel's input type), in pair order: the kernels
// take a group's rows contiguous.
template <class In>
std::vector<In> gather_rows(const In* x, const Groups& g, int64_t hidden) {
  const int64_t pairs = static_cast<int64_t>(g.token.size());
  std::vector<In> rows(pairs * hidden);
  at::parallel_for(0, pairs, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) std::memcpy(&rows[p * hidden], x + g.token[p] * hidden, hidden * sizeof(In));
  });
  return rows;
}

// The dtype's rounding of float32 values (bf16: nearest even, kept as float32).
template <class W>
inline float round_to(float v) {
  if constexpr (std::is_same_v<W, float>) return v;
  return tierserve_glue::BF16::round(v);
}

// sum[token, c] += y[r, c] (rounded to the dtype, as the linear's output) * weight, for the
// pairs [first, first + n) of one expert; y's rows `ldy` apart.
template <class W>
void add_weighted(const Groups& g, int64_t first, int64_t n, const float* y, int64_t ldy, float* sum, int64_t width) {
  for (int64_t r = 0; r < n; ++r) {
    float* s = &sum[g.token[first + r] * width];
    const float w = g.weight[first + r];
    for (int64_t c = 0; c < width; ++c) s[c] += round_to<W>(y[r * ldy + c]) * w;
  }
}

// out[t, c0 + c] = sum[t, c] in the dtype (bf16: nearest even), t < tokens, c < width.
template <class W>
void write_sums(const std::vector<float>& sum, at::Tensor& out, int64_t c0, int64_t width) {
  const int64_t tokens = out.size(0), hidden = out.size(1);
  W* o = out.data_ptr<W>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < width; ++c) o[t * hidden + c0 + c] = static_cast<W>(sum[t * width + c]);
}

// h[i] = silu(gate[i]) * up[i] for i < n, gate and up the linear's float32 outputs: rounded
// to the dtype first (as the linear returns them), then llama_glue_core.h's silu_times; h in
// the kernel's input type `In` (float32, or bf16 for the pairs kernel).
template <class W, class In>
void swiglu_span(const float* gate, const float* up, In* h, int64_t n, std::vector<uint16_t>& scratch) {
  using tierserve_glue::bf16_from_float;
  if constexpr (std::is_same_v<W, float>) {
    tierserve_glue::silu_times_run<tierserve_glue::F32>(gate, up, h, n);
  } else {
    scratch.resize(3 * n);
    uint16_t *g = scratch.data(), *u = g + n, *y = u + n;
    for (int64_t i = 0; i < n; ++i) {
      g[i] = bf16_from_float(gate[i]);
      u[i] = bf16_from_float(up[i]);
    }
    if constexpr (std::is_same_v<In, float>) {
      tierserve_glue::silu_times_run<tierserve_glue::BF16>(g, u, y, n);
      for (int64_t i = 0; i < n; ++i) h[i] = tierserve_glue::BF16::load(y[i]);
    } else {
      tierserve_glue::silu_times_run<tierserve_glue::BF16>(g, u, reinterpret_cast<uint16_t*>(h), n);
    }
  }
}

// Rows of x in passes of at most kMaxRows: out[r, j - n0] = x[r] . w[j], j in [n0, n1).
template <class W, class In>
void few_rows(const In* x, const W* w, float* out, int64_t rows, int64_t k, int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  for (int64_t r = 0; r < rows; r += kMaxRows)
    tierserve_dense::pass_rows(x + r * k, w + n0 * k, out + r * width, std::min(kMaxRows, rows - r), k, width, 0, width);
}

// W: the weights' type; In: the kernel's x (float32: the widening kernel; bf16: the pairs one).
template <class W, class In>
at::Tensor run(const at::Tensor& x, const Groups& g, const std::vector<const W*>& gate_up,
               const std::vector<const W*>& down, int64_t inter) {
  const int64_t tokens = x.size(0), hidden = x.size(1), pairs = static_cast<int64_t>(g.token.size());
  const at::Tensor xin = x.to(std::is_same_v<In, float> ? at::kFloat : at::kBFloat16).contiguous();  // bf16 widened: exact
  const std::vector<In> gathered = gather_rows(xin.data_ptr<In>(), g, hidden);
  // 1. silu(gate) * up, [pairs, inter]; threads split the intermediate columns.
  std::vector<In> act(pairs * inter);
  const int64_t col_grain = std::max<int64_t>(16, (16 << 10) / (hidden * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, inter, col_grain, [&](int64_t j0, int64_t j1) {
    const int64_t width = j1 - j0;
    std::vector<float> gate, up;
    std::vector<uint16_t> scratch;
    for (const int64_t e : g.touched) {
      const int64_t first = g.start[e], n = g.start[e + 1] - first;
      gate.resize(n * width);
      up.resize(n * width);
      few_rows(&gathered[first * hidden], gate_up[e], gate.data(), n, hidden, j0, j1);
      few_rows(&gathered[first * hidden], gate_up[e], up.data(), n, hidden, inter + j0, inter + j1);
      for (int64_t r = 0; r < n; ++r)
        swiglu_span<W, In>(&gate[r * width], &up[r * width], &act[(first + r) * inter + j0], width, scratch);
    }
  });
  // 2. down, times the routing weights, summed per token; threads split the hidden columns.
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  const int64_t out_grain = std::max<int64_t>(16, (16 << 10) / (inter * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, hidden, out_grain, [&](int64_t c0, int64_t c1) {
    const int64_t width = c1 - c0;
    std::vector<float> sum(tokens * width, 0.0f), y;
    for (const int64_t e : g.touched) {  // NOTE: ascending experts: each token's sum in one fixed order
      const int64_t first = g.start[e], n = g.start[e + 1] - first;
      y.resize(n * width);
      few_rows(&act[first * inter], down[e], y.data(), n, inter, c0, c1);
      add_weighted<W>(g, first, n, y.data(), width, sum.data(), width);
    }
    write_sums<W>(sum, out, c0, width);
  });
  return out;
}

// ---- int8 / 4-bit expert weights (quant_gemv_core.h's formats and tiles) -----------------
// The same two regions over the packed weights: x (and then the activations) quantized to
// int8 per row and group of 32 once for all the pairs, each expert's tiles read once for
// all of its tokens; threads split the tiles (16 output rows each).

struct Packed {
  std::vector<const uint8_t*> w;  // per expert: its packed tiles
  std::vector<const float*> scales;  // int8: per expert float32 [N]; q4: null (in the tiles)
  int64_t stride;  // bytes per tile
};

// Rows [first, ...) of a quantized input.
inline tierserve_gemv::QInput rows_from(const tierserve_gemv::QInput& in, int64_t first, int64_t k) {
  using tierserve_gemv::kGroup;
  return {in.pairs + first * k / 2, in.words + first * k / 2,  in.quads + first * k / 4,
          in.scale + first * k / kGroup, in.sum + first * k / kGroup, in.total + first * k / kGroup};
}

inline void quantize_parallel(tierserve_gemv::Quantized& q, const float* x, int64_t rows, int64_t k) {
  q.resize(rows, k);
  at::parallel_for(0, rows, std::max<int64_t>(1, (64 << 10) / k), [&](int64_t r0, int64_t r1) { q.quantize_rows(x, k, r0, r1); });
}

// W: x's dtype (the roundings of the linears' outputs); Q4: the 4-bit format, else int8.
template <class W, bool Q4>
at::Tensor run_quantized(const at::Tensor& x, const Groups& g, const Packed& gate_up, const Packed& down, int64_t inter) {
  using tierserve_gemv::kTile;
  const int64_t tokens = x.size(0), hidden = x.size(1), pairs = static_cast<int64_t>(g.token.size());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const std::vector<float> gathered = gather_rows(xf.data_ptr<float>(), g, hidden);
  tierserve_gemv::Quantized qx;
  quantize_parallel(qx, gathered.data(), pairs, hidden);
  const tierserve_gemv::QInput in = qx.input();
  const tierserve_gemv::Isa isa = tierserve_gemv::best_isa();
  // 1. threads split the gate tiles; each also runs the matching up tiles (I / 16 further).
  std::vector<float> act(pairs * inter);
  const int64_t gate_tiles = inter / kTile;
  at::parallel_for(0, gate_tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> both;  // [n, 2I]: this thread's columns only
    std::vector<uint16_t> scratch;
    const int64_t j0 = t0 * kTile, width = (t1 - t0) * kTile;
    for (const int64_t e : g.touched) {
      const int64_t first = g.start[e], n = g.start[e + 1] - first;
      both.resize(n * 2 * inter);
      const tierserve_gemv::Problem<float> p{gate_up.w[e], gate_up.scales[e], both.data(), hidden, 2 * inter, gate_up.stride};
      const tierserve_gemv::QInput rows = rows_from(in, first, hidden);
      tierserve_gemv::tiles<Q4>(p, rows, n, t0, t1, isa);
      tierserve_gemv::tiles<Q4>(p, rows, n, gate_tiles + t0, gate_tiles + t1, isa);
      for (int64_t r = 0; r < n; ++r)
        swiglu_span<W, float>(&both[r * 2 * inter + j0], &both[r * 2 * inter + inter + j0], &act[(first + r) * inter + j0],
                              width, scratch);
    }
  });
  tierserve_gemv::Quantized qa;
  quantize_parallel(qa, act.data(), pairs, inter);
  const tierserve_gemv::QInput in_act = qa.input();
  // 2. threads split the down tiles (hidden columns); sums as in `run`.
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  at::parallel_for(0, hidden / kTile, 1, [&](int64_t t0, int64_t t1) {
    const int64_t c0 = t0 * kTile, width = (t1 - t0) * kTile;
    std::vector<float> sum(tokens * width, 0.0f), y;
    for (const int64_t e : g.touched) {  // NOTE: ascending experts, as in `run`
      const int64_t first = g.start[e], n = g.start[e + 1] - first;
      y.resize(n * hidden);
      const tierserve_gemv::Problem<float> p{down.w[e], down.scales[e], y.data(), inter, hidden, down.stride};
      tierserve_gemv::tiles<Q4>(p, rows_from(in_act, first, inter), n, t0, t1, isa);
      add_weighted<W>(g, first, n, y.data() + c0, hidden, sum.data(), width);
    }
    write_sums<W>(sum, out, c0, width);
  });
  return out;
}

Packed packed(at::TensorList weights, at::TensorList scales, bool q4, int64_t n, int64_t k, const char* what) {
  using tierserve_gemv::kGroup;
  using tierserve_gemv::kTile;
  using tierserve_gemv::kTileGroupBytes;
  const int64_t stride = q4 ? k / kGroup * kTileGroupBytes : k * kTile;
  Packed out{{}, {}, stride};
  TORCH_CHECK(q4 || scales.size() == weights.size(), "moe_experts_quantized: one scale vector per int8 ", what, " weight");
  for (size_t e = 0; e < weights.size(); ++e) {
    const at::Tensor& w = weights[e];
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(0) == n / kTile && w.size(1) == stride &&
                    w.is_contiguous(), "moe_experts_quantized: every ", what, " weight packed as [", n / kTile, ", ", stride, "]");
    out.w.push_back(w.data_ptr<uint8_t>());
    if (q4) {
      out.scales.push_back(nullptr);
    } else {
      TORCH_CHECK(scales[e].scalar_type() == at::kFloat && scales[e].numel() == n && scales[e].is_contiguous(),
                  "moe_experts_quantized: int8 scales are float32 [N]");
      out.scales.push_back(scales[e].data_ptr<float>());
    }
  }
  return out;
}

// The quantized experts: gate_up per expert packed [2I / 16, ...], down [H / 16, ...]
// (gpu/quant/gemv.py's pack_int8 / pack_q4), int8 scales float32 [N] per expert (empty
// lists for q4); H and I multiples of 32 (the groups) and 16 (the tiles).
at::Tensor moe_experts_quantized(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                                 at::TensorList gate_up, at::TensorList gate_up_scales, at::TensorList down,
                                 at::TensorList down_scales, bool q4, int64_t inter) {
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "moe_experts_quantized: one gate_up and one down per expert");
  const Groups g = step_groups(x, experts, weights, static_cast<int64_t>(down.size()));
  const int64_t hidden = x.size(1);
  TORCH_CHECK(hidden % 32 == 0 && inter % 32 == 0 && inter > 0, "moe_experts_quantized: H and I multiples of 32");
  const Packed gu = packed(gate_up, gate_up_scales, q4, 2 * inter, hidden, "gate_up");
  const Packed dn = packed(down, down_scales, q4, hidden, inter, "down");
  if (x.scalar_type() == at::kFloat)
    return q4 ? run_quantized<float, true>(x, g, gu, dn, inter) : run_quantized<float, false>(x, g, gu, dn, inter);
  return q4 ? run_quantized<c10::BFloat16, true>(x, g, gu, dn, inter) : run_quantized<c10::BFloat16, false>(x, g, gu, dn, inter);
}

template <class W>
std::vector<const W*> pointers(at::TensorList weights, int64_t rows, int64_t cols, const char* what) {
  std::vector<const W*> out;
  out.reserve(weights.size());
  for (const auto& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols && w.is_contiguous(), "moe_experts: every ",
                what, " weight must be a contiguous [", rows, ", ", cols, "]");
    out.push_back(w.data_ptr<W>());
  }
  return out;
}

// x [T, H]; experts [T, k] int64 and weights [T, k] (x's dtype): each token's experts and
// routing weights; gate_up: per expert [2I, H] (gate rows, then up rows); down: per expert
// [H, I]. All float32 or all bfloat16. -> [T, H] in x's dtype.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       at::TensorList gate_up, at::TensorList down) {
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "moe_experts: one gate_up and one down per expert");
  const Groups g = step_groups(x, experts, weights, static_cast<int64_t>(down.size()));
  const auto dtype = x.scalar_type();
  for (const auto& w : gate_up) TORCH_CHECK(w.scalar_type() == dtype, "moe_experts: weights in x's dtype");
  for (const auto& w : down) TORCH_CHECK(w.scalar_type() == dtype, "moe_experts: weights in x's dtype");
  const int64_t hidden = x.size(1), inter = down[0].size(1);
  if (dtype == at::kFloat) {
    return run<float, float>(x, g, pointers<float>(gate_up, 2 * inter, hidden, "gate_up"),
                             pointers<float>(down, hidden, inter, "down"), inter);
  }
  using In = tierserve_dense::InputOf<c10::BFloat16>::type;
  return run<c10::BFloat16, In>(x, g, pointers<c10::BFloat16>(gate_up, 2 * inter, hidden, "gate_up"),
                                pointers<c10::BFloat16>(down, hidden, inter, "down"), inter);
}

}  // namespace

// Whether a token's output is the same bits whichever tokens share the step (the AVX-512
// kernels: float32 widened, bf16 pairs), or depends on them (the AVX2 one).
bool moe_experts_row_invariant() {
#ifdef TIERSERVE_DENSE_AVX512
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.def("moe_experts(Tensor x, Tensor experts, Tensor weights, Tensor[] gate_up, Tensor[] down) -> Tensor");
  m.def("moe_experts_quantized(Tensor x, Tensor experts, Tensor weights, Tensor[] gate_up, Tensor[] gate_up_scales, "
        "Tensor[] down, Tensor[] down_scales, bool q4, int inter) -> Tensor");
  m.def("moe_experts_row_invariant() -> bool", &moe_experts_row_invariant);
}

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) {
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_experts_quantized", &moe_experts_quantized);
}
