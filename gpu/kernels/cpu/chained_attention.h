// Deterministic mode's attention on CPU (gpu/attention/deterministic_paged.py): the paged
// decode kernel's problem, key chunks and chunk merge (paged_attention_core.h), with one
// arithmetic per (query head, key) that two vector forms compute alike, "the chained form":
//   score  = (((+0 + q0 k0) + q1 k1) + ... + q_{D-1} k_{D-1}) * scale, each step one fused multiply-add;
//   per block of kBlock keys (n of them the row's): top = max(m, scores); shrink = exp(m - top);
//   p_j = exp(s_j - top), 0 for j >= n; sum = the p_j summed by j mod 16 in key order, the 16
//   partial sums then halved pairwise (k + 8, + 4, + 2, + 1); l = fma(l, shrink, sum);
//   acc = acc * shrink, then acc[e] = fma(p_j, v_j[e], acc[e]) for j < n in key order.
// Keys in lanes (one row: a decode): the block's keys transposed to [D][kBlock], a vector of
// scores per query-vector element. Queries in lanes (a tile of up to kTileRows consecutive
// tokens of one request: a prefill chunk's): their queries transposed to [D][units], each key
// element broadcast, so each K/V row is read and converted once for the whole tile, the
// shape of a GEMM. NOTE: every lane runs the scalar sequence above (exp is lane-wise, the
// sums are spelled out, never a horizontal reduction), so a token's output is the same bits
// in either form, alone or in any tile, and with the paged kernel's key cut (by the row's
// own length) whatever else shares the step: invariant 7.

#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "chained_vec.h"
#include "paged_attention_core.h"

namespace tierserve_chained {

namespace cvec = tierserve_chained_vec;

using tierserve_paged::Item;
using tierserve_paged::kAhead;
using tierserve_paged::kBlock;
using tierserve_paged::kChunk;
using tierserve_paged::Natural;
using tierserve_paged::Problem;
using tierserve_paged::Split;
using tierserve_paged_vec::kNegInf;

constexpr int64_t kTileRows = 16;  // consecutive tokens of a request whose queries share a K/V read

constexpr int kPartials = 16;      // the block sum's partial sums (j mod 16)
static_assert(kBlock % kPartials == 0, "a block is whole rounds of the partial sums");

inline float widen(float x) { return x; }
template <class KV>
float widen(KV x) { return static_cast<float>(x); }

// A block's probability sum from its 16 partial sums (overwritten): the halving tree.
inline float halve(float* part) {
  for (int w = kPartials / 2; w >= 1; w /= 2) {
    for (int k = 0; k < w; ++k) part[k] = part[k] + part[k + w];
  }
  return part[0];
}

// Rows [row, row + rows) of the step: consecutive positions of one request (a tile).
struct Tile {
  int64_t row, rows;
};

// The tiles of a step's rows: a row joins the previous row's tile when it is the next
// position of the same request (one more key, the same pages).
inline std::vector<Tile> tiles_of(const int64_t* pages, const int64_t* lens, int64_t batch, int64_t max_pages,
                                  int64_t page_size) {
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < batch; ++b) {
    if (!tiles.empty() && tiles.back().rows < kTileRows && lens[b] == lens[b - 1] + 1 && lens[b - 1] > 0) {
      const int64_t used = (lens[b] + page_size - 1) / page_size;
      if (std::equal(pages + b * max_pages, pages + b * max_pages + used, pages + (b - 1) * max_pages)) {
        ++tiles.back().rows;
        continue;
      }
    }
    tiles.push_back({b, 1});
  }
  return tiles;
}

// A step's work items: a tile's key chunk for a group of kv heads (Item.row: the tile's
// index, t0 / t1: the chunk's keys for the tile's longest row), and per row and group a
// Split as paged::plan makes them. Longest first, as there.
inline std::vector<Item> plan(const std::vector<Tile>& tiles, const int64_t* lens, int64_t batch, int64_t kv_heads,
                              int threads, std::vector<Split>& splits) {
  const auto chunks = [&](int64_t b) { return tierserve_paged::chunks_of(lens[b], kChunk); };
  std::vector<Item> items;
  const auto work = [&](const Item& x) { return (x.t1 - x.t0) * tiles[x.row].rows; };
  if (static_cast<int64_t>(tiles.size()) >= 4 * threads) {  // plenty: an item is a whole tile (chunk -1)
    splits.clear();
    for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) {
      items.push_back({i, -1, 0, lens[tiles[i].row + tiles[i].rows - 1], 0, kv_heads, 0});
    }
    std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return work(x) > work(y); });
    return items;
  }
  int64_t tile_chunks = 0;
  for (const Tile& t : tiles) tile_chunks += chunks(t.row + t.rows - 1);
  const int64_t groups = tile_chunks < 4 * threads ? kv_heads : 1, per = kv_heads / groups;
  tierserve_paged::make_splits(lens, batch, kChunk, groups, splits);
  for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) {
    const int64_t last = tiles[i].row + tiles[i].rows - 1;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t c = 0; c < chunks(last); ++c) {
        items.push_back({i, c, c * kChunk, std::min(lens[last], (c + 1) * kChunk), g * per, (g + 1) * per, g});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return work(x) > work(y); });
  return items;
}

// One thread's worker: runs items, keeping its scratch between them. S: the vector layer.
template <class S, class T, class KV>
class Attender {
  using V = typename S::V;

 public:
  explicit Attender(const Problem<T, KV>& p)
      : p_(p), up_(round_up(kTileRows * p.group)),
        qt_(p.kv_heads * p.dim * up_), scores_(kBlock * up_), kr_(kBlock * p.dim), k_(kBlock * p.dim),
        v_(kBlock * p.dim),
        acc_(kTileRows * p.heads * p.dim), m_(p.kv_heads * up_), l_(p.kv_heads * up_), shrink_(up_),
        part_(kPartials), width_(tierserve_paged::partial_width(p.heads, p.dim)) {}

  // Item `it` of a step planned by `plan` over `tiles`: each of its rows' results written
  // out (a row of one chunk) or its chunks' partial results merged: here (a whole tile) or in
  // `partials`, by the row's last chunk to finish.
  void run(const Item& it, const std::vector<Tile>& tiles, std::vector<Split>& splits, int64_t groups, float* partials,
           float* tmp) {
    const Tile& tile = tiles[it.row];
    if (it.chunk >= 0) {
      chunk(tile, it.chunk, it.k0, it.k1);
      for (int64_t r = 0; r < rows_; ++r) {
        Split& split = splits[(row0_ + r) * groups + it.split];
        if (finish(r, split.chunks, partials + (split.first_chunk + it.chunk) * width_, tmp) &&
            split.pending->fetch_sub(1, std::memory_order_acq_rel) == 1) {
          tierserve_paged::merge<Natural>(p_, split, row0_ + r, partials, tmp, k0_ * p_.group, k1_ * p_.group);
        }
      }
      return;
    }
    // The whole tile: every chunk in turn, its partial results kept in this worker's own buffer.
    const int64_t chunks = chunks_of(p_.lens[tile.row + tile.rows - 1]);
    local_.resize(tile.rows * chunks * width_);
    for (int64_t c = 0; c < chunks; ++c) {
      chunk(tile, c, it.k0, it.k1);
      for (int64_t r = 0; r < rows_; ++r) {
        const int64_t at = row0_ - tile.row + r;
        finish(r, chunks_of(p_.lens[row0_ + r]), local_.data() + (at * chunks + c) * width_, tmp);
      }
    }
    for (int64_t r = 0; r < tile.rows; ++r) {
      const Split split{r * chunks, chunks_of(p_.lens[tile.row + r]), nullptr};
      if (split.chunks > 1) tierserve_paged::merge<Natural>(p_, split, tile.row + r, local_.data(), tmp, 0, p_.heads);
    }
  }

 private:
  static int64_t round_up(int64_t n) { return (n + S::W - 1) / S::W * S::W; }
  int64_t units() const { return rows_ * p_.group; }  // per kv head: unit u = row r * group + head i
  float* acc(int64_t r, int64_t head) { return acc_.data() + (r * p_.heads + head) * p_.dim; }
  // Keys the row has in the block at t (<= 0: none; the chunk ends at `end`).
  int64_t keys(int64_t r, int64_t t, int64_t end) const {
    return std::min<int64_t>({kBlock, p_.lens[row0_ + r] - t, end - t});
  }

  void start() {
    const int64_t d = p_.dim, g = p_.group;
    std::fill(acc_.begin(), acc_.begin() + rows_ * p_.heads * d, 0.f);
    std::fill(m_.begin(), m_.end(), kNegInf);
    std::fill(l_.begin(), l_.end(), 0.f);
    if (rows_ == 1) return;
    for (int64_t h = k0_; h < k1_; ++h) {  // the queries, transposed: qt[h][e][u]
      float* qt = qt_.data() + h * d * up_;
      std::fill(qt, qt + d * up_, 0.f);
      for (int64_t r = 0; r < rows_; ++r) {
        for (int64_t i = 0; i < g; ++i) {
          const T* q = p_.q + ((row0_ + r) * p_.heads + h * g + i) * d;
          for (int64_t e = 0; e < d; ++e) qt[e * up_ + r * g + i] = widen(q[e]);
        }
      }
    }
  }

  // Element offsets of the slots of keys [t, t + n) of the tile's rows (they share pages).
  void slots(int64_t t, int64_t n, int64_t* out) const {
    const int64_t ps = p_.page_size, stride = p_.kv_heads * p_.dim;
    const int64_t* pages = p_.pages + (row0_ + rows_ - 1) * p_.max_pages;
    for (int64_t j = 0; j < n; ++j) out[j] = (pages[(t + j) / ps] * ps + (t + j) % ps) * stride;
  }

  // A slot's K and V rows of the item's kv heads into L2, a block ahead of their use and at
  // the pace of the loads (the paged kernel's `far`, whose NOTE has the measurements).
  [[gnu::always_inline]] void far(int64_t slot) const {
    const int64_t bytes = (k1_ - k0_) * p_.dim * static_cast<int64_t>(sizeof(KV));
    tierserve_paged::to_l2(p_.k + slot + k0_ * p_.dim, bytes);
    tierserve_paged::to_l2(p_.v + slot + k0_ * p_.dim, bytes);
  }

  void block(int64_t t, int64_t end) {
    const int64_t n = keys(rows_ - 1, t, end), d = p_.dim;  // the longest row's keys
    const int64_t next = std::max<int64_t>(0, keys(rows_ - 1, t + kBlock, end));
    slots(t, n, slot_);
    slots(t + kBlock, next, next_slot_);
    for (int64_t h = k0_; h < k1_; ++h) {
      // The block's K/V rows of kv head h as float, [j][e]; one row's K also transposed.
      for (int64_t j = 0; j < n; ++j) {
        if (h == k0_ && j < next) far(next_slot_[j]);
        // Rows kAhead keys ahead into L1, as the paged kernel's `near` (Zen 5, 32 decode rows of
        // 150-350 keys, 30 layers, pages as served, one thread: 30.2-31.6 -> 27.0-28.3 ms a
        // step; prefill tiles, compute-bound, the same within noise).
        if (j + kAhead < n) {
          tierserve_paged::to_l1(p_.k + slot_[j + kAhead] + h * d, d * static_cast<int64_t>(sizeof(KV)));
          tierserve_paged::to_l1(p_.v + slot_[j + kAhead] + h * d, d * static_cast<int64_t>(sizeof(KV)));
        }
        cvec::widen_row(p_.k + slot_[j] + h * d, kr_.data() + j * d, d);
        cvec::widen_row(p_.v + slot_[j] + h * d, v_.data() + j * d, d);
      }
      for (int64_t j = n; h == k0_ && j < next; ++j) far(next_slot_[j]);
      if (rows_ == 1) {
        cvec::transpose_rows(kr_.data(), n, d, kBlock, k_.data());
        for (int64_t i = 0; i < p_.group; ++i) row_softmax(h, i, n);
      } else {
        tile_scores(h, n);
        tile_softmax(h, t, end);
      }
      accumulate(h, t, end);
    }
  }

  // One row (keys in lanes): scores_[i][j] for query head i of kv head h, then its
  // softmax step; the probabilities stay in scores_[i][j].
  void row_softmax(int64_t h, int64_t i, int64_t n) {
    constexpr int kVecs = kBlock / S::W;
    const int64_t d = p_.dim, head = h * p_.group + i;
    const T* q = p_.q + (row0_ * p_.heads + head) * d;
    V dot[kVecs];
    for (int c = 0; c < kVecs; ++c) dot[c] = S::zero();
    for (int64_t e = 0; e < d; ++e) {
      const V qe = S::set1(widen(q[e]));
      for (int c = 0; c < kVecs; ++c) dot[c] = S::fma(qe, S::load(k_.data() + e * kBlock + c * S::W), dot[c]);
    }
    float* s = scores_.data() + i * kBlock;
    const V scale = S::set1(p_.scale);
    for (int c = 0; c < kVecs; ++c) S::store(s + c * S::W, S::mul(dot[c], scale));
    std::fill(s + n, s + kBlock, kNegInf);
    float& m = m_[h * up_ + i];
    float& l = l_[h * up_ + i];
    V top_v = S::set1(m);
    for (int c = 0; c < kVecs; ++c) top_v = S::max(top_v, S::load(s + c * S::W));
    const float top = S::reduce_max(top_v);
    for (int c = 0; c < kVecs; ++c) S::store(s + c * S::W, S::exp(S::sub(S::load(s + c * S::W), S::set1(top))));
    std::fill(s + n, s + kBlock, 0.f);
    float* part = part_.data();
    for (int k = 0; k < kPartials; k += S::W) {
      V sum = S::load(s + k);
      for (int j = k + kPartials; j < kBlock; j += kPartials) sum = S::add(sum, S::load(s + j));
      S::store(part + k, sum);
    }
    float shrink[S::W];
    S::store(shrink, S::exp(S::set1(m - top)));
    l = std::fma(l, shrink[0], halve(part));
    m = top;
    shrink_[i] = shrink[0];
  }

  // A tile (queries in lanes): scores_[j][u] for the units of kv head h.
  void tile_scores(int64_t h, int64_t n) {
    constexpr int kKeys = 8;  // keys per pass: independent chains over one query vector
    const int64_t d = p_.dim, vecs = round_up(units()) / S::W;
    const float* qt = qt_.data() + h * d * up_;
    const V scale = S::set1(p_.scale);
    for (int64_t uv = 0; uv < vecs; ++uv) {
      for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
        V dot[kKeys];
        for (int jj = 0; jj < kKeys; ++jj) dot[jj] = S::zero();
        const float* k = kr_.data() + j0 * d;  // rows past the block's keys: stale, masked later
        const float* q = qt + uv * S::W;
        for (int64_t e = 0; e < d; ++e, q += up_) {
          const V qe = S::load(q);
          for (int jj = 0; jj < kKeys; ++jj) dot[jj] = S::fma(qe, S::set1(k[jj * d + e]), dot[jj]);
        }
        for (int jj = 0; jj < kKeys; ++jj) S::store(scores_.data() + (j0 + jj) * up_ + uv * S::W, S::mul(dot[jj], scale));
      }
    }
  }

  // The tile's softmax step, lane-wise per unit: probabilities left in scores_[j][u]; a
  // unit with no keys in this block keeps its state.
  void tile_softmax(int64_t h, int64_t t, int64_t end) {
    const int64_t vecs = round_up(units()) / S::W, g = p_.group;
    // Scores past each unit's keys: -inf (before the max), 0 after the exp.
    auto mask = [&](float value) {
      for (int64_t u = 0; u < up_; ++u) {
        const int64_t n = u < units() ? std::max<int64_t>(0, keys(u / g, t, end)) : 0;
        for (int64_t j = n; j < kBlock; ++j) scores_[j * up_ + u] = value;
      }
    };
    mask(kNegInf);
    for (int64_t uv = 0; uv < vecs; ++uv) {
      float* s = scores_.data() + uv * S::W;
      float* m = m_.data() + h * up_ + uv * S::W;
      V top = S::load(m);
      for (int64_t j = 0; j < kBlock; ++j) top = S::max(top, S::load(s + j * up_));
      for (int64_t j = 0; j < kBlock; ++j) S::store(s + j * up_, S::exp(S::sub(S::load(s + j * up_), top)));
      S::store(shrink_.data() + uv * S::W, S::exp(S::sub(S::load(m), top)));
      float tops[S::W];
      S::store(tops, top);
      for (int64_t u = 0; u < S::W; ++u) {  // units without keys here keep m
        if (uv * S::W + u < units() && keys((uv * S::W + u) / g, t, end) > 0) m[u] = tops[u];
      }
    }
    mask(0.f);
    for (int64_t uv = 0; uv < vecs; ++uv) {
      const float* s = scores_.data() + uv * S::W;
      V part[kPartials];
      for (int k = 0; k < kPartials; ++k) {
        part[k] = S::load(s + k * up_);
        for (int64_t j = k + kPartials; j < kBlock; j += kPartials) part[k] = S::add(part[k], S::load(s + j * up_));
      }
      for (int w = kPartials / 2; w >= 1; w /= 2) {
        for (int k = 0; k < w; ++k) part[k] = S::add(part[k], part[k + w]);
      }
      float sum[S::W];
      S::store(sum, part[0]);
      float* l = l_.data() + h * up_ + uv * S::W;
      for (int64_t u = 0; u < S::W; ++u) {
        const int64_t unit = uv * S::W + u;
        if (unit < units() && keys(unit / g, t, end) > 0) l[u] = std::fma(l[u], shrink_[unit], sum[u]);
      }
    }
  }

  // acc = acc * shrink, then acc[e] = fma(p_j, v_j[e], acc[e]) in key order, for every unit
  // of kv head h with keys in the block (one row: its query heads).
  void accumulate(int64_t h, int64_t t, int64_t end) {
    const int64_t d = p_.dim, g = p_.group, full = d / S::W * S::W;
    const int64_t step = rows_ == 1 ? 1 : up_;  // p_j of unit u at scores_[u * ustep + j * step]
    const int64_t ustep = rows_ == 1 ? kBlock : 1;
    for (int64_t u0 = 0; u0 < units();) {
      // The next run of units with the same key count (one row's heads, or rows alike).
      const int64_t n = keys(u0 / g, t, end);
      int64_t u1 = u0 + 1;
      while (u1 < units() && u1 - u0 < kMaxUnits && keys(u1 / g, t, end) == n) ++u1;
      if (n > 0) {
        float* a[kMaxUnits];
        const float* pr[kMaxUnits];
        for (int64_t u = u0; u < u1; ++u) {
          a[u - u0] = acc(u / g, h * g + u % g);
          pr[u - u0] = scores_.data() + u * ustep;
          const float shrink = shrink_[u];
          for (int64_t e = 0; e < d; ++e) a[u - u0][e] *= shrink;
        }
        const int count = static_cast<int>(u1 - u0);
        for (int64_t c0 = 0; c0 < full;) {  // whole vectors: kCols at a time, as many units as fit the registers
          const int cols = static_cast<int>(std::min<int64_t>(kCols, (full - c0) / S::W));
          const int fit = kRegisters / cols;
          for (int u = 0; u < count; u += fit) {
            const int here = std::min(fit, count - u);
            kernels()[cols - 1][here - 1](a + u, pr + u, step, n, v_.data() + c0, d, c0);
          }
          c0 += cols * S::W;
        }
        for (int u = 0; u < count; ++u) {  // elements past the whole vectors
          for (int64_t e = full; e < d; ++e) {
            for (int64_t j = 0; j < n; ++j) a[u][e] = std::fma(pr[u][j * step], v_[j * d + e], a[u][e]);
          }
        }
      }
      u0 = u1;
    }
  }

  // The accumulation of U units over C vectors of columns from c0, in registers.
  static constexpr int kCols = 4;
  static constexpr int kRegisters = S::W == 16 ? 24 : 12;  // accumulators (of 32 / 16 vector registers)
  static constexpr int kMaxUnits = kRegisters;
  using Kernel = void (*)(float* const*, const float* const*, int64_t, int64_t, const float*, int64_t, int64_t);

  template <int U, int C>
  static void pv(float* const* a, const float* const* pr, int64_t step, int64_t n, const float* v, int64_t d,
                 int64_t c0) {
    V r[U][C];
    for (int u = 0; u < U; ++u) {
      for (int c = 0; c < C; ++c) r[u][c] = S::load(a[u] + c0 + c * S::W);
    }
    for (int64_t j = 0; j < n; ++j, v += d) {
      V vj[C];
      for (int c = 0; c < C; ++c) vj[c] = S::load(v + c * S::W);
      for (int u = 0; u < U; ++u) {
        const V pj = S::set1(pr[u][j * step]);
        for (int c = 0; c < C; ++c) r[u][c] = S::fma(pj, vj[c], r[u][c]);
      }
    }
    for (int u = 0; u < U; ++u) {
      for (int c = 0; c < C; ++c) S::store(a[u] + c0 + c * S::W, r[u][c]);
    }
  }

  template <int C, int... U>
  static constexpr std::array<Kernel, kMaxUnits> kernels_of(std::integer_sequence<int, U...>) {
    return {(U + 1 <= kRegisters / C ? &pv<(U + 1 <= kRegisters / C ? U + 1 : 1), C> : nullptr)...};
  }
  static const std::array<std::array<Kernel, kMaxUnits>, kCols>& kernels() {
    static constexpr auto seq = std::make_integer_sequence<int, kMaxUnits>{};
    static const std::array<std::array<Kernel, kMaxUnits>, kCols> table{
        kernels_of<1>(seq), kernels_of<2>(seq), kernels_of<3>(seq), kernels_of<4>(seq)};
    return table;
  }

  static int64_t chunks_of(int64_t len) { return tierserve_paged::chunks_of(len, kChunk); }

  // Chunk c of the tile's rows, for kv heads [k0, k1): the rows with keys in it are a suffix
  // of the tile (lengths ascend by one).
  void chunk(const Tile& tile, int64_t c, int64_t k0, int64_t k1) {
    const int64_t t0 = c * kChunk, t1 = std::min(p_.lens[tile.row + tile.rows - 1], t0 + kChunk);
    int64_t r0 = 0;
    while (c > 0 && p_.lens[tile.row + r0] <= t0) ++r0;
    row0_ = tile.row + r0, rows_ = tile.rows - r0;
    k0_ = k0, k1_ = k1;
    start();
    for (int64_t t = t0; t < t1; t += kBlock) block(t, t1);
  }

  // Row r's result for this chunk's heads: written out (a row of `chunks` 1; false), or kept
  // at `dst` as the chunk's partial result for the merge (true).
  bool finish(int64_t r, int64_t chunks, float* dst, float* tmp) {
    const int64_t row = row0_ + r, g = p_.group, d = p_.dim, h0 = k0_ * g, h1 = k1_ * g;
    float* m = tmp;  // the row's m and l per head, gathered from the unit layout
    float* l = tmp + p_.heads;
    for (int64_t head = h0; head < h1; ++head) {
      const int64_t at = (head / g) * up_ + r * g + head % g;
      m[head] = m_[at], l[head] = l_[at];
    }
    if (chunks == 1) {
      tierserve_paged::write_out<Natural>(p_, row, acc(r, 0), l, h0, h1);
      return false;
    }
    const int64_t hd = p_.heads * d;
    std::copy(acc(r, h0), acc(r, h1), dst + h0 * d);
    std::copy(m + h0, m + h1, dst + hd + h0);
    std::copy(l + h0, l + h1, dst + hd + p_.heads + h0);
    return true;
  }

  const Problem<T, KV>& p_;
  const int64_t up_;         // units per kv head, padded to whole vectors
  std::vector<float> qt_;    // [Hkv, D, up] a tile's queries, transposed
  std::vector<float> scores_;  // [kBlock, up] (a tile) or [group, kBlock] (one row)
  std::vector<float> kr_, k_, v_;  // the block's K rows [kBlock, D] (and transposed [D, kBlock]), V rows, as float
  std::vector<float> acc_;     // [rows, H, D]
  std::vector<float> m_, l_;   // [Hkv, up] per unit
  std::vector<float> shrink_;  // [up] this block's, per unit of the current kv head
  std::vector<float> part_;
  std::vector<float> local_;  // a whole tile's partial results: [rows, chunks, width]
  const int64_t width_;
  int64_t slot_[kBlock] = {};       // the block's slots
  int64_t next_slot_[kBlock] = {};  // the next block's (fetched into L2 while this one runs)
  int64_t row0_ = 0, rows_ = 0, k0_ = 0, k1_ = 0;
};

}  // namespace tierserve_chained
