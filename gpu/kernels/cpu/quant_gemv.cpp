// Weight-only quantized matmuls as torch ops: int8 weights for few-row batches (decode), 4-bit
// ones for any batch (x quantized to int8); the formats and the inner loops are in quant_gemv_core.h.

#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "quant_gemv_core.h"

namespace {

using namespace tierserve_gemv;

// Work items of 16 output rows over the intra-op threads, for all rows of x in each.
template <class Fn>
void over_items(int64_t n, int64_t item_bytes, const Fn& fn) {
  const int64_t items = (n + kTile - 1) / kTile;
  // NOTE: at least ~32 KB of weight per work item, so small matrices do not pay for threads they cannot use
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / item_bytes);
  at::parallel_for(0, items, grain, fn);
}

template <class Out>
void int8_all(const Problem<Out>& p, int64_t rows, std::string isa) {
  if (isa == "auto") isa = compiled_isas().front();
  over_items(p.N, kTile * p.K, [&](int64_t i0, int64_t i1) {
#if defined(QG_AVX512)
    if (isa == "avx512") return int8_items<Avx512>(p, rows, i0, i1);
#endif
#if defined(QG_AVX2)
    if (isa == "avx2") return int8_items<Avx2>(p, rows, i0, i1);
#endif
    int8_items<Scalar>(p, rows, i0, i1);
  });
}

template <class Out>
void q4_all(const Problem<Out>& p, const Q4Input& in, int64_t rows, const std::string& isa) {
  over_items(p.N, p.stride, [&](int64_t i0, int64_t i1) { q4_items(p, in, rows, i0, i1, isa != "scalar"); });
}

// x [M, K] float32 or bfloat16 -> out [M, n] in x's dtype; x as float32 rows (a view when
// it already is, else converted in a plain loop: aten ops here would cost more than a small
// matmul) and, for q4, quantized per group (quant_gemv_core.h's Quantized).
template <bool Q4>
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const float* scales, int64_t n, int64_t stride,
                const std::string& isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_gemv: x must be float32 or bfloat16");
  TORCH_CHECK(weight.is_contiguous(), "quant_gemv: the weight must be contiguous");
  const std::vector<std::string> isas = compiled_isas();
  TORCH_CHECK(isa == "auto" || std::find(isas.begin(), isas.end(), isa) != isas.end(),
              "quant_gemv: instruction set '", isa, "' is not compiled in");
  const at::Tensor input = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  std::vector<float> copy;
  const float* xf = nullptr;
  if (input.scalar_type() == at::kFloat) {
    xf = input.data_ptr<float>();
  } else {
    const at::BFloat16* src = input.data_ptr<at::BFloat16>();
    copy.resize(rows * k);
    for (int64_t i = 0; i < rows * k; ++i) copy[i] = static_cast<float>(src[i]);
    xf = copy.data();
  }
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  auto run = [&](auto* o) {
    using Out = std::remove_pointer_t<decltype(o)>;
    const Problem<Out> p{xf, w, scales, o, k, n, stride};
    if constexpr (Q4) {
      Quantized q;
      q.resize(rows, k);
      at::parallel_for(0, rows, std::max<int64_t>(1, (64 << 10) / k), [&](int64_t r0, int64_t r1) { q.quantize_rows(xf, k, r0, r1); });
      q4_all(p, q.input(), rows, isa);
    } else {
      int8_all(p, rows, isa);
    }
  };
  if (x.scalar_type() == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    run(out.data_ptr<at::BFloat16>());
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
