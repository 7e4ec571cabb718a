// The inner loops of quant_gemv.cpp's weight-only quantized matmuls, shared with
// decode_step.cpp (which runs them inside its own parallel region): the instruction-set
// layers, the problem, and the work of one thread (`int8_items`, `q4_items`: output rows
// of a range of 16-row work items for all rows of x). NOTE: a row's result depends only on
// its own x and the weight, never on the other rows or on how [0, N) is cut into items,
// so both callers give bit-identical results.
//
// out[M, N] = x[M, K] @ w[N, K]^T, written in x's dtype (float32 or bfloat16), the weight
// streamed once per call for many rows of x and prefetched in software a few KB ahead.
//
// Weight formats:
// - int8: int8 [N, K] with one float32 scale per output row: w = q * s. Few-row kernel
//   (decode): passes of up to 8 rows of x, the weight expanded to float32 in registers and
//   multiplied with x in float32 (fused multiply-add); a work item reads R rows side by side
//   (R * M accumulators in registers), vectorized along K.
// - q4: 4-bit groups of 32 along K with an fp16 scale d and offset m each: w = d * q + m
//   (GGUF Q4_1; Q4_0 is m = -8 d), in tiles of 16 output rows (layout below), against x
//   quantized to int8 per group of 32: integer dot products (vpmaddubsw), the scales applied
//   once per group. Any number of rows: it is faster than float32 GEMMs at prefill shapes
//   too, and reads a quarter of their bytes.
//
// The vector code (AVX-512, AVX2 + FMA + F16C) is compiled when -march=native offers it;
// the scalar path is always there. `isa` picks one for tests ("auto": the widest compiled;
// q4 has AVX2 and scalar code, AVX-512 builds run the AVX2 one).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
};
#endif

// Everything one pass needs: up to kMaxRows rows of x against all N output rows.
template <class Out>
struct Problem {
  const float* x;       // int8: [rows, K] float32 (q4 reads its Quantized rows instead)
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

// ---- q4 weights against int8 activations ------------------------------------------------
// x is quantized per row and group of 32 (`Quantized`): s = max|x| / 127, xq = round(x * 127
// / max|x|) in -127..127. A group's dot product is then exact integer arithmetic,
// I = sum_k q_k xq_k and S = sum_k xq_k, and out = sum over groups of
// fma(I, d * s, acc) then fma(m, s * S, acc), in group order: the exact dot product of the
// dequantized weight (d q + m) with the dequantized x (s xq), rounded the same way by every
// instruction set. NOTE: so a row's result depends on its own x and the weight only — not
// on the other rows, the instruction set or how the work is cut — and the scalar path is
// the AVX2 one's exact reference.
//
// The packed weight (gpu/quant/gemv.py's pack_q4): per tile of 16 output rows and group,
// d[16] and m[16] as fp16, then 8 quads (k = 4u .. 4u + 3) of 32 bytes: byte 2r holds row
// r's q[4u] (low nibble) and q[4u + 2] (high), byte 2r + 1 its q[4u + 1] and q[4u + 3]. One
// load, a mask and a shift give two vectors of 16 (row, two k) byte pairs, ready for
// vpmaddubsw against a broadcast pair of x (unsigned weights 0..15 times signed x).

// Everything a q4 pass needs besides the weight: the quantized rows of x.
struct Q4Input {
  const int32_t* pairs;
  const float* scale;
  const float* sum;
};

// x's rows quantized for the q4 kernel: per pair of k its two int8 values, the 16-bit pair
// repeated in both halves of an int32 (so a 32-bit broadcast gives every 16-bit lane the
// pair); per group its scale s and s * S.
struct Quantized {
  std::vector<int32_t> pairs;  // [rows, K / 2]
  std::vector<float> scale;    // [rows, K / 32]
  std::vector<float> sum;      // [rows, K / 32]: s * sum of the group's xq

  void resize(int64_t rows, int64_t k) {
    const int64_t groups = rows * (k / kGroup);
    if (static_cast<int64_t>(pairs.size()) < rows * k / 2) pairs.resize(rows * k / 2);
    if (static_cast<int64_t>(scale.size()) < groups) scale.resize(groups), sum.resize(groups);
  }

  // Rows [r0, r1) of x [rows, k] (resize first); callers may split rows among threads.
  void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1) {
    for (int64_t g = r0 * (k / kGroup); g < r1 * (k / kGroup); ++g) {
      quantize_group(x + g * kGroup, pairs.data() + g * kGroup / 2, scale[g], sum[g]);
    }
  }

  void quantize(const float* x, int64_t rows, int64_t k) {
    resize(rows, k);
    quantize_rows(x, k, 0, rows);
  }

  Q4Input input() const { return {pairs.data(), scale.data(), sum.data()}; }

  // NOTE: the AVX2 code computes what the scalar code does, bit for bit (the max, one
  // division, products rounded to nearest even, an integer sum), so where x is quantized
  // does not change a result.
  static void quantize_group(const float* x, int32_t* pair, float& s, float& ssum) {
#if defined(QG_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(std::numeric_limits<float>::max());
    __m256 v[4], amax8 = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      const __m256 a = _mm256_andnot_ps(sign, v[i]);
      amax8 = _mm256_max_ps(amax8, a);
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for inf and NaN
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const bool finite = _mm256_movemask_ps(ok) == 0xFF;
#else
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < kGroup; ++i) {
      amax = std::max(amax, std::fabs(x[i]));
      finite = finite && std::isfinite(x[i]);
    }
#endif
    if (!finite || amax == 0.0f) {  // all zeros: exact zeros; inf or NaN: NaN outputs, as a float matmul gives
      std::fill(pair, pair + kGroup / 2, 0);
      s = ssum = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      return;
    }
    const float inv = 127.0f / amax;
    int32_t total = 0;
#if defined(QG_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i q[4], t = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      t = _mm256_add_epi32(t, q[i]);
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), t);
    for (int32_t l : lanes) total += l;
    // int32 -> int8 in k order: packs work per 128-bit lane, hence the permute
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    const __m256i w16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
    const __m256i b8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(w16, w16b), 0xD8);  // 32 int8, k order
    // each 16-bit pair repeated in both halves of its int32
    const __m256i lo = _mm256_unpacklo_epi16(b8, b8), hi = _mm256_unpackhi_epi16(b8, b8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pair), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pair + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
#else
    for (int64_t j = 0; j < kGroup / 2; ++j) {
      const int32_t a = static_cast<int32_t>(std::nearbyint(x[2 * j] * inv));
      const int32_t b = static_cast<int32_t>(std::nearbyint(x[2 * j + 1] * inv));
      total += a + b;
      const uint32_t p16 = (static_cast<uint32_t>(a) & 0xFF) | ((static_cast<uint32_t>(b) & 0xFF) << 8);
      pair[j] = static_cast<int32_t>(p16 | (p16 << 16));
    }
#endif
    s = amax / 127.0f;
    ssum = s * static_cast<float>(total);
  }
};

// Reference and fallback: output rows [n0, n1) for rows [0, rows) of x, one row at a time.
template <class Out>
void q4_scalar(const Problem<Out>& p, const Q4Input& in, int64_t rows, int64_t n0, int64_t n1) {
  const int64_t groups = p.K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* tile = p.w + (n / kTile) * p.stride;
    const int64_t r = n % kTile;
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* base = tile + g * kTileGroupBytes;
        const int32_t* xp = in.pairs + m * p.K / 2 + g * kGroup / 2;
        int32_t dot = 0;
        for (int64_t u = 0; u < kGroup / 4; ++u) {
          const uint8_t b0 = base[kTile * 4 + u * 32 + 2 * r], b1 = base[kTile * 4 + u * 32 + 2 * r + 1];
          const int32_t lo = xp[2 * u], hi = xp[2 * u + 1];
          dot += (b0 & 0x0F) * static_cast<int8_t>(lo & 0xFF) + (b1 & 0x0F) * static_cast<int8_t>((lo >> 8) & 0xFF);
          dot += (b0 >> 4) * static_cast<int8_t>(hi & 0xFF) + (b1 >> 4) * static_cast<int8_t>((hi >> 8) & 0xFF);
        }
        const float s = in.scale[m * groups + g];
        acc = std::fma(static_cast<float>(dot), half_at(base + 2 * r) * s, acc);
        acc = std::fma(half_at(base + 2 * (kTile + r)), in.sum[m * groups + g], acc);
      }
      p.out[m * p.N + n] = static_cast<Out>(acc);
    }
  }
}

#if defined(QG_AVX2)
// R rows of x from row m0 against tile t: per row two 16-lane int16 sums of a group (the
// quads' low and high pairs; each at most 8 * 2 * 15 * 127 = 30480, so no overflow), then
// widened to int32 per output row and accumulated in float32. `unpacked`: the tile's quads
// already split into their low and high vectors (q4_unpack), else they are split here.
template <int R, class Out>
void q4_tile_rows(const Problem<Out>& p, const Q4Input& in, int64_t t, int64_t m0, const uint8_t* unpacked) {
  const int64_t groups = p.K / kGroup;
  const uint8_t* tile = p.w + t * p.stride;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];  // rows [0-3 | 8-11] and [4-7 | 12-15] (madd's order)
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* base = tile + g * kTileGroupBytes;
    if (m0 == 0) {
      for (int64_t line = 0; line < kTileGroupBytes; line += 64) prefetch(base + kPrefetchBytes + line);
    }
    __m256i lo_sum[R], hi_sum[R];
    for (int m = 0; m < R; ++m) lo_sum[m] = hi_sum[m] = _mm256_setzero_si256();
    for (int u = 0; u < kGroup / 4; ++u) {
      __m256i lo, hi;
      if (unpacked) {
        lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unpacked + (g * 8 + u) * 64));
        hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unpacked + (g * 8 + u) * 64 + 32));
      } else {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + kTile * 4 + u * 32));
        lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
      }
      for (int m = 0; m < R; ++m) {
        const int32_t* xp = in.pairs + (m0 + m) * p.K / 2 + g * kGroup / 2 + 2 * u;
        lo_sum[m] = _mm256_add_epi16(lo_sum[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xp[0])));
        hi_sum[m] = _mm256_add_epi16(hi_sum[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xp[1])));
      }
    }
    const __m256 da = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base)));
    const __m256 db = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 16)));
    const __m256 ma = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 32)));
    const __m256 mb = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 48)));
    const __m256 d0 = _mm256_permute2f128_ps(da, db, 0x20), d1 = _mm256_permute2f128_ps(da, db, 0x31);
    const __m256 o0 = _mm256_permute2f128_ps(ma, mb, 0x20), o1 = _mm256_permute2f128_ps(ma, mb, 0x31);
    for (int m = 0; m < R; ++m) {
      const __m256 s = _mm256_set1_ps(in.scale[(m0 + m) * groups + g]);
      const __m256 ssum = _mm256_set1_ps(in.sum[(m0 + m) * groups + g]);
      const __m256i i0 = _mm256_madd_epi16(_mm256_unpacklo_epi16(lo_sum[m], hi_sum[m]), ones);
      const __m256i i1 = _mm256_madd_epi16(_mm256_unpackhi_epi16(lo_sum[m], hi_sum[m]), ones);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d0, s), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d1, s), acc[m][1]);
      acc[m][0] = _mm256_fmadd_ps(o0, ssum, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(o1, ssum, acc[m][1]);
    }
  }
  const int64_t n0 = t * kTile, live = std::min(kTile, p.N - n0);
  for (int m = 0; m < R; ++m) {
    float rows[kTile];
    _mm256_storeu_ps(rows, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x20));
    _mm256_storeu_ps(rows + 8, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x31));
    for (int64_t r = 0; r < live; ++r) p.out[(m0 + m) * p.N + n0 + r] = static_cast<Out>(rows[r]);
  }
}

// Tile t's quads split into low and high vectors: 512 bytes a group, read by every chunk.
inline void q4_unpack(const uint8_t* tile, int64_t groups, uint8_t* out) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    for (int u = 0; u < kGroup / 4; ++u) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + g * kTileGroupBytes + kTile * 4 + u * 32));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * 8 + u) * 64), _mm256_and_si256(b, mask));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * 8 + u) * 64 + 32),
                          _mm256_and_si256(_mm256_srli_epi16(b, 4), mask));
    }
  }
}

// Tiles [t0, t1) for all rows of x. Up to kQ4ChunkRows rows (decode): one chunk, the quads
// split in registers. More: in blocks of kQ4BlockRows rows (their quantized x stays in L2
// while the tiles go past), each tile split once per block into a scratch buffer that the
// block's chunks of kQ4ChunkRows rows (their sums in registers) read from L1.
constexpr int kQ4ChunkRows = 4;
constexpr int64_t kQ4BlockRows = 48;

template <class Out>
void q4_chunk(const Problem<Out>& p, const Q4Input& in, int64_t t, int64_t m, int64_t rows, const uint8_t* unpacked) {
  switch (rows) {
    case 1: return q4_tile_rows<1>(p, in, t, m, unpacked);
    case 2: return q4_tile_rows<2>(p, in, t, m, unpacked);
    case 3: return q4_tile_rows<3>(p, in, t, m, unpacked);
    default: return q4_tile_rows<kQ4ChunkRows>(p, in, t, m, unpacked);
  }
}

template <class Out>
void q4_avx2(const Problem<Out>& p, const Q4Input& in, int64_t rows, int64_t t0, int64_t t1) {
  if (rows <= kQ4ChunkRows) {
    for (int64_t t = t0; t < t1; ++t) q4_chunk(p, in, t, 0, rows, nullptr);
    return;
  }
  const int64_t groups = p.K / kGroup;
  thread_local std::vector<uint8_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < groups * 512) scratch.resize(groups * 512);
  for (int64_t b0 = 0; b0 < rows; b0 += kQ4BlockRows) {
    const int64_t b1 = std::min(rows, b0 + kQ4BlockRows);
    for (int64_t t = t0; t < t1; ++t) {
      q4_unpack(p.w + t * p.stride, groups, scratch.data());
      for (int64_t m = b0; m < b1; m += kQ4ChunkRows) q4_chunk(p, in, t, m, std::min<int64_t>(kQ4ChunkRows, b1 - m), scratch.data());
    }
  }
}
#endif

// int8 output rows [i0 * 16, i1 * 16) (clipped to N) for all `rows` rows of x: passes of up
// to kMaxRows rows, and with more than one pass, over blocks of kInt8BlockItems items (~64
// KB of weight, read from DRAM once and by the later passes from L2), not the whole range.
// Each stream's head is prefetched (the loops prefetch kPrefetchBytes ahead; this covers
// what comes before). What one thread runs: quant_gemv.cpp's ops give each thread a range
// of items, decode_step.cpp too.
constexpr int64_t kInt8BlockBytes = 64 << 10;

template <class I, class Out>
void int8_items(const Problem<Out>& p, int64_t rows, int64_t i0, int64_t i1) {
  using ItemFn = void (*)(const Problem<Out>&, int64_t, int64_t);
  static constexpr ItemFn kItems[kMaxRows] = {
      int8_item<I, 1, Out>, int8_item<I, 2, Out>, int8_item<I, 3, Out>, int8_item<I, 4, Out>,
      int8_item<I, 5, Out>, int8_item<I, 6, Out>, int8_item<I, 7, Out>, int8_item<I, 8, Out>};
  if (i0 >= i1) return;
  const int64_t item_bytes = kTile * p.K;
  const int64_t block = rows <= kMaxRows ? i1 - i0 : std::max<int64_t>(1, kInt8BlockBytes / item_bytes);
  for (int64_t b0 = i0; b0 < i1; b0 += block) {
    const int64_t b1 = std::min(i1, b0 + block);
    const uint8_t* head = p.w + b0 * item_bytes;
    const int64_t head_bytes = std::min(kPrefetchBytes, (b1 - b0) * item_bytes);
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
      if (m0 == 0) {
        for (int64_t line = 0; line < head_bytes; line += 64) prefetch(head + line);
      }
      Problem<Out> pass = p;
      pass.x = p.x + m0 * p.K;
      pass.out = p.out + m0 * p.N;
      kItems[std::min<int64_t>(kMaxRows, rows - m0) - 1](pass, b0 * kTile, std::min(p.N, b1 * kTile));
    }
  }
}

// q4 output tiles [i0, i1) for all `rows` rows of x (any number: no passes), `vector` the
// AVX2 code where it is compiled (the same results as the scalar path, bit for bit).
template <class Out>
void q4_items(const Problem<Out>& p, const Q4Input& in, int64_t rows, int64_t i0, int64_t i1, bool vector) {
  if (i0 >= i1) return;
  for (int64_t line = 0; line < std::min(kPrefetchBytes, (i1 - i0) * p.stride); line += 64) prefetch(p.w + i0 * p.stride + line);
#if defined(QG_AVX2)
  if (vector) return q4_avx2(p, in, rows, i0, i1);
#endif
  (void)vector;
  q4_scalar(p, in, rows, i0 * kTile, std::min(p.N, i1 * kTile));
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
