// Weight-only quantized matmuls for few-row batches (decode), as torch ops; the formats and
// the inner loops are in quant_gemv_core.h.

#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include "quant_gemv_core.h"

namespace {

using namespace tierserve_gemv;

// Work items of 16 output rows over the intra-op threads, every pass of x's rows in each.
template <class I, bool Q4, class Out>
void run_all(const Problem<Out>& p, int64_t rows) {
  const int64_t items = (p.N + kTile - 1) / kTile;
  const int64_t item_bytes = Q4 ? p.stride : kTile * p.K;
  // NOTE: at least ~32 KB of weight per work item, so small matrices do not pay for threads they cannot use
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / item_bytes);
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) { run_items<I, Q4>(p, rows, i0, i1); });
}

template <bool Q4, class Out>
void dispatch_isa(const Problem<Out>& p, int64_t rows, std::string isa) {
  if (isa == "auto") isa = compiled_isas().front();
#if defined(QG_AVX512)
  if (isa == "avx512") return run_all<Avx512, Q4>(p, rows);
#endif
#if defined(QG_AVX2)
  if (isa == "avx2") return run_all<Avx2, Q4>(p, rows);
#endif
  TORCH_CHECK(isa == "scalar", "quant_gemv: instruction set '", isa, "' is not compiled in");
  run_all<Scalar, Q4>(p, rows);
}

// x as float32 rows (a view when it already is) and, for q4, each group's sum of x (for the
// offsets: m * sum_k x_k), in plain loops: aten ops here would cost more than a small matmul.
struct Activations {
  std::vector<float> copy, sums;
  const float* x = nullptr;

  Activations(const at::Tensor& input, bool group_sums) {
    const int64_t rows = input.size(0), k = input.size(1);
    if (input.scalar_type() == at::kFloat) {
      x = input.data_ptr<float>();
    } else {
      const at::BFloat16* src = input.data_ptr<at::BFloat16>();
      copy.resize(rows * k);
      for (int64_t i = 0; i < rows * k; ++i) copy[i] = static_cast<float>(src[i]);
      x = copy.data();
    }
    if (!group_sums) return;
    sums.assign(rows * (k / kGroup), 0.0f);
    for (int64_t i = 0; i < rows * k; ++i) sums[i / kGroup] += x[i];
  }
};

// x [M, K] float32 or bfloat16 -> out [M, n] in x's dtype.
template <bool Q4>
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const float* scales, int64_t n, int64_t stride,
                const std::string& isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_gemv: x must be float32 or bfloat16");
  TORCH_CHECK(weight.is_contiguous(), "quant_gemv: the weight must be contiguous");
  const at::Tensor input = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const Activations act(input, Q4);
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  const float* sums = Q4 ? act.sums.data() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    dispatch_isa<Q4>(Problem<float>{act.x, sums, w, scales, out.data_ptr<float>(), k, n, stride}, rows, isa);
  } else {
    auto* o = out.data_ptr<at::BFloat16>();
    dispatch_isa<Q4>(Problem<at::BFloat16>{act.x, sums, w, scales, o, k, n, stride}, rows, isa);
  }
  return out;
}

at::Tensor quant_gemv_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, std::string isa) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "quant_gemv_int8: weight must be int8 [N, K]");
  TORCH_CHECK(x.dim() == 2 && weight.size(1) == x.size(1) && x.size(1) % kGroup == 0,
              "quant_gemv_int8: x must be [M, K] with K the weight's, a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == weight.size(0),
              "quant_gemv_int8: scales must be float32 [N]");
  return gemv<false>(x, weight, scales.data_ptr<float>(), weight.size(0), weight.size(1), isa);
}

at::Tensor quant_gemv_q4(const at::Tensor& x, const at::Tensor& packed, int64_t n, std::string isa) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(0) == (n + kTile - 1) / kTile,
              "quant_gemv_q4: packed must be uint8 [ceil(N / 16), K / 32 * 320]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0 && packed.size(1) == x.size(1) / kGroup * kTileGroupBytes,
              "quant_gemv_q4: x [M, K] does not match the packed weight");
  return gemv<true>(x, packed, nullptr, n, packed.size(1), isa);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.def("quant_gemv_int8(Tensor x, Tensor weight, Tensor scales, str isa='auto') -> Tensor");
  m.def("quant_gemv_q4(Tensor x, Tensor packed, int n, str isa='auto') -> Tensor");
  m.def("quant_gemv_isas() -> str[]", &compiled_isas);
}

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) {
  m.impl("quant_gemv_int8", &quant_gemv_int8);
  m.impl("quant_gemv_q4", &quant_gemv_q4);
}
