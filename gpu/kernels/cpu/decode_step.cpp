// A Llama-family (Llama, Qwen2) decode step in one native call: embedding, every layer's norm, qkv, RoPE, KV
// write, attention, o_proj and residual, norm, gate_up, SiLU * up, down and residual, then
// the final norm and the head, run by one OpenMP team (one parallel region per step; the
// threads meet at five barriers a layer, one after each phase: qkv with RoPE and the KV
// write, attention, o_proj, gate_up, down; inside a phase each works through its own share
// and then steals what is left of the others'). It is the CPU counterpart of graph replay: a
// torch-path decode step is ~10 ops a layer, each a Python dispatch and a fork/join of the
// intra-op threads, and at batch 1 those cost more than reading the weights.
//
// NOTE: bit-identical to the torch path with the C++ kernels (gpu/models/llama.py with
// model.cpu_kernels on) for every batch that path runs on the quantized kernels: each
// stage is the same inner code (quant_gemv_core.h, paged_attention_core.h or, under
// deterministic mode's backend, chained_attention.h: `set_chained`, llama_glue_core.h) on
// the same inputs, rounding where that path rounds, and a row's
// result never depends on how a stage's work is cut among the threads. What differs is
// only who computes what and when: norms and activation conversions are computed by every
// thread for itself (cheaper than a barrier), residual adds happen in the epilogue of the
// matmul that produces the update, SiLU * up in the epilogue of gate_up.
//
// One LlamaDecoder per model and KV pool (torch.classes.tierserve_cpu.LlamaDecoder), built
// once from the very weight and pool tensors the torch path uses (no copies); `step` runs
// one decode step (its scratch allocated per step), `steps_argmax` a decode run of k greedy
// steps, each one `step_argmax` of its own inputs (kernel/scheduling/decode_runs.py). NOTE: one thread (the device thread)
// calls a decoder at a time: a step writes the KV pool, as the torch path's steps do.

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/all.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "argmax_core.h"
#include "chained_attention.h"
#include "llama_glue_core.h"
#include "paged_attention_core.h"
#include "quant_gemv_core.h"

namespace {

namespace gemv = tierserve_gemv;
namespace paged = tierserve_paged;
namespace chain = tierserve_chained;
namespace glue = tierserve_glue;
namespace argmax = tierserve_argmax;

enum Kind : int64_t { kInt8 = 1, kQ4 = 2 };  // the weight formats of quant_gemv_core.h

struct Linear {
  int64_t kind = 0, n = 0, k = 0, stride = 0;
  at::Tensor weight, scales;  // held: the decoder reads them by pointer
  const uint8_t* w = nullptr;
  const float* s = nullptr;
};

struct Layer {
  at::Tensor input_norm, post_norm, qkv_bias, k_pool, v_pool;  // qkv_bias: empty, or [qkv rows]
  Linear qkv, o, gate_up, down;
};

// [begin, end) of `count` work units for thread t of `threads`: contiguous, balanced.
inline std::pair<int64_t, int64_t> share(int64_t count, int t, int threads) {
  return {count * t / threads, count * (t + 1) / threads};
}

// The element type of a compute dtype: glue's storage view and the matmul / attention one.
// kv: the KV pool's element type (the compute dtype's, or float16 under float32 compute).
struct F32Types {
  using glue_t = glue::F32;
  using elem = float;
  using kv = float;
};
struct F32HalfKVTypes {
  using glue_t = glue::F32;
  using elem = float;
  using kv = c10::Half;
};
struct BF16Types {
  using glue_t = glue::BF16;
  using elem = c10::BFloat16;
  using kv = c10::BFloat16;
};

class LlamaDecoder : public torch::CustomClassHolder {
 public:
  // dims: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, page_size.
  // scale: the attention's (the torch path's SDPA default, head_dim ** -0.5, as it computes it).
  LlamaDecoder(std::vector<int64_t> dims, double eps, double scale, at::Tensor embed, at::Tensor rope,
               at::Tensor final_norm)
      : eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)), embed_(std::move(embed)), rope_(std::move(rope)), final_norm_(std::move(final_norm)) {
    TORCH_CHECK(dims.size() == 8, "LlamaDecoder: dims are layers, hidden, heads, kv_heads, head_dim, intermediate, "
                "vocab, page_size");
    num_layers_ = dims[0], hidden_ = dims[1], heads_ = dims[2], kv_heads_ = dims[3], dim_ = dims[4];
    inter_ = dims[5], vocab_ = dims[6], page_size_ = dims[7];
    dtype_ = embed_.scalar_type();
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "LlamaDecoder: float32 or bfloat16, not ", dtype_);
    TORCH_CHECK(heads_ > 0 && kv_heads_ > 0 && heads_ % kv_heads_ == 0 && dim_ % 2 == 0 && dim_ <= paged::kMaxHeadDim,
                "LlamaDecoder: ", heads_, " heads over ", kv_heads_, " kv heads of dim ", dim_);
    TORCH_CHECK(hidden_ % gemv::kGroup == 0 && inter_ % gemv::kTile == 0 && (heads_ * dim_) % gemv::kGroup == 0 &&
                    dim_ % gemv::kTile == 0,
                "LlamaDecoder: hidden and heads * head_dim must be multiples of 32, intermediate and head_dim of 16");
    check_vector(embed_, vocab_ * hidden_, "embed");
    TORCH_CHECK(rope_.dim() == 2 && rope_.size(1) == dim_ && rope_.is_contiguous() && rope_.scalar_type() == dtype_,
                "LlamaDecoder: rope must be [positions, head_dim] (cos | sin) in the compute dtype");
    check_vector(final_norm_, hidden_, "final_norm");
  }

  // Layer i's weights (in order); kinds/weights/scales: qkv, o, gate_up, down; qkv_bias
  // empty (Llama) or the fused q | k | v bias (Qwen2).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<int64_t> kinds, std::vector<at::Tensor> weights,
                 std::vector<at::Tensor> scales, at::Tensor qkv_bias, at::Tensor k_pool, at::Tensor v_pool) {
    TORCH_CHECK(static_cast<int64_t>(layers_.size()) < num_layers_, "LlamaDecoder: more layers than ", num_layers_);
    TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && scales.size() == 4, "LlamaDecoder: four linears a layer");
    check_vector(input_norm, hidden_, "input_norm");
    check_vector(post_norm, hidden_, "post_norm");
    if (layers_.empty()) kv_dtype_ = k_pool.scalar_type();
    const bool kv_ok = kv_dtype_ == dtype_ || (dtype_ == at::kFloat && kv_dtype_ == at::kHalf);
    for (const at::Tensor* pool : {&k_pool, &v_pool}) {
      TORCH_CHECK(pool->dim() == 3 && pool->size(1) == kv_heads_ && pool->size(2) == dim_ && pool->is_contiguous() &&
                      kv_ok && pool->scalar_type() == kv_dtype_ && pool->size(0) % page_size_ == 0,
                  "LlamaDecoder: a KV pool must be [slots, kv_heads, head_dim] in the compute dtype (or float16 "
                  "under float32), the same for every layer");
    }
    Layer layer;
    layer.input_norm = input_norm, layer.post_norm = post_norm, layer.k_pool = k_pool, layer.v_pool = v_pool;
    const int64_t qkv_n = (heads_ + 2 * kv_heads_) * dim_;
    if (qkv_bias.numel() > 0) check_vector(qkv_bias, qkv_n, "qkv_bias");
    layer.qkv_bias = qkv_bias;
    layer.qkv = linear(kinds[0], weights[0], scales[0], qkv_n, hidden_);
    layer.o = linear(kinds[1], weights[1], scales[1], hidden_, heads_ * dim_);
    layer.gate_up = linear(kinds[2], weights[2], scales[2], 2 * inter_, hidden_);
    layer.down = linear(kinds[3], weights[3], scales[3], hidden_, inter_);
    layers_.push_back(std::move(layer));
  }

  void set_head(int64_t kind, at::Tensor weight, at::Tensor scales) { head_ = linear(kind, weight, scales, vocab_, hidden_); }

  // Attention in the chained form (chained_attention.h: deterministic mode's, which its
  // prefill runs too) instead of the paged decode kernel's.
  void set_chained(bool chained) { chained_ = chained; }

  // One decode step of B rows: ids, positions, out_loc (each row's new KV slot) [B],
  // page_table [B, pages], seq_lens [B] (keys, the new one included), logit_rows [R]
  // (rows of the batch whose logits are returned) -> float32 logits [R, vocab].
  at::Tensor step(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& out_loc,
                  const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& logit_rows) {
    return std::get<0>(forward(ids, positions, out_loc, page_table, seq_lens, logit_rows, false));
  }

  // `step`, and each logit row's argmax (int64 [R]: what `argmax(dim=-1)` of the logits
  // gives), found by the head's threads over the tiles each computed, while the logits are
  // still in their caches (a greedy pick after the step reads them back cold).
  std::tuple<at::Tensor, at::Tensor> step_argmax(const at::Tensor& ids, const at::Tensor& positions,
                                                 const at::Tensor& out_loc, const at::Tensor& page_table,
                                                 const at::Tensor& seq_lens, const at::Tensor& logit_rows) {
    return forward(ids, positions, out_loc, page_table, seq_lens, logit_rows, true);
  }

  // `steps` greedy decode steps of B rows back to back, each row's pick the input of its
  // next step: ids and positions [B] are the first step's, page_table [B, pages] reaches
  // the last step's key (position + steps - 1). Each step's KV slot is its position's
  // place in the row's pages (where the paged attention reads that key back) -> the
  // picks, int64 [B, done]. Every step is `step_argmax` of its own inputs: a run's
  // tokens are the ones B single steps would pick. interrupts (int64 [2]): a counter
  // another thread may bump while the run goes on (a request arrived), and its value when
  // the run was planned; once they differ, the run ends after the step under way (done <
  // steps; the first step always runs), even for a bump made before the run started.
  // stops (int64 [B, S], -1 padded): each row's tokens that end its request; the run also
  // ends after a step where a row picks one (its request is done: report it now).
  // temperature (float32 [B], or empty: every row greedy) and noise (float32 [steps, B,
  // vocab], or empty): a row of temperature > 0 draws by Gumbel-max instead, its pick at
  // step s the first index of max(logits / temperature + noise[s, b]), each operation
  // rounded to float32 on its own, as gpu/sampling.py's `_draw` computes it.
  at::Tensor steps_argmax(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& page_table,
                          int64_t steps, const at::Tensor& interrupts, const at::Tensor& stops,
                          const at::Tensor& temperature, const at::Tensor& noise) {
    const int64_t batch = ids.size(0), width = page_table.size(1);
    TORCH_CHECK(steps >= 1, "LlamaDecoder.steps_argmax: steps must be >= 1, got ", steps);
    TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && positions.size(0) == batch && ids.scalar_type() == at::kLong &&
                    positions.scalar_type() == at::kLong && page_table.dim() == 2 && page_table.size(0) == batch &&
                    page_table.scalar_type() == at::kLong && page_table.is_contiguous(),
                "LlamaDecoder.steps_argmax: ids and positions int64 [B], page_table contiguous int64 [B, pages]");
    TORCH_CHECK(interrupts.numel() == 2 && interrupts.scalar_type() == at::kLong && interrupts.is_contiguous(),
                "LlamaDecoder.steps_argmax: interrupts must be two int64s (the counter, its value at planning)");
    TORCH_CHECK(stops.dim() == 2 && stops.size(0) == batch && stops.scalar_type() == at::kLong && stops.is_contiguous(),
                "LlamaDecoder.steps_argmax: stops must be contiguous int64 [B, S]");
    const bool draws = temperature.numel() > 0;
    TORCH_CHECK(!draws || (temperature.dim() == 1 && temperature.size(0) == batch && temperature.scalar_type() == at::kFloat &&
                           temperature.is_contiguous() && noise.dim() == 3 && noise.size(0) == steps &&
                           noise.size(1) == batch && noise.size(2) == vocab_ && noise.scalar_type() == at::kFloat &&
                           noise.is_contiguous()),
                "LlamaDecoder.steps_argmax: temperature float32 [B] and noise contiguous float32 [steps, B, vocab], "
                "or both empty");
    const float* temp = draws ? temperature.data_ptr<float>() : nullptr;
    std::vector<float> scores(draws ? vocab_ : 0);
    const int64_t* stop = stops.data_ptr<int64_t>();
    const int64_t per_row = stops.size(1);
    at::Tensor input = ids.contiguous().clone(), pos = positions.contiguous().clone();
    at::Tensor loc = at::empty_like(pos), lens = at::empty_like(pos), rows = at::arange(batch, pos.options());
    at::Tensor picks = at::empty({batch, steps}, pos.options());
    int64_t* in = input.data_ptr<int64_t>();
    int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* table = page_table.data_ptr<int64_t>();
    const int64_t* bumps = interrupts.data_ptr<int64_t>();
    const int64_t seen = __atomic_load_n(bumps + 1, __ATOMIC_ACQUIRE);
    int64_t done = 0;
    bool stopped = false;  // a row picked one of its stop tokens
    for (; done < steps && !stopped && (done == 0 || __atomic_load_n(bumps, __ATOMIC_ACQUIRE) == seen); ++done) {
      for (int64_t b = 0; b < batch; ++b) {
        TORCH_CHECK(p[b] >= 0 && p[b] / page_size_ < width, "LlamaDecoder.steps_argmax: position ", p[b],
                    " outside the row's ", width, " pages");
        loc.data_ptr<int64_t>()[b] = table[b * width + p[b] / page_size_] * page_size_ + p[b] % page_size_;
        lens.data_ptr<int64_t>()[b] = p[b] + 1;
      }
      const auto [logits, picked] = forward(input, pos, loc, page_table, lens, rows, true);
      for (int64_t b = 0; b < batch; ++b) {
        in[b] = picked.data_ptr<int64_t>()[b];
        if (draws && temp[b] > 0.0f) in[b] = draw(logits.data_ptr<float>() + b * vocab_, temp[b],
                                                  noise.data_ptr<float>() + (done * batch + b) * vocab_, scores.data());
        picks.data_ptr<int64_t>()[b * steps + done] = in[b];
        ++p[b];
        for (int64_t j = 0; j < per_row; ++j) stopped = stopped || stop[b * per_row + j] == in[b];
      }
    }
    return picks.narrow(1, 0, done).contiguous();
  }

 private:
  // Gumbel-max: the first index of max(logits / t + noise) (gpu/sampling.py `_draw` on a row
  // that only has a temperature): the division and the sum each rounded to float32, in that
  // order, as torch does them one tensor op at a time (the build never contracts them).
  int64_t draw(const float* logits, float t, const float* noise, float* scores) const {
    for (int64_t v = 0; v < vocab_; ++v) {
      const float tempered = logits[v] / t;
      scores[v] = tempered + noise[v];
    }
    return tierserve_argmax::argmax_row(scores, vocab_);
  }

  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& ids, const at::Tensor& positions,
                                             const at::Tensor& out_loc, const at::Tensor& page_table,
                                             const at::Tensor& seq_lens, const at::Tensor& logit_rows, bool pick) {
    TORCH_CHECK(static_cast<int64_t>(layers_.size()) == num_layers_ && head_.kind != 0, "LlamaDecoder: not fully built");
    const int64_t batch = ids.size(0);
    for (const at::Tensor* t : {&ids, &positions, &out_loc, &seq_lens, &logit_rows}) {
      TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous(),
                  "LlamaDecoder.step: ids, positions, out_loc, seq_lens and logit_rows are contiguous int64 [B]");
    }
    TORCH_CHECK(positions.size(0) == batch && out_loc.size(0) == batch && seq_lens.size(0) == batch,
                "LlamaDecoder.step: ids, positions, out_loc and seq_lens must have one entry per row");
    TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch && page_table.scalar_type() == at::kLong &&
                    page_table.is_contiguous(), "LlamaDecoder.step: page_table must be contiguous int64 [B, pages]");
    check_rows(ids, positions, out_loc, logit_rows, batch);
    paged::check_pages(page_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), batch, page_table.size(1),
                       page_size_, layers_[0].k_pool.size(0) / page_size_);
    at::Tensor logits = at::empty({logit_rows.size(0), vocab_}, embed_.options().dtype(at::kFloat));
    at::Tensor picks = at::empty({pick ? logit_rows.size(0) : 0}, ids.options());
    if (batch == 0) return {logits, picks};
    int64_t* out = pick ? picks.data_ptr<int64_t>() : nullptr;
    if (dtype_ == at::kFloat && kv_dtype_ == at::kHalf) {
      run<F32HalfKVTypes>(ids, positions, out_loc, page_table, seq_lens, logit_rows, logits, out);
    } else if (dtype_ == at::kFloat) {
      run<F32Types>(ids, positions, out_loc, page_table, seq_lens, logit_rows, logits, out);
    } else {
      run<BF16Types>(ids, positions, out_loc, page_table, seq_lens, logit_rows, logits, out);
    }
    return {logits, picks};
  }

  void check_vector(const at::Tensor& t, int64_t numel, const char* name) const {
    TORCH_CHECK(t.is_contiguous() && t.numel() == numel && t.scalar_type() == dtype_, "LlamaDecoder: ", name,
                " must be contiguous with ", numel, " elements in the compute dtype");
  }

  Linear linear(int64_t kind, const at::Tensor& weight, const at::Tensor& scales, int64_t n, int64_t k) const {
    Linear l;
    l.kind = kind, l.n = n, l.k = k, l.weight = weight, l.scales = scales;
    TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2, "LlamaDecoder: a weight must be a contiguous matrix");
    if (kind == kInt8) {
      TORCH_CHECK(weight.scalar_type() == at::kByte && weight.size(0) == (n + gemv::kTile - 1) / gemv::kTile &&
                      weight.size(1) == k * gemv::kTile,
                  "LlamaDecoder: an int8 weight must be packed uint8 [ceil(", n, " / 16), ", k, " * 16]");
      TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
                  "LlamaDecoder: int8 scales must be float32 [", n, "]");
      l.s = scales.data_ptr<float>();
    } else {
      TORCH_CHECK(kind == kQ4, "LlamaDecoder: weight kind ", kind, " is neither int8 (1) nor q4 (2)");
      TORCH_CHECK(weight.scalar_type() == at::kByte && weight.size(0) == (n + gemv::kTile - 1) / gemv::kTile &&
                      weight.size(1) == k / gemv::kGroup * gemv::kTileGroupBytes,
                  "LlamaDecoder: a q4 weight must be packed uint8 [ceil(", n, " / 16), ", k, " / 32 * 320]");
    }
    l.stride = weight.size(1);
    l.w = static_cast<const uint8_t*>(weight.data_ptr());
    return l;
  }

  void check_rows(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& out_loc,
                  const at::Tensor& logit_rows, int64_t batch) const {
    const int64_t slots = layers_[0].k_pool.size(0), max_pos = rope_.size(0);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t id = ids.data_ptr<int64_t>()[b], pos = positions.data_ptr<int64_t>()[b];
      const int64_t loc = out_loc.data_ptr<int64_t>()[b];
      TORCH_CHECK(id >= 0 && id < vocab_, "LlamaDecoder.step: token id ", id, " outside the vocabulary");
      TORCH_CHECK(pos >= 0 && pos < max_pos, "LlamaDecoder.step: position ", pos, " outside the RoPE table");
      TORCH_CHECK(loc >= 0 && loc < slots, "LlamaDecoder.step: KV slot ", loc, " outside the pool");
    }
    for (int64_t r = 0; r < logit_rows.size(0); ++r) {
      const int64_t row = logit_rows.data_ptr<int64_t>()[r];
      TORCH_CHECK(row >= 0 && row < batch, "LlamaDecoder.step: logit row ", row, " outside the batch");
    }
  }

  template <class Types>
  void run(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& out_loc, const at::Tensor& page_table,
           const at::Tensor& seq_lens, const at::Tensor& logit_rows, at::Tensor& logits, int64_t* picks);

  float eps_, scale_;
  bool chained_ = false;
  int64_t num_layers_ = 0, hidden_ = 0, heads_ = 0, kv_heads_ = 0, dim_ = 0, inter_ = 0, vocab_ = 0, page_size_ = 0;
  at::ScalarType dtype_, kv_dtype_ = at::kFloat;
  at::Tensor embed_, rope_, final_norm_;
  std::vector<Layer> layers_;
  Linear head_;
};

// Each thread's own copy of a matmul's input: x as float32 rows, then quantized per group
// as the kernels read it (quant_input.h, as quant_gemv.cpp's op computes it).
struct Input {
  std::vector<float> x;
  gemv::Quantized q;
  std::vector<uint16_t> row;  // one normed row in the compute dtype (bfloat16's bits)
  const uint8_t* stream_end = nullptr;  // where this thread's last weight read ended (matmul_items)

  template <class G>
  void from(const typename G::scalar* src, int64_t rows, int64_t k) {
    for (int64_t i = 0; i < rows * k; ++i) x[i] = G::load(src[i]);
    q.quantize(x.data(), rows, k);
  }

  // weight * norm(src row) in the compute dtype, as float32 (glue's rms_norm, then the matmul's read).
  template <class G>
  void normed(const typename G::scalar* src, const typename G::scalar* w, int64_t rows, int64_t k, float eps,
              const int64_t* pick = nullptr) {
    using S = typename G::scalar;
    S* y = reinterpret_cast<S*>(row.data());
    for (int64_t r = 0; r < rows; ++r) {
      glue::norm_row<G>(src + (pick ? pick[r] : r) * k, w, y, k, eps);
      for (int64_t i = 0; i < k; ++i) x[r * k + i] = G::load(y[i]);
    }
    q.quantize(x.data(), rows, k);
  }
};

// out rows [i0 * 16, i1 * 16) (clipped to N) of `rows` rows of x (quant_gemv_core.h's tiles).
// The stream's head is prefetched unless this thread's previous call ended where this one starts.
template <class Out>
void matmul_items(const Linear& l, Input& in, Out* out, int64_t rows, int64_t i0, int64_t i1) {
  const gemv::Problem<Out> p{l.w, l.s, out, l.k, l.n, l.stride};
  const bool head = l.w + i0 * l.stride != in.stream_end;
  in.stream_end = l.w + i1 * l.stride;
  if (l.kind == kQ4) {
    gemv::tiles<true>(p, in.q.input(), rows, i0, i1, gemv::best_isa(), head);
  } else {
    gemv::tiles<false>(p, in.q.input(), rows, i0, i1, gemv::best_isa(), head);
  }
}

inline int64_t items_of(const Linear& l) { return (l.n + gemv::kTile - 1) / gemv::kTile; }

// h += delta (each sum rounded to the compute dtype, as glue's add_rms_norm and torch's add)
// on columns [n0, n1); delta's rows are `delta_stride` apart (0: one row for all, a bias).
template <class G>
void add_rows(typename G::scalar* h, const typename G::scalar* delta, int64_t rows, int64_t width, int64_t n0, int64_t n1,
              int64_t delta_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const typename G::scalar* d = delta + r * delta_stride;
    for (int64_t n = n0; n < n1; ++n) h[r * width + n] = G::store(G::load(h[r * width + n]) + G::load(d[n]));
  }
}

// One thread's share of a phase's chunks, [front, back) packed in one word (front in the low
// half), on its own cache line: its owner takes chunks from the front, a thread done with its
// own share steals from the back, and a compare-exchange never lets both take one chunk.
struct alignas(64) Share {
  std::atomic<uint64_t> bounds{0};
};

inline uint64_t pack(int64_t front, int64_t back) {
  return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
}

// Takes the front (or back) chunk of `share` into `chunk`; false once the share is empty.
inline bool take(Share& share, bool front, int64_t& chunk) {
  uint64_t v = share.bounds.load(std::memory_order_relaxed);
  while (true) {
    const int64_t f = static_cast<int64_t>(v & 0xffffffffu), b = static_cast<int64_t>(v >> 32);
    if (f >= b) return false;
    if (share.bounds.compare_exchange_weak(v, front ? pack(f + 1, b) : pack(f, b - 1), std::memory_order_relaxed)) {
      chunk = front ? f : b - 1;
      return true;
    }
  }
}

// A phase's work: `count` units in chunks of `grain`, one contiguous share of the chunks per thread.
struct Work {
  int64_t count, grain;
  int64_t chunks() const { return (count + grain - 1) / grain; }
};

// Units per chunk: ~8 chunks a thread, so a stolen chunk is short.
inline Work work_of(int64_t count, int threads, bool whole_units = false) {
  return {count, whole_units ? 1 : std::max<int64_t>(1, count / (8 * threads))};
}

// Thread t's part of a phase split into `count` shares: f(u0, u1) on its own share's chunks,
// front to back, then on chunks stolen from the back of the others' shares.
// NOTE: a static split left one thread waiting for the other at every barrier (memory-bound
// matmuls on a shared bus do not finish together, and a VM's thread may be descheduled:
// ~0.5 ms of a 6 ms batch-1 step on two cores); a shared counter handing out chunks in turn
// was slower still (each thread's weight reads no longer one forward stream, which the
// hardware prefetchers need). Shares keep the streams and stealing evens out the end. Which
// thread computes a unit never changes its values: every unit is computed whole by one thread.
template <class F>
void run_shares(Share* shares, int t, int count, const Work& w, F&& f) {
  int64_t c;
  for (int i = 0; i < count; ++i) {
    Share& share = shares[(t + i) % count];
    while (take(share, i == 0, c)) f(c * w.grain, std::min(w.count, (c + 1) * w.grain));
  }
}

constexpr int kPhases = 5;  // per layer: qkv (+ RoPE, KV write), attention, o, gate_up, down

template <class Types>
void LlamaDecoder::run(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& out_loc,
                       const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& logit_rows,
                       at::Tensor& logits, int64_t* picks) {
  using G = typename Types::glue_t;
  using S = typename G::scalar;  // storage bits
  using E = typename Types::elem;
  using K = typename Types::kv;
  constexpr bool kConvertKV = !std::is_same_v<E, K>;
  const int64_t B = ids.size(0), R = logit_rows.size(0), H = hidden_, D = dim_, half = D / 2;
  const int64_t qkv_n = (heads_ + 2 * kv_heads_) * D, kmax = std::max({H, inter_, heads_ * D});
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* loc = out_loc.data_ptr<int64_t>();
  const int64_t* pick = logit_rows.data_ptr<int64_t>();
  // Shared per-step buffers, in the compute dtype.
  std::vector<E> h(B * H), qkv(B * qkv_n), q(B * heads_ * D), att(B * heads_ * D), delta(B * H), gu(B * 2 * inter_),
      act(B * inter_), head_out(std::is_same_v<E, float> ? 0 : R * vocab_);
  const E* embed = reinterpret_cast<const E*>(embed_.data_ptr());
  for (int64_t b = 0; b < B; ++b) std::memcpy(&h[b * H], embed + id[b] * H, sizeof(E) * H);
  // The attention's work items (the same every layer: they depend on the lengths only).
  const int threads = std::max(1, at::get_num_threads());
  std::vector<paged::Split> splits;
  std::vector<chain::Tile> tiles;
  std::vector<paged::Item> items;
  if (chained_) {
    tiles = chain::tiles_of(page_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), B, page_table.size(1),
                            page_size_);
    items = chain::plan(tiles, seq_lens.data_ptr<int64_t>(), B, kv_heads_, threads, splits);
  } else {
    items = paged::plan(seq_lens.data_ptr<int64_t>(), B, paged::kChunk, kv_heads_, threads, splits);
  }
  const int64_t groups = static_cast<int64_t>(splits.size()) / B;  // chained: 0 where items are whole tiles
  const int64_t width = paged::partial_width(heads_, D);
  std::vector<float> partials(paged::partial_slots(splits) * width);
  const int64_t head_tiles = D / gemv::kTile, qkv_heads = heads_ + 2 * kv_heads_, gate_tiles = inter_ / gemv::kTile;
  // Each phase's work (the same every layer), then every phase's shares, set before the team starts.
  const Work works[kPhases + 1] = {work_of(qkv_heads, threads, true), work_of(static_cast<int64_t>(items.size()), threads, true),
                                   work_of(items_of(layers_[0].o), threads), work_of(gate_tiles, threads),
                                   work_of(items_of(layers_[0].down), threads), work_of(items_of(head_), threads)};
  std::vector<Share> shares((num_layers_ * kPhases + 1) * threads);
  for (int64_t p = 0; p < num_layers_ * kPhases + 1; ++p) {
    const Work& w = works[p == num_layers_ * kPhases ? kPhases : p % kPhases];
    for (int t = 0; t < threads; ++t) {
      const auto [f, b] = share(w.chunks(), t, threads);
      shares[p * threads + t].bounds.store(pack(f, b), std::memory_order_relaxed);
    }
  }
  std::vector<Input> inputs(threads);
  for (Input& in : inputs) {
    in.x.resize(std::max(B, R) * kmax);
    in.row.resize(kmax);
  }
  const E* rope = reinterpret_cast<const E*>(rope_.data_ptr());
  auto sv = [](const at::Tensor& t) { return reinterpret_cast<const S*>(t.data_ptr()); };
  auto st = [](std::vector<E>& v) { return reinterpret_cast<S*>(v.data()); };
  E* out_logits = std::is_same_v<E, float> ? reinterpret_cast<E*>(logits.data_ptr<float>()) : head_out.data();
  std::vector<argmax::Pick> picked(picks ? threads * R : 0);  // each thread's pick of each row, over its tiles

#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    Input& in = inputs[t];
    std::vector<float> merge_tmp(width);
    std::vector<E> k_row(kConvertKV ? D : 0);  // a rotated key before its conversion to the pool's type
    // This thread's part of phase p of the current layer, or (p == kPhases, after the last
    // layer, where `layer_shares` has reached the head's) of the head. NOTE: `threads` shares
    // a phase, stolen by whoever runs: a smaller team (omp may give fewer) still does them all.
    Share* layer_shares = shares.data();
    auto part = [&](int p, auto&& f) { run_shares(layer_shares + (p % kPhases) * threads, t, threads, works[p], f); };
    // Every matmul phase: its output tiles, then `epilogue(n0, n1)` on their columns.
    auto matmul = [&](const Linear& l, int64_t rows, E* out, int p, auto&& epilogue) {
      part(p, [&](int64_t a, int64_t e) {
        matmul_items(l, in, out, rows, a, e);
        epilogue(a * gemv::kTile, std::min(l.n, e * gemv::kTile));
      });
    };
    for (const Layer& L : layers_) {
      // x = input_norm(h); qkv = x @ Wqkv^T by whole heads (q, k, v), each finished by its taker:
      // RoPE of a q or k head, a k or v head written at each row's new slot.
      in.normed<G>(st(h), sv(L.input_norm), B, H, eps_);
      if (t == 0) {  // the previous layer's attention is past its barrier: its merge counters are free
        for (paged::Split& s : splits) {
          if (s.pending) s.pending->store(s.chunks, std::memory_order_relaxed);
        }
      }
      part(0, [&](int64_t j, int64_t) {
        matmul_items(L.qkv, in, qkv.data(), B, j * head_tiles, (j + 1) * head_tiles);
        if (L.qkv_bias.numel() > 0) add_rows<G>(st(qkv), sv(L.qkv_bias), B, qkv_n, j * D, (j + 1) * D, 0);
        for (int64_t b = 0; b < B; ++b) {
          const S* x = st(qkv) + b * qkv_n + j * D;
          const S* c = reinterpret_cast<const S*>(rope + pos[b] * D);
          if (j < heads_) {
            glue::rope_head<G>(x, c, c + half, st(q) + (b * heads_ + j) * D, half);
            continue;
          }
          const int64_t kv = (j - heads_) % kv_heads_, slot = (loc[b] * kv_heads_ + kv) * D;
          const bool is_key = j < heads_ + kv_heads_;
          K* dst = reinterpret_cast<K*>((is_key ? L.k_pool : L.v_pool).data_ptr()) + slot;
          if constexpr (kConvertKV) {  // rounded to the pool's type as the torch path's pool.write rounds
            const E* src = reinterpret_cast<const E*>(x);
            if (is_key) {
              glue::rope_head<G>(x, c, c + half, st(k_row), half);
              src = k_row.data();
            }
            for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<K>(src[e]);
          } else if (is_key) {
            glue::rope_head<G>(x, c, c + half, reinterpret_cast<S*>(dst), half);
          } else {
            std::memcpy(dst, x, sizeof(S) * D);
          }
        }
      });
#pragma omp barrier
      // Attention of every row's query over its pages.
      const paged::Problem<E, K> ap{q.data(), reinterpret_cast<const K*>(L.k_pool.data_ptr()),
                                 reinterpret_cast<const K*>(L.v_pool.data_ptr()), page_table.data_ptr<int64_t>(),
                                 seq_lens.data_ptr<int64_t>(), att.data(), page_table.size(1), page_size_, heads_,
                                 kv_heads_, D, heads_ / kv_heads_, scale_};
      if (chained_) {
        chain::Attender<tierserve_paged_vec::Simd, E, K> attender(ap);
        part(1, [&](int64_t i, int64_t) {
          attender.run(items[i], tiles, splits, groups, partials.data(), merge_tmp.data());
        });
      } else {
        paged::with_variant<K>(D, [&](auto variant) {
          using V = decltype(variant);
          paged::Attender<typename V::S, V::NV, E, K> attender(ap);
          const auto [own, own_end] = share(works[1].chunks(), t, threads);
          part(1, [&](int64_t i, int64_t) {  // then: the next item of this thread's own share
            const paged::Item* then = i >= own && i + 1 < own_end ? &items[i + 1] : nullptr;
            paged::run_item(ap, attender, items[i], splits, partials.data(), merge_tmp.data(), then);
          });
        });
      }
#pragma omp barrier
      // h += att @ Wo^T
      in.from<G>(st(att), B, heads_ * D);
      matmul(L.o, B, delta.data(), 2, [&](int64_t n0, int64_t n1) { add_rows<G>(st(h), st(delta), B, H, n0, n1, H); });
#pragma omp barrier
      // x = post_norm(h); gate_up by matching tiles of both halves, then SiLU(gate) * up on them.
      in.normed<G>(st(h), sv(L.post_norm), B, H, eps_);
      part(3, [&](int64_t a, int64_t e) {
        matmul_items(L.gate_up, in, gu.data(), B, a, e);
        matmul_items(L.gate_up, in, gu.data(), B, gate_tiles + a, gate_tiles + e);
        for (int64_t b = 0; b < B; ++b) {
          const S* g = st(gu) + b * 2 * inter_;
          S* y = st(act) + b * inter_;
          glue::silu_times_run<G>(g + a * gemv::kTile, g + inter_ + a * gemv::kTile, y + a * gemv::kTile, (e - a) * gemv::kTile);
        }
      });
#pragma omp barrier
      // h += act @ Wdown^T
      in.from<G>(st(act), B, inter_);
      matmul(L.down, B, delta.data(), 4, [&](int64_t n0, int64_t n1) { add_rows<G>(st(h), st(delta), B, H, n0, n1, H); });
#pragma omp barrier
      layer_shares += kPhases * threads;
    }
    // logits of the picked rows: final_norm(h) @ Whead^T, and (picks) each row's argmax
    // over the columns this thread computed, read while they are in its cache.
    in.normed<G>(st(h), sv(final_norm_), R, H, eps_, pick);
    std::vector<argmax::Pick> mine(picks ? R : 0);
    float* lp = logits.data_ptr<float>();
    matmul(head_, R, out_logits, kPhases, [&](int64_t n0, int64_t n1) {
      for (int64_t r = 0; r < R; ++r) {
        if constexpr (!std::is_same_v<E, float>) {
          for (int64_t n = n0; n < n1; ++n) lp[r * vocab_ + n] = static_cast<float>(head_out[r * vocab_ + n]);
        }
        if (picks) argmax::merge_part(mine[r], lp + r * vocab_ + n0, n1 - n0, n0);
      }
    });
    if (picks) std::copy(mine.begin(), mine.end(), picked.begin() + t * R);
  }
  // NOTE: a row's parts merge into the same pick whichever thread computed which tiles
  // (argmax_core.h's `better` is order-free), so the pick is the logits' argmax.
  for (int64_t r = 0; picks && r < R; ++r) {
    argmax::Pick best;
    for (int t = 0; t < threads; ++t) {
      const argmax::Pick& p = picked[t * R + r];
      if (p.index >= 0 && argmax::better(p, best)) best = p;
    }
    picks[r] = best.index;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.class_<LlamaDecoder>("LlamaDecoder")
      .def(torch::init<std::vector<int64_t>, double, double, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &LlamaDecoder::add_layer)
      .def("set_head", &LlamaDecoder::set_head)
      .def("set_chained", &LlamaDecoder::set_chained)
      .def("step", &LlamaDecoder::step)
      .def("step_argmax", &LlamaDecoder::step_argmax)
      .def("steps_argmax", &LlamaDecoder::steps_argmax);
}
