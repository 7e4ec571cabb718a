// The inner loops of quant_gemv.cpp's weight-only quantized matmuls, shared with
// decode_step.cpp (which runs them inside its own parallel region): the instruction-set
// layers, the problem of one pass, and `item`, which computes output rows [n0, n1) of
// up to kMaxRows rows of x. NOTE: a row's result depends only on its own x and the
// weight, never on the other rows of the pass or on how [0, N) is cut into items, so
// both callers give bit-identical results.
//
// Weight-only quantized matmuls for few-row batches (decode): out[M, N] = x[M, K] @ w[N, K]^T.
//
// Batch-1 decode reads every weight once per token, so these kernels stream the weight bytes
// once per call for all M rows of x (up to 8 per pass; more rows take more passes), expand
// them to float32 in registers, multiply with x in float32 (fused multiply-add, float32
// accumulation) and write the result in x's dtype (float32 or bfloat16). Work items of 16
// output rows are spread over the intra-op threads (at::parallel_for), and the weight stream
// is prefetched in software a few KB ahead.
//
// Weight formats:
// - int8: int8 [N, K] with one float32 scale per output row: w = q * s. A work item reads R
//   rows side by side (R * M accumulators in registers), vectorized along K.
// - q4: 4-bit groups of 32 along K with an fp16 scale d and offset m each: w = d * q + m
//   (GGUF Q4_1; Q4_0 is m = -8 d). Interleaved by tiles of 16 output rows so that one vector
//   holds the 16 rows' weights at one k: uint8 [N / 16, K / 32 * 320], per tile and group
//   d[16] fp16, m[16] fp16, then 16 pairs (k = 2j, 2j + 1) of 16 bytes, byte r holding
//   q[r, 2j] in its low nibble and q[r, 2j + 1] in its high one. Vectorized along rows, the
//   scales are applied once per group: sum_k x_k w_k = d * sum_k x_k q_k + m * sum_k x_k.
//   NOTE: gpu/quant/gemv.py (pack_q4) writes this layout; both sides must agree on it.
//
// The vector code (AVX-512, AVX2 + FMA + F16C) is compiled when -march=native offers it;
// the scalar path is always there. `isa` picks one for tests ("auto": the widest compiled).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_AVX2 1
#include <immintrin.h>
#endif
#if defined(QG_AVX2) && defined(__AVX512F__)
#define QG_AVX512 1
#endif

namespace tierserve_gemv {

constexpr int64_t kGroup = 32;                  // weights per 4-bit group along K
constexpr int64_t kTile = 16;                   // output rows per work item (q4: per interleaved tile)
constexpr int64_t kTileGroupBytes = kTile * 4 + kTile * kGroup / 2;  // d, m (fp16) + nibbles
constexpr int kMaxRows = 8;                     // rows of x per pass over the weight
constexpr int64_t kPrefetchBytes = 16384;       // software prefetch distance along a stream (4 KB: 0.92x the op in-model, 16-32 KB: 1.1x)

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// One instruction set: V holds L float32 lanes.
struct Scalar {
  using V = float;
  static constexpr int L = 1;
  static V zero() { return 0.0f; }
  static V load(const float* p) { return *p; }
  static V set1(float v) { return v; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V add(V a, V b) { return a + b; }
  static float sum(V v) { return v; }
  static void store(float* p, V v) { *p = v; }
  static V i8(const int8_t* p) { return static_cast<float>(*p); }
  static void nibbles(const uint8_t* p, V& lo, V& hi) { lo = float(p[0] & 0x0F); hi = float(p[0] >> 4); }
  static V halves(const uint8_t* p) { return half_at(p); }
};

#if defined(QG_AVX2)
struct Avx2 {
  using V = __m256;
  static constexpr int L = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void nibbles(const uint8_t* p, V& lo, V& hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  static V halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};
#endif

#if defined(QG_AVX512)
struct Avx512 {
  using V = __m512;
  static constexpr int L = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void nibbles(const uint8_t* p, V& lo, V& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
  static V halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
};
#endif

// Everything one pass needs: up to kMaxRows rows of x against all N output rows.
template <class Out>
struct Problem {
  const float* x;       // [rows, K] float32
  const float* xsum;    // q4: [rows, K / 32], each group's sum of x
  const uint8_t* w;     // the weight; int8: K bytes per row, q4: `stride` bytes per tile
  const float* scales;  // int8: [N]
  Out* out;             // [rows, N]
  int64_t K, N, stride;
};

template <class I, int M, int R, class Out>
void int8_rows(const Problem<Out>& p, int64_t n0) {
  typename I::V acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = I::zero();
  const int8_t* w = reinterpret_cast<const int8_t*>(p.w) + n0 * p.K;
  for (int64_t k = 0; k < p.K; k += I::L) {
    for (int r = 0; r < R; ++r) {
      if (k % 64 == 0) prefetch(w + r * p.K + k + kPrefetchBytes);
      const typename I::V wv = I::i8(w + r * p.K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = I::fma(wv, I::load(p.x + m * p.K + k), acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) p.out[m * p.N + n0 + r] = static_cast<Out>(I::sum(acc[r][m]) * p.scales[n0 + r]);
}

// int8 output rows [n0, n1): R rows at a time (R * M accumulators), the remainder one by one.
template <class I, int M, class Out>
void int8_item(const Problem<Out>& p, int64_t n0, int64_t n1) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  int64_t n = n0;
  for (; n + R <= n1; n += R) int8_rows<I, M, R>(p, n);
  for (; n < n1; ++n) int8_rows<I, M, 1>(p, n);
}

// P interleaved q4 tiles from tile t0: C = 16 / L vectors per tile, two partial sums (even
// and odd k) per tile and row of x, so that enough independent FMA chains are in flight.
template <class I, int M, int P, class Out>
void q4_tiles(const Problem<Out>& p, int64_t t0) {
  using V = typename I::V;
  constexpr int C = kTile / I::L;
  V acc[P][M][C];
  for (int t = 0; t < P; ++t)
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < C; ++c) acc[t][m][c] = I::zero();
  const int64_t groups = p.K / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* base[P];
    for (int t = 0; t < P; ++t) {
      base[t] = p.w + (t0 + t) * p.stride + g * kTileGroupBytes;
      for (int64_t line = 0; line < kTileGroupBytes; line += 64) prefetch(base[t] + kPrefetchBytes + line);
    }
    V part[P][M][C][2];
    for (int t = 0; t < P; ++t)
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) part[t][m][c][0] = part[t][m][c][1] = I::zero();
    for (int j = 0; j < kGroup / 2; ++j) {
      const float* xk = p.x + g * kGroup + 2 * j;
      for (int t = 0; t < P; ++t) {
        const uint8_t* q = base[t] + kTile * 4 + j * kTile;
        for (int c = 0; c < C; ++c) {
          V lo, hi;
          I::nibbles(q + c * I::L, lo, hi);
          for (int m = 0; m < M; ++m) {
            part[t][m][c][0] = I::fma(lo, I::set1(xk[m * p.K]), part[t][m][c][0]);
            part[t][m][c][1] = I::fma(hi, I::set1(xk[m * p.K + 1]), part[t][m][c][1]);
          }
        }
      }
    }
    for (int t = 0; t < P; ++t)
      for (int c = 0; c < C; ++c) {
        const V d = I::halves(base[t] + 2 * c * I::L), off = I::halves(base[t] + 2 * (kTile + c * I::L));
        for (int m = 0; m < M; ++m) {
          acc[t][m][c] = I::fma(d, I::add(part[t][m][c][0], part[t][m][c][1]), acc[t][m][c]);
          acc[t][m][c] = I::fma(off, I::set1(p.xsum[m * groups + g]), acc[t][m][c]);
        }
      }
  }
  for (int t = 0; t < P; ++t)
    for (int m = 0; m < M; ++m) {
      float rows[kTile];
      for (int c = 0; c < C; ++c) I::store(rows + c * I::L, acc[t][m][c]);
      const int64_t n0 = (t0 + t) * kTile;
      for (int64_t r = 0; r < std::min(kTile, p.N - n0); ++r) p.out[m * p.N + n0 + r] = static_cast<Out>(rows[r]);
    }
}

// q4_tiles for more rows of x than AVX2's 16 registers hold partial sums for (two per tile,
// row and vector): one partial sum per row and vector instead, for chunks of kChunkRows
// rows, each chunk expanding the tile group's nibbles again (from L1). 1.6x faster than
// q4_tiles for 8 rows (its partial sums would spill at every k), but not for 1-2 rows.
// NOTE: a row's result so depends on whether more than 2 rows share its pass; the decode
// step and the op pass the same rows, so they agree bit for bit.
constexpr int kChunkRows = 4;

// R rows of x from row m0 against one tile (the chunk of q4_tile_chunked).
template <class I, int R, class Out>
void q4_tile_rows(const Problem<Out>& p, int64_t t0, int m0) {
  using V = typename I::V;
  constexpr int C = kTile / I::L;
  const int64_t groups = p.K / kGroup;
  const uint8_t* tile = p.w + t0 * p.stride;
  V acc[R][C];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = I::zero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* base = tile + g * kTileGroupBytes;
    if (m0 == 0) {
      for (int64_t line = 0; line < kTileGroupBytes; line += 64) prefetch(base + kPrefetchBytes + line);
    }
    V part[R][C];
    for (int m = 0; m < R; ++m)
      for (int c = 0; c < C; ++c) part[m][c] = I::zero();
    const float* x0 = p.x + m0 * p.K + g * kGroup;
    for (int j = 0; j < kGroup / 2; ++j) {
      const uint8_t* q = base + kTile * 4 + j * kTile;
      for (int c = 0; c < C; ++c) {
        V lo, hi;
        I::nibbles(q + c * I::L, lo, hi);
        for (int m = 0; m < R; ++m) {
          part[m][c] = I::fma(lo, I::set1(x0[m * p.K + 2 * j]), part[m][c]);
          part[m][c] = I::fma(hi, I::set1(x0[m * p.K + 2 * j + 1]), part[m][c]);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const V d = I::halves(base + 2 * c * I::L), off = I::halves(base + 2 * (kTile + c * I::L));
      for (int m = 0; m < R; ++m) {
        acc[m][c] = I::fma(d, part[m][c], acc[m][c]);
        acc[m][c] = I::fma(off, I::set1(p.xsum[(m0 + m) * groups + g]), acc[m][c]);
      }
    }
  }
  const int64_t n0 = t0 * kTile;
  for (int m = 0; m < R; ++m) {
    float out[kTile];
    for (int c = 0; c < C; ++c) I::store(out + c * I::L, acc[m][c]);
    for (int64_t r = 0; r < std::min(kTile, p.N - n0); ++r) p.out[(m0 + m) * p.N + n0 + r] = static_cast<Out>(out[r]);
  }
}

template <class I, int M, class Out>
void q4_tile_chunked(const Problem<Out>& p, int64_t t0) {
  constexpr int full = M / kChunkRows, rest = M % kChunkRows;
  for (int c = 0; c < full; ++c) q4_tile_rows<I, kChunkRows>(p, t0, c * kChunkRows);
  if constexpr (rest > 0) q4_tile_rows<I, rest>(p, t0, full * kChunkRows);
}

// q4 output rows [n0, n1) (whole tiles but the last): P tiles at a time, the rest one by one.
template <class I, int M, class Out>
void q4_item(const Problem<Out>& p, int64_t n0, int64_t n1) {
  int64_t t = n0 / kTile;
  const int64_t t1 = (n1 + kTile - 1) / kTile;
  if constexpr (I::L == 8 && M > 2) {
    for (; t < t1; ++t) q4_tile_chunked<I, M>(p, t);
  } else {
    constexpr int P = M <= 2 ? 2 : 1;
    for (; t + P <= t1; t += P) q4_tiles<I, M, P>(p, t);
    for (; t < t1; ++t) q4_tiles<I, M, 1>(p, t);
  }
}

template <class I, bool Q4, int M, class Out>
void item(const Problem<Out>& p, int64_t n0, int64_t n1) {
  Q4 ? q4_item<I, M>(p, n0, n1) : int8_item<I, M>(p, n0, n1);
}

// Output rows [i0 * 16, i1 * 16) (clipped to N) for all `rows` rows of x: passes of up to
// kMaxRows rows over the weight stream of those items, each pass prefetching the stream's
// head (the loops prefetch kPrefetchBytes ahead; this covers what comes before). What one
// thread runs: quant_gemv.cpp's ops give each thread a range of items, decode_step.cpp too.
template <class I, bool Q4, class Out>
void run_items(const Problem<Out>& p, int64_t rows, int64_t i0, int64_t i1) {
  using ItemFn = void (*)(const Problem<Out>&, int64_t, int64_t);
  static constexpr ItemFn kItems[kMaxRows] = {
      item<I, Q4, 1, Out>, item<I, Q4, 2, Out>, item<I, Q4, 3, Out>, item<I, Q4, 4, Out>,
      item<I, Q4, 5, Out>, item<I, Q4, 6, Out>, item<I, Q4, 7, Out>, item<I, Q4, 8, Out>};
  if (i0 >= i1) return;
  const int64_t item_bytes = Q4 ? p.stride : kTile * p.K, groups = p.K / kGroup;
  const uint8_t* head = p.w + i0 * item_bytes;
  const int64_t head_bytes = std::min(kPrefetchBytes, (i1 - i0) * item_bytes);
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
    for (int64_t line = 0; line < head_bytes; line += 64) prefetch(head + line);
    Problem<Out> pass = p;
    pass.x = p.x + m0 * p.K;
    pass.xsum = Q4 ? p.xsum + m0 * groups : nullptr;
    pass.out = p.out + m0 * p.N;
    kItems[std::min<int64_t>(kMaxRows, rows - m0) - 1](pass, i0 * kTile, std::min(p.N, i1 * kTile));
  }
}

inline std::vector<std::string> compiled_isas() {
  std::vector<std::string> isas;
#if defined(QG_AVX512)
  isas.emplace_back("avx512");
#endif
#if defined(QG_AVX2)
  isas.emplace_back("avx2");
#endif
  isas.emplace_back("scalar");
  return isas;
}

}  // namespace tierserve_gemv
