// The warp-specialized Hopper (sm_90a) prefill kernel for 16-bit and fp8 K/V at head dims 64, 128,
// 256 and 192 / 128, ragged (contiguous) or paged. A CTA is three warpgroups:
//   - a producer, which walks the plan's row blocks and hands each to the consumers with its Q (the
//     block's geometry in a shared-memory slot, block_slot), fills two-stage rings of K and V tiles
//     (128 keys; 64 at head dim 256 and with fp8 at 192 / 128), each stage handed over on
//     mbarriers (full: the bytes landed; empty: every consumer warp is done reading it), and
//     copies the block's packed Q rows (two Q stages, so the next block's Q arrives while this one
//     runs; one at head dim 256, whose Q tile is 64 KB, and with 16-bit K/V at 192 / 128; there
//     the block's first K/V tiles go ahead of its Q), by TMA where the block has 128 rows and
//     the group divides 64, else with cp.async (fill_q_stage). Ragged K/V: one thread
//     issues the tensor-memory-access (TMA) copies of whole tiles, and the warpgroup copies a tile
//     that runs past the block's keys with zero-filled cp.async copies, so that no key outside the
//     range can put a NaN into P.V. Paged K/V: the threads gather every tile's rows with cp.async
//     (thread t looks up key t's slot a tile ahead), and the copies themselves arrive on the full
//     barrier as they land (cp.async.mbarrier.arrive.noinc), so the producer never waits for its
//     own copies. fp8 K/V (ragged or paged): the threads copy each tile's fp8 rows into a staging
//     ring the same way, then widen them exactly into the 16-bit rings in f16, in which both
//     products then run (produce_fp8_block; Sm90WsConfig::Mma: with bf16 Q the consumers first
//     rewrite their Q rows in f16, q_rows_to_f16);
//   - two consumers of 64 packed query rows each (the plan's 128-row tile), issuing as
//     kernel_sm90.cuh does S_t = Q.K_t^T with P_{t-1}.V_{t-1} behind it. They take turns to issue
//     their products (two named barriers), so one warpgroup's softmax runs under the other's
//     products. A warpgroup waits for K_t before its turn and for V_{t-1} between its two
//     issues, so that it holds the turn only to issue. With ragged K/V at head dim 128 a warpgroup
//     also runs its softmax under its own P.V, waiting for it at its next turn (kLateWait in
//     consume); elsewhere it waits for it after the tile's mask, then takes the exponentials
//     straight into P's fragments against the running reference, without the tile's row maxima
//     (OnlineSoftmax::update_scores_ahead), and runs the exact update only where that fails.
// No barrier spans the CTA inside the KV loop: the warpgroups only meet through the rings.
// Masks, the online softmax and the epilogue are the sm_80 kernel's, one 16-row tile a warp.
//
// The parts: sm90_ws_config.cuh (shapes, shared memory layout, rings and barriers),
// sm90_ws_producer.cuh and sm90_ws_consumer.cuh; this file holds the kernel and its launch.
// tests/model/ws_prefill_protocol.py models how the warpgroups hand the stages over.
//
// Included (through kernel_sm90.cuh) only by cuda/inst/prefill_sm90_d*.cu.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/kernel_launch.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/options.h"
#include "prefill/launch.h"
#include "prefill/sm90_ws_config.cuh"
#include "prefill/sm90_ws_consumer.cuh"
#include "prefill/sm90_ws_producer.cuh"

namespace flashkv::cuda::prefill_detail {

// grid (workers, Hkv), 384 threads; CTA (w, h) runs worker w's items for KV head h. `maps` is
// unused with fp8 K/V, and with paged K/V unless its paged_box is set.
template <typename QT, int D, int DV, KvFormat F, bool kPaged>
__global__ void __launch_bounds__(384, 1)
    prefill_sm90_ws_kernel(const __grid_constant__ AttentionParams p,
                           const __grid_constant__ Sm90TmaMaps maps) {
  using Cfg = Sm90WsConfig<QT, D, DV, F>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  const WsBarriers<Cfg> bars{smem_addr(smem + Cfg::kBarOffset)};
  const int tid = threadIdx.x;
  if (tid == 0) {
    // Q full: one arrival per producer thread's copies, and producer thread 0's after it wrote
    // the stage's row block.
    for (int s = 0; s < Cfg::kQStages; ++s) {
      sm90::mbar_init(bars.q_full(s), 128 + 1);
      sm90::mbar_init(bars.q_empty(s), 8);
    }
    // K/V full: one arrival with the TMA's byte count (or after the copies of a tile that runs
    // past the block's keys), or one per producer thread (its copies with paged K/V, its widened
    // stores with fp8). Paged K takes one more where the producer hands over custom-mask
    // verdicts, from thread 0, which publishes the tile's (tile_hides_none).
    const int full_arrivals = kPaged || Cfg::kFp8 ? 128 : 1;
    const int k_full_arrivals = full_arrivals + (kPaged && Cfg::kPagedMaskVerdicts ? 1 : 0);
    for (int s = 0; s < Cfg::kKvStages; ++s) {
      sm90::mbar_init(bars.k_full(s), k_full_arrivals);
      sm90::mbar_init(bars.k_empty(s), 8);
      sm90::mbar_init(bars.v_full(s), full_arrivals);
      sm90::mbar_init(bars.v_empty(s), 8);
    }
    for (int s = 0; s < Cfg::kFp8Stages; ++s) {
      sm90::mbar_init(bars.staged(0, s), 128);
      sm90::mbar_init(bars.staged(1, s), 128);
    }
    ws::fence_barrier_init();
  }
  __syncthreads();
  ptx::launch_dependents();
  if (tid < 128) {
    ws::release_registers<40>();
    produce<Cfg, kPaged>(p, maps, smem, bars, tid);
  } else {
    ws::claim_registers<232>();
    consume<Cfg, kPaged>(p, smem, bars, tid - 128);
    if (p.merge_o) ptx::grid_dependency_wait();  // see prefill_kernel
  }
}

// The driver's cuTensorMapEncodeTiled, through the runtime (no link against the driver library).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr,
                                                                12000, cudaEnableDefault, &found);
    return status == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr)
               : nullptr;
  }();
  return fn;
}

// A 16-bit [rows, heads, head_dim] tensor (element strides stride_n, stride_h) as a TMA tensor map
// of boxes of box_rows rows x box_heads heads x 64 dims, with the 128-byte swizzle; false where the
// layout does not allow one.
inline bool encode_map(CUtensorMap* map, const void* data, CUtensorMapDataType type, int64_t rows,
                       int heads, int head_dim, int box_heads, int box_rows, int64_t stride_n,
                       int64_t stride_h) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || rows <= 0 || rows > (int64_t{1} << 31) - 1) return false;
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0) return false;
  const uint64_t dims[3] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(rows)};
  const uint64_t strides[2] = {static_cast<uint64_t>(stride_h) * 2,
                               static_cast<uint64_t>(stride_n) * 2};
  for (const uint64_t st : strides)
    if (st % 16 != 0 || st >= (uint64_t{1} << 40)) return false;
  const uint32_t box[3] = {64, static_cast<uint32_t>(box_heads), static_cast<uint32_t>(box_rows)};
  const uint32_t element_strides[3] = {1, 1, 1};
  return encode(map, type, 3, const_cast<void*>(data), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// K or V ([num_kv_rows, Hkv, head_dim]) in boxes of box_rows rows of one head; false where the
// layout does not allow a map (the caller then runs a kernel that copies with cp.async).
inline bool encode_kv_map(CUtensorMap* map, const void* data, CUtensorMapDataType type,
                          const AttentionParams& p, int head_dim, int box_rows, int64_t stride_n,
                          int64_t stride_h) {
  return encode_map(map, data, type, p.num_kv_rows, p.num_kv_heads, head_dim, 1, box_rows, stride_n,
                    stride_h);
}

// Q ([num_qo_tokens, Hq, head_dim]) in boxes of one consumer warpgroup's 64 packed rows: 64 / G
// tokens x the G query heads of a K/V head; false where G does not divide 64 or the layout allows
// no map (fill_q_stage then copies Q with cp.async).
template <typename Cfg>
bool encode_q_map(CUtensorMap* map, CUtensorMapDataType type, const AttentionParams& p) {
  const int group = p.num_kv_heads > 0 ? p.num_qo_heads / p.num_kv_heads : 0;
  if (group <= 0 || Cfg::kWgRows % group != 0) return false;
  return encode_map(map, p.q, type, p.num_qo_tokens, p.num_qo_heads, Cfg::kDqk, group,
                    Cfg::kWgRows / group, p.q_stride_n, p.q_stride_h);
}

// Launches the warp-specialized kernel; false (nothing launched) where it does not apply: paged
// K/V with FLASHKV_PREFILL_SM90_WS_PAGED=0, paged or fp8 K/V in a pool of 2^31 rows or more (the
// producer addresses rows with 32 bits), or 16-bit ragged K/V in a layout no tensor map can
// describe.
template <typename QT, int D, int DV, KvFormat F>
bool launch_prefill_sm90_ws(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = Sm90WsConfig<QT, D, DV, F>;
  Sm90TmaMaps maps{};
  if (p.paged && !env_prefill_sm90_ws_paged()) return false;
  const CUtensorMapDataType type = std::is_same<QT, __half>::value
                                       ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  if (p.paged || Cfg::kFp8) {
    if (p.num_kv_rows > (int64_t{1} << 31) - 1) return false;
    // Pages of 16 to 128 tokens (a power of two, at most a tile) map as boxes of one page.
    const int ps = p.page_size;
    if (p.paged && !Cfg::kFp8 && env_prefill_sm90_paged_tma() && ps >= 16 && ps <= Cfg::kKvTile &&
        (ps & (ps - 1)) == 0 &&
        encode_kv_map(&maps.k, p.k, type, p, D, ps, p.k_stride_n, p.k_stride_h) &&
        encode_kv_map(&maps.v, p.v, type, p, DV, ps, p.v_stride_n, p.v_stride_h))
      maps.paged_box = ps;
  } else {
    if (!encode_kv_map(&maps.k, p.k, type, p, D, Cfg::kKvTile, p.k_stride_n, p.k_stride_h) ||
        !encode_kv_map(&maps.v, p.v, type, p, DV, Cfg::kKvTile, p.v_stride_n, p.v_stride_h))
      return false;
  }
  maps.q_by_tma = encode_q_map<Cfg>(&maps.q, type, p);
  auto kernel = p.paged ? prefill_sm90_ws_kernel<QT, D, DV, F, true>
                        : prefill_sm90_ws_kernel<QT, D, DV, F, false>;
  constexpr int smem_bytes = Cfg::kSmemBytes;
  detail::cuda_check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
      "prefill: cudaFuncSetAttribute");
  launch_kernel(kernel, dim3(p.num_workers, p.num_kv_heads, 1), dim3(Cfg::kThreads, 1, 1),
                smem_bytes, stream, p.merge_o && p.overlap_previous, "prefill: kernel launch", p,
                maps);
  return true;
}

}  // namespace flashkv::cuda::prefill_detail
