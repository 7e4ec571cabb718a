// Weight-only quantized matmuls as torch ops, int8 and 4-bit weights for any number of rows
// (x quantized to int8); the formats and the inner loops are in quant_gemv_core.h.

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

// x [M, K] float32 or bfloat16 -> out [M, n] in x's dtype: x as float32 rows (a view when
// it already is, else converted in a plain loop: aten ops here would cost more than a small
// matmul), quantized per group (quant_input.h), then the tiles over the intra-op threads.
template <bool Q4>
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const float* scales, int64_t n, const std::string& isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_gemv: x must be float32 or bfloat16");
  TORCH_CHECK(weight.is_contiguous(), "quant_gemv: the weight must be contiguous");
  const std::vector<std::string> isas = compiled_isas();
  TORCH_CHECK(isa == "auto" || std::find(isas.begin(), isas.end(), isa) != isas.end(),
              "quant_gemv: instruction set '", isa, "' is not compiled in");
  const Isa path = isa_named(isa);
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
  Quantized q;
  q.resize(rows, k);
  at::parallel_for(0, rows, std::max<int64_t>(1, (64 << 10) / k), [&](int64_t r0, int64_t r1) { q.quantize_rows(xf, k, r0, r1); });
  const QInput in = q.input();
  const int64_t stride = weight.size(1), tile_count = (n + kTile - 1) / kTile;
  // NOTE: at least ~32 KB of weight per thread's range, so small matrices do not pay for threads they cannot use
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / stride);
  auto run = [&](auto* o) {
    using Out = std::remove_pointer_t<decltype(o)>;
    const Problem<Out> p{static_cast<const uint8_t*>(weight.data_ptr()), scales, o, k, n, stride};
    at::parallel_for(0, tile_count, grain, [&](int64_t i0, int64_t i1) { tiles<Q4>(p, in, rows, i0, i1, path); });
  };
  if (x.scalar_type() == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    run(out.data_ptr<at::BFloat16>());
  }
  return out;
}

// The path "auto" runs here (best_isa: the 512-bit one only where it measured faster).
std::string auto_isa() {
  const std::vector<std::string> names = compiled_isas();
  const Isa best = best_isa();
  for (const std::string& name : names) {
    if (isa_named(name) == best) return name;
  }
  return "scalar";
}

at::Tensor quant_gemv_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, std::string isa) {
  const int64_t n = scales.numel();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "quant_gemv_int8: scales must be float32 [N]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(0) == (n + kTile - 1) / kTile,
              "quant_gemv_int8: packed must be uint8 [ceil(N / 16), K * 16]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0 && packed.size(1) == x.size(1) * kTile,
              "quant_gemv_int8: x [M, K] does not match the packed weight (K a multiple of 32)");
  return gemv<false>(x, packed, scales.data_ptr<float>(), n, isa);
}

at::Tensor quant_gemv_q4(const at::Tensor& x, const at::Tensor& packed, int64_t n, std::string isa) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(0) == (n + kTile - 1) / kTile,
              "quant_gemv_q4: packed must be uint8 [ceil(N / 16), K / 32 * 320]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0 && packed.size(1) == x.size(1) / kGroup * kTileGroupBytes,
              "quant_gemv_q4: x [M, K] does not match the packed weight");
  return gemv<true>(x, packed, nullptr, n, isa);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.def("quant_gemv_int8(Tensor x, Tensor packed, Tensor scales, str isa='auto') -> Tensor");
  m.def("quant_gemv_q4(Tensor x, Tensor packed, int n, str isa='auto') -> Tensor");
  m.def("quant_gemv_isas() -> str[]", &compiled_isas);
  m.def("quant_gemv_isa() -> str", &auto_isa);
}

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) {
  m.impl("quant_gemv_int8", &quant_gemv_int8);
  m.impl("quant_gemv_q4", &quant_gemv_q4);
}
