// The prefill kernel: a persistent CTA per (worker, KV head) walks its worker's work items
// (plan.h); each item's packed rows (tokens x G query heads of the KV head) are cut into blocks
// of kCtaRows, and each block streams its KV range in kKvTile tiles through a two-stage cp.async
// pipeline: while tile t is multiplied, tile t + 1 is in flight and the page indices of tile
// t + 2 are being read.
//
// Included only by the explicit instantiation files (cuda/inst/prefill_*.cu).
#pragma once

#include <cuda_runtime.h>

#include "common/kernel_launch.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"
#include "prefill/epilogue.cuh"
#include "prefill/launch.h"
#include "prefill/load.cuh"
#include "prefill/mainloop.cuh"
#include "prefill/mask.cuh"
#include "prefill/softmax.cuh"

namespace flashkv::cuda::prefill_detail {

// One row block: loads, the KV loop, the stores. Ends with every thread past its last read of
// shared memory only after the caller's next __syncthreads().
template <typename Cfg>
__device__ __forceinline__ void run_block(const AttentionParams& p, const RowBlock& b, int kv_head,
                                          int group, unsigned char* smem) {
  using QT = typename Cfg::Q;
  constexpr int kNTiles = Cfg::kKvTile / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_row0 = warp * Cfg::kRowsPerWarp;

  float o[Cfg::kMTiles][Cfg::kDv / 8][4];
  zero_output(o);
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

  const int num_tiles =
      b.kv_hi > b.kv_lo ? (b.kv_hi - b.kv_lo + Cfg::kKvTile - 1) / Cfg::kKvTile : 0;
  if (num_tiles > 0) {
    KvTileRows<Cfg> rows;
    rows.fetch(p, b, b.kv_lo, tid);
    load_q<Cfg>(p, b, kv_head, group, reinterpret_cast<QT*>(smem + Cfg::kQOffset), tid);
    load_kv_tile<Cfg>(p, b, rows, kv_head, b.kv_lo, smem, 0, tid);
    cp_async_commit();
    if (num_tiles > 1) rows.fetch(p, b, b.kv_lo + Cfg::kKvTile, tid);
    for (int t = 0; t < num_tiles; ++t) {
      const int stage = t & 1;
      const int j0 = b.kv_lo + t * Cfg::kKvTile;
      cp_async_wait<0>();
      __syncthreads();  // tile t landed for everyone; everyone is done with tile t - 1
      if (t + 1 < num_tiles) {
        load_kv_tile<Cfg>(p, b, rows, kv_head, j0 + Cfg::kKvTile, smem, stage ^ 1, tid);
        cp_async_commit();
        if (t + 2 < num_tiles) rows.fetch(p, b, j0 + 2 * Cfg::kKvTile, tid);
      }
      uint32_t stage_off = 0;
      if constexpr (Cfg::kFp8) {
        widen_fp8_tile<Cfg, Cfg::kDqk>(smem + Cfg::kK8Offset + stage * Cfg::kK8StageBytes,
                                       reinterpret_cast<QT*>(smem + Cfg::kKOffset), tid);
        widen_fp8_tile<Cfg, Cfg::kDv>(smem + Cfg::kV8Offset + stage * Cfg::kV8StageBytes,
                                      reinterpret_cast<QT*>(smem + Cfg::kVOffset), tid);
        __syncthreads();
      } else {
        stage_off = stage;
      }

      float s[Cfg::kMTiles][kNTiles][4];
      qk_product<Cfg>(fa, stage_off * Cfg::kKStageBytes, s);
      if (soft_cap) apply_soft_cap<Cfg>(s, p.logits_soft_cap, scale_over_cap);
      if (!tile_is_full(p, b, j0, Cfg::kKvTile))
        apply_mask<Cfg::kMTiles, kNTiles>(s, p, b, group, warp_row0, j0, lane);
      softmax.update(s, o, c);
      PFragments<Cfg> pf;
      pack_p<Cfg>(s, pf);
      pv_product<Cfg>(pf, fa, stage_off * Cfg::kVStageBytes, o);
    }
  }

  float scale[Cfg::kMTiles][2], lse[Cfg::kMTiles][2];
  softmax.finish(c, scale, lse, Cfg::kFp8 ? p.v_scale : 1.0f);
  store_block<Cfg>(p, b, kv_head, group, warp_row0, lane, smem, o, scale, lse);
}

// grid (workers, Hkv), kPrefillThreads threads; CTA (w, h) runs worker w's items for KV head h.
template <typename Cfg>
__global__ void __launch_bounds__(kPrefillThreads, 2)
    prefill_kernel(const __grid_constant__ AttentionParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  // A dependent launched with programmatic stream serialization (a merged prefix pass after
  // this one) may be scheduled as this grid's CTAs retire; it waits before reading our outputs.
  ptx::launch_dependents();
  for_each_row_block<Cfg::kCtaRows>(p, [&](const RowBlock& b, int kv_head, int group) {
    run_block<Cfg>(p, b, kv_head, group, smem);
  });
  // Launched early (programmatic dependent launch), the grid must not finish before the kernel
  // it overlaps: the next launch in the stream (the split merge, which reads the merge state)
  // waits only for this grid.
  if (p.merge_o) ptx::grid_dependency_wait();
}

template <int DQK, int DV, typename QT, KvFormat KVF>
void launch_prefill(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = TileConfig<DQK, DV, QT, KVF>;
  const auto kernel = prefill_kernel<Cfg>;
  detail::cuda_check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes),
      "prefill: cudaFuncSetAttribute");
  // Overlap with the kernel before only where the kernel waits for it (a merge state) and the
  // architecture has programmatic dependent launch.
  const bool programmatic = p.merge_o && p.overlap_previous && current_device_cc() >= 90;
  launch_kernel(kernel, dim3(p.num_workers, p.num_kv_heads, 1), dim3(kPrefillThreads, 1, 1),
                Cfg::kSmemBytes, stream, programmatic, "prefill: kernel launch", p);
}

}  // namespace flashkv::cuda::prefill_detail

// Explicit instantiation of one (head dims, dtype, KV format) variant.
#define FLASHKV_INSTANTIATE_PREFILL(DQK, DV, QT, KVF)                            \
  template void flashkv::cuda::prefill_detail::launch_prefill<DQK, DV, QT, KVF>( \
      const flashkv::AttentionParams&, cudaStream_t)
