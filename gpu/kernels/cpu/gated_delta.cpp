// The gated delta rule's recurrent form on CPU: every token of a step, request by request,
// in one call (gpu/kernels/gated_delta.py states the recurrence).
//
// torch runs the recurrent form one position at a time (~10 ops a position for every
// layer), so a deterministic-mode prefill of a long prompt was a per-token Python loop. Here
// each (request, value head) pair walks its own tokens in order, its state [dk, dv] in
// registers and cache, the pairs split over the threads.
//
// NOTE: invariant 7. A pair's arithmetic depends only on its own inputs: per token the
// decay multiply, S^T k summed over the key dimension in index order, the delta, the rank-1
// update, S^T q summed in index order; each an IEEE multiply then add (compiled with
// -ffp-contract=off, so no fused multiply-add depends on the compiler's choice), the same
// whichever lanes the compiler vectorizes over the value dimension. So a request's outputs
// and states do not depend on the other requests of the step, nor on how its tokens were
// split into steps: a prefill chunk of n tokens ends in the state n decode steps reach,
// bit for bit. This is why deterministic mode runs it (decode and prefill alike), unlike
// the other kernels here.

#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& decay,
                  const torch::Tensor& beta, const torch::Tensor& states, const torch::Tensor& starts) {
  for (const torch::Tensor* t : {&q, &k, &v, &decay, &beta, &states})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "gated_delta_recurrent: inputs and states must be contiguous float32");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1), "gated_delta_recurrent: q, k [T, H, dk] and v [T, H, dv]");
  TORCH_CHECK(decay.dim() == 2 && beta.sizes() == decay.sizes() && decay.size(0) == q.size(0) &&
                  decay.size(1) == q.size(1), "gated_delta_recurrent: decay and beta [T, H]");
  TORCH_CHECK(states.dim() == 4 && states.size(1) == q.size(1) && states.size(2) == q.size(2) &&
                  states.size(3) == v.size(2), "gated_delta_recurrent: states [R, H, dk, dv]");
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && starts.dim() == 1 && starts.size(0) == states.size(0) + 1,
              "gated_delta_recurrent: starts [R + 1] int64");
}

// One (request, head) pair over tokens [begin, end): s is its state, updated in place;
// after token t (counted from begin, 1-based n = t - begin + 1) the state is copied to
// `tracked_out[n]` where one is asked for.
void walk(float* s, int64_t begin, int64_t end, int64_t head, int64_t heads, int64_t dk, int64_t dv,
          const float* q, const float* k, const float* v, const float* decay, const float* beta, float* out,
          const std::vector<float*>& tracked_out) {
  std::vector<float> recall(dv), delta(dv);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t row = t * heads + head;
    const float* kt = k + row * dk;
    const float* qt = q + row * dk;
    const float* vt = v + row * dv;
    const float a = decay[row], b = beta[row];
    for (int64_t j = 0; j < dv; ++j) recall[j] = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      float* si = s + i * dv;
      const float ki = kt[i];
      for (int64_t j = 0; j < dv; ++j) {
        si[j] = si[j] * a;
        recall[j] = recall[j] + si[j] * ki;
      }
    }
    for (int64_t j = 0; j < dv; ++j) delta[j] = (vt[j] - recall[j]) * b;
    float* o = out + row * dv;
    for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      float* si = s + i * dv;
      const float ki = kt[i], qi = qt[i];
      for (int64_t j = 0; j < dv; ++j) {
        si[j] = si[j] + ki * delta[j];
        o[j] = o[j] + si[j] * qi;
      }
    }
    float* keep = tracked_out[t - begin + 1];
    if (keep != nullptr)
      for (int64_t x = 0; x < dk * dv; ++x) keep[x] = s[x];
  }
}

// Every request's tokens (request r: rows starts[r] .. starts[r+1]) from its state
// states[r] (updated in place) -> out [T, H, dv]. track [M, 2] int64: (request, n) pairs,
// tracked[m] [H, dk, dv] gets request's state after its first n tokens.
void recurrent(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& decay,
               const torch::Tensor& beta, torch::Tensor states, const torch::Tensor& starts, torch::Tensor out,
               const torch::Tensor& track, torch::Tensor tracked) {
  check_inputs(q, k, v, decay, beta, states, starts);
  TORCH_CHECK(out.sizes() == v.sizes() && out.scalar_type() == torch::kFloat32 && out.is_contiguous(),
              "gated_delta_recurrent: out like v");
  TORCH_CHECK(track.scalar_type() == torch::kInt64 && track.dim() == 2 && track.size(1) == 2 &&
                  tracked.dim() == 4 && tracked.size(0) == track.size(0) && tracked.is_contiguous() &&
                  tracked.scalar_type() == torch::kFloat32, "gated_delta_recurrent: track [M, 2], tracked [M, H, dk, dv]");
  const int64_t requests = states.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  const int64_t* at = starts.data_ptr<int64_t>();
  const int64_t* tr = track.data_ptr<int64_t>();
  float* s = states.data_ptr<float>();
  float* kept = tracked.data_ptr<float>();
  at::parallel_for(0, requests * heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t r = pair / heads, h = pair % heads;
      const int64_t begin = at[r], end = at[r + 1];
      std::vector<float*> tracked_out(end - begin + 1, nullptr);
      for (int64_t m = 0; m < track.size(0); ++m) {
        const int64_t n = tr[2 * m + 1];
        if (tr[2 * m] == r) {
          TORCH_CHECK(n > 0 && n < end - begin, "gated_delta_recurrent: a tracked point outside its request");
          tracked_out[n] = kept + (m * heads + h) * dk * dv;
        }
      }
      walk(s + (r * heads + h) * dk * dv, begin, end, h, heads, dk, dv, q.data_ptr<float>(), k.data_ptr<float>(),
           v.data_ptr<float>(), decay.data_ptr<float>(), beta.data_ptr<float>(), out.data_ptr<float>(), tracked_out);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m) {
  m.def("gated_delta_recurrent(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, Tensor(a!) states, "
        "Tensor starts, Tensor(b!) out, Tensor track, Tensor(c!) tracked) -> ()");
}

TORCH_LIBRARY_IMPL(tierserve_cpu, CPU, m) { m.impl("gated_delta_recurrent", &recurrent); }
