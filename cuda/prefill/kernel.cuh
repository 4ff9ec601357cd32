// The prefill kernel: a persistent CTA per (worker, KV head) walks its worker's work items
// (plan.h); each item's packed rows (tokens x G query heads of the KV head) are cut into blocks
// of a warp group's tile, the blocks are split between the CTA's two warp groups, and each group
// streams its block's KV range in kKvTile tiles through a two-stage cp.async pipeline, taking
// turns with the other group on the tensor cores (schedule.cuh).
//
// Included only by the explicit instantiation files (cuda/inst/prefill_*.cu).
#pragma once

#include <cuda_runtime.h>

#include "flashkv/core/error.h"
#include "prefill/epilogue.cuh"
#include "prefill/launch.h"
#include "prefill/load.cuh"
#include "prefill/mainloop.cuh"
#include "prefill/mask.cuh"
#include "prefill/schedule.cuh"
#include "prefill/softmax.cuh"

namespace flashkv::cuda::prefill_detail {

constexpr float kLog2e = 1.4426950408889634f;

template <typename Cfg>
__device__ __forceinline__ int num_kv_tiles(const RowBlock& b) {
  return b.kv_hi > b.kv_lo ? (b.kv_hi - b.kv_lo + Cfg::kKvTile - 1) / Cfg::kKvTile : 0;
}

// One row block, run by one warp group on its own shared memory `smem`. Turn u (u = 0..n) is
// the MMA phase P_{u-1}.V_{u-1} then S_u = Q.K_u^T; the softmax of S_u follows outside the turn.
// The loads of K_{u+1} and V_u are issued at the start of turn u, into the stages that turn u-1
// finished reading, so each lands while a whole turn pair runs.
template <typename Cfg>
__device__ __forceinline__ void run_block(const AttentionParams& p, const RowBlock& b, int kv_head,
                                          int group, unsigned char* smem, PingPong& pp) {
  using QT = typename Cfg::Q;
  constexpr int kNTiles = Cfg::kKvTile / 8;
  const int tid = threadIdx.x & (kWgThreads - 1), lane = tid & 31, warp = tid >> 5;
  const int warp_row0 = warp * Cfg::kRowsPerWarp;
  const int group_barrier = kGroupBarrier + pp.group;

  float o[Cfg::kMTiles][Cfg::kDv / 8][4];
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < Cfg::kDv / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.0f;
  OnlineSoftmax<Cfg::kMTiles> softmax;
  softmax.init();

  // Logit scale (fp8 K's scale folds in here) and the softmax's base-2 factor.
  const float logit_scale = p.sm_scale * (Cfg::kFp8 ? p.k_scale : 1.0f);
  const bool soft_cap = p.logits_soft_cap > 0.0f;
  const float c = soft_cap ? kLog2e : logit_scale * kLog2e;
  const float scale_over_cap = soft_cap ? logit_scale / p.logits_soft_cap : 0.0f;

  FragmentAddresses<Cfg> fa;
  fa.init(smem_addr(smem + Cfg::kQOffset), smem_addr(smem + Cfg::kKOffset),
          smem_addr(smem + Cfg::kVOffset), warp_row0, lane);

  const int n = num_kv_tiles<Cfg>(b);
  if (n > 0) {
    named_barrier_sync(group_barrier, kWgThreads);  // the previous block's readers are done
    load_q<Cfg>(p, b, kv_head, group, reinterpret_cast<QT*>(smem + Cfg::kQOffset), tid);
    load_k_tile<Cfg>(p, b, kv_head, b.kv_lo, smem, 0, tid);
    cp_async_commit();
    PFragments<Cfg> pf;
    for (int u = 0; u <= n; ++u) {
      const int j0 = b.kv_lo + u * Cfg::kKvTile;
      cp_async_wait<0>();
      named_barrier_sync(group_barrier, kWgThreads);  // K_u, V_{u-1} landed; turn u-1 is done
      if (u < n) {
        if (u + 1 < n) load_k_tile<Cfg>(p, b, kv_head, j0 + Cfg::kKvTile, smem, (u + 1) & 1, tid);
        load_v_tile<Cfg>(p, b, kv_head, j0, smem, u & 1, tid);
        cp_async_commit();
      }
      uint32_t k_off = 0, v_off = 0;
      if constexpr (Cfg::kFp8) {
        if (u < n)
          widen_fp8_tile<Cfg, Cfg::kDqk>(smem + Cfg::kK8Offset + (u & 1) * Cfg::kK8StageBytes,
                                         reinterpret_cast<QT*>(smem + Cfg::kKOffset), tid);
        if (u > 0)
          widen_fp8_tile<Cfg, Cfg::kDv>(smem + Cfg::kV8Offset + ((u - 1) & 1) * Cfg::kV8StageBytes,
                                        reinterpret_cast<QT*>(smem + Cfg::kVOffset), tid);
        named_barrier_sync(group_barrier, kWgThreads);
      } else {
        k_off = (u & 1) * Cfg::kKStageBytes;
        v_off = ((u - 1) & 1) * Cfg::kVStageBytes;
      }

      float s[Cfg::kMTiles][kNTiles][4];
      pp.begin_turn();
      if (u > 0) pv_product<Cfg>(pf, fa, v_off, o);
      if (u < n) qk_product<Cfg>(fa, k_off, s);
      pp.end_turn();
      if (u < n) {
        if (soft_cap) apply_soft_cap<Cfg>(s, p.logits_soft_cap, scale_over_cap);
        if (!tile_is_full(p, b, group, j0, Cfg::kKvTile))
          apply_mask<Cfg::kMTiles, kNTiles>(s, p, b, group, warp_row0, j0, lane);
        softmax.update(s, o, c);
        pack_p<Cfg>(s, pf);
      }
    }
  }

  float scale[Cfg::kMTiles][2], lse[Cfg::kMTiles][2];
  softmax.finish(c, scale, lse, Cfg::kFp8 ? p.v_scale : 1.0f);
  store_block<Cfg>(p, b, kv_head, group, warp_row0, lane, o, scale, lse);
}

// grid (workers, Hkv), kCtaThreads threads; CTA (w, h) runs worker w's items for KV head h.
template <typename Cfg>
__global__ void __launch_bounds__(kCtaThreads, 1)
    prefill_kernel(const __grid_constant__ AttentionParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int worker = blockIdx.x, kv_head = blockIdx.y;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int first = p.worker_indptr[worker], last = p.worker_indptr[worker + 1];
  PingPong pp{static_cast<int>(threadIdx.x) / kWgThreads};
  unsigned char* group_smem = smem + pp.group * Cfg::kWgSmemBytes;

  // Both groups compute the same split of the blocks and the number of turns it takes.
  GroupSplit plan_split;
  for (int i = first; i < last; ++i) {
    const WorkItem it = p.items[i];
    for (int row0 = 0; row0 < it.q_len * group; row0 += Cfg::kWgRows)
      plan_split.assign(
          block_turns(num_kv_tiles<Cfg>(make_row_block(p, it, group, row0, Cfg::kWgRows))));
  }
  GroupSplit split;
  for (int i = first; i < last; ++i) {
    const WorkItem it = p.items[i];
    for (int row0 = 0; row0 < it.q_len * group; row0 += Cfg::kWgRows) {
      const RowBlock b = make_row_block(p, it, group, row0, Cfg::kWgRows);
      if (split.assign(block_turns(num_kv_tiles<Cfg>(b))) == pp.group)
        run_block<Cfg>(p, b, kv_head, group, group_smem, pp);
    }
  }
  pp.finish(plan_split.total());
}

template <int DQK, int DV, typename QT, KvFormat KVF>
void launch_prefill(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = TileConfig<DQK, DV, QT, KVF>;
  const auto kernel = prefill_kernel<Cfg>;
  check_cuda(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes),
      "prefill: cudaFuncSetAttribute");
  const dim3 grid(p.num_workers, p.num_kv_heads);
  kernel<<<grid, kCtaThreads, Cfg::kSmemBytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "prefill: kernel launch");
}

}  // namespace flashkv::cuda::prefill_detail

// Explicit instantiation of one (head dims, dtype, KV format) variant.
#define FLASHKV_INSTANTIATE_PREFILL(DQK, DV, QT, KVF)                            \
  template void flashkv::cuda::prefill_detail::launch_prefill<DQK, DV, QT, KVF>( \
      const flashkv::AttentionParams&, cudaStream_t)
