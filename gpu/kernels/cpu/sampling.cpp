// Greedy sampling's one pass on CPU: the index of each row's maximum.
//
// torch's `max(dim=-1)` / `argmax` over a 49k vocabulary runs ~100 us a row on an AVX2
// EPYC (a generic reduction carrying an index per element); this is two streaming passes
// over the row (~10 us): the maximum (and whether any element is NaN), then the first
// element equal to it. It returns exactly what `argmax(dim=-1)` returns:
//   - the FIRST index of the maximum when several elements tie (+0 and -0 tie),
//   - the first NaN's index when the row holds a NaN (NaN is the maximum),
//   - 0 for a row of -inf.
// Exact by construction (a comparison, no arithmetic), so no bound to tune per CPU.

#include <torch/extension.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

int64_t first_equal(const float* x, int64_t n, float m, int64_t from) {
  for (int64_t i = from; i < n; ++i)
    if (x[i] == m) return i;
  return -1;  // unreachable: m is one of x's elements
}

#if defined(__AVX512F__)
constexpr int64_t W = 16;

// The row's maximum over its first `body` elements (a multiple of 4W), and whether any is NaN.
float max_body(const float* x, int64_t body, bool& nan) {
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

int64_t first_equal_body(const float* x, int64_t body, float m) {
  const __m512 target = _mm512_set1_ps(m);
  for (int64_t i = 0; i < body; i += W) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return -1;
}
#elif defined(__AVX2__)
constexpr int64_t W = 8;

float max_body(const float* x, int64_t body, bool& nan) {
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

int64_t first_equal_body(const float* x, int64_t body, float m) {
  const __m256 target = _mm256_set1_ps(m);
  for (int64_t i = 0; i < body; i += W) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  return -1;
}
#else
constexpr int64_t W = 1;

float max_body(const float* x, int64_t body, bool& nan) {
  float m = kNegInf;
  nan = false;
  for (int64_t i = 0; i < body; ++i) {
    nan |= std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  return m;
}

int64_t first_equal_body(const float* x, int64_t body, float m) { return first_equal(x, body, m, 0); }
#endif

int64_t argmax_row(const float* x, int64_t n) {
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

torch::Tensor argmax(const torch::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == torch::kFloat32 && scores.is_contiguous(),
              "sampling_argmax: scores must be a contiguous float32 [B, V] tensor");
  TORCH_CHECK(scores.size(1) > 0, "sampling_argmax: empty rows have no maximum");
  const int64_t rows = scores.size(0), n = scores.size(1);
  torch::Tensor out = torch::empty({rows}, scores.options().dtype(torch::kInt64));
  const float* x = scores.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) idx[r] = argmax_row(x + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) { m.def("sampling_argmax(Tensor scores) -> Tensor"); }

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) { m.impl("sampling_argmax", &argmax); }
