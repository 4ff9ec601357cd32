// The Hopper (sm_90a) prefill kernel for 16-bit Q/K/V at head dim 128 (the cp.async one; the
// warp-specialized kernel of kernel_sm90_ws.cuh runs first where it applies): the same work split,
// masks, softmax and stores as the sm_80 kernel (kernel.cuh), with both products on warpgroup
// MMAs (wgmma.cuh). A CTA is two warpgroups of 64 packed query rows each (128 rows, the plan's
// row tile at head dim 128); Q.K^T reads Q and K straight from shared memory, and P.V takes P from
// registers (the Q.K^T accumulators, packed in place) and V from shared memory. KV tiles of 128
// keys go through a two-stage cp.async pipeline: while the warpgroups multiply tile t, tile t + 1
// is in flight and the page indices of tile t + 2 are being read. Each warp's accumulators have
// the mma.sync layout of 16 rows, so the sm_80 kernel's masks, online softmax and epilogue apply
// as they are (one 16-row tile a warp).
//
// Included only by cuda/inst/prefill_sm90_d*.cu.
#pragma once

#include <cuda_runtime.h>

#include "common/kernel_launch.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/options.h"
#include "prefill/epilogue.cuh"
#include "prefill/kernel_sm90_ws.cuh"
#include "prefill/launch.h"
#include "prefill/load.cuh"
#include "prefill/mainloop.cuh"
#include "prefill/mask.cuh"
#include "prefill/softmax.cuh"
#include "prefill/wgmma.cuh"

namespace flashkv::cuda::prefill_detail {

template <typename QT>
struct Sm90Config : Sm90Shape<QT> {
  using Base = Sm90Shape<QT>;
  static constexpr int kWarps = 8, kThreads = kWarps * 32;
  // Q and every K / V stage are [128, 128] tiles at this kernel's one head dim.
  static constexpr int kTileBytes = Base::kQTileBytes;
  static_assert(Base::kKTileBytes == kTileBytes && Base::kVTileBytes == kTileBytes,
                "128-key tiles");
  // K is read by tile t's Q.K^T while V is read by tile t - 1's P.V: two K stages, three V.
  static constexpr int kKStages = 2, kVStages = 3;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kTileBytes;
  static constexpr int kVOffset = kKOffset + kKStages * kTileBytes;
  // Tiles must start on 1024-byte swizzle atoms: the dynamic allocation has that much slack.
  static constexpr int kSmemBytes = kVOffset + kVStages * kTileBytes + 1024;
};

// Thread t copies 16-byte chunks t % 8 and t % 8 + 8 (both halves) of rows t / 8 + 32 i.
constexpr int kSm90RowsPerPass = 256 / 8;

// The block's packed Q rows -> the swizzled Q tile; padding rows are zero-filled.
template <typename Cfg>
__device__ __forceinline__ void load_q_sm90(const AttentionParams& p, const RowBlock& b,
                                            int kv_head, int group, unsigned char* tile, int tid) {
  using QT = typename Cfg::Q;
#pragma unroll
  for (int i = 0; i < Cfg::kCtaRows / kSm90RowsPerPass; ++i) {
    const int row = (tid >> 3) + i * kSm90RowsPerPass;
    bool valid;
    const QT* src = q_row_source<QT>(p, b, kv_head, group, row, (tid & 7) * 8, valid);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      cp_async_16(tile + sm90::tile_offset(Cfg::kCtaRows, row, (tid & 7) + 8 * h),
                  valid ? src + 64 * h : src, valid ? 16 : 0);
  }
}

// One operand (K or V) of a KV tile: rows[i] is the element offset of key tid / 8 + 32 i in the
// operand's tensor (head included), or -1 past the range (zero-filled).
template <typename Cfg>
__device__ __forceinline__ void load_operand_sm90(const typename Cfg::Q* src,
                                                  const int64_t (&rows)[Cfg::kKvTile / 32],
                                                  unsigned char* tile, int tid) {
#pragma unroll
  for (int i = 0; i < Cfg::kKvTile / kSm90RowsPerPass; ++i) {
    const bool valid = rows[i] >= 0;
    const typename Cfg::Q* row_src = src + (valid ? rows[i] + (tid & 7) * 8 : 0);
    const int row = (tid >> 3) + i * kSm90RowsPerPass;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      cp_async_16(tile + sm90::tile_offset(Cfg::kKvTile, row, (tid & 7) + 8 * h),
                  valid ? row_src + 64 * h : row_src, valid ? 16 : 0);
  }
}

template <typename Cfg>
__device__ __forceinline__ void load_kv_sm90(const AttentionParams& p, const RowBlock& b,
                                             const KvTileRows<Cfg>& rows, int kv_head, int j0,
                                             unsigned char* smem, int tile, int tid) {
  using QT = typename Cfg::Q;
  int64_t k_rows[KvTileRows<Cfg>::kRows], v_rows[KvTileRows<Cfg>::kRows];
  rows.offsets(p, b, j0, tid, p.k_stride_n, kv_head * p.k_stride_h, k_rows);
  rows.offsets(p, b, j0, tid, p.v_stride_n, kv_head * p.v_stride_h, v_rows);
  load_operand_sm90<Cfg>(static_cast<const QT*>(p.k), k_rows,
                         smem + Cfg::kKOffset + tile % Cfg::kKStages * Cfg::kTileBytes, tid);
  load_operand_sm90<Cfg>(static_cast<const QT*>(p.v), v_rows,
                         smem + Cfg::kVOffset + tile % Cfg::kVStages * Cfg::kTileBytes, tid);
}

// One row block (see run_block in kernel.cuh; the same contract).
template <typename Cfg>
__device__ __forceinline__ void run_block_sm90(const AttentionParams& p, const RowBlock& b,
                                               int kv_head, int group, unsigned char* smem) {
  using QT = typename Cfg::Q;
  constexpr int kNTiles = Cfg::kKvTile / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warpgroup = warp >> 2;
  const int warp_row0 = warp * Cfg::kRowsPerWarp;

  float o[1][Cfg::kDv / 8][4];
  zero_output(o);
  float(&o_acc)[64] = reinterpret_cast<float(&)[64]>(o);
  OnlineSoftmax<1> softmax;
  softmax.init();

  const float logit_scale = p.sm_scale;
  const bool soft_cap = p.logits_soft_cap > 0.0f;
  const float c = soft_cap ? kLog2e : logit_scale * kLog2e;
  const float scale_over_cap = soft_cap ? logit_scale / p.logits_soft_cap : 0.0f;

  const uint32_t base = smem_addr(smem);
  const uint32_t q_tile = base + Cfg::kQOffset;
  const int num_tiles =
      b.kv_hi > b.kv_lo ? (b.kv_hi - b.kv_lo + Cfg::kKvTile - 1) / Cfg::kKvTile : 0;
  if (num_tiles > 0) {
    KvTileRows<Cfg> rows;
    rows.fetch(p, b, b.kv_lo, tid);
    load_q_sm90<Cfg>(p, b, kv_head, group, smem + Cfg::kQOffset, tid);
    load_kv_sm90<Cfg>(p, b, rows, kv_head, b.kv_lo, smem, 0, tid);
    cp_async_commit();
    if (num_tiles > 1) rows.fetch(p, b, b.kv_lo + Cfg::kKvTile, tid);
    float s[1][kNTiles][4];
    float(&s_acc)[64] = reinterpret_cast<float(&)[64]>(s);
    PFragments<Cfg> pf;  // P of the previous tile, the A operand of its P.V
    // Tile t: wait for its K/V (and retire what tile t + 1's copies overwrite), start those
    // copies, then issue S_t = Q.K_t^T and, behind it, P_{t-1}.V_{t-1}; the softmax of S_t runs
    // while the tensor cores still work on P_{t-1}.V_{t-1}, and O is rescaled only after it.
    for (int t = 0; t < num_tiles; ++t) {
      const int j0 = b.kv_lo + t * Cfg::kKvTile;
      cp_async_wait<0>();
      sm90::fence_async_shared();
      // Tile t landed for everyone; both warpgroups are past S_{t-1} (K stage (t + 1) % 2) and
      // P_{t-2}.V_{t-2} (V stage (t + 1) % 3).
      __syncthreads();
      if (t + 1 < num_tiles) {
        load_kv_sm90<Cfg>(p, b, rows, kv_head, j0 + Cfg::kKvTile, smem, t + 1, tid);
        cp_async_commit();
        if (t + 2 < num_tiles) rows.fetch(p, b, j0 + 2 * Cfg::kKvTile, tid);
      }
      const uint32_t k_tile = base + Cfg::kKOffset + t % Cfg::kKStages * Cfg::kTileBytes;
      sm90::fence();
#pragma unroll
      for (int k = 0; k < Cfg::kDqk / 16; ++k)
        sm90::mma_ss<QT>(s_acc, sm90::k_major(q_tile, Cfg::kCtaRows, warpgroup * 64, k),
                         sm90::k_major(k_tile, Cfg::kKvTile, 0, k), k > 0);
      sm90::commit();
      if (t > 0) {
        const uint32_t v_prev = base + Cfg::kVOffset + (t - 1) % Cfg::kVStages * Cfg::kTileBytes;
#pragma unroll
        for (int kk = 0; kk < Cfg::kKvTile / 16; ++kk)
          sm90::mma_rs<QT>(o_acc, pf[0][kk], sm90::n_major(v_prev, Cfg::kKvTile, kk));
        sm90::commit();
        sm90::wait<1>();  // S_t (P_{t-1}.V_{t-1} may still run)
      } else {
        sm90::wait<0>();
      }
      if (soft_cap) apply_soft_cap<Cfg>(s, p.logits_soft_cap, scale_over_cap);
      if (!tile_is_full(p, b, j0, Cfg::kKvTile))
        apply_mask<1, kNTiles>(s, p, b, group, warp_row0, j0, lane);
      float corr[1][2];
      const bool moved = softmax.update_scores(s, c, corr);
      sm90::wait<0>();  // P_{t-1}.V_{t-1}: O and pf are free
      if (moved) softmax.rescale(o, corr);
      pack_p<Cfg>(s, pf);
    }
    // The last tile's P.V (its V stage is not overwritten: no copies are left).
    const uint32_t v_last =
        base + Cfg::kVOffset + (num_tiles - 1) % Cfg::kVStages * Cfg::kTileBytes;
    sm90::fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::kKvTile / 16; ++kk)
      sm90::mma_rs<QT>(o_acc, pf[0][kk], sm90::n_major(v_last, Cfg::kKvTile, kk));
    sm90::commit();
    sm90::wait<0>();
  }

  float scale[1][2], lse[1][2];
  softmax.finish(c, scale, lse, 1.0f);
  // A merged store stages the state in the warp's Q rows, which in this layout hold other warps'
  // rows too: every warp must be past its last Q.K^T first.
  if (p.merge_o != nullptr && b.partial < 0) __syncthreads();
  store_block<Cfg>(p, b, kv_head, group, warp_row0, lane, smem, o, scale, lse);
}

// grid (workers, Hkv), 256 threads; CTA (w, h) runs worker w's items for KV head h.
template <typename QT>
__global__ void __launch_bounds__(256, 1)
    prefill_sm90_kernel(const __grid_constant__ AttentionParams p) {
  using Cfg = Sm90Config<QT>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  ptx::launch_dependents();
  for_each_row_block<Cfg::kCtaRows>(p, [&](const RowBlock& b, int kv_head, int group) {
    run_block_sm90<Cfg>(p, b, kv_head, group, smem);
  });
  if (p.merge_o) ptx::grid_dependency_wait();  // see prefill_kernel
}

template <typename QT, int D, int DV, KvFormat F>
void launch_prefill_sm90(const AttentionParams& p, cudaStream_t stream) {
  // The warp-specialized kernel (kernel_sm90_ws.cuh) unless FLASHKV_PREFILL_SM90_WS=0, or for
  // paged K/V FLASHKV_PREFILL_SM90_WS_PAGED=0 (core/options.h), or where it does not apply;
  // then with 16-bit K/V at head dim 128 the cp.async kernel above, else the sm_80 kernel.
  if (env_prefill_sm90_ws() && launch_prefill_sm90_ws<QT, D, DV, F>(p, stream)) return;
  if constexpr (D != 128 || DV != 128 || F != KvFormat::kSame) {
    launch_prefill<D, DV, QT, F>(p, stream);
  } else {
    using Cfg = Sm90Config<QT>;
    const auto kernel = prefill_sm90_kernel<QT>;
    detail::cuda_check(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes),
        "prefill: cudaFuncSetAttribute");
    const bool programmatic = p.merge_o && p.overlap_previous;
    launch_kernel(kernel, dim3(p.num_workers, p.num_kv_heads, 1), dim3(Cfg::kThreads, 1, 1),
                  Cfg::kSmemBytes, stream, programmatic, "prefill: kernel launch", p);
  }
}

}  // namespace flashkv::cuda::prefill_detail
