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

#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

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

namespace {

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

// q4 output rows [n0, n1) (whole tiles but the last): P tiles at a time, the rest one by one.
template <class I, int M, class Out>
void q4_item(const Problem<Out>& p, int64_t n0, int64_t n1) {
  constexpr int P = M <= 2 ? 2 : 1;
  int64_t t = n0 / kTile;
  const int64_t t1 = (n1 + kTile - 1) / kTile;
  for (; t + P <= t1; t += P) q4_tiles<I, M, P>(p, t);
  for (; t < t1; ++t) q4_tiles<I, M, 1>(p, t);
}

template <class I, bool Q4, int M, class Out>
void item(const Problem<Out>& p, int64_t n0, int64_t n1) {
  Q4 ? q4_item<I, M>(p, n0, n1) : int8_item<I, M>(p, n0, n1);
}

template <class I, bool Q4, class Out>
void run_pass(const Problem<Out>& p, int rows) {
  using ItemFn = void (*)(const Problem<Out>&, int64_t, int64_t);
  static constexpr ItemFn kItems[kMaxRows] = {
      item<I, Q4, 1, Out>, item<I, Q4, 2, Out>, item<I, Q4, 3, Out>, item<I, Q4, 4, Out>,
      item<I, Q4, 5, Out>, item<I, Q4, 6, Out>, item<I, Q4, 7, Out>, item<I, Q4, 8, Out>};
  const ItemFn fn = kItems[rows - 1];
  const int64_t items = (p.N + kTile - 1) / kTile;
  const int64_t item_bytes = Q4 ? p.stride : kTile * p.K;
  // NOTE: at least ~32 KB of weight per work item, so small matrices do not pay for threads they cannot use
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / item_bytes);
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    // the stream's head: the loops prefetch kPrefetchBytes ahead, this covers what comes before
    const uint8_t* head = p.w + i0 * item_bytes;
    const int64_t head_bytes = std::min(kPrefetchBytes, (i1 - i0) * item_bytes);
    for (int64_t line = 0; line < head_bytes; line += 64) prefetch(head + line);
    fn(p, i0 * kTile, std::min(p.N, i1 * kTile));
  });
}

template <class I, bool Q4, class Out>
void run_all(Problem<Out> p, int64_t rows) {
  const int64_t groups = p.K / kGroup;
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
    Problem<Out> pass = p;
    pass.x = p.x + m0 * p.K;
    pass.xsum = Q4 ? p.xsum + m0 * groups : nullptr;
    pass.out = p.out + m0 * p.N;
    run_pass<I, Q4>(pass, static_cast<int>(std::min<int64_t>(kMaxRows, rows - m0)));
  }
}

std::vector<std::string> compiled_isas() {
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

template <bool Q4, class Out>
void dispatch_isa(const Problem<Out>& p, int64_t rows, std::string isa) {
  if (isa == "auto") isa = compiled_isas().front();
#if defined(QG_AVX512)
  if (isa == "avx512") return run_all<Avx512, Q4>(p, rows);
#endif
#if defined(QG_AVX2)
  if (isa == "avx2") return run_all<Avx2, Q4>(p, rows);
#endif
  TORCH_CHECK(isa == "scalar", "quant_gemv: instruction set '", isa, "' is not compiled in");
  run_all<Scalar, Q4>(p, rows);
}

// x as float32 rows (a view when it already is) and, for q4, each group's sum of x (for the
// offsets: m * sum_k x_k), in plain loops: aten ops here would cost more than a small matmul.
struct Activations {
  std::vector<float> copy, sums;
  const float* x = nullptr;

  Activations(const at::Tensor& input, bool group_sums) {
    const int64_t rows = input.size(0), k = input.size(1);
    if (input.scalar_type() == at::kFloat) {
      x = input.data_ptr<float>();
    } else {
      const at::BFloat16* src = input.data_ptr<at::BFloat16>();
      copy.resize(rows * k);
      for (int64_t i = 0; i < rows * k; ++i) copy[i] = static_cast<float>(src[i]);
      x = copy.data();
    }
    if (!group_sums) return;
    sums.assign(rows * (k / kGroup), 0.0f);
    for (int64_t i = 0; i < rows * k; ++i) sums[i / kGroup] += x[i];
  }
};

// x [M, K] float32 or bfloat16 -> out [M, n] in x's dtype.
template <bool Q4>
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const float* scales, int64_t n, int64_t stride,
                const std::string& isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_gemv: x must be float32 or bfloat16");
  TORCH_CHECK(weight.is_contiguous(), "quant_gemv: the weight must be contiguous");
  const at::Tensor input = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const Activations act(input, Q4);
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  const float* sums = Q4 ? act.sums.data() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    dispatch_isa<Q4>(Problem<float>{act.x, sums, w, scales, out.data_ptr<float>(), k, n, stride}, rows, isa);
  } else {
    auto* o = out.data_ptr<at::BFloat16>();
    dispatch_isa<Q4>(Problem<at::BFloat16>{act.x, sums, w, scales, o, k, n, stride}, rows, isa);
  }
  return out;
}

at::Tensor quant_gemv_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, std::string isa) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "quant_gemv_int8: weight must be int8 [N, K]");
  TORCH_CHECK(x.dim() == 2 && weight.size(1) == x.size(1) && x.size(1) % kGroup == 0,
              "quant_gemv_int8: x must be [M, K] with K the weight's, a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == weight.size(0),
              "quant_gemv_int8: scales must be float32 [N]");
  return gemv<false>(x, weight, scales.data_ptr<float>(), weight.size(0), weight.size(1), isa);
}

at::Tensor quant_gemv_q4(const at::Tensor& x, const at::Tensor& packed, int64_t n, std::string isa) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(0) == (n + kTile - 1) / kTile,
              "quant_gemv_q4: packed must be uint8 [ceil(N / 16), K / 32 * 320]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0 && packed.size(1) == x.size(1) / kGroup * kTileGroupBytes,
              "quant_gemv_q4: x [M, K] does not match the packed weight");
  return gemv<true>(x, packed, nullptr, n, packed.size(1), isa);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.def("quant_gemv_int8(Tensor x, Tensor weight, Tensor scales, str isa='auto') -> Tensor");
  m.def("quant_gemv_q4(Tensor x, Tensor packed, int n, str isa='auto') -> Tensor");
  m.def("quant_gemv_isas() -> str[]", &compiled_isas);
}

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) {
  m.impl("quant_gemv_int8", &quant_gemv_int8);
  m.impl("quant_gemv_q4", &quant_gemv_q4);
}
