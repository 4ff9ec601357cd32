// The float64 reference: SEMANTICS.md, implemented literally. The oracle of every test.
// Takes host tensors of any float dtype (fp8 KV dequantized with the scales). Runs on the
// process's thread pool (ThreadPool::global()), each (row, head) computed by one thread in
// the same order as a serial loop: the result does not depend on the number of threads.
// NaN in the inputs propagates as plain arithmetic does: a NaN in an allowed key makes that
// query head's scores, O and LSE NaN (even when it is the only allowed key); a NaN in an allowed
// value makes its own dims of O NaN; a NaN in a key or value nobody may see changes nothing. A
// NaN state makes a merge NaN. Kernels keep NaN where these put it (compare() checks), with one
// exception they do not promise: a NaN value in a key a row may not see (causal, window, mask)
// but rows of its tile may can reach that row through a 0 * NaN product.
#pragma once

#include <cmath>
#include <vector>

#include "flashkv/ops/attention.h"

namespace flashkv::reference {

// O [rows, heads, head_dim] and LSE [rows, heads] (base 2; -inf for a row with no visible key).
struct Result {
  int64_t rows = 0;
  int heads = 0;
  int head_dim = 0;
  std::vector<double> o;
  std::vector<double> lse;

  double o_at(int64_t r, int h, int d) const { return o[(r * heads + h) * head_dim + d]; }
  double lse_at(int64_t r, int h) const { return lse[r * heads + h]; }
};

// Both take opt.sinks (f32 [Hq] on the host, optional): each row's result includes the sink once
// (SEMANTICS.md "Attention sinks"); opt.merge_o / merge_lse are not read.
// Ragged attention (see ragged_prefill for shapes).
Result ragged_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& qo_indptr, const TensorView& kv_indptr,
                        const AttentionOptions& opt, float k_scale = 1.0f, float v_scale = 1.0f);

// Paged attention (see paged_prefill); qo_indptr absent = one query row per request (decode).
Result paged_attention(const TensorView& q, const TensorView& qo_indptr, const PagedKV& kv,
                       const AttentionOptions& opt);

// Merges states over disjoint KV sets (all with the same shape).
Result merge_states(const std::vector<Result>& parts);

}  // namespace flashkv::reference
