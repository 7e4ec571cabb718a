// The first index of a float32 span's maximum, exactly as torch's `argmax(dim=-1)` gives
// it, shared by greedy sampling (sampling.cpp) and the native decode step's fused pick
// (decode_step.cpp):
//   - the FIRST index of the maximum when several elements tie (+0 and -0 tie),
//   - the first NaN's index when the span holds a NaN (NaN is the maximum),
//   - 0 for a span of -inf.
// Two streaming passes: the maximum (and whether any element is NaN), then the first
// element equal to it. Exact by construction (a comparison, no arithmetic).
//
// `Pick` carries one span's answer so that answers over parts of a row merge into the
// row's (`better`): a pick is the same whichever way the row was cut and in whatever order
// its parts are merged.

#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <limits>

namespace tierserve_argmax {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

inline int64_t first_equal(const float* x, int64_t n, float m, int64_t from) {
  for (int64_t i = from; i < n; ++i)
    if (x[i] == m) return i;
  return -1;  // unreachable: m is one of x's elements
}

#if defined(__AVX512F__)
constexpr int64_t W = 16;

// The row's maximum over its first `body` elements (a multiple of 4W), and whether any is NaN.
inline float max_body(const float* x, int64_t body, bool& nan) {
  __m512 m0 = _mm512_set1_ps(kNegInf), m1 = m0, m2 = m0, m3 = m0;
  __mmask16 unordered = 0;
  for (int64_t i = 0; i < body; i += 4 * W) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + W);
    const __m512 c = _mm512_loadu_ps(x + i + 2 * W), d = _mm512_loadu_ps(x + i + 3 * W);
    unordered |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
    m2 = _mm512_max_ps(m2, c);
    m3 = _mm512_max_ps(m3, d);
  }
  nan = unordered != 0;
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

inline int64_t first_equal_body(const float* x, int64_t body, float m) {
  const __m512 target = _mm512_set1_ps(m);
  for (int64_t i = 0; i < body; i += W) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return -1;
}
#elif defined(__AVX2__)
constexpr int64_t W = 8;

inline float max_body(const float* x, int64_t body, bool& nan) {
  __m256 m0 = _mm256_set1_ps(kNegInf), m1 = m0, m2 = m0, m3 = m0;
  __m256 unordered = _mm256_setzero_ps();
  for (int64_t i = 0; i < body; i += 4 * W) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + W);
    const __m256 c = _mm256_loadu_ps(x + i + 2 * W), d = _mm256_loadu_ps(x + i + 3 * W);
    unordered = _mm256_or_ps(unordered, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                                     _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    m2 = _mm256_max_ps(m2, c);
    m3 = _mm256_max_ps(m3, d);
  }
  nan = _mm256_movemask_ps(unordered) != 0;
  const __m256 m = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

inline int64_t first_equal_body(const float* x, int64_t body, float m) {
  const __m256 target = _mm256_set1_ps(m);
  for (int64_t i = 0; i < body; i += W) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  return -1;
}
#else
constexpr int64_t W = 1;

inline float max_body(const float* x, int64_t body, bool& nan) {
  float m = kNegInf;
  nan = false;
  for (int64_t i = 0; i < body; ++i) {
    nan |= std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  return m;
}

inline int64_t first_equal_body(const float* x, int64_t body, float m) { return first_equal(x, body, m, 0); }
#endif

inline int64_t argmax_row(const float* x, int64_t n) {
  // NOTE: the vector max (like `maxps`) passes NaN through unpredictably, so NaN is
  // tracked on the side: any NaN makes the answer the first NaN, as torch's.
  const int64_t body = n / (4 * W) * (4 * W);
  bool nan = false;
  float m = max_body(x, body, nan);
  for (int64_t i = body; i < n; ++i) {
    nan |= std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  if (nan) return first_nan(x, n);
  const int64_t hit = first_equal_body(x, body, m);
  return hit >= 0 ? hit : first_equal(x, n, m, body);
}

// One part of a row: its argmax (an index into the row) and the value there.
struct Pick {
  int64_t index = -1;  // -1: no part merged yet
  float value = 0.0f;
};

// Whether `a` is the row's argmax rather than `b` (each the argmax of a part): a NaN beats
// any number, and between two NaNs or two equal numbers the lower index wins.
inline bool better(const Pick& a, const Pick& b) {
  if (b.index < 0) return true;
  const bool an = std::isnan(a.value), bn = std::isnan(b.value);
  if (an != bn) return an;
  if (!an && a.value != b.value) return a.value > b.value;
  return a.index < b.index;
}

// `best` updated with the argmax of x[0, n), a part of the row starting at row index `offset`.
inline void merge_part(Pick& best, const float* x, int64_t n, int64_t offset) {
  const int64_t i = argmax_row(x, n);
  const Pick part{offset + i, x[i]};
  if (better(part, best)) best = part;
}

}  // namespace tierserve_argmax
