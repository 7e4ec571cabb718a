// The element-wise arithmetic of llama_glue.cpp, shared with decode_step.cpp: the dtypes'
// rounding, RMSNorm of a row, RoPE of a head, SiLU(gate) * up of an element. NOTE: the
// rounding rules are llama_glue.cpp's (see its header); both callers give bit-identical results.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tierserve_glue {

constexpr int64_t kLanes = 16;  // one AVX-512 register of floats (two AVX2 ones)

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// bfloat16 storage as raw bits: round to nearest even (as c10::BFloat16 does), NaN kept quiet.
inline uint16_t bf16_from_float(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40u) : uint16_t(rounded);
}

struct F32 {
  using scalar = float;
  static float load(float v) { return v; }
  static float store(float f) { return f; }
  static float round(float f) { return f; }
};

struct BF16 {
  using scalar = uint16_t;
  static float load(uint16_t v) { return bits_to_float(uint32_t(v) << 16); }
  static uint16_t store(float f) { return bf16_from_float(f); }
  static float round(float f) { return load(store(f)); }
};

// exp(x) for SiLU: Cody-Waite range reduction to 2^n * exp(r), |r| <= ln2/2, and a degree-6
// polynomial (relative error ~2 ulp of float32); branch-free so that loops over it vectorize.
// Up to float32's largest finite result (x = 88.7228), then inf like expf, so silu(-100) is
// -0 as in torch. Below -80 it returns exp(-80): SiLU only ever adds it to 1.
inline float fast_exp(float x) {
  const float kMax = 88.7228f;
  const float big = x > kMax ? INFINITY : 1.0f;
  x = x < -80.0f ? -80.0f : (x > kMax ? kMax : x);
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n as 2^(n-1) * 2: n reaches 128 near kMax, one past float32's largest exponent.
  return big * (p * bits_to_float(uint32_t(int32_t(n) + 126) << 23) * 2.0f);
}

template <typename D>
inline float mean_square(const typename D::scalar* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      float v = D::load(x[i + j]);
      acc[j] += v * v;
    }
  }
  for (; i < n; ++i) {
    float v = D::load(x[i]);
    acc[0] += v * v;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
  return sum / float(n);
}

// weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the product rounded to the dtype.
template <typename D>
inline void norm_row(const typename D::scalar* x, const typename D::scalar* w, typename D::scalar* y, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(mean_square<D>(x, n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    y[i] = D::store(D::load(w[i]) * D::round(D::load(x[i]) * inv));
  }
}

// Rotate-half RoPE of one head, each product and the difference/sum rounded to the dtype
// (the torch code multiplies, then adds, in the compute dtype), so bfloat16 q, k are
// bit-equal to the torch path's. One float32 rounding instead would be a little more
// accurate (measured on random q: mean error 3.4e-3 vs 4.8e-3, a third of the elements
// differ) but would make `model.cpu_kernels` change bfloat16 results.
template <typename D>
inline void rope_head(const typename D::scalar* x, const typename D::scalar* c, const typename D::scalar* s,
               typename D::scalar* y, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = D::load(x[j]), x2 = D::load(x[j + half]);
    const float cj = D::load(c[j]), sj = D::load(s[j]);
    y[j] = D::store(D::round(x1 * cj) - D::round(x2 * sj));
    y[j + half] = D::store(D::round(x2 * cj) + D::round(x1 * sj));
  }
}

// silu(gate) rounded to the dtype (F.silu's output), times up, rounded again.
template <typename D>
inline typename D::scalar silu_times(typename D::scalar gate, typename D::scalar up) {
  const float x = D::load(gate);
  return D::store(D::round(x / (1.0f + fast_exp(-x))) * D::load(up));
}

#if defined(__AVX2__)
// fast_exp's reduction and polynomial in the lanes of L (Lanes8, Lanes16), x already clamped:
// the scalar code's operations in its order, so every lane gives fast_exp's bits.
template <class L>
inline typename L::V exp_clamped(typename L::V x) {
  const typename L::V n = L::nearest(L::mul(x, L::set1(1.44269504088896341f)));
  typename L::V r = L::sub(x, L::mul(n, L::set1(0.693145751953125f)));
  r = L::sub(r, L::mul(n, L::set1(1.428606765330187045e-06f)));
  typename L::V p = L::set1(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = L::add(L::mul(p, r), L::set1(c));
  return L::mul(L::mul(p, L::pow2_minus1(n)), L::set1(2.0f));
}

// Eight lanes of the scalar code above, operation for operation (a multiply and an add
// where it multiplies and adds: the build never contracts them to an FMA), so every lane
// is bit-identical to `silu_times` — the compiler leaves that scalar loop unvectorized.
struct Lanes8 {
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static void store(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(v)); }
  static __m256 round(__m256 v, const float*) { return v; }
  static __m256 round(__m256 v, const uint16_t*) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits(v)), 16));
  }
  // bf16_from_float of each lane: round to nearest even, NaN kept quiet.
  static __m128i bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i bits = _mm256_blendv_epi8(rounded, quiet, nan);
    const __m256i packed = _mm256_packus_epi32(bits, bits);  // per 128-bit lane: [0-3 0-3 | 4-7 4-7]
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
  }

  static __m256 exp(__m256 x) {  // fast_exp
    const __m256 max = _mm256_set1_ps(88.7228f), floor = _mm256_set1_ps(-80.0f);
    const __m256 over = _mm256_cmp_ps(x, max, _CMP_GT_OQ);
    const __m256 big = _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(INFINITY), over);
    x = _mm256_blendv_ps(_mm256_blendv_ps(x, max, over), floor, _mm256_cmp_ps(x, floor, _CMP_LT_OQ));
    return _mm256_mul_ps(big, exp_clamped<Lanes8>(x));
  }
  using V = __m256;
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V nearest(V v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2_minus1(V n) {  // 2^(n-1) for integral n
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23));
  }
};
#endif

#if defined(__AVX512F__)
// Sixteen lanes of the same operations (Lanes8's, with AVX-512 masks for its blends), so
// every lane is bit-identical to `silu_times` too: half the instructions of Lanes8.
struct Lanes16 {
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load(const uint16_t* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
  static void store(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v)); }
  static __m512 round(__m512 v, const float*) { return v; }
  static __m512 round(__m512 v, const uint16_t*) { return widen(bf16_bits(v)); }
  static __m512 widen(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
  // bf16_from_float of each lane: round to nearest even, NaN kept quiet.
  static __m256i bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
  }

  static __m512 exp(__m512 x) {  // fast_exp
    const __m512 max = _mm512_set1_ps(88.7228f), floor = _mm512_set1_ps(-80.0f);
    const __mmask16 over = _mm512_cmp_ps_mask(x, max, _CMP_GT_OQ), under = _mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ);
    const __m512 big = _mm512_mask_blend_ps(over, _mm512_set1_ps(1.0f), _mm512_set1_ps(INFINITY));
    x = _mm512_mask_blend_ps(under, _mm512_mask_blend_ps(over, x, max), floor);
    return _mm512_mul_ps(big, exp_clamped<Lanes16>(x));
  }
  using V = __m512;
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V nearest(V v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2_minus1(V n) {  // 2^(n-1) for integral n
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(126)), 23));
  }
};
#endif

// y[i] = silu_times(gate[i], up[i]) for i < n.
template <typename D>
inline void silu_times_run(const typename D::scalar* gate, const typename D::scalar* up, typename D::scalar* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  {
    using L = Lanes16;
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    for (; i + 16 <= n; i += 16) {
      const __m512 x = L::load(gate + i);
      const __m512 minus_x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
      const __m512 silu = L::round(_mm512_div_ps(x, _mm512_add_ps(one, L::exp(minus_x))), gate);
      L::store(y + i, _mm512_mul_ps(silu, L::load(up + i)));
    }
  }
#endif
#if defined(__AVX2__)
  using L = Lanes8;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = L::load(gate + i);
    const __m256 silu = L::round(_mm256_div_ps(x, _mm256_add_ps(one, L::exp(_mm256_xor_ps(x, sign)))), gate);
    L::store(y + i, _mm256_mul_ps(silu, L::load(up + i)));
  }
#endif
  for (; i < n; ++i) y[i] = silu_times<D>(gate[i], up[i]);
}

}  // namespace tierserve_glue
