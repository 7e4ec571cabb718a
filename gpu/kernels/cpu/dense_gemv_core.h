// The few-row matmul kernels of dense_gemv.cpp, shared with moe_experts.cpp: out[m, j] =
// x[m] . w[j] for up to kMaxRows rows of x (float32) against rows of a float32 or bfloat16
// weight, each weight row read once for all of them. See dense_gemv.cpp for the arithmetic.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TIERSERVE_DENSE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIERSERVE_DENSE_AVX2 1
#endif

namespace tierserve_dense {

// Software prefetch distance along the weight, which both AVX-512 kernels read as one
// forward stream (a row, or a block's adjacent rows, then the next): from ~4 rows of x they
// compute long enough per cache line that the hardware prefetchers fall behind. [40960 x
// 1024] bf16 on a 2-core Zen 5 EPYC, 8 rows: 7.8-8.5 -> 2.3-2.5 ms (widening kernel),
// 4.3 -> 2.4 ms (pairs kernel; on an L2-resident weight it computes 4x as fast); float32
// [20480 x 1024], 8 rows: 4.9-8.3 -> 2.6 ms; 1 row unchanged. Into L2 (prefetcht1, as the
// quantized kernels', quant_gemv_core.h), not L1: on a 2-core Zen 4 EPYC, calls alternating
// in one process, [49152 x 576] and [61440 x 1024] at 1 / 4 / 8 rows took 0.83-0.95 /
// 0.62-0.78 / 0.60-0.81x the time of into-L1 16 KB ahead (layer-sized weights 0.78-1.0x);
// the distance alone (8 KB into L1) changed nothing.
constexpr int64_t kPrefetchBytes = 8192;
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }  // prefetcht1

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
// sequential stream, prefetched kPrefetchBytes ahead (two or four outputs at once,
// interleaved streams, were 1.2-1.4x slower at one row on a Zen 5 EPYC).
template <int M, class W>
inline void output_rows(const float* x, const W* wr, float* out, int64_t k, int64_t ldo) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    prefetch_l2(reinterpret_cast<const char*>(wr + i) + kPrefetchBytes);  // a line a chunk (bf16: 64 B)
    if constexpr (sizeof(W) == 4) prefetch_l2(reinterpret_cast<const char*>(wr + i + 16) + kPrefetchBytes);
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

#if defined(TIERSERVE_DENSE_AVX512) && defined(__AVX512BF16__)
#define TIERSERVE_DENSE_BF16_PAIRS 1
// bfloat16 x against a bfloat16 weight with AVX512-BF16's dot product of pairs
// (`vdpbf16ps`: 32 products into 16 float32 lanes), where a MoE step's experts of ~5 tokens
// each make the widening kernel above compute-bound. Each (row of x, output) is one
// accumulator over the chunks of 32 in order, its lanes summed by one fixed tree, then the
// scalar tail: the same operations whatever M and R, so a row's outputs do not depend on
// the rows beside it or on which outputs share its block. Up to 4 rows of x, one weight row
// at a time (one forward stream: the step is a read of the weight); more, R = 2 weight rows
// at a time share each load of x (the step computes). Against R = 8 / 4 / 2 (1-2 / 3-4 / 5+
// rows), alternating in one process on a 2-core Zen 5 EPYC: 60 x [1024 x 1024], 1 row 2.83
// vs 3.17 ms, 4 rows 2.89 vs 3.69, 8-32 rows equal; a MoE layer at 8 tokens 2.31 vs 2.62.
// Not the widening kernel's bits (the instruction adds a pair's products before the
// accumulator, and flushes denormals).
template <int M, int R>
inline void pair_block(const c10::BFloat16* x, const c10::BFloat16* w, float* out, int64_t k, int64_t ldo) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      prefetch_l2(reinterpret_cast<const char*>(w + r * k + i) + kPrefetchBytes);
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * k + i);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k + i);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float sum = _mm512_reduce_add_ps(acc[m][r]);
      for (int64_t t = i; t < k; ++t) sum += static_cast<float>(w[r * k + t]) * static_cast<float>(x[m * k + t]);
      out[m * ldo + r] = sum;
    }
  }
}

// out[m * ldo + j] for j in [n0, n1), m < M (at most 8).
template <int M>
void pair_group(const c10::BFloat16* x, const c10::BFloat16* w, float* out, int64_t k, int64_t ldo, int64_t n0,
                int64_t n1) {
  constexpr int R = M <= 4 ? 1 : 2;
  int64_t j = n0;
  for (; j + R <= n1; j += R) pair_block<M, R>(x, w + j * k, out + j, k, ldo);
  for (; j < n1; ++j) pair_block<M, 1>(x, w + j * k, out + j, k, ldo);
}

template <int M>
void pair_rows(const c10::BFloat16* x, const c10::BFloat16* w, float* out, int64_t k, int64_t ldo, int64_t n0,
               int64_t n1) {
  pair_group<(M < 8 ? M : 8)>(x, w, out, k, ldo, n0, n1);
  if constexpr (M > 8) pair_group<M - 8>(x + 8 * k, w, out + 8 * ldo, k, ldo, n0, n1);
}

using PairRowsFn = void (*)(const c10::BFloat16*, const c10::BFloat16*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr PairRowsFn kPairRows[kMaxRows] = {
    pair_rows<1>, pair_rows<2>,  pair_rows<3>,  pair_rows<4>,  pair_rows<5>,  pair_rows<6>,  pair_rows<7>,  pair_rows<8>,
    pair_rows<9>, pair_rows<10>, pair_rows<11>, pair_rows<12>, pair_rows<13>, pair_rows<14>, pair_rows<15>, pair_rows<16>};
#endif

// The kernels' x type for a weight type: bf16 weights take bf16 x on the pairs kernel where
// it is built; everything else, float32 x on the widening kernel.
template <class W>
struct InputOf {
  using type = float;
};
#ifdef TIERSERVE_DENSE_BF16_PAIRS
template <>
struct InputOf<c10::BFloat16> {
  using type = c10::BFloat16;
};
#endif

// One pass: out[r * ldo + j] = x[r] . w[j] for rows r < rows (1..kMaxRows), j in [n0, n1).
template <class W>
inline void pass_rows(const typename InputOf<W>::type* x, const W* w, float* out, int64_t rows, int64_t k,
                      int64_t ldo, int64_t n0, int64_t n1) {
#ifdef TIERSERVE_DENSE_BF16_PAIRS
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    kPairRows[rows - 1](x, w, out, k, ldo, n0, n1);
  } else {
    kRows<W>[rows - 1](x, w, out, k, ldo, n0, n1);
  }
#else
  kRows<W>[rows - 1](x, w, out, k, ldo, n0, n1);
#endif
}

}  // namespace tierserve_dense
