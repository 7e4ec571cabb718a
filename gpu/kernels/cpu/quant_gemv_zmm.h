// quant_gemv_core.h's matmuls in 512-bit registers (its `vnni512` path): one zmm holds a
// tile's 16 output rows, so a quad of k is one vpdpbusd a row of x where the 256-bit path
// needs two, and the rows come out in their own order (no madd-order permutes). Included by
// quant_gemv_core.h, after the formats and the 256-bit code it mirrors.
//
// NOTE: the same integers and the same float32 operations in the same order as the scalar
// reference (a group's exact I, then fma(I, d * s, acc), fma(m, s * S, acc) for q4;
// fma(I, s, acc) then * the row's scale for int8), so this path gives the other paths' bits.
// Whether it is faster depends on the core, not on the flags: Zen 5 runs 512-bit integer
// dot products at full width (2x the 256-bit path's rate), Zen 4 splits them in two halves.
// `zmm_outruns_ymm` measures that once per process and best_isa() follows it.

#pragma once

#include <chrono>
#include <random>

namespace tierserve_gemv {

#if defined(QG_VNNI512)
constexpr int kZmmChunkRows = 8;  // rows of x whose sums stay in registers (2 zmm each)

// Quad u of a q4 tile-group (32 bytes: byte 2r = row r's q[4u] | q[4u + 2] << 4, byte 2r + 1
// = q[4u + 1] | q[4u + 3] << 4) as one zmm whose lane r holds row r's q[4u .. 4u + 3] as
// bytes: the byte pair widened to a lane (b0 | b1 << 8), OR'd with itself shifted by 12
// (which puts b0's and b1's high nibbles in bytes 2 and 3), the low nibbles kept.
inline __m512i q4_quad512(const uint8_t* quad) {
  const __m512i z = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad)));
  return _mm512_ternarylogic_epi32(z, _mm512_slli_epi32(z, 12), _mm512_set1_epi8(0x0F), 0xA8);  // (a | b) & c
}

// Quad u of an int8 tile-group (pair chunks 2u and 2u + 1, each 16 words: row r's (q[k],
// q[k + 1])) as one zmm whose lane r holds row r's q[4u .. 4u + 3] flipped to w + 128
// (vpdpbusd wants unsigned weights; int8_group_dots_vnni's correction takes it back out).
inline __m512i int8_quad512(const uint8_t* group, int u) {
  const __m512i z = _mm512_loadu_si512(group + 2 * u * 32);
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_xor_si512(_mm512_permutexvar_epi16(order, z), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Quad u of group g of a tile in this path's form: from the tile's split copy
// (`unpack512`) where there is one, else formed here.
template <bool Q4>
inline __m512i quad512(const uint8_t* group, const uint8_t* split, int64_t g, int u) {
  if (split) return _mm512_loadu_si512(split + (g * 8 + u) * 64);
  return Q4 ? q4_quad512(group + kTile * 4 + u * 32) : int8_quad512(group, u);
}

template <bool Q4>
constexpr int64_t group_bytes() {
  return Q4 ? kTileGroupBytes : kInt8GroupBytes;
}

// R rows of x from row m0 against tile t: per group the exact I of each (row, output row)
// lane, then the group's float32 step. Fewer than 4 rows: two sums a row (quads u and u + 1
// apart), so the loop is not bound by vpdpbusd's latency.
template <int R, bool Q4, class Out>
void tile_rows512(const Problem<Out>& p, const QInput& in, int64_t t, int64_t m0, const uint8_t* split) {
  constexpr int C = R < 4 ? 2 : 1;
  const int64_t groups = p.K / kGroup;
  const uint8_t* tile = p.w + t * p.stride;
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* base = tile + g * group_bytes<Q4>();
    if (m0 == 0) {
      for (int64_t line = 0; line < group_bytes<Q4>(); line += 64) prefetch(base + kPrefetchBytes + line);
    }
    __m512i sums[C][R];
    for (int c = 0; c < C; ++c) {
      for (int m = 0; m < R; ++m) sums[c][m] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int u = 0; u < kGroup / 4; ++u) {
      const __m512i w = quad512<Q4>(base, split, g, u);
      for (int m = 0; m < R; ++m) {
        const int32_t xq = in.quads[(m0 + m) * p.K / 4 + g * kGroup / 4 + u];
        sums[u % C][m] = _mm512_dpbusd_epi32(sums[u % C][m], w, _mm512_set1_epi32(xq));
      }
    }
    __m512 d, off;  // q4: the group's scales and offsets, one lane an output row
    if constexpr (Q4) {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base)));
      off = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 32)));
    }
    for (int m = 0; m < R; ++m) {
      __m512i dot = sums[0][m];
      if constexpr (C == 2) dot = _mm512_add_epi32(dot, sums[1][m]);
      const int64_t at = (m0 + m) * groups + g;
      const __m512 s = _mm512_set1_ps(in.scale[at]);
      if constexpr (Q4) {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, s), acc[m]);
        acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(in.sum[at]), acc[m]);
      } else {
        dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(in.total[at] * 128));  // the weights were read as w + 128
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m]);
      }
    }
  }
  const int64_t n0 = t * kTile, live = std::min(kTile, p.N - n0);
  for (int m = 0; m < R; ++m) {
    float rows[kTile];
    _mm512_storeu_ps(rows, acc[m]);
    for (int64_t r = 0; r < live; ++r) {
      p.out[(m0 + m) * p.N + n0 + r] = static_cast<Out>(Q4 ? rows[r] : rows[r] * p.scales[n0 + r]);
    }
  }
}

template <bool Q4, class Out>
void chunk512(const Problem<Out>& p, const QInput& in, int64_t t, int64_t m, int64_t rows, const uint8_t* split) {
  switch (rows) {
    case 1: return tile_rows512<1, Q4>(p, in, t, m, split);
    case 2: return tile_rows512<2, Q4>(p, in, t, m, split);
    case 3: return tile_rows512<3, Q4>(p, in, t, m, split);
    case 4: return tile_rows512<4, Q4>(p, in, t, m, split);
    case 5: return tile_rows512<5, Q4>(p, in, t, m, split);
    case 6: return tile_rows512<6, Q4>(p, in, t, m, split);
    case 7: return tile_rows512<7, Q4>(p, in, t, m, split);
    default: return tile_rows512<kZmmChunkRows, Q4>(p, in, t, m, split);
  }
}

// Tile t's quads in this path's form, 512 bytes a group, for the chunks of many rows.
template <bool Q4>
inline void unpack512(const uint8_t* tile, int64_t groups, uint8_t* out) {
  for (int64_t g = 0; g < groups; ++g) {
    for (int u = 0; u < kGroup / 4; ++u) {
      _mm512_storeu_si512(out + (g * 8 + u) * 64, quad512<Q4>(tile + g * group_bytes<Q4>(), nullptr, g, u));
    }
  }
}

// Output tiles [t0, t1) for all rows of x (over_tiles: chunks of up to 8 rows).
template <bool Q4, class Out>
void tiles512(const Problem<Out>& p, const QInput& in, int64_t rows, int64_t t0, int64_t t1) {
  const int64_t groups = p.K / kGroup;
  over_tiles(
      rows, kZmmChunkRows, groups, t0, t1,
      [&](int64_t t, uint8_t* scratch) -> const uint8_t* {
        unpack512<Q4>(p.w + t * p.stride, groups, scratch);
        return scratch;
      },
      [&](int64_t t, int64_t m, int64_t r, const uint8_t* split) { chunk512<Q4>(p, in, t, m, r, split); });
}

// Whether this path beats the 256-bit one on this core: both timed on the same 4-bit
// weight (48 tiles x 576, ~270 KB: in L2, so the time is the arithmetic's) for 8 rows of
// x, alternately, best of several runs each; the 512-bit path must win by 10 %. The
// values are arbitrary but finite (fp16 scales of 1/64, no denormals): every path gives
// the same bits, so the choice changes only the speed.
inline bool zmm_outruns_ymm() {
  constexpr int64_t kTiles = 48, kK = 576, kRows = 8;
  std::vector<uint8_t> w(kTiles * (kK / kGroup) * kTileGroupBytes);
  std::mt19937 rng(7);
  for (uint8_t& b : w) b = static_cast<uint8_t>(rng());
  for (int64_t at = 0; at < static_cast<int64_t>(w.size()); at += kTileGroupBytes) {
    for (int64_t i = 0; i < 64; i += 2) w[at + i] = 0x00, w[at + i + 1] = 0x24;  // d and m: fp16 1/64
  }
  std::vector<float> x(kRows * kK), out(kRows * kTiles * kTile);
  for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
  Quantized q;
  q.quantize(x.data(), kRows, kK);
  const Problem<float> p{w.data(), nullptr, out.data(), kK, kTiles * kTile, (kK / kGroup) * kTileGroupBytes};
  auto seconds = [&](bool zmm) {
    const auto start = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 4; ++rep) {
      if (zmm) {
        tiles512<true>(p, q.input(), kRows, 0, kTiles);
      } else {
        q4_avx2<true>(p, q.input(), kRows, 0, kTiles);
      }
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double best_zmm = 1e9, best_ymm = 1e9;
  for (int round = 0; round < 8; ++round) {
    best_ymm = std::min(best_ymm, seconds(false));
    best_zmm = std::min(best_zmm, seconds(true));
  }
  return best_zmm * 1.1 < best_ymm;
}
#endif

}  // namespace tierserve_gemv
