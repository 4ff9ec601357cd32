// Merge pass of split prefill items: each MergeItem's num_chunks fp32 partial states (rows
// partial + c * q_len + token, plan.h) fold, in chunk order c = 0, 1, ..., into the final O (Q's
// dtype) and LSE. One warp per (token, query head); lanes stride over D_v.
#pragma once

#include <cuda_runtime.h>

#include "flashkv/ops/params.h"
#include "prefill/primitives.cuh"

namespace flashkv::cuda::prefill_detail {

constexpr int kMergeThreads = 256;

template <typename QT>
__device__ void merge_one(const AttentionParams& p, const MergeItem& mi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hq = p.num_qo_heads, dv = p.head_dim_v;
  const float neg_inf = -__int_as_float(0x7f800000);
  for (int pair = warp; pair < mi.q_len * hq; pair += kMergeThreads / 32) {
    const int tok = pair / hq, head = pair - tok * hq;
    auto prow = [&](int c) { return static_cast<int64_t>(mi.partial) + c * mi.q_len + tok; };
    float m = neg_inf;
    for (int c = 0; c < mi.num_chunks; ++c) m = fmaxf(m, p.partial_lse[prow(c) * hq + head]);
    const int64_t row = static_cast<int64_t>(mi.q_begin) + tok;
    QT* dst = static_cast<QT*>(p.o) + row * p.o_stride_n + head * p.o_stride_h;
    if (m == neg_inf) {  // no chunk saw a visible key
      for (int d = lane; d < dv; d += 32) dst[d] = QT(0.0f);
      if (p.lse && lane == 0) p.lse[row * hq + head] = neg_inf;
      continue;
    }
    float sum = 0.0f;
    for (int c = 0; c < mi.num_chunks; ++c) sum += exp2f(p.partial_lse[prow(c) * hq + head] - m);
    const float inv = 1.0f / sum;
    for (int d = lane; d < dv; d += 32) {
      float acc = 0.0f;
      for (int c = 0; c < mi.num_chunks; ++c) {
        const float w = exp2f(p.partial_lse[prow(c) * hq + head] - m);
        acc += w * p.partial_o[(prow(c) * hq + head) * dv + d];
      }
      dst[d] = QT(acc * inv);
    }
    if (p.lse && lane == 0) p.lse[row * hq + head] = m + log2f(sum);
  }
}

// scan_items = false: grid.x = num_merges, CTA i merges merges[i].
// scan_items = true (CUDA-graph mode, where the grid cannot depend on the batch): a fixed grid
// walks the device item list (worker_indptr[num_workers] items); each chunk-0 split item names a
// tile to merge, whose MergeItem is the first entry with the same partial base (valid entries
// come first and their bases are distinct, so stale entries past them are never reached).
template <typename QT>
__global__ void __launch_bounds__(kMergeThreads)
    merge_partials_kernel(const __grid_constant__ AttentionParams p, bool scan_items) {
  if (!scan_items) {
    merge_one<QT>(p, p.merges[blockIdx.x]);
    return;
  }
  const int num_items = p.worker_indptr[p.num_workers];
  for (int i = blockIdx.x; i < num_items; i += gridDim.x) {
    const WorkItem it = p.items[i];
    if (it.partial < 0 || it.chunk != 0) continue;
    int m = 0;
    while (p.merges[m].partial != it.partial) ++m;
    merge_one<QT>(p, p.merges[m]);
  }
}

}  // namespace flashkv::cuda::prefill_detail
