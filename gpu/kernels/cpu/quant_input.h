// The activations of quant_gemv_core.h's matmuls: x quantized to int8 per row and group of
// 32 along K (llama.cpp's Q8_1 scheme): s = max|x| / 127, xq = round(x / s) in -127..127
// (round half to even). A group's dot product with integer weights is then exact integer
// arithmetic, and a matmul applies the scales once per group.
//
// NOTE: the AVX2 code computes what the scalar code does, bit for bit (the max, one
// division, products rounded to nearest even, an integer sum), so where (and by which
// instruction set) x is quantized never changes a result.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_AVX2 1
#include <immintrin.h>
#endif

namespace tierserve_gemv {

constexpr int64_t kGroup = 32;  // x values per scale along K (= a 4-bit weight group)

// The quantized rows of x as the kernels read them.
struct QInput {
  const int32_t* pairs;  // [rows, K / 2]: xq[2j], xq[2j + 1] as bytes, repeated in both halves (q4's vpmaddubsw)
  const int32_t* words;  // [rows, K / 2]: xq[2j], xq[2j + 1] as int16 halves (int8's vpmaddwd)
  const int32_t* quads;  // [rows, K / 4]: xq[4j .. 4j + 3] as bytes (q4's vpdpbusd)
  const float* scale;    // [rows, K / 32]: s
  const float* sum;      // [rows, K / 32]: s * the group's sum of xq (q4's offsets)
  const int32_t* total;  // [rows, K / 32]: the group's sum of xq (int8's vpdpbusd correction)
};

// x's rows quantized in both layouts (a 32-bit broadcast of either gives every lane of a
// vector the pair it multiplies).
struct Quantized {
  std::vector<int32_t> pairs, words, quads;
  std::vector<float> scale, sum;
  std::vector<int32_t> total;

  void resize(int64_t rows, int64_t k) {
    const int64_t groups = rows * (k / kGroup);
    if (static_cast<int64_t>(pairs.size()) < rows * k / 2) {
      pairs.resize(rows * k / 2), words.resize(rows * k / 2), quads.resize(rows * k / 4);
    }
    if (static_cast<int64_t>(scale.size()) < groups) scale.resize(groups), sum.resize(groups), total.resize(groups);
  }

  // Rows [r0, r1) of x [rows, k] (resize first); callers may split rows among threads.
  void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1) {
    for (int64_t g = r0 * (k / kGroup); g < r1 * (k / kGroup); ++g) {
      quantize_group(x + g * kGroup, pairs.data() + g * kGroup / 2, words.data() + g * kGroup / 2,
                     quads.data() + g * kGroup / 4, scale[g], sum[g], total[g]);
    }
  }

  void quantize(const float* x, int64_t rows, int64_t k) {
    resize(rows, k);
    quantize_rows(x, k, 0, rows);
  }

  QInput input() const { return {pairs.data(), words.data(), quads.data(), scale.data(), sum.data(), total.data()}; }

  static void quantize_group(const float* x, int32_t* pair, int32_t* word, int32_t* quad, float& s, float& ssum,
                             int32_t& xsum) {
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
      std::fill(word, word + kGroup / 2, 0);
      std::fill(quad, quad + kGroup / 4, 0);
      s = ssum = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      xsum = 0;
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
    // int32 -> int16 -> int8 in k order: packs work per 128-bit lane, hence the permutes
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    const __m256i w16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(word), w16);  // int16 in k order: the words
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(word + 8), w16b);
    const __m256i b8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(w16, w16b), 0xD8);  // 32 int8, k order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(quad), b8);  // the quads: the bytes themselves
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
      word[j] = static_cast<int32_t>((static_cast<uint32_t>(a) & 0xFFFF) | (static_cast<uint32_t>(b) << 16));
      const int shift = 16 * (j % 2);  // pair j is half of quad j / 2
      if (shift == 0) quad[j / 2] = 0;
      quad[j / 2] = static_cast<int32_t>(static_cast<uint32_t>(quad[j / 2]) | (p16 << shift));
    }
#endif
    s = amax / 127.0f;
    ssum = s * static_cast<float>(total);
    xsum = total;
  }
};

}  // namespace tierserve_gemv
