// Paged decode attention on CPU: one query token per row against that row's keys, read
// from the KV pool's pages where they lie (no gather into contiguous buffers).
//
// A work item is a chunk of a row's keys: every row is cut into chunks of kChunk keys (the
// last one shorter), and the chunk that finishes a row last merges the row's partial results
// with their log-sum-exp, in chunk order. NOTE: the key cut depends on the row's own length
// only, never on the batch or the thread count, so a row's output is the same whichever rows
// share its step (batch-invariant, like the torch path it replaces); a batch-1 step still
// spreads a long row over the threads. At small batches an item is also one kv head's part
// of a chunk (each head merged on its own), which changes no value: a head's keys are
// visited in the same order either way. An item walks its keys in blocks, reading each
// block's slots while the next block is prefetched. The query heads sharing a kv head are
// done together, so each K/V row is loaded once for all of them (grouped-query attention).
// Scores, softmax and output accumulate in float32 with an online (streaming) softmax.
//
// Vector code (paged_attention_vec.h): AVX-512 or AVX2 intrinsics when the compiler
// targets them (-march=native), else a scalar path; a head_dim that is not a multiple of
// the vector span runs scalar. The pool holds the query's dtype (float32, bfloat16) or,
// under a float32 query, float16 (cache.kv_dtype): its rows widened to float32 as loaded.
//
// `paged_attention_chained` takes the same problem in deterministic mode's arithmetic
// (chained_attention.h), where a request's consecutive rows (a prefill chunk) form tiles.

#include <ATen/Parallel.h>
#include <torch/all.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <tuple>
#include <type_traits>
#include <vector>

#include "chained_attention.h"
#include "paged_attention_core.h"

namespace {

using namespace tierserve_paged;

template <class S, int NV, class T, class KV>
void attend(const Problem<T, KV>& p, int64_t batch) {
  const int threads = at::get_num_threads();
  std::vector<Split> splits;
  const std::vector<Item> items = plan(p.lens, batch, kChunk, p.kv_heads, threads, splits);
  const int64_t width = partial_width(p.heads, p.dim), count = static_cast<int64_t>(items.size());
  // Split rows' chunks leave their results here, at their row's first_chunk + chunk.
  std::vector<float> partials(partial_slots(splits) * width);
  std::atomic<int64_t> next{0};
  // One task per thread, each taking items off a shared counter: rows of very different
  // lengths still spread evenly over the threads.
  at::parallel_for(0, std::min<int64_t>(threads, count), 1, [&](int64_t lo, int64_t hi) {
    Attender<S, NV, T, KV> attender(p);
    std::vector<float> tmp(width);
    for (int64_t task = lo; task < hi; ++task) {
      for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
        run_item(p, attender, items[i], splits, partials.data(), tmp.data());
      }
    }
  });
}

template <class T, class KV>
void dispatch(const Problem<T, KV>& p, int64_t batch) {
  with_variant<KV>(p.dim, [&](auto variant) {
    using V = decltype(variant);
    attend<typename V::S, V::NV, T, KV>(p, batch);
  });
}

template <class T, class KV>
void chained(const Problem<T, KV>& p, int64_t batch) {
  using S = tierserve_paged_vec::Simd;
  namespace chain = tierserve_chained;
  const int threads = at::get_num_threads();
  const std::vector<chain::Tile> tiles = chain::tiles_of(p.pages, p.lens, batch, p.max_pages, p.page_size);
  std::vector<Split> splits;
  const std::vector<Item> items = chain::plan(tiles, p.lens, batch, p.kv_heads, threads, splits);
  const int64_t groups = static_cast<int64_t>(splits.size()) / batch;  // 0: whole tiles, no splits
  const int64_t width = partial_width(p.heads, p.dim), count = static_cast<int64_t>(items.size());
  std::vector<float> partials(partial_slots(splits) * width);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, count), 1, [&](int64_t lo, int64_t hi) {
    chain::Attender<S, T, KV> attender(p);
    std::vector<float> tmp(width);
    for (int64_t task = lo; task < hi; ++task) {
      for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
        attender.run(items[i], tiles, splits, groups, partials.data(), tmp.data());
      }
    }
  });
}

// The checks both ops make, then f(problem, batch) on the pool's element type; the output.
template <class F>
at::Tensor attention(const char* op, const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& page_table_in, const at::Tensor& seq_lens_in, int64_t page_size, double scale,
                     F&& f) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              op, ": q [B, H, D], k_cache and v_cache [slots, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), op, ": k_cache and v_cache differ in shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": the pool must be contiguous");
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": float32 or bfloat16, not ", dtype);
  const auto kv_dtype = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv_dtype && (kv_dtype == dtype || (dtype == at::kFloat && kv_dtype == at::kHalf)),
              op, ": k_cache and v_cache must have q's dtype (or float16 under float32 q)");
  const int64_t batch = q_in.size(0), heads = q_in.size(1), dim = q_in.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && dim > 0 && dim <= kMaxHeadDim, op, ": head_dim ", dim,
              " must match the pool's and be at most ", kMaxHeadDim);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, op, ": ", heads, " query heads over ", kv_heads, " kv heads");
  TORCH_CHECK(page_size > 0 && k_cache.size(0) % page_size == 0, op, ": bad page_size ", page_size);
  TORCH_CHECK(page_table_in.dim() == 2 && page_table_in.size(0) == batch && page_table_in.scalar_type() == at::kLong,
              op, ": page_table must be int64 [B, max_pages]");
  TORCH_CHECK(seq_lens_in.dim() == 1 && seq_lens_in.size(0) == batch && seq_lens_in.scalar_type() == at::kLong,
              op, ": seq_lens must be int64 [B]");
  const at::Tensor q = q_in.contiguous(), page_table = page_table_in.contiguous(), seq_lens = seq_lens_in.contiguous();
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  if (batch == 0) return out;
  const int64_t max_pages = page_table.size(1);
  check_pages(page_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), batch, max_pages, page_size,
              k_cache.size(0) / page_size);
  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op_) {
    using T = std::remove_pointer_t<decltype(qp)>;
    using KV = std::remove_pointer_t<decltype(kp)>;
    const Problem<T, KV> p{qp, kp, vp, page_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), op_, max_pages,
                           page_size, heads, kv_heads, dim, heads / kv_heads, static_cast<float>(scale)};
    f(p, batch);
  };
  if (kv_dtype == at::kHalf) {
    run(q.data_ptr<float>(), k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>(), out.data_ptr<float>());
  } else if (dtype == at::kFloat) {
    run(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>());
  } else {
    run(q.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), out.data_ptr<bf16>());
  }
  return out;
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table, const at::Tensor& seq_lens, int64_t page_size,
                                  double scale) {
  return attention("paged_attention_decode", q, k_cache, v_cache, page_table, seq_lens, page_size, scale,
                   [](const auto& p, int64_t batch) { dispatch(p, batch); });
}

// Deterministic mode's form (chained_attention.h): the same problem, rows of one request
// at consecutive positions (a prefill chunk's tokens) computed as tiles.
at::Tensor paged_attention_chained(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& page_table, const at::Tensor& seq_lens, int64_t page_size,
                                   double scale) {
  return attention("paged_attention_chained", q, k_cache, v_cache, page_table, seq_lens, page_size, scale,
                   [](const auto& p, int64_t batch) { chained(p, batch); });
}

// torch's floor division (`//`) of an int64 by a positive divisor.
inline int64_t floor_div(int64_t v, int64_t d) { return v >= 0 ? v / d : -((-v + d - 1) / d); }

// A decode-only step's metadata from the request table, as the torch ops of
// gpu/attention/paged_decode.py compute it, in one call: each row's new KV slot
// (req_to_token[row, pos]), its page table (each page's first slot // page_size, for the
// pages of the longest row's keys [0, max pos]) and its key count (pos + 1).
std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_decode_slots(const at::Tensor& req_to_token,
                                                                  const at::Tensor& rows_in,
                                                                  const at::Tensor& positions_in, int64_t page_size) {
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kLong && req_to_token.is_contiguous(),
              "paged_decode_slots: req_to_token must be contiguous int64 [rows, context]");
  TORCH_CHECK(rows_in.dim() == 1 && positions_in.dim() == 1 && rows_in.size(0) == positions_in.size(0) &&
                  rows_in.scalar_type() == at::kLong && positions_in.scalar_type() == at::kLong,
              "paged_decode_slots: rows and positions must be int64 [B]");
  TORCH_CHECK(page_size > 0, "paged_decode_slots: bad page_size ", page_size);
  const at::Tensor rows = rows_in.contiguous(), positions = positions_in.contiguous();
  const int64_t batch = rows.size(0), table_rows = req_to_token.size(0), width = req_to_token.size(1);
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t keys = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(row[b] >= 0 && row[b] < table_rows, "paged_decode_slots: row ", row[b], " outside the table");
    TORCH_CHECK(pos[b] >= 0 && pos[b] < width, "paged_decode_slots: position ", pos[b], " outside the context");
    keys = std::max(keys, pos[b] + 1);
  }
  const int64_t pages = (keys + page_size - 1) / page_size;
  const auto opts = rows.options();
  at::Tensor out_loc = at::empty({batch}, opts), page_table = at::empty({batch, pages}, opts);
  at::Tensor seq_lens = at::empty({batch}, opts);
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  int64_t* loc = out_loc.data_ptr<int64_t>();
  int64_t* pt = page_table.data_ptr<int64_t>();
  int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* slots = table + row[b] * width;
    loc[b] = slots[pos[b]];
    lens[b] = pos[b] + 1;
    for (int64_t i = 0; i < pages; ++i) pt[b * pages + i] = floor_div(slots[i * page_size], page_size);
  }
  return {out_loc, page_table, seq_lens};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_lens, "
        "int page_size, float scale) -> Tensor");
  m.def("paged_attention_chained(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_lens, "
        "int page_size, float scale) -> Tensor");
  m.def("paged_decode_slots(Tensor req_to_token, Tensor rows, Tensor positions, int page_size) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("paged_attention_chained", &paged_attention_chained);
  m.impl("paged_decode_slots", &paged_decode_slots);
}
