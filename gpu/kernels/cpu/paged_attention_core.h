// The work of paged_attention.cpp's decode attention, shared with decode_step.cpp (which
// runs it inside its own parallel region): the problem, the per-thread Attender, the
// plan of a step's work items and what one item does. NOTE: a row's output depends on
// its own length only (see paged_attention.cpp), so both callers give bit-identical results.

#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "paged_attention_vec.h"

namespace tierserve_paged {

using tierserve_paged_vec::bf16;
using tierserve_paged_vec::kBf16Dot;
using tierserve_paged_vec::kNegInf;
using tierserve_paged_vec::Rows;
using tierserve_paged_vec::Scalar;
using tierserve_paged_vec::Simd;

constexpr int kBlock = 64;          // keys per softmax update (a multiple of every vector width)
constexpr int64_t kChunk = 128;     // keys per work item (a multiple of kBlock); see the NOTE above
constexpr int64_t kMaxHeadDim = 512;
constexpr int kAhead = 8;           // keys ahead that a row's K and V lines are fetched into L1

// `bytes` from `at` into L1 (software prefetch, a line at a time). NOTE: always inlined, as
// every helper that calls it: GCC takes a function whose only effect is a prefetch for one
// without any and drops its calls (it did, until inlining was forced).
[[gnu::always_inline]] inline void to_l1(const void* at, int64_t bytes) {
  const char* p = static_cast<const char*>(at);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

// `bytes` from `at` into L2 (as to_l1, with the low-locality hint), always inlined likewise.
[[gnu::always_inline]] inline void to_l2(const void* at, int64_t bytes) {
  const char* p = static_cast<const char*>(at);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}

// What every work item reads; pointers into contiguous tensors. T: the query's and the
// output's element type; KV: the pool's (T, or float16 under float32 compute).
template <class T, class KV = T>
struct Problem {
  const T* q;            // [B, H, D]
  const KV* k;           // [slots, Hkv, D]
  const KV* v;
  const int64_t* pages;  // [B, max_pages]
  const int64_t* lens;   // [B]
  T* out;                // [B, H, D]
  int64_t max_pages, page_size, heads, kv_heads, dim, group;
  float scale;
};

// A row's running softmax state, for all its query heads, in float layout.
struct State {
  float* q;    // [H, D] the query (unless read as bf16, see kBf16Dot)
  float* acc;  // [H, D] sum of p * v
  float* m;    // [H] running max score
  float* l;    // [H] running sum of p
};

// A work item: keys [t0, t1) (chunk `chunk` of `row`) for kv heads [k0, k1), whose merge counter is splits[split].
struct Item {
  int64_t row, chunk, t0, t1, k0, k1, split;
};

template <class S, int NV, class T, class KV = T>
class Attender {
  using V = typename S::V;
  using R = Rows<S, KV>;
  static constexpr bool kDotBf16 = kBf16Dot<S, KV> && std::is_same_v<T, KV>;
  static constexpr int64_t kMaxVecs = NV > 0 ? NV : kMaxHeadDim / S::W;
  // Query heads whose accumulators fit in the vector registers beside one V row (32
  // registers with AVX-512, 16 with AVX2); one at a time for head dims of no fixed size.
  static constexpr int kRegisters = S::W == 16 ? 32 : 16;
  static constexpr int kHeadsPerPass = NV > 0 ? std::clamp((kRegisters - 4) / NV - 1, 1, 4) : 1;
  // Query heads whose queries (and a dot vector each) stay in registers beside one K row in
  // `score`: NV / 2 vectors a query as bf16, NV as float.
  static constexpr int kQueryVecs = kDotBf16 ? NV / 2 : NV;
  static constexpr int kScoreHeads = NV > 0 ? std::clamp((kRegisters - 4) / kQueryVecs, 1, 12) : 1;

 public:
  explicit Attender(const Problem<T, KV>& p) : p_(p), nv_(NV > 0 ? NV : p.dim / S::W) {
    const int64_t h = p.heads, d = p.dim;
    scratch_.assign(2 * h * d + 2 * h + h * kBlock + h * S::W * S::W, 0.f);
    float* s = scratch_.data();
    st_ = {s, s + h * d, s + 2 * h * d, s + 2 * h * d + h};
    scores_ = s + 2 * h * d + 2 * h;
    dots_ = scores_ + h * kBlock;
  }

  // Item `it`'s keys; leaves the unnormalized state of its query heads in the result (the
  // other heads' entries are not touched). `then`: the item this thread runs next, if it
  // knows, whose first block is fetched while this one's last block computes.
  const State& run(const Item& it, const Item* then = nullptr) {
    k0_ = it.k0, k1_ = it.k1;
    start(it.row);
    int cur = 0;
    slots(it.row, it.t0, block_len(it.t0, it.t1), slot_off_[cur]);
    for (int64_t t = it.t0; t < it.t1; t += kBlock, cur ^= 1) {
      next_n_ = 0;
      far_ = {slot_off_[cur ^ 1], 0, it.k0 * p_.dim, span(it)};
      if (t + kBlock < it.t1) {  // the next block's rows are fetched while this one computes
        next_n_ = block_len(t + kBlock, it.t1);
        slots(it.row, t + kBlock, next_n_, slot_off_[cur ^ 1]);
        far_.n = next_n_;
      } else if (then != nullptr) {
        far_ = {then_off_, block_len(then->t0, then->t1), then->k0 * p_.dim, span(*then)};
        slots(then->row, then->t0, far_.n, then_off_);
      }
      next_off_ = slot_off_[cur ^ 1];
      block(block_len(t, it.t1), slot_off_[cur]);
    }
    return st_;
  }

 private:
  static int block_len(int64_t t, int64_t t1) { return static_cast<int>(std::min<int64_t>(kBlock, t1 - t)); }

  void start(int64_t row) {
    const int64_t d = p_.dim, h0 = k0_ * p_.group, h1 = k1_ * p_.group;
    q_row_ = p_.q + row * p_.heads * d;
    if constexpr (!kDotBf16) {
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t e = 0; e < d; ++e) st_.q[h * d + R::position(e)] = static_cast<float>(q_row_[h * d + e]);
      }
    }
    std::fill(st_.acc + h0 * d, st_.acc + h1 * d, 0.f);
    std::fill(st_.m + h0, st_.m + h1, kNegInf);
    std::fill(st_.l + h0, st_.l + h1, 0.f);
  }

  // Element offsets of the slots of keys [t, t + n): the page table is read once per page.
  void slots(int64_t row, int64_t t, int n, int64_t* out) const {
    const int64_t ps = p_.page_size, stride = p_.kv_heads * p_.dim;
    const int64_t* pages = p_.pages + row * p_.max_pages;
    int64_t page = t / ps, off = t % ps;
    int64_t base = pages[page] * ps * stride;
    for (int j = 0; j < n; ++j) {
      out[j] = base + off * stride;
      if (++off == ps && j + 1 < n) {
        off = 0;
        base = pages[++page] * ps * stride;
      }
    }
  }

  // Software prefetch of the K and V rows into L2 one block (kBlock keys) ahead of their use:
  // they lie on scattered pages, in runs too short for the hardware prefetchers to pick up in
  // time. A key's rows are fetched as the key a block earlier is scored (`ahead`), so the
  // prefetches are spread over the block as the loads are; the last block fetches the first
  // block of the item the thread runs next, where the caller knows it (`run`'s `then`).
  // NOTE: paced, not the whole next block at once: a burst of a block's prefetches (up to
  // 96 KB) overran the core's miss buffers, and AMD cores drop the software prefetches they
  // cannot hold (Zen 4, 2 threads, decode_step.cpp A/B on alternate steps, pages as served:
  // 32 rows of 200-400 keys, attention 11.9 -> 9.1 ms of a 35.2 -> 32.6 ms step; one row,
  // attention 0.83x, the step 0.97x). Into L2, each row then pulled into L1 kAhead keys
  // before its use (`near`): the whole next block into L1 at once evicted the block being
  // computed (AMX Xeon, 32 decodes of 150-350 keys, one thread: 41.0 -> 32.1 ms a step of 30
  // layers for L2 against L1). The L1 distance kAhead is 8 keys since `score` keeps the
  // queries in registers (a key costs less time there): on a Zen 5 EPYC, 32 decodes of
  // 150-350 keys, 30 layers, pages as served, one thread: 15.7 ms a step at 16, 14.1 at 8,
  // 14.3 at 4, 14.4 at 12; the same within noise on two threads (decode_attention.py's
  // child, alternating runs). With the old score loop 16 had been 1.16x faster than 8.
  struct Far {
    const int64_t* off;  // slots of the block a block ahead
    int n;               // how many
    int64_t head_off;    // its first kv head's offset in a slot
    int64_t bytes;       // its kv heads' bytes in a slot
  };

  int64_t span(const Item& it) const { return (it.k1 - it.k0) * p_.dim * static_cast<int64_t>(sizeof(KV)); }

  [[gnu::always_inline]] void far(int j) const {
    if (j >= far_.n) return;
    to_l2(p_.k + far_.off[j] + far_.head_off, far_.bytes);
    to_l2(p_.v + far_.off[j] + far_.head_off, far_.bytes);
  }

  // A K or V row a few keys ahead into L1 (`far` brought it to L2).
  [[gnu::always_inline]] void near(const KV* row) const { to_l1(row, p_.dim * static_cast<int64_t>(sizeof(KV))); }

  // A slot's K and V rows of the run's kv heads into L1, as `near`.
  [[gnu::always_inline]] void near_slot(int64_t slot_off) const {
    const int64_t bytes = (k1_ - k0_) * p_.dim * static_cast<int64_t>(sizeof(KV));
    to_l1(p_.k + slot_off + k0_ * p_.dim, bytes);
    to_l1(p_.v + slot_off + k0_ * p_.dim, bytes);
  }

  void block(int n, const int64_t* slot_off) {
    score(n, slot_off);
    for (int j = n; j < far_.n; ++j) far(j);  // a block ahead longer than this one
    for (int64_t h = k0_; h < k1_; ++h) {
      for (int64_t i = 0; i < p_.group; ++i) softmax(h * p_.group + i, n);
      accumulate(h, n, slot_off);
    }
  }

  void load_row(const KV* row, V* out) const {
    const int64_t nv = NV > 0 ? NV : nv_;
    for (int64_t c = 0; c < nv; c += R::vecs) R::load(row + c * S::W, out + c);
  }

  // scores[head][j] = q_head . k_j for the query heads of the run's kv heads [k0, k1), W
  // keys at a time, in passes of up to kScoreHeads query heads whose queries stay in
  // registers: key by key, the pass's kv heads' rows (one contiguous run of the slot) before
  // the next key, so a page's K rows are one forward stream; each row is loaded once for its
  // query heads, and W keys' dot vectors are summed at once. The first pass pulls each key's
  // K and V rows kAhead keys ahead into L1 (Zen 5, 32 decodes x 150-350 keys, 30 layers,
  // pages as served, one thread: 20.4 -> 14.6 ms a step, against none).
  void score(int n, const int64_t* slot_off) {
    const int64_t h0 = k0_ * p_.group, h1 = k1_ * p_.group;
    n_ = n, slot_off_cur_ = slot_off;
    for (int j0 = 0; j0 < n; j0 += S::W) {
      const int m = std::min(S::W, n - j0);
      for (int64_t head = h0; head < h1; head += kScoreHeads) {
        const int count = static_cast<int>(std::min<int64_t>(kScoreHeads, h1 - head));
        score_pass<kScoreHeads>(count, head, j0, m, slot_off, head == h0);
      }
      for (int64_t head = h0; head < h1; ++head) S::sums(dots_ + head * S::W * S::W, scores_ + head * kBlock + j0);
    }
  }

  template <int HP>
  void score_pass(int count, int64_t head0, int j0, int m, const int64_t* slot_off, bool fetch) {
    if constexpr (HP > 1) {
      if (count < HP) return score_pass<HP - 1>(count, head0, j0, m, slot_off, fetch);
    }
    score_heads<HP>(head0, j0, m, slot_off, fetch);
  }

  // The dot products of query heads [head0, head0 + HP) with keys j0 + jj, jj < m (zeros for
  // m <= jj < W, overwritten in softmax), in `dots`: per head, W / kQuad vectors, each the
  // first levels of S::sums' tree over kQuad keys (S::quad). NOTE: a head's dot sums its
  // products in the same order whatever pass, run or batch it is in. The quads take the
  // tree's first levels while the dot vectors are in registers, a quarter of the stores and
  // loads of keeping every key's (Zen 5, 32 decodes, the pool in cache, one thread: 0.243 ->
  // 0.219 ms a layer).
  template <int HP>
  void score_heads(int64_t head0, int j0, int m, const int64_t* slot_off, bool fetch) {
    constexpr int kQuad = S::W >= 4 ? 4 : 1;
    const int64_t d = p_.dim, nv = NV > 0 ? NV : nv_;
    float* dots = dots_ + head0 * S::W * S::W;
    int64_t row_off[HP];
    bool next_row[HP];  // whether head i reads another kv head's row than head i - 1
    for (int i = 0; i < HP; ++i) {
      row_off[i] = (head0 + i) / p_.group * d;
      next_row[i] = i == 0 || row_off[i] != row_off[i - 1];
    }
    if constexpr (kDotBf16) {
      constexpr int64_t kChunks = kMaxVecs / 2;  // 2W bf16 values each
      const int64_t chunks = nv / 2;
      typename S::B q[HP][kChunks], k[kQuad][kChunks];
      for (int i = 0; i < HP; ++i) {
        for (int64_t c = 0; c < chunks; ++c) q[i][c] = S::load_bf16(q_row_ + (head0 + i) * d + c * 2 * S::W);
      }
      const auto load_k = [&](int t, int j, int i) {
        for (int64_t c = 0; c < chunks; ++c) k[t][c] = S::load_bf16(p_.k + slot_off[j] + row_off[i] + c * 2 * S::W);
      };
      const auto dot = [&](int t, int i) {
        V sum = S::zero();
        for (int64_t c = 0; c < chunks; ++c) sum = S::dot_bf16(sum, q[i][c], k[t][c]);
        return sum;
      };
      score_quads<HP, kQuad>(dots, j0, m, slot_off, fetch, next_row, load_k, dot);
    } else {
      V q[HP][kMaxVecs], k[kQuad][kMaxVecs];
      for (int i = 0; i < HP; ++i) {
        for (int64_t c = 0; c < nv; ++c) q[i][c] = S::load(st_.q + (head0 + i) * d + c * S::W);
      }
      const auto load_k = [&](int t, int j, int i) { load_row(p_.k + slot_off[j] + row_off[i], k[t]); };
      const auto dot = [&](int t, int i) {
        V sum = S::mul(q[i][0], k[t][0]);
        for (int64_t c = 1; c < nv; ++c) sum = S::fma(q[i][c], k[t][c], sum);
        return sum;
      };
      score_quads<HP, kQuad>(dots, j0, m, slot_off, fetch, next_row, load_k, dot);
    }
  }

  // score_heads' key loop: kQuad keys at a time, each head's dots with them reduced by
  // S::quad (or, kQuad 1, stored as they are); load_k(t, j, i) loads key j's row for head i
  // as the quad's t-th, dot(t, i) is head i's dot vector with it.
  template <int HP, int kQuad, class LoadK, class Dot>
  void score_quads(float* dots, int j0, int m, const int64_t* slot_off, bool fetch, const bool* next_row,
                   LoadK&& load_k, Dot&& dot) {
    for (int j = j0; j < j0 + S::W; j += kQuad) {
      const int keys = std::clamp(j0 + m - j, 0, kQuad);  // of this quad's, the rest are past the block
      if (fetch) {
        for (int t = 0; t < keys; ++t) ahead(j + t);
      }
      float* out = dots + (j - j0) / kQuad * S::W;
      for (int i = 0; i < HP; ++i) {
        V v[kQuad];
        if (next_row[i]) {
          for (int t = 0; t < keys; ++t) load_k(t, j + t, i);
        }
        for (int t = 0; t < kQuad; ++t) v[t] = t < keys ? dot(t, i) : S::zero();
        if constexpr (kQuad == 4) {
          S::store(out + i * S::W * S::W, S::quad(v[0], v[1], v[2], v[3]));
        } else {
          S::store(out + i * S::W * S::W, v[0]);
        }
      }
    }
  }

  // Key j + kAhead's K and V rows of the run's kv heads into L1: in this block, or the next.
  [[gnu::always_inline]] void ahead(int j) const {
    far(j);
    const int a = j + kAhead;
    if (a < n_) {
      near_slot(slot_off_cur_[a]);
    } else if (a - n_ < next_n_) {
      near_slot(next_off_[a - n_]);
    }
  }

  // Online softmax of one head over the block: a new running max, the old sums scaled
  // down to it, and the block's scores turned into probabilities (0 past n).
  void softmax(int64_t head, int n) {
    float* s = scores_ + head * kBlock;
    const V scale = S::set1(p_.scale);
    for (int j = 0; j < kBlock; j += S::W) S::store(s + j, S::mul(S::load(s + j), scale));
    std::fill(s + n, s + kBlock, kNegInf);
    V top_v = S::set1(st_.m[head]);
    for (int j = 0; j < kBlock; j += S::W) top_v = S::max(top_v, S::load(s + j));
    const float top = S::reduce_max(top_v);
    const float shrink = std::exp(st_.m[head] - top);  // 0 on the first block (m = -inf)
    st_.m[head] = top;
    for (int j = 0; j < kBlock; j += S::W) S::store(s + j, S::exp(S::sub(S::load(s + j), S::set1(top))));
    std::fill(s + n, s + kBlock, 0.f);
    V total = S::zero();
    for (int j = 0; j < kBlock; j += S::W) total = S::add(total, S::load(s + j));
    st_.l[head] = st_.l[head] * shrink + S::reduce_add(total);
    if (shrink != 1.f) {
      float* acc = st_.acc + head * p_.dim;
      for (int64_t c = 0; c < p_.dim; c += S::W) S::store(acc + c, S::mul(S::load(acc + c), S::set1(shrink)));
    }
  }

  // acc[head] += sum_j p[head][j] * v_j for the query heads of kv head h, up to
  // kHeadsPerPass heads at a time: their accumulators stay in registers over the block
  // and each V row is loaded (and converted) once per pass.
  void accumulate(int64_t h, int n, const int64_t* slot_off) {
    for (int64_t i0 = 0; i0 < p_.group; i0 += kHeadsPerPass) {
      switch (std::min<int64_t>(kHeadsPerPass, p_.group - i0)) {
        case 4: accumulate_heads<4>(h, h * p_.group + i0, n, slot_off); break;
        case 3: accumulate_heads<3>(h, h * p_.group + i0, n, slot_off); break;
        case 2: accumulate_heads<2>(h, h * p_.group + i0, n, slot_off); break;
        default: accumulate_heads<1>(h, h * p_.group + i0, n, slot_off);
      }
    }
  }

  template <int HP>
  void accumulate_heads(int64_t h, int64_t head0, int n, const int64_t* slot_off) {
    const int64_t nv = NV > 0 ? NV : nv_;
    V a[HP][kMaxVecs], vv[kMaxVecs];
    for (int i = 0; i < HP; ++i) {
      for (int64_t c = 0; c < nv; ++c) a[i][c] = S::load(st_.acc + (head0 + i) * p_.dim + c * S::W);
    }
    for (int j = 0; j < n; ++j) {
      if (j + kAhead < n) near(p_.v + slot_off[j + kAhead] + h * p_.dim);
      load_row(p_.v + slot_off[j] + h * p_.dim, vv);
      for (int i = 0; i < HP; ++i) {
        const V pj = S::set1(scores_[(head0 + i) * kBlock + j]);
        for (int64_t c = 0; c < nv; ++c) a[i][c] = S::fma(pj, vv[c], a[i][c]);
      }
    }
    for (int i = 0; i < HP; ++i) {
      for (int64_t c = 0; c < nv; ++c) S::store(st_.acc + (head0 + i) * p_.dim + c * S::W, a[i][c]);
    }
  }

  const Problem<T, KV>& p_;
  const int64_t nv_;
  std::vector<float> scratch_;
  State st_{};
  float* scores_ = nullptr;  // [H, kBlock]: scores, then probabilities
  float* dots_ = nullptr;    // [H, W, W]: per query head, W keys' dot products as quads (score_heads)
  int64_t slot_off_[2][kBlock] = {};  // this block's slots and the next one's
  const T* q_row_ = nullptr;          // the row's query in the input
  int64_t k0_ = 0, k1_ = 0;           // the kv heads of the current run
  int n_ = 0;                         // keys in the current block, and their slots
  const int64_t* slot_off_cur_ = nullptr;
  const int64_t* next_off_ = nullptr;  // the next block's slots, and how many (0: none)
  int next_n_ = 0;
  Far far_{};                      // the rows `far` fetches, a block ahead
  int64_t then_off_[kBlock] = {};  // slots of the next item's first block (`run`'s then)
};

// Where a row's element e lies in a float layout that keeps the pool's order.
struct Natural {
  static int64_t position(int64_t e) { return e; }
};

// out[row] = acc / l per query head in [h0, h1), back in the pool's element order (acc in
// `Layout`: Rows<S, KV> or Natural) and the output dtype.
template <class Layout, class T, class KV>
void write_out(const Problem<T, KV>& p, int64_t row, const float* acc, const float* l, int64_t h0, int64_t h1) {
  T* out = p.out + row * p.heads * p.dim;
  for (int64_t h = h0; h < h1; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;  // a row of no keys gives zeros
    const float* a = acc + h * p.dim;
    for (int64_t e = 0; e < p.dim; ++e) out[h * p.dim + e] = static_cast<T>(a[Layout::position(e)] * inv);
  }
}

// The key chunks of one row's group of kv heads: where their partial results lie (the row's
// chunk slots) and how many are still running (the chunk that brings `pending` to zero merges them).
struct Split {
  int64_t first_chunk = 0;
  int64_t chunks = 1;
  std::unique_ptr<std::atomic<int64_t>> pending;
};

// Partial results of one chunk: acc [H, D], then m [H], then l [H].
inline int64_t partial_width(int64_t heads, int64_t dim) { return heads * (dim + 2); }

// A row's chunks combined by their log-sum-exp for query heads [h0, h1), then written out.
template <class Layout, class T, class KV>
void merge(const Problem<T, KV>& p, const Split& split, int64_t row, const float* partials, float* tmp, int64_t h0,
           int64_t h1) {
  const int64_t h = p.heads, d = p.dim, width = partial_width(h, d);
  const float* first = partials + split.first_chunk * width;
  float* acc = tmp;
  float* l = tmp + h * d;
  std::fill(tmp, tmp + h * d + h, 0.f);
  for (int64_t i = h0; i < h1; ++i) {
    float top = kNegInf;
    for (int64_t c = 0; c < split.chunks; ++c) top = std::max(top, first[c * width + h * d + i]);
    for (int64_t c = 0; c < split.chunks; ++c) {
      const float* part = first + c * width;
      const float w = std::exp(part[h * d + i] - top);
      l[i] += w * part[h * d + h + i];
      for (int64_t e = 0; e < d; ++e) acc[i * d + e] += w * part[i * d + e];
    }
  }
  write_out<Layout>(p, row, acc, l, h0, h1);
}

// The items of a step, longest first (the shared counter then ends on short ones), and in
// `splits` one Split per row and group of kv heads. With fewer key chunks than 4 per thread
// (small batches) every kv head is an item of its own, so a few rows still spread over the
// threads; NOTE: a head's values never depend on that cut (each head's keys are visited in
// the same order, its state is its own), only who computes them.
// Key chunks of a row of `len` keys (at least one).
inline int64_t chunks_of(int64_t len, int64_t chunk) { return std::max<int64_t>(1, (len + chunk - 1) / chunk); }

// Per row and group of kv heads, where its chunks' partial results go and (a row of more
// than one chunk) how many are still to come: splits[b * groups + g].
inline void make_splits(const int64_t* lens, int64_t batch, int64_t chunk, int64_t groups, std::vector<Split>& splits) {
  splits.resize(batch * groups);
  int64_t first_chunk = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = chunks_of(lens[b], chunk);
    for (int64_t g = 0; g < groups; ++g) {
      Split& split = splits[b * groups + g];
      split.first_chunk = first_chunk, split.chunks = n;
      if (n > 1) split.pending = std::make_unique<std::atomic<int64_t>>(n);
    }
    first_chunk += n;
  }
}

inline std::vector<Item> plan(const int64_t* lens, int64_t batch, int64_t chunk, int64_t kv_heads, int threads,
                              std::vector<Split>& splits) {
  int64_t row_chunks = 0;
  for (int64_t b = 0; b < batch; ++b) row_chunks += chunks_of(lens[b], chunk);
  const int64_t groups = row_chunks < 4 * threads ? kv_heads : 1, per = kv_heads / groups;
  make_splits(lens, batch, chunk, groups, splits);
  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t c = 0; c < chunks_of(lens[b], chunk); ++c) {
        items.push_back({b, c, c * chunk, std::min(lens[b], (c + 1) * chunk), g * per, (g + 1) * per, b * groups + g});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.t1 - x.t0 > y.t1 - y.t0; });
  return items;
}

// Chunk slots of partial results a step's splits need (0: no row is cut into chunks).
inline int64_t partial_slots(const std::vector<Split>& splits) {
  const bool cut = std::any_of(splits.begin(), splits.end(), [](const Split& s) { return s.chunks > 1; });
  return cut ? splits.back().first_chunk + splits.back().chunks : 0;
}


// Work item `it` of a step planned by `plan`: its keys through `attender`, then the row
// written out (a row of one chunk) or the chunk's partial result left in `partials`, the
// row's last chunk to finish merging them (the others' results are complete by then).
template <class S, int NV, class T, class KV>
void run_item(const Problem<T, KV>& p, Attender<S, NV, T, KV>& attender, const Item& it, std::vector<Split>& splits,
              float* partials, float* tmp, const Item* then = nullptr) {
  const State& st = attender.run(it, then);
  const int64_t h0 = it.k0 * p.group, h1 = it.k1 * p.group;
  Split& split = splits[it.split];
  if (split.chunks == 1) {
    write_out<Rows<S, KV>>(p, it.row, st.acc, st.l, h0, h1);
    return;
  }
  const int64_t d = p.dim, hd = p.heads * d, width = partial_width(p.heads, d);
  float* dst = partials + (split.first_chunk + it.chunk) * width;  // this item's heads of the chunk's slot
  std::copy(st.acc + h0 * d, st.acc + h1 * d, dst + h0 * d);
  std::copy(st.m + h0, st.m + h1, dst + hd + h0);
  std::copy(st.l + h0, st.l + h1, dst + hd + p.heads + h0);
  if (split.pending->fetch_sub(1, std::memory_order_acq_rel) == 1) merge<Rows<S, KV>>(p, split, it.row, partials, tmp, h0, h1);
}

// The attention variant for head_dim `dim` and pool element type T, as paged_attention.cpp has
// always picked it: the vector code with the register count fixed for head dims 64 and 128
// (any other multiple of the vector span: a loop), else scalar. Calls f(Variant<S, NV>{}).
template <class S_, int NV_>
struct Variant {
  using S = S_;
  static constexpr int NV = NV_;
};

template <class T, class F>
void with_variant(int64_t dim, F&& f) {
  if (dim % Rows<Simd, T>::span == 0) {
    switch (dim / Simd::W) {
      case 64 / Simd::W: f(Variant<Simd, 64 / Simd::W>{}); return;
      case 128 / Simd::W: f(Variant<Simd, 128 / Simd::W>{}); return;
      default: f(Variant<Simd, 0>{}); return;
    }
  }
  f(Variant<Scalar, 0>{});
}

// Every page a row's keys use must be a page of the pool: a bad id would read outside it.
inline void check_pages(const int64_t* pages, const int64_t* lens, int64_t batch, int64_t max_pages, int64_t page_size,
                 int64_t num_pages) {
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_pages * page_size, "paged_attention_decode: row ", b, " has ",
                lens[b], " keys but its page table holds ", max_pages * page_size);
    const int64_t used = (lens[b] + page_size - 1) / page_size;
    for (int64_t i = 0; i < used; ++i) {
      const int64_t page = pages[b * max_pages + i];
      TORCH_CHECK(page >= 0 && page < num_pages, "paged_attention_decode: row ", b, " reads page ", page,
                  " outside the pool's ", num_pages);
    }
  }
}

}  // namespace tierserve_paged
