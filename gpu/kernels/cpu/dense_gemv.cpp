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
// so it is used outside deterministic mode only, like every kernel here. bfloat16: x is
// widened to float32 once, each weight element as it is read (exact: a bf16 is the top half
// of a float32), the products summed in float32 as torch's bf16 GEMMs do, and the output
// rounded to bf16 (nearest even) at the end. torch's bf16 GEMMs at 1 row of a [1024 x 1024]
// weight read it at ~6 GB/s on a Zen 4 EPYC that reads 35.

#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TIERSERVE_DENSE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIERSERVE_DENSE_AVX2 1
#endif

namespace {

#ifdef TIERSERVE_DENSE_AVX512
constexpr int64_t kMaxRows = 16;  // rows of x per pass over the weight (16 accumulators of 16 lanes)
#else
constexpr int64_t kMaxRows = 8;  // rows of x per pass over the weight (registers: 8 accumulators)
#endif

#ifdef TIERSERVE_DENSE_AVX2
inline float lanes_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

#ifdef TIERSERVE_DENSE_AVX2
// 8 weights as float32 lanes (bf16: widened exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#ifndef TIERSERVE_DENSE_AVX512
// out[m * ldo + j] for j in [n0, n1), m < M: rows of x (float32, stride k) against rows of w
// (stride k). NOTE: U independent accumulators per row of x (4 for one row, 2 for two or
// three): one FMA chain per row would wait on the FMA's latency every 8 floats, slower than
// the read.
template <int M, class W>
void rows(const float* x, const W* w, float* out, int64_t k, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int U = M == 1 ? 4 : (M < 4 ? 2 : 1);
  for (int64_t j = n0; j < n1; ++j) {
    const W* wr = w + j * k;
    int64_t i = 0;
    float sums[M];
#ifdef TIERSERVE_DENSE_AVX2
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    for (; i + 8 * U <= k; i += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256 wv = load8(wr + i + 8 * u);
        for (int m = 0; m < M; ++m) acc[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + i + 8 * u), acc[m][u]);
      }
    }
    for (; i + 8 <= k; i += 8) {
      const __m256 wv = load8(wr + i);
      for (int m = 0; m < M; ++m) acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + i), acc[m][0]);
    }
    for (int m = 0; m < M; ++m) {
      __m256 total = acc[m][0];
      for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, acc[m][u]);
      sums[m] = lanes_sum(total);
    }
#else
    for (int m = 0; m < M; ++m) sums[m] = 0.0f;
#endif
    for (; i < k; ++i)
      for (int m = 0; m < M; ++m) sums[m] += static_cast<float>(wr[i]) * x[m * k + i];
    for (int m = 0; m < M; ++m) out[m * ldo + j] = sums[m];
  }
}
#endif

#ifdef TIERSERVE_DENSE_AVX512
// 16 weights as float32 lanes (bf16: widened exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// AVX-512: two accumulators of 16 lanes per (row of x, output), over alternate chunks of
// 16 (two chains hide the FMA's latency at one row), added and their lanes summed by one
// fixed tree, then the scalar tail. NOTE: the same operations for every M, so a row's
// outputs do not depend on how many rows share the pass (a speculative verify step of k + 1
// rows gives each row what a one-row decode step gives it). One output at a time, rows in
// groups of 8 (the weight row read from L1 by the second group): the weight is one
// sequential stream, which the hardware prefetchers follow (two or four outputs at once,
// interleaved streams, were 1.2-1.4x slower at one row on a Zen 5 EPYC).
template <int M, class W>
inline void output_rows(const float* x, const W* wr, float* out, int64_t k, int64_t ldo) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const __m512 w0 = load16(wr + i), w1 = load16(wr + i + 16);
    for (int m = 0; m < M; ++m) {
      acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * k + i), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * k + i + 16), acc[m][1]);
    }
  }
  if (i + 16 <= k) {
    const __m512 w0 = load16(wr + i);
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * k + i), acc[m][0]);
    i += 16;
  }
  for (int m = 0; m < M; ++m) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
    for (int64_t t = i; t < k; ++t) sum += static_cast<float>(wr[t]) * x[m * k + t];
    out[m * ldo] = sum;
  }
}

// out[m * ldo + j] for j in [n0, n1), m < M.
template <int M, class W>
void rows(const float* x, const W* w, float* out, int64_t k, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int kFirst = M < 8 ? M : 8;
  for (int64_t j = n0; j < n1; ++j) {
    output_rows<kFirst>(x, w + j * k, out + j, k, ldo);
    if constexpr (M > 8) output_rows<M - 8>(x + 8 * k, w + j * k, out + 8 * ldo + j, k, ldo);
  }
}

template <class W>
using RowsFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t);
template <class W>
constexpr RowsFn<W> kRows[kMaxRows] = {rows<1, W>,  rows<2, W>,  rows<3, W>,  rows<4, W>,  rows<5, W>,  rows<6, W>,
                                       rows<7, W>,  rows<8, W>,  rows<9, W>,  rows<10, W>, rows<11, W>, rows<12, W>,
                                       rows<13, W>, rows<14, W>, rows<15, W>, rows<16, W>};
#else
template <class W>
using RowsFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t);
template <class W>
constexpr RowsFn<W> kRows[kMaxRows] = {rows<1, W>, rows<2, W>, rows<3, W>, rows<4, W>,
                                       rows<5, W>, rows<6, W>, rows<7, W>, rows<8, W>};
#endif

template <class W>
void run(const float* xp, const W* wp, float* op, int64_t m, int64_t k, int64_t n) {
  // NOTE: at least ~32 KB of weight per thread's range (small matrices skip the threads).
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (k * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < m; r += kMaxRows) {
      const int64_t rows_now = std::min(kMaxRows, m - r);
      kRows<W>[rows_now - 1](xp + r * k, wp, op + r * n, k, n, n0, n1);
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
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16: widened once (exact)
  const int64_t m = xf.size(0), k = xf.size(1), n = w.size(0);
  at::Tensor out = at::empty({m, n}, xf.options());
  if (m > 0 && n > 0) {
    if (dtype == at::kFloat) {
      run(xf.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), m, k, n);
    } else {
      run(xf.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), m, k, n);
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
