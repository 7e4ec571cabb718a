// The vector layer of paged_attention.cpp: float32 vectors of AVX-512 (16 lanes), AVX2
// (8) or a scalar stand-in (1), the same operations on each, and how pool rows of
// float32 / bf16 load into them. Only paged_attention.cpp includes it.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace tierserve_paged_vec {

using bf16 = c10::BFloat16;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (scores minus their running max): x = n ln2 + r with |r| <= ln2 / 2,
// and a degree-6 Taylor polynomial of exp(r) (relative error ~2e-7).
constexpr float kLog2e = 1.44269504f;
constexpr float kLn2Hi = 0.693145752f;  // ln2 in two parts, so that n * kLn2Hi is exact
constexpr float kLn2Lo = 1.42860677e-6f;
constexpr float kExpFloor = -87.0f;     // keeps 2^n a normal float
constexpr float kC2 = 1.f / 2, kC3 = 1.f / 6, kC4 = 1.f / 24, kC5 = 1.f / 120, kC6 = 1.f / 720;

struct Scalar {
  static constexpr int W = 1;
  using V = float;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static float reduce_add(V v) { return v; }
  static float reduce_max(V v) { return v; }
  static void sums(const float* v, float* out) { out[0] = v[0]; }  // see Simd::sums (no quads: W < 4)
  static V exp(V x) { return std::exp(std::max(x, kExpFloor)); }
};

#if defined(__AVX512F__)
struct Simd {
  static constexpr int W = 16;
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  // The sums of the lanes of W vectors (the dot products of W keys), by a transposing tree
  // (about 2 shuffles a sum where W separate reductions take 4 each), in two steps: `quad`
  // takes the tree's first two levels over vectors 4i..4i+3, as soon as they are computed
  // (a quarter of the stores of keeping the W vectors), and `sums` the rest, out[j] = the
  // sum of vector j, from the W / 4 quads in order.
  static V quad(V x0, V x1, V x2, V x3) {
    const V a = add(_mm512_unpacklo_ps(x0, x1), _mm512_unpackhi_ps(x0, x1));  // per 128-bit lane:
    const V b = add(_mm512_unpacklo_ps(x2, x3), _mm512_unpackhi_ps(x2, x3));  // [x0+x2, y0+y2, x1+x3, y1+y3]
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return add(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  static void sums(const float* quads, float* out) {
    V c[2];
    for (int i = 0; i < 2; ++i) {  // lanes pairwise summed: [b0 l0+l1, b0 l2+l3, b1 l0+l1, b1 l2+l3]
      const V b0 = load(quads + 2 * i * W), b1 = load(quads + (2 * i + 1) * W);
      c[i] = add(_mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    store(out, add(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                   _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1))));
  }
  static V exp(V x) {
    x = _mm512_max_ps(x, set1(kExpFloor));
    V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, set1(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, set1(kLn2Lo), r);
    V p = fma(set1(kC6), r, set1(kC5));
    p = fma(p, r, set1(kC4));
    p = fma(p, r, set1(kC3));
    p = fma(p, r, set1(kC2));
    p = fma(p, r, set1(1.f));
    p = fma(p, r, set1(1.f));
    return _mm512_scalef_ps(p, n);
  }
#if defined(__AVX512BF16__)
  // 2W bf16 values as they are, and acc + their pairwise products summed in float32
  // (vdpbf16ps): the keys' dot products need no conversion at all.
  using B = __m512i;
  static B load_bf16(const bf16* p) { return _mm512_loadu_si512(p); }
  static V dot_bf16(V acc, B q, B k) { return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k); }
#endif
  // 2W bf16 values as two float vectors: the even elements, then the odd ones (a bf16 is
  // the top half of a float32, so a shift and a mask convert without a shuffle).
  static void load_split(const bf16* p, V* out) {
    const __m512i x = _mm512_loadu_si512(p);
    out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    out[1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Simd {
  static constexpr int W = 8;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static __m128 half_sum(V v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); }
  static float reduce_add(V v) {
    __m128 s = half_sum(v);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float reduce_max(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  // As the AVX-512 quad and sums (W / 4 = 2 quads).
  static V quad(V x0, V x1, V x2, V x3) {
    const V a = add(_mm256_unpacklo_ps(x0, x1), _mm256_unpackhi_ps(x0, x1));
    const V b = add(_mm256_unpacklo_ps(x2, x3), _mm256_unpackhi_ps(x2, x3));
    const __m256d x = _mm256_castps_pd(a), y = _mm256_castps_pd(b);  // per 128-bit lane: vectors 4i..4i+3
    return add(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  static void sums(const float* quads, float* out) {
    const V b0 = load(quads), b1 = load(quads + W);
    store(out, add(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31)));
  }
  static V exp(V x) {
    x = _mm256_max_ps(x, set1(kExpFloor));
    V n = _mm256_round_ps(_mm256_mul_ps(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, set1(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, set1(kLn2Lo), r);
    V p = fma(set1(kC6), r, set1(kC5));
    p = fma(p, r, set1(kC4));
    p = fma(p, r, set1(kC3));
    p = fma(p, r, set1(kC2));
    p = fma(p, r, set1(1.f));
    p = fma(p, r, set1(1.f));
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
  }
  static void load_split(const bf16* p, V* out) {  // as the AVX-512 one
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    out[1] = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
#else
using Simd = Scalar;
#endif

// How a pool row of T reads as float32 vectors: `span` elements per load, as `vecs`
// vectors. The float layout of a row (queries and accumulators use the same) may order
// its elements differently from the pool's: `position(e)` is where element e lies.
template <class S, class T>
struct Rows {
  static constexpr int vecs = 1, span = S::W;
  static void load(const T* p, typename S::V* out) {
    if constexpr (std::is_same_v<T, float>) {
      out[0] = S::load(p);
    } else {
      static_assert(S::W == 1, "bf16 vectors load through Rows<Simd, bf16>");
      out[0] = static_cast<float>(p[0]);
    }
  }
  static int64_t position(int64_t e) { return e; }
};

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
template <>
struct Rows<Simd, bf16> {  // each 2W elements: the even ones, then the odd ones
  static constexpr int vecs = 2, span = 2 * Simd::W;
  static void load(const bf16* p, Simd::V* out) { Simd::load_split(p, out); }
  static int64_t position(int64_t e) {
    const int64_t r = e % span;
    return e - r + (r % 2) * Simd::W + r / 2;
  }
};
#endif

#if defined(__F16C__) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
template <>
struct Rows<Simd, c10::Half> {  // float16 rows (a float32 model's KV pool): converted in order
  static constexpr int vecs = 1, span = Simd::W;
  static void load(const c10::Half* p, Simd::V* out) {
#if defined(__AVX512F__)
    out[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
    out[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  }
  static int64_t position(int64_t e) { return e; }
};
#endif

// Whether scores of bf16 keys come from bf16 dot products (the query read as it is).
template <class S, class T>
constexpr bool kBf16Dot =
#if defined(__AVX512BF16__)
    std::is_same_v<S, Simd> && std::is_same_v<T, bf16>;
#else
    false;
#endif

}  // namespace tierserve_paged_vec
