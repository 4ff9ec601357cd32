// Merge pass of split prefill items: each MergeItem's num_chunks fp32 partial states (rows
// partial + c * q_len + token, plan.h) fold, in chunk order c = 0, 1, ..., into the final O (in
// O's dtype OT: Q's, or f32) and LSE. One warp per (token, query head); lanes stride over D_v.
#pragma once

#include <cuda_runtime.h>

#include "common/merge.cuh"
#include "flashkv/kernels/params.h"
#include "prefill/primitives.cuh"

namespace flashkv::cuda::prefill_detail {

constexpr int kMergeThreads = 256;

template <typename OT>
__device__ void merge_one(const AttentionParams& p, const MergeItem& mi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hq = p.num_qo_heads, dv = p.head_dim_v;
  const float neg_inf = -__int_as_float(0x7f800000);
  for (int pair = warp; pair < mi.q_len * hq; pair += kMergeThreads / 32) {
    const int tok = pair / hq, head = pair - tok * hq;
    auto prow = [&](int c) { return static_cast<int64_t>(mi.partial) + c * mi.q_len + tok; };
    const int64_t row = static_cast<int64_t>(mi.q_begin) + tok;
    // p's merge state (merge_o / merge_lse) is one more state, folded after the chunks; it may
    // be the output row itself, so every lane reads it before any lane writes.
    const float prev_lse = p.merge_o ? p.merge_lse[row * hq + head] : neg_inf;
    const OT* prev = p.merge_o ? static_cast<const OT*>(p.merge_o) + row * p.merge_stride_n +
                                     head * p.merge_stride_h
                               : nullptr;
    // The weights, 1 / sum and the LSE: common/merge.cuh (the maximum first).
    // The sink, when given, is one more state (O = 0), counted here once.
    const float sink = sink_lse(p.sinks, head);
    MergeState<> st;
    st.see(prev_lse);
    st.see(sink);
    bool nan = prev_lse != prev_lse;
    for (int c = 0; c < mi.num_chunks; ++c) {
      const float l = p.partial_lse[prow(c) * hq + head];
      st.see(l);
      nan |= l != l;
    }
    OT* dst = static_cast<OT*>(p.o) + row * p.o_stride_n + head * p.o_stride_h;
    __syncwarp();
    // No chunk saw a visible key (nor did the merge state). A NaN state (NaN in the KV) is not
    // empty: its weight is NaN, and so are O and LSE.
    if (st.max == neg_inf && !nan) {
      for (int d = lane; d < dv; d += 32) dst[d] = OT(0.0f);
      if (p.lse && lane == 0) p.lse[row * hq + head] = neg_inf;
      continue;
    }
    for (int c = 0; c < mi.num_chunks; ++c) st.add(p.partial_lse[prow(c) * hq + head]);
    const float w_prev = st.add(prev_lse);
    st.add(sink);
    const float inv = st.inv_sum();
    for (int d = lane; d < dv; d += 32) {
      float acc = 0.0f;
      for (int c = 0; c < mi.num_chunks; ++c) {
        const float w = st.weight(p.partial_lse[prow(c) * hq + head]);
        acc += w * p.partial_o[(prow(c) * hq + head) * dv + d];
      }
      if (w_prev != 0.0f) acc += w_prev * static_cast<float>(prev[d]);
      dst[d] = OT(acc * inv);
    }
    if (p.lse && lane == 0) p.lse[row * hq + head] = st.lse();
  }
}

// grid.x = merges to run; CTA i merges merges[i]. With a CUDA-graph plan the grid is the
// layout's merge capacity and the entries past this plan's merges are empty (q_len 0).
template <typename QT>
__global__ void __launch_bounds__(kMergeThreads)
    merge_partials_kernel(const __grid_constant__ AttentionParams p) {
  if (p.o_dtype == DType::f32)
    merge_one<float>(p, p.merges[blockIdx.x]);
  else
    merge_one<QT>(p, p.merges[blockIdx.x]);
}

}  // namespace flashkv::cuda::prefill_detail
