// Paged decode attention on CPU: one query token per row against that row's keys, read
// from the KV pool's pages where they lie (no gather into contiguous buffers).
//
// A work item is a chunk of a row's keys: every row is cut into chunks of kChunk keys
// (the last one shorter), and the chunk that finishes a row last merges the row's partial
// results with their log-sum-exp, in chunk order. NOTE: the cut depends on the row's own
// length only, never on the batch or the thread count, so a row's output is the same
// whichever rows share its step (batch-invariant, like the torch path it replaces); a
// batch-1 step still spreads a long row over the threads. An item
// walks its keys in blocks, reading each block's slots (all kv heads of a slot lie side
// by side) while the next block is prefetched. The query heads sharing a kv head are done
// together, so each K/V row is loaded once for all of them (grouped-query attention).
// Scores, softmax and output accumulate in float32 with an online (streaming) softmax.
//
// Vector code (paged_attention_vec.h): AVX-512 or AVX2 intrinsics when the compiler
// targets them (-march=native), else a scalar path; a head_dim that is not a multiple of
// the vector span runs scalar.

#include <ATen/Parallel.h>
#include <torch/all.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "paged_attention_vec.h"

namespace {

using tierserve_paged_vec::bf16;
using tierserve_paged_vec::kBf16Dot;
using tierserve_paged_vec::kNegInf;
using tierserve_paged_vec::Rows;
using tierserve_paged_vec::Scalar;
using tierserve_paged_vec::Simd;

constexpr int kBlock = 64;          // keys per softmax update (a multiple of every vector width)
constexpr int64_t kChunk = 128;     // keys per work item (a multiple of kBlock); see the NOTE above
constexpr int64_t kMaxHeadDim = 512;

// What every work item reads; pointers into contiguous tensors.
template <class T>
struct Problem {
  const T* q;            // [B, H, D]
  const T* k;            // [slots, Hkv, D]
  const T* v;
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

template <class S, int NV, class T>
class Attender {
  using V = typename S::V;
  using R = Rows<S, T>;
  static constexpr int64_t kMaxVecs = NV > 0 ? NV : kMaxHeadDim / S::W;
  // Query heads whose accumulators fit in the vector registers beside one V row (32
  // registers with AVX-512, 16 with AVX2); one at a time for head dims of no fixed size.
  static constexpr int kRegisters = S::W == 16 ? 32 : 16;
  static constexpr int kHeadsPerPass = NV > 0 ? std::clamp((kRegisters - 4) / NV - 1, 1, 4) : 1;

 public:
  explicit Attender(const Problem<T>& p) : p_(p), nv_(NV > 0 ? NV : p.dim / S::W) {
    const int64_t h = p.heads, d = p.dim;
    scratch_.assign(2 * h * d + 2 * h + h * kBlock + p.group * S::W * S::W, 0.f);
    float* s = scratch_.data();
    st_ = {s, s + h * d, s + 2 * h * d, s + 2 * h * d + h};
    scores_ = s + 2 * h * d + 2 * h;
    dots_ = scores_ + h * kBlock;
  }

  // Keys [t0, t1) of `row`; leaves the unnormalized state of its heads in the result.
  const State& run(int64_t row, int64_t t0, int64_t t1) {
    start(row);
    int cur = 0;
    slots(row, t0, block_len(t0, t1), slot_off_[cur]);
    for (int64_t t = t0; t < t1; t += kBlock, cur ^= 1) {
      if (t + kBlock < t1) {  // the next block's rows are fetched while this one computes
        const int n = block_len(t + kBlock, t1);
        slots(row, t + kBlock, n, slot_off_[cur ^ 1]);
        prefetch(slot_off_[cur ^ 1], n);
      }
      block(block_len(t, t1), slot_off_[cur]);
    }
    return st_;
  }

 private:
  static int block_len(int64_t t, int64_t t1) { return static_cast<int>(std::min<int64_t>(kBlock, t1 - t)); }

  void start(int64_t row) {
    const int64_t d = p_.dim, hd = p_.heads * d;
    q_row_ = p_.q + row * hd;
    if constexpr (!kBf16Dot<S, T>) {
      for (int64_t h = 0; h < p_.heads; ++h) {
        for (int64_t e = 0; e < d; ++e) st_.q[h * d + R::position(e)] = static_cast<float>(q_row_[h * d + e]);
      }
    }
    std::fill(st_.acc, st_.acc + hd, 0.f);
    std::fill(st_.m, st_.m + p_.heads, kNegInf);
    std::fill(st_.l, st_.l + p_.heads, 0.f);
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

  // Software prefetch of a block's slots (K and V): they lie on scattered pages, in runs
  // too short for the hardware prefetchers to pick up in time.
  void prefetch(const int64_t* slot_off, int n) const {
    const int64_t bytes = p_.kv_heads * p_.dim * static_cast<int64_t>(sizeof(T));
    for (int j = 0; j < n; ++j) {
      const char* k = reinterpret_cast<const char*>(p_.k + slot_off[j]);
      const char* v = reinterpret_cast<const char*>(p_.v + slot_off[j]);
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(k + b);
        __builtin_prefetch(v + b);
      }
    }
  }

  void block(int n, const int64_t* slot_off) {
    for (int64_t h = 0; h < p_.kv_heads; ++h) {
      score(h, n, slot_off);
      for (int64_t i = 0; i < p_.group; ++i) softmax(h * p_.group + i, n);
      accumulate(h, n, slot_off);
    }
  }

  void load_row(const T* row, V* out) const {
    const int64_t nv = NV > 0 ? NV : nv_;
    for (int64_t c = 0; c < nv; c += R::vecs) R::load(row + c * S::W, out + c);
  }

  // scores[head][j] = q_head . k_j for the query heads of kv head h: each key is loaded
  // once for all of them; W keys' dot vectors are summed at once.
  void score(int64_t h, int n, const int64_t* slot_off) {
    const int64_t g = p_.group, d = p_.dim, nv = NV > 0 ? NV : nv_;
    V kv[kMaxVecs];
    for (int j0 = 0; j0 < n; j0 += S::W) {
      for (int jj = 0; jj < S::W; ++jj) {
        if (j0 + jj >= n) {  // past the block's keys: sums of zeros, overwritten in softmax
          for (int64_t i = 0; i < g; ++i) S::store(dots_ + (i * S::W + jj) * S::W, S::zero());
          continue;
        }
        const T* k = p_.k + slot_off[j0 + jj] + h * d;
        if constexpr (kBf16Dot<S, T>) {
          for (int64_t i = 0; i < g; ++i) {
            S::store(dots_ + (i * S::W + jj) * S::W, S::dot_bf16(q_row_ + (h * g + i) * d, k, nv / 2));
          }
          continue;
        }
        load_row(k, kv);
        for (int64_t i = 0; i < g; ++i) {
          const float* q = st_.q + (h * g + i) * d;
          V dot = S::mul(S::load(q), kv[0]);
          for (int64_t c = 1; c < nv; ++c) dot = S::fma(S::load(q + c * S::W), kv[c], dot);
          S::store(dots_ + (i * S::W + jj) * S::W, dot);
        }
      }
      for (int64_t i = 0; i < g; ++i) S::sums(dots_ + i * S::W * S::W, scores_ + (h * g + i) * kBlock + j0);
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

  const Problem<T>& p_;
  const int64_t nv_;
  std::vector<float> scratch_;
  State st_{};
  float* scores_ = nullptr;  // [H, kBlock]: scores, then probabilities
  float* dots_ = nullptr;    // [G, W, W]: W keys' unsummed dot products per query head
  int64_t slot_off_[2][kBlock] = {};  // this block's slots and the next one's
  const T* q_row_ = nullptr;          // the row's query in the input
};

// out[row] = acc / l per head, back in the pool's element order and the output dtype.
template <class S, class T>
void write_out(const Problem<T>& p, int64_t row, const float* acc, const float* l) {
  T* out = p.out + row * p.heads * p.dim;
  for (int64_t h = 0; h < p.heads; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;  // a row of no keys gives zeros
    const float* a = acc + h * p.dim;
    for (int64_t e = 0; e < p.dim; ++e) out[h * p.dim + e] = static_cast<T>(a[Rows<S, T>::position(e)] * inv);
  }
}

// The key chunks of one row: where their partial results lie and how many are still
// running (the chunk that brings `pending` to zero merges them).
struct Split {
  int64_t first_item = 0;
  int64_t chunks = 1;
  std::unique_ptr<std::atomic<int64_t>> pending;
};

// Partial results of one chunk: acc [H, D], then m [H], then l [H].
inline int64_t partial_width(int64_t heads, int64_t dim) { return heads * (dim + 2); }

// A row's chunks combined by their log-sum-exp, then written out.
template <class S, class T>
void merge(const Problem<T>& p, const Split& split, int64_t row, const float* partials, float* tmp) {
  const int64_t h = p.heads, d = p.dim, width = partial_width(h, d);
  const float* first = partials + split.first_item * width;
  float* acc = tmp;
  float* l = tmp + h * d;
  std::fill(tmp, tmp + h * d + h, 0.f);
  for (int64_t i = 0; i < h; ++i) {
    float top = kNegInf;
    for (int64_t c = 0; c < split.chunks; ++c) top = std::max(top, first[c * width + h * d + i]);
    for (int64_t c = 0; c < split.chunks; ++c) {
      const float* part = first + c * width;
      const float w = std::exp(part[h * d + i] - top);
      l[i] += w * part[h * d + h + i];
      for (int64_t e = 0; e < d; ++e) acc[i * d + e] += w * part[i * d + e];
    }
  }
  write_out<S>(p, row, acc, l);
}

struct Item {
  int64_t row, chunk, t0, t1;
};

// The items of a step, longest first (the shared counter then ends on short ones).
std::vector<Item> plan(const int64_t* lens, int64_t batch, int64_t chunk, std::vector<Split>& splits) {
  std::vector<Item> items;
  splits.resize(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = std::max<int64_t>(1, (lens[b] + chunk - 1) / chunk);
    splits[b].first_item = static_cast<int64_t>(items.size());
    splits[b].chunks = n;
    if (n > 1) splits[b].pending = std::make_unique<std::atomic<int64_t>>(n);
    for (int64_t c = 0; c < n; ++c) items.push_back({b, c, c * chunk, std::min(lens[b], (c + 1) * chunk)});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.t1 - x.t0 > y.t1 - y.t0; });
  return items;
}

template <class S, int NV, class T>
void attend(const Problem<T>& p, int64_t batch) {
  const int threads = at::get_num_threads();
  std::vector<Split> splits;
  const std::vector<Item> items = plan(p.lens, batch, kChunk, splits);
  const int64_t width = partial_width(p.heads, p.dim), count = static_cast<int64_t>(items.size());
  // Split rows' chunks leave their results here, at their row's first_item + chunk.
  std::vector<float> partials(count > batch ? count * width : 0);
  std::atomic<int64_t> next{0};
  // One task per thread, each taking items off a shared counter: rows of very different
  // lengths still spread evenly over the threads.
  at::parallel_for(0, std::min<int64_t>(threads, count), 1, [&](int64_t lo, int64_t hi) {
    Attender<S, NV, T> attender(p);
    std::vector<float> tmp(width);
    for (int64_t task = lo; task < hi; ++task) {
      for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
        const Item& it = items[i];
        const State& st = attender.run(it.row, it.t0, it.t1);
        Split& split = splits[it.row];
        if (split.chunks == 1) {
          write_out<S>(p, it.row, st.acc, st.l);
          continue;
        }
        const int64_t hd = p.heads * p.dim;
        float* dst = partials.data() + (split.first_item + it.chunk) * width;
        std::copy(st.acc, st.acc + hd, dst);
        std::copy(st.m, st.m + p.heads, dst + hd);
        std::copy(st.l, st.l + p.heads, dst + hd + p.heads);
        if (split.pending->fetch_sub(1, std::memory_order_acq_rel) == 1) {
          merge<S>(p, split, it.row, partials.data(), tmp.data());
        }
      }
    }
  });
}

template <class S, class T>
void dispatch_dim(const Problem<T>& p, int64_t batch) {
  switch (p.dim / S::W) {
    case 64 / S::W: attend<S, 64 / S::W, T>(p, batch); break;
    case 128 / S::W: attend<S, 128 / S::W, T>(p, batch); break;
    default: attend<S, 0, T>(p, batch);
  }
}

template <class T>
void dispatch(const Problem<T>& p, int64_t batch) {
  if (p.dim % Rows<Simd, T>::span == 0) {
    dispatch_dim<Simd, T>(p, batch);
  } else {
    attend<Scalar, 0, T>(p, batch);
  }
}

// Every page a row's keys use must be a page of the pool: a bad id would read outside it.
void check_pages(const int64_t* pages, const int64_t* lens, int64_t batch, int64_t max_pages, int64_t page_size,
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

at::Tensor paged_attention_decode(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table_in, const at::Tensor& seq_lens_in, int64_t page_size,
                                  double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "paged_attention_decode: q [B, H, D], k_cache and v_cache [slots, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention_decode: k_cache and v_cache differ in shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention_decode: the pool must be contiguous");
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_attention_decode: float32 or bfloat16, not ", dtype);
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "paged_attention_decode: q, k_cache and v_cache must share a dtype");
  const int64_t batch = q_in.size(0), heads = q_in.size(1), dim = q_in.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && dim > 0 && dim <= kMaxHeadDim, "paged_attention_decode: head_dim ", dim,
              " must match the pool's and be at most ", kMaxHeadDim);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_attention_decode: ", heads, " query heads over ",
              kv_heads, " kv heads");
  TORCH_CHECK(page_size > 0 && k_cache.size(0) % page_size == 0, "paged_attention_decode: bad page_size ", page_size);
  TORCH_CHECK(page_table_in.dim() == 2 && page_table_in.size(0) == batch && page_table_in.scalar_type() == at::kLong,
              "paged_attention_decode: page_table must be int64 [B, max_pages]");
  TORCH_CHECK(seq_lens_in.dim() == 1 && seq_lens_in.size(0) == batch && seq_lens_in.scalar_type() == at::kLong,
              "paged_attention_decode: seq_lens must be int64 [B]");
  const at::Tensor q = q_in.contiguous(), page_table = page_table_in.contiguous(), seq_lens = seq_lens_in.contiguous();
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  if (batch == 0) return out;
  const int64_t max_pages = page_table.size(1);
  check_pages(page_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), batch, max_pages, page_size,
              k_cache.size(0) / page_size);
  AT_DISPATCH_SWITCH(dtype, "paged_attention_decode",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      Problem<float> p{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                       page_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                       max_pages, page_size, heads, kv_heads, dim, heads / kv_heads, static_cast<float>(scale)};
      dispatch(p, batch);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      Problem<bf16> p{q.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(),
                      page_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<bf16>(),
                      max_pages, page_size, heads, kv_heads, dim, heads / kv_heads, static_cast<float>(scale)};
      dispatch(p, batch);
    }));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_lens, "
        "int page_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) { m.impl("paged_attention_decode", &paged_attention_decode); }
