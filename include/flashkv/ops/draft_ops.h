// KV indices of multi-step speculative drafting (topk branches per request).
#pragma once

#include "flashkv/core/tensor.h"

namespace flashkv {

// Draft decode step `step` (0-based): row (r, b) = r * topk + b of the step's batch sees request
// r's seq_lens[r] cached tokens, then the first step + 1 draft tokens of its branch b:
//   kv_indices[kv_indptr[row] + j]               = req_to_token[req_pool_indices[r], j], j <
//   seq_lens[r] kv_indices[kv_indptr[row] + seq_lens[r] + s] = draft_loc[r, b, s], s <= step
//   step_loc[row]                                = draft_loc[r, b, step]  (where the step writes
//   K/V) req_to_token [max_reqs, max_context_len] i32; req_pool_indices [bs] i32; seq_lens [bs]
//   i32; draft_loc [bs, topk, num_steps] i32 (contiguous); kv_indptr [bs * topk + 1] i32 with
//   kv_indptr[row + 1] - kv_indptr[row] == seq_lens[r] + step + 1; kv_indices i32; step_loc
//   [bs * topk] i32. All on one device. Host tensors are checked entry by entry before anything
//   is written; CUDA rows whose indices are out of range are skipped.
void build_draft_kv_indices(const TensorView& req_to_token, const TensorView& req_pool_indices,
                            const TensorView& seq_lens, const TensorView& draft_loc, int step,
                            const TensorView& kv_indptr, const TensorView& kv_indices,
                            const TensorView& step_loc, Stream stream = {});

}  // namespace flashkv
