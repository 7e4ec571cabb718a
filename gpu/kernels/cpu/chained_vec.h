// Data movement for the chained form (chained_attention.h): pool rows widened to float32
// and a block of K rows transposed, with AVX-512 or AVX2 shuffles where the compiler
// targets them. Moves values only, never rounds: the arithmetic is chained_attention.h's.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "paged_attention_vec.h"

namespace tierserve_chained_vec {

using tierserve_paged_vec::Simd;
using V = Simd::V;
constexpr int W = Simd::W;

// W values of a pool row at p as float32.
template <class KV>
inline V load_wide(const KV* p) {
  if constexpr (std::is_same_v<KV, float>) {
    return Simd::load(p);
  } else {
    float x[W];
    for (int i = 0; i < W; ++i) x[i] = static_cast<float>(p[i]);
    return Simd::load(x);
  }
}

#if defined(__AVX512F__)
template <>
inline V load_wide(const c10::BFloat16* p) {  // a bf16 is a float32's top half
  const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
template <>
inline V load_wide(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// r[i][e] -> r[e][i] for 16 vectors.
inline void transpose(V* r) {
  V t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  auto pd = [](V x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i]), pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i]), pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i + 1]), pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i + 1]), pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8) {  // 128-bit lanes 0, 2 and 1, 3 of rows i and i + 4
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
template <>
inline V load_wide(const c10::BFloat16* p) {
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
#if defined(__F16C__)
template <>
inline V load_wide(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

inline void transpose(V* r) {  // 8 vectors
  V t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#else
inline void transpose(V*) {}  // one lane: nothing to move
#endif

// d values of a pool row as float32 at dst.
template <class KV>
inline void widen_row(const KV* src, float* dst, int64_t d) {
  if constexpr (std::is_same_v<KV, float>) {
    std::memcpy(dst, src, sizeof(float) * d);
  } else {
    int64_t e = 0;
    for (; e + W <= d; e += W) Simd::store(dst + e, load_wide(src + e));
    for (; e < d; ++e) dst[e] = static_cast<float>(src[e]);
  }
}

// rows [block][d] (row-major; rows from n on read as zeros) -> out [d][block].
inline void transpose_rows(const float* rows, int64_t n, int64_t d, int64_t block, float* out) {
  const int64_t full = d / W * W;
  for (int64_t j0 = 0; j0 < block; j0 += W) {
    for (int64_t e0 = 0; e0 < full; e0 += W) {
      V r[W];
      for (int i = 0; i < W; ++i) r[i] = j0 + i < n ? Simd::load(rows + (j0 + i) * d + e0) : Simd::zero();
      transpose(r);
      for (int i = 0; i < W; ++i) Simd::store(out + (e0 + i) * block + j0, r[i]);
    }
  }
  for (int64_t e = full; e < d; ++e) {
    for (int64_t j = 0; j < block; ++j) out[e * block + j] = j < n ? rows[j * d + e] : 0.f;
  }
}

}  // namespace tierserve_chained_vec
