// The element-wise arithmetic of llama_glue.cpp, shared with decode_step.cpp: the dtypes'
// rounding, RMSNorm of a row, RoPE of a head, SiLU(gate) * up of an element. NOTE: the
// rounding rules are llama_glue.cpp's (see its header); both callers give bit-identical results.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

}  // namespace tierserve_glue
