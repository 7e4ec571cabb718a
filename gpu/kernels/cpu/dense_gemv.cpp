// float32 and bfloat16 matmuls of a few rows, out = x @ w^T, reading each weight row once
// for all the rows of x. Decode steps (and a MoE step's expert groups of a few tokens each) multiply a
// handful of rows by weights far larger than the caches, so the time is one read of the
// weight; torch's GEMMs at 1-8 rows read it at a fraction of the machine's bandwidth here
// (benchmarks/moe.py's notes: 1 row of [1024 x 1024] ~300 us, 5 rows ~600 us, where one
// read takes ~140 us).
//
// Each output element is a dot product of a weight row and an x row in 8 float32 lanes
// (FMA; 16 with AVX-512, up to 16 rows a pass, each row's arithmetic the same whatever the
// pass's rows), the lanes summed at the end, then the scalar tail: not torch's summation order,
// so it is used outside deterministic mode only, like every kernel here. bfloat16: with
// AVX512-BF16, x stays bf16 and AVX512-BF16's dot product of pairs sums two products into
// each float32 lane (dense_gemv_core.h's pairs kernel); elsewhere x is widened to float32
// once, each weight element as it is read (exact: a bf16 is the top half of a float32).
// Either way the products are summed in float32 as torch's bf16 GEMMs do, and the output
// rounded to bf16 (nearest even) at the end. torch's bf16 GEMMs at 1 row of a [1024 x 1024]
// weight read it at ~6 GB/s on a Zen 4 EPYC that reads 35. The kernels are in
// dense_gemv_core.h (shared with moe_experts.cpp).

#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <type_traits>

#include "dense_gemv_core.h"

namespace {

using tierserve_dense::kMaxRows;

// Threads split the weight's rows; each takes its range in blocks of ~64 KB of weight and
// runs every pass of rows of x over a block before the next, so a step of more than
// kMaxRows rows reads the weight from memory once (the later passes from L2).
template <class W>
void run(const typename tierserve_dense::InputOf<W>::type* xp, const W* wp, float* op, int64_t m, int64_t k, int64_t n) {
  // NOTE: at least ~32 KB of weight per thread's range (small matrices skip the threads).
  const int64_t bytes = k * static_cast<int64_t>(sizeof(W));
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / bytes), block = std::max<int64_t>(1, (64 << 10) / bytes);
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
      const int64_t b1 = std::min(n1, b0 + block);
      for (int64_t r = 0; r < m; r += kMaxRows)
        tierserve_dense::pass_rows(xp + r * k, wp, op + r * n, std::min(kMaxRows, m - r), k, n, b0, b1);
    }
  });
}

// x [M, K], w [N, K] (both float32 or both bfloat16; w contiguous) -> [M, N] in their dtype;
// passes of up to kMaxRows rows of x each.
at::Tensor dense_gemv(const at::Tensor& x, const at::Tensor& w) {
  const auto dtype = w.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16),
              "dense_gemv: x and w both float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense_gemv: x [M, K] and w [N, K]");
  TORCH_CHECK(w.is_contiguous(), "dense_gemv: the weight must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m > 0 && n > 0) {
    if (dtype == at::kFloat) {
      const at::Tensor xf = x.contiguous();
      run(xf.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), m, k, n);
    } else {
      using In = tierserve_dense::InputOf<c10::BFloat16>::type;  // bf16 (pairs kernel) or float32 (widened: exact)
      const at::Tensor xin = x.to(std::is_same_v<In, float> ? at::kFloat : at::kBFloat16).contiguous();
      run(xin.data_ptr<In>(), w.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), m, k, n);
    }
  }
  return out.to(dtype);  // bf16: rounded to nearest even once
}

}  // namespace

// Rows of x per pass over the weight: 16 on the AVX-512 path, where a row's arithmetic does not
// depend on the rows beside it; 8 on the AVX2 one, where it does (one row unrolls further).
int64_t dense_gemv_pass_rows() { return kMaxRows; }

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.def("dense_gemv(Tensor x, Tensor w) -> Tensor");
  m.def("dense_gemv_pass_rows() -> int", &dense_gemv_pass_rows);
}

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) { m.impl("dense_gemv", &dense_gemv); }
