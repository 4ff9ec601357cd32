// The kernel entry points behind the ops (internal: only ops/*.cpp call these). The CPU ones
// always exist; the CUDA ones only in a CUDA build (FLASHKV_WITH_CUDA).
#pragma once

#include "flashkv/core/device.h"
#include "flashkv/ops/params.h"

namespace flashkv {
namespace cpu {
// Runs every work item of p (prefill, ragged or paged, and decode), then the merges.
void attention(const AttentionParams& p);
void merge(const MergeParams& p);
}  // namespace cpu

namespace cuda {
void paged_decode(const AttentionParams& p, Stream stream);
void prefill(const AttentionParams& p, Stream stream);  // ragged or paged by p.paged
void merge(const MergeParams& p, Stream stream);
// Packed query rows (tokens x G query heads) of the prefill kernel's CTA tile for these head
// dims: plan prefill with PlanOptions.q_tile = prefill_cta_rows(D_qk, D_v) / G for full tiles.
int prefill_cta_rows(int head_dim_qk, int head_dim_v);
}  // namespace cuda
}  // namespace flashkv
