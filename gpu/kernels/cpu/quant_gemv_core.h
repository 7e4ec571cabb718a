// The inner loops of quant_gemv.cpp's weight-only quantized matmuls, shared with
// decode_step.cpp (which runs them inside its own parallel region): the problem, and the
// work of one thread (`tiles`: a range of 16-output-row tiles for all rows
// of x). NOTE: a row's result depends only on its own x and the weight — never on the other
// rows, on how [0, N) is cut into tiles, or on the instruction set — so both callers give
// bit-identical results and the scalar code is the AVX2 code's exact reference.
//
// out[M, N] = x[M, K] @ w[N, K]^T, written in x's dtype (float32 or bfloat16), with x
// quantized to int8 per group of 32 (quant_input.h) and integer dot products; the weight
// is streamed once per call for many rows of x and prefetched in software a few KB ahead.
// Both formats take any number of rows (decode and prefill): per group a few integer
// instructions do what float32 needs many multiply-adds for.
//
// Weight formats (packed by gpu/quant/gemv.py), in tiles of 16 output rows:
// - int8: one float32 scale per output row (w = q * s); per tile and pair of k, 32 bytes:
//   rows 0-7's (q[k], q[k + 1]), then rows 8-15's (layout and loop below).
// - q4: 4-bit groups of 32 along K with an fp16 scale d and offset m each: w = d * q + m
//   (GGUF Q4_1; Q4_0 is m = -8 d).
//
// The vector code (AVX2 + FMA + F16C) is compiled when -march=native offers it (AVX-512
// builds run it too); with AVX512-VNNI (+VL) a second copy of it sums the integer dot products
// with vpdpbusd / vpdpwssd (one instruction where AVX2 needs a multiply-add and an add: the
// same exact integers), and with AVX-512 F/BW a third holds a whole tile in one 512-bit
// register (quant_gemv_zmm.h; run where it measures faster). The scalar path is always
// there. An `Isa` picks one, for tests.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "quant_input.h"

namespace tierserve_gemv {

constexpr int64_t kTile = 16;                   // output rows per tile (a work item)
constexpr int64_t kTileGroupBytes = kTile * 4 + kTile * kGroup / 2;  // q4: d, m (fp16) + nibbles
// Software prefetch distance along a weight stream, and its target: L2 (prefetcht1), not L1.
// NOTE: measured on Zen 4 in the native decode step, A/B on alternate steps of one process:
// into L2 8 KB ahead ran a step in 0.89-0.92x the time of into L1 16 KB ahead (one row; 32
// rows 0.97x); into L2 16 KB ahead 0.92x, 4 KB about as 8, 2 KB 1.2x slower. An L1-bound
// prefetch holds an L1 miss buffer until its line arrives, and the tiles' own loads then wait
// for those buffers; an L2-bound one leaves them to the loads (the line is in L2 when they come).
constexpr int64_t kPrefetchBytes = 8192;
// Rows of x: up to kChunkRows (decode) in one chunk, their sums in registers; more in
// blocks of kBlockRows (their quantized x stays in L2 while the tiles go past), each tile
// read by the block's chunks from L1.
constexpr int kChunkRows = 4;
constexpr int64_t kBlockRows = 48;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 2); }  // prefetcht1: into L2 (kPrefetchBytes)

#if defined(QG_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QG_VNNI 1
#endif
#if defined(QG_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define QG_VNNI512 1
#endif

// The code paths of the kernels; every one gives the same bits (NOTE above).
enum class Isa { kScalar, kAvx2, kVnni, kVnni512 };

inline std::vector<std::string> compiled_isas() {  // names, widest first
  std::vector<std::string> names;
#if defined(QG_VNNI512)
  names.push_back("vnni512");
#endif
#if defined(QG_VNNI)
  names.push_back("vnni");
#endif
#if defined(QG_AVX2)
  names.push_back("avx2");
#endif
  names.push_back("scalar");
  return names;
}

inline bool zmm_outruns_ymm();  // quant_gemv_zmm.h: measured once per process

// The path the kernels run: the widest compiled one, except that the 512-bit path runs only
// where it measured faster than the 256-bit one (a full-width core, not a split one).
inline Isa best_isa() {
#if defined(QG_VNNI512)
  static const Isa chosen = zmm_outruns_ymm() ? Isa::kVnni512 : Isa::kVnni;
  return chosen;
#elif defined(QG_VNNI)
  return Isa::kVnni;
#elif defined(QG_AVX2)
  return Isa::kAvx2;
#else
  return Isa::kScalar;
#endif
}

// "auto" is the best; other names as compiled_isas() lists them.
inline Isa isa_named(const std::string& name) {
  if (name == "auto") return best_isa();
  return name == "vnni512" ? Isa::kVnni512 : name == "vnni" ? Isa::kVnni : name == "avx2" ? Isa::kAvx2 : Isa::kScalar;
}

// Everything a pass needs besides x: the weight, its per-row scales (int8) and the output.
template <class Out>
struct Problem {
  const uint8_t* w;     // the packed weight: `stride` bytes per tile of 16 output rows
  const float* scales;  // int8: [N]
  Out* out;             // [rows, N]
  int64_t K, N, stride;
};

// The loop of every vector path over output tiles [t0, t1) and all `rows` rows of x: up to
// `chunk_rows` rows as one chunk a tile, reading the packed tile itself; more in blocks of
// kBlockRows, each tile first `unpack(t, scratch)`ed (its quads in the path's split form,
// 512 bytes a group; it returns the copy, or null where the path reads the packed tile)
// and then read from L1 by the block's chunks: `chunk(t, m0, rows, split)`.
template <class Unpack, class Chunk>
void over_tiles(int64_t rows, int64_t chunk_rows, int64_t groups, int64_t t0, int64_t t1, Unpack unpack, Chunk chunk) {
  if (rows <= chunk_rows) {
    for (int64_t t = t0; t < t1; ++t) chunk(t, 0, rows, nullptr);
    return;
  }
  thread_local std::vector<uint8_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < groups * 512) scratch.resize(groups * 512);
  for (int64_t b0 = 0; b0 < rows; b0 += kBlockRows) {
    const int64_t b1 = std::min(rows, b0 + kBlockRows);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* split = unpack(t, scratch.data());
      for (int64_t m = b0; m < b1; m += chunk_rows) chunk(t, m, std::min(chunk_rows, b1 - m), split);
    }
  }
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

// Reference and fallback: output rows [n0, n1) for rows [0, rows) of x, one row at a time.
template <class Out>
void q4_scalar(const Problem<Out>& p, const QInput& in, int64_t rows, int64_t n0, int64_t n1) {
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
// A quad's 32 bytes split into its vectors: AVX2, the low and the high nibbles (each byte
// pair a row's q[4u], q[4u + 1], resp. q[4u + 2], q[4u + 3]); VNNI, those interleaved per
// row into 4-byte lanes (rows [0-3 | 8-11], then [4-7 | 12-15]: madd's order).
template <bool Vnni>
inline void q4_split(const uint8_t* quad, __m256i& a, __m256i& b) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad));
  const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  if constexpr (Vnni) {
    a = _mm256_unpacklo_epi16(lo, hi), b = _mm256_unpackhi_epi16(lo, hi);
  } else {
    a = lo, b = hi;
  }
}

// Quad u of group g: from the tile's split copy (q4_unpack) where there is one, else split here.
template <bool Vnni>
inline void q4_quad(const uint8_t* base, const uint8_t* split, int64_t g, int u, __m256i& a, __m256i& b) {
  if (split) {
    a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(split + (g * 8 + u) * 64));
    b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(split + (g * 8 + u) * 64 + 32));
  } else {
    q4_split<Vnni>(base + kTile * 4 + u * 32, a, b);
  }
}

// Group g's integer dot products of R rows of x with tile `base`, one int32 lane an output
// row in madd's order (i0: rows [0-3 | 8-11], i1: [4-7 | 12-15]): two 16-lane int16 sums a
// row (the quads' low and high pairs; each at most 8 * 2 * 15 * 127 = 30480, so no
// overflow), widened at the end.
template <int R>
inline void q4_group_dots(const QInput& in, int64_t k, const uint8_t* base, const uint8_t* split, int64_t g,
                          int64_t m0, __m256i* i0, __m256i* i1) {
  __m256i lo_sum[R], hi_sum[R];
  for (int m = 0; m < R; ++m) lo_sum[m] = hi_sum[m] = _mm256_setzero_si256();
  // NOTE: unrolled, or GCC keeps the quad loop rolled and spills one of the 2R sums to
  // the stack for R = 4: a store-to-load round trip on a loop-carried chain (prefill's
  // q4 matmuls measured ~1.25x faster unrolled on an AVX2 EPYC).
#pragma GCC unroll 8
  for (int u = 0; u < kGroup / 4; ++u) {
    __m256i lo, hi;
    q4_quad<false>(base, split, g, u, lo, hi);
    for (int m = 0; m < R; ++m) {
      const int32_t* xp = in.pairs + (m0 + m) * k / 2 + g * kGroup / 2 + 2 * u;
      lo_sum[m] = _mm256_add_epi16(lo_sum[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xp[0])));
      hi_sum[m] = _mm256_add_epi16(hi_sum[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xp[1])));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < R; ++m) {
    i0[m] = _mm256_madd_epi16(_mm256_unpacklo_epi16(lo_sum[m], hi_sum[m]), ones);
    i1[m] = _mm256_madd_epi16(_mm256_unpackhi_epi16(lo_sum[m], hi_sum[m]), ones);
  }
}

#if defined(QG_VNNI)
// vpdpbusd sums of R rows of x's quads (group g) against a tile's quads in VNNI's split form
// (`quad(u, a, b)`: quad u's a: rows [0-3 | 8-11], b: [4-7 | 12-15], each lane a row's four
// unsigned weights), one int32 lane an output row in madd's order; quads u and u + 1 into
// sums of their own (two dependency chains a row: one would be bound by vpdpbusd's
// latency), added at the end.
template <int R, class Quad>
inline void dpbusd_group(const QInput& in, int64_t k, int64_t g, int64_t m0, Quad quad, __m256i* i0, __m256i* i1) {
  __m256i e0[R], e1[R], o0[R], o1[R];
  for (int m = 0; m < R; ++m) e0[m] = e1[m] = o0[m] = o1[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int u = 0; u < kGroup / 4; u += 2) {
    __m256i a0, b0, a1, b1;
    quad(u, a0, b0);
    quad(u + 1, a1, b1);
    for (int m = 0; m < R; ++m) {
      const int32_t* xq = in.quads + (m0 + m) * k / 4 + g * kGroup / 4 + u;
      const __m256i x0 = _mm256_set1_epi32(xq[0]), x1 = _mm256_set1_epi32(xq[1]);
      e0[m] = _mm256_dpbusd_epi32(e0[m], a0, x0);
      e1[m] = _mm256_dpbusd_epi32(e1[m], b0, x0);
      o0[m] = _mm256_dpbusd_epi32(o0[m], a1, x1);
      o1[m] = _mm256_dpbusd_epi32(o1[m], b1, x1);
    }
  }
  for (int m = 0; m < R; ++m) i0[m] = _mm256_add_epi32(e0[m], o0[m]), i1[m] = _mm256_add_epi32(e1[m], o1[m]);
}

// The same integers as q4_group_dots with vpdpbusd (a row's four weights against x's quad).
template <int R>
inline void q4_group_dots_vnni(const QInput& in, int64_t k, const uint8_t* base, const uint8_t* split, int64_t g,
                               int64_t m0, __m256i* i0, __m256i* i1) {
  dpbusd_group<R>(in, k, g, m0, [base, split, g](int u, __m256i& a, __m256i& b) { q4_quad<true>(base, split, g, u, a, b); }, i0, i1);
}
#endif

// R rows of x from row m0 against tile t: per group the integer dot products
// (q4_group_dots), accumulated in float32. `unpacked`: the tile's quads already split
// (q4_unpack), else they are split here.
template <int R, bool Vnni, class Out>
void q4_tile_rows(const Problem<Out>& p, const QInput& in, int64_t t, int64_t m0, const uint8_t* unpacked) {
  const int64_t groups = p.K / kGroup;
  const uint8_t* tile = p.w + t * p.stride;
  __m256 acc[R][2];  // rows [0-3 | 8-11] and [4-7 | 12-15] (madd's order)
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* base = tile + g * kTileGroupBytes;
    if (m0 == 0) {
      for (int64_t line = 0; line < kTileGroupBytes; line += 64) prefetch(base + kPrefetchBytes + line);
    }
    __m256i i0[R], i1[R];
#if defined(QG_VNNI)
    if constexpr (Vnni) {
      q4_group_dots_vnni<R>(in, p.K, base, unpacked, g, m0, i0, i1);
    } else {
      q4_group_dots<R>(in, p.K, base, unpacked, g, m0, i0, i1);
    }
#else
    q4_group_dots<R>(in, p.K, base, unpacked, g, m0, i0, i1);
#endif
    const __m256 da = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base)));
    const __m256 db = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 16)));
    const __m256 ma = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 32)));
    const __m256 mb = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 48)));
    const __m256 d0 = _mm256_permute2f128_ps(da, db, 0x20), d1 = _mm256_permute2f128_ps(da, db, 0x31);
    const __m256 o0 = _mm256_permute2f128_ps(ma, mb, 0x20), o1 = _mm256_permute2f128_ps(ma, mb, 0x31);
    for (int m = 0; m < R; ++m) {
      const __m256 s = _mm256_set1_ps(in.scale[(m0 + m) * groups + g]);
      const __m256 ssum = _mm256_set1_ps(in.sum[(m0 + m) * groups + g]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[m]), _mm256_mul_ps(d0, s), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[m]), _mm256_mul_ps(d1, s), acc[m][1]);
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

// Tile t's quads split (q4_split): 512 bytes a group, read by every chunk.
template <bool Vnni>
inline void q4_unpack(const uint8_t* tile, int64_t groups, uint8_t* out) {
  for (int64_t g = 0; g < groups; ++g) {
    for (int u = 0; u < kGroup / 4; ++u) {
      __m256i a, b;
      q4_split<Vnni>(tile + g * kTileGroupBytes + kTile * 4 + u * 32, a, b);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * 8 + u) * 64), a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * 8 + u) * 64 + 32), b);
    }
  }
}

template <bool Vnni, class Out>
void q4_chunk(const Problem<Out>& p, const QInput& in, int64_t t, int64_t m, int64_t rows, const uint8_t* unpacked) {
  switch (rows) {
    case 1: return q4_tile_rows<1, Vnni>(p, in, t, m, unpacked);
    case 2: return q4_tile_rows<2, Vnni>(p, in, t, m, unpacked);
    case 3: return q4_tile_rows<3, Vnni>(p, in, t, m, unpacked);
    default: return q4_tile_rows<kChunkRows, Vnni>(p, in, t, m, unpacked);
  }
}

template <bool Vnni, class Out>
void q4_avx2(const Problem<Out>& p, const QInput& in, int64_t rows, int64_t t0, int64_t t1) {
  const int64_t groups = p.K / kGroup;
  over_tiles(
      rows, kChunkRows, groups, t0, t1,
      [&](int64_t t, uint8_t* scratch) -> const uint8_t* {
        q4_unpack<Vnni>(p.w + t * p.stride, groups, scratch);
        return scratch;
      },
      [&](int64_t t, int64_t m, int64_t r, const uint8_t* split) { q4_chunk<Vnni>(p, in, t, m, r, split); });
}
#endif

// ---- int8 weights against int8 activations ----------------------------------------------
// Per output row n and row m of x: out = s_n * (sum over groups of fma(I_g, s_mg, acc)), I_g
// = sum_k q_nk xq_mk exact in int32 (|I_g| <= 32 * 127 * 127 < 2^24: exact as a float too),
// in group order. The packed weight (gpu/quant/gemv.py's pack_int8): per tile, K / 2 pairs
// of k of 32 bytes, rows 0-7's (q[k], q[k + 1]) then rows 8-15's. Sign-extended to int16
// (vpmovsxbw), each half is 8 rows' pairs against a broadcast word of x (vpmaddwd): 8 int32
// row sums, one lane a row, so no shuffles are needed.
constexpr int64_t kInt8GroupBytes = kTile * kGroup;  // a tile's bytes per group along K

template <class Out>
void int8_scalar(const Problem<Out>& p, const QInput& in, int64_t rows, int64_t n0, int64_t n1) {
  const int64_t groups = p.K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* tile = reinterpret_cast<const int8_t*>(p.w + (n / kTile) * p.stride);
    const int64_t r = n % kTile, at = (r / 8) * 16 + (r % 8) * 2;  // row r's pair in each 32 bytes
    for (int64_t m = 0; m < rows; ++m) {
      const int32_t* words = in.words + m * p.K / 2;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int64_t j = g * kGroup / 2; j < (g + 1) * kGroup / 2; ++j) {
          const int32_t lo = static_cast<int16_t>(words[j] & 0xFFFF), hi = static_cast<int16_t>(words[j] >> 16);
          dot += tile[j * 32 + at] * lo + tile[j * 32 + at + 1] * hi;
        }
        acc = std::fma(static_cast<float>(dot), in.scale[m * groups + g], acc);
      }
      p.out[m * p.N + n] = static_cast<Out>(acc * p.scales[n]);
    }
  }
}

#if defined(QG_AVX2)
// Group g's int32 dot products of R rows of x with the tile's 32 bytes a pair of k at `base`
// (sum[m][0]: rows 0-7, sum[m][1]: rows 8-15).
template <int R>
inline void int8_group_dots(const QInput& in, int64_t k, const uint8_t* base, int64_t g, int64_t m0, __m256i (*sum)[2]) {
  for (int m = 0; m < R; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_si256();
  const int32_t* words = in.words + g * kGroup / 2;
  for (int j = 0; j < kGroup / 2; ++j) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + j * 32)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + j * 32 + 16)));
    for (int m = 0; m < R; ++m) {
      const __m256i xw = _mm256_set1_epi32(words[(m0 + m) * k / 2 + j]);
      sum[m][0] = _mm256_add_epi32(sum[m][0], _mm256_madd_epi16(w0, xw));
      sum[m][1] = _mm256_add_epi32(sum[m][1], _mm256_madd_epi16(w1, xw));
    }
  }
}

#if defined(QG_VNNI)
// int8 with vpdpbusd, four products a lane (vpmaddwd / vpdpwssd take two): vpdpbusd wants
// one operand unsigned, so the weight's bytes are flipped to w + 128 (XOR 0x80) and a lane
// sums I + 128 S against x's signed quads (S: the group's sum of xq, exact in QInput.total);
// I is that minus 128 S, the very integers of the AVX2 path.
// Quad u (k = 4u .. 4u + 3) of the group at `base`: pair chunks 2u and 2u + 1 interleaved by
// row into 4-byte lanes (a: rows [0-3 | 8-11], b: [4-7 | 12-15], madd's order), flipped.
inline void int8_quad(const uint8_t* base, int u, __m256i& a, __m256i& b) {
  const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 2 * u * 32));
  const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (2 * u + 1) * 32));
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  a = _mm256_xor_si256(_mm256_unpacklo_epi16(c0, c1), flip);
  b = _mm256_xor_si256(_mm256_unpackhi_epi16(c0, c1), flip);
}

// Group g's I for R rows of x in madd's order (i0: rows [0-3 | 8-11], i1: [4-7 | 12-15]),
// from the tile's flipped split copy (int8_unpack, q4's split layout) where there is one,
// else from `base`.
template <int R>
inline void int8_group_dots_vnni(const QInput& in, int64_t k, const uint8_t* base, const uint8_t* split, int64_t g,
                                 int64_t m0, __m256i* i0, __m256i* i1) {
  dpbusd_group<R>(in, k, g, m0, [base, split, g](int u, __m256i& a, __m256i& b) {
    if (split) {
      a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(split + (g * 8 + u) * 64));
      b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(split + (g * 8 + u) * 64 + 32));
    } else {
      int8_quad(base, u, a, b);
    }
  }, i0, i1);
  const int64_t groups = k / kGroup;
  for (int m = 0; m < R; ++m) {  // the weights were read as w + 128
    const __m256i bias = _mm256_set1_epi32(in.total[(m0 + m) * groups + g] * 128);
    i0[m] = _mm256_sub_epi32(i0[m], bias), i1[m] = _mm256_sub_epi32(i1[m], bias);
  }
}

// Tile t's quads split and flipped (int8_quad): 512 bytes a group, read by every chunk.
inline void int8_unpack(const uint8_t* tile, int64_t groups, uint8_t* out) {
  for (int64_t g = 0; g < groups; ++g) {
    for (int u = 0; u < kGroup / 4; ++u) {
      __m256i a, b;
      int8_quad(tile + g * kInt8GroupBytes, u, a, b);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * 8 + u) * 64), a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * 8 + u) * 64 + 32), b);
    }
  }
}
#endif

// R rows of x from row m0 against tile t (R <= kChunkRows: 2R int32 sums and 2R float
// accumulators, the latter touched once a group). `unpacked` (VNNI): the tile's flipped
// split copy, or null.
template <int R, bool Vnni, class Out>
void int8_tile_rows(const Problem<Out>& p, const QInput& in, int64_t t, int64_t m0, const uint8_t* unpacked) {
  const int64_t groups = p.K / kGroup;
  const uint8_t* tile = p.w + t * p.stride;
  __m256 acc[R][2];  // rows 0-7 and 8-15 (VNNI: [0-3 | 8-11] and [4-7 | 12-15], madd's order)
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* base = tile + g * kInt8GroupBytes;
    if (m0 == 0) {
      for (int64_t line = 0; line < kInt8GroupBytes; line += 64) prefetch(base + kPrefetchBytes + line);
    }
    __m256i sum[R][2];
#if defined(QG_VNNI)
    if constexpr (Vnni) {
      __m256i i0[R], i1[R];
      int8_group_dots_vnni<R>(in, p.K, base, unpacked, g, m0, i0, i1);
      for (int m = 0; m < R; ++m) sum[m][0] = i0[m], sum[m][1] = i1[m];
    } else {
      int8_group_dots<R>(in, p.K, base, g, m0, sum);
    }
#else
    (void)unpacked;
    int8_group_dots<R>(in, p.K, base, g, m0, sum);
#endif
    for (int m = 0; m < R; ++m) {
      const __m256 s = _mm256_set1_ps(in.scale[(m0 + m) * groups + g]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m][0]), s, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m][1]), s, acc[m][1]);
    }
  }
  const int64_t n0 = t * kTile, live = std::min(kTile, p.N - n0);
  for (int m = 0; m < R; ++m) {
    float rows[kTile];
    if constexpr (Vnni) {
      _mm256_storeu_ps(rows, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x20));
      _mm256_storeu_ps(rows + 8, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x31));
    } else {
      _mm256_storeu_ps(rows, acc[m][0]);
      _mm256_storeu_ps(rows + 8, acc[m][1]);
    }
    for (int64_t r = 0; r < live; ++r) p.out[(m0 + m) * p.N + n0 + r] = static_cast<Out>(rows[r] * p.scales[n0 + r]);
  }
}

template <bool Vnni, class Out>
void int8_chunk(const Problem<Out>& p, const QInput& in, int64_t t, int64_t m, int64_t rows, const uint8_t* unpacked) {
  switch (rows) {
    case 1: return int8_tile_rows<1, Vnni>(p, in, t, m, unpacked);
    case 2: return int8_tile_rows<2, Vnni>(p, in, t, m, unpacked);
    case 3: return int8_tile_rows<3, Vnni>(p, in, t, m, unpacked);
    default: return int8_tile_rows<kChunkRows, Vnni>(p, in, t, m, unpacked);
  }
}

template <bool Vnni, class Out>
void int8_avx2(const Problem<Out>& p, const QInput& in, int64_t rows, int64_t t0, int64_t t1) {
  const int64_t groups = p.K / kGroup;
  over_tiles(
      rows, kChunkRows, groups, t0, t1,
      [&](int64_t t, uint8_t* scratch) -> const uint8_t* {  // VNNI: split and flipped once a tile
#if defined(QG_VNNI)
        if constexpr (Vnni) {
          int8_unpack(p.w + t * p.stride, groups, scratch);
          return scratch;
        }
#endif
        (void)t, (void)scratch;
        return nullptr;
      },
      [&](int64_t t, int64_t m, int64_t r, const uint8_t* split) { int8_chunk<Vnni>(p, in, t, m, r, split); });
}
#endif

}  // namespace tierserve_gemv

#include "quant_gemv_zmm.h"

namespace tierserve_gemv {

// What one thread runs: output tiles [i0, i1) of a weight of format `Q4` (else int8) for
// all `rows` rows of x, on the code path `isa` (one compiled here: isa_named; every path
// gives the same bits). quant_gemv.cpp's ops give each thread a range of tiles, decode_step.cpp too.
template <bool Q4, class Out>
void tiles(const Problem<Out>& p, const QInput& in, int64_t rows, int64_t i0, int64_t i1, Isa isa, bool head = true) {
  if (i0 >= i1) return;
  // the stream's head (the loops prefetch kPrefetchBytes ahead; this covers what comes before),
  // unless the caller's previous call ended right before i0 (its loop prefetched this far)
  if (head) {
    for (int64_t line = 0; line < std::min(kPrefetchBytes, (i1 - i0) * p.stride); line += 64) prefetch(p.w + i0 * p.stride + line);
  }
#if defined(QG_VNNI512)
  if (isa == Isa::kVnni512) return tiles512<Q4>(p, in, rows, i0, i1);
#endif
#if defined(QG_VNNI)
  if (isa == Isa::kVnni) return Q4 ? q4_avx2<true>(p, in, rows, i0, i1) : int8_avx2<true>(p, in, rows, i0, i1);
#endif
#if defined(QG_AVX2)
  if (isa != Isa::kScalar) return Q4 ? q4_avx2<false>(p, in, rows, i0, i1) : int8_avx2<false>(p, in, rows, i0, i1);
#endif
  (void)isa;
  const int64_t n0 = i0 * kTile, n1 = std::min(p.N, i1 * kTile);
  return Q4 ? q4_scalar(p, in, rows, n0, n1) : int8_scalar(p, in, rows, n0, n1);
}

}  // namespace tierserve_gemv
