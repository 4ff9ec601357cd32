// Compile-time shape of one paged-decode kernel instantiation, and the launcher declarations
// that cuda/decode.cu dispatches to (defined in decode_kernel.cuh, instantiated per head dim
// in cuda/inst/decode_d*.cu).
#pragma once

#include <cuda_runtime.h>

#include "common/convert.cuh"
#include "flashkv/kernels/params.h"

namespace flashkv::cuda::decode_detail {

constexpr int kStages = 3;  // KV tiles: one being computed, two in flight
// Shared memory one CTA may use so that two fit on an SM (228 KB, 1 KB reserved per CTA).
constexpr int kSmemBudget = 112 * 1024;
// Items of a CTA whose views (decode_kernel.cuh, ItemView) are made once into shared memory.
constexpr int kItemSlots = 32;
constexpr int kItemViewBytes = 24;

// D: head dim (Q/K and V alike); kKv: KV element kind; kNTiles: 8-head column tiles of the
// mma (the CTA handles up to 8 * kNTiles query heads of one KV head).
template <int D, KvFormat kKv, int kNTiles>
struct Traits {
  static_assert(D % 64 == 0, "head dims 64, 128, 256");
  static constexpr int kHeadDim = D;
  // fp8 KV needs twice the MMA/softmax work per byte of 16-bit KV (and the conversions): its
  // 128-token tiles get 8 warps, one 16-token block each, to hide that work's latency. The
  // register cap this implies (128 for two CTAs of 256 threads) only fits one head tile and
  // D <= 128.
  static constexpr int kWarps = (kKv != KvFormat::kSame && D <= 128 && kNTiles == 1) ? 8 : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKvBytes = kKv == KvFormat::kSame ? 2 : 1;
  static constexpr int kRowBytes = D * kKvBytes;  // one token's K (or V) row of one KV head
  static constexpr int kChunks = kRowBytes / 16;  // 16-byte chunks per row
  static constexpr bool kSwizzle = kChunks >= 8;  // XOR the chunk with (row & 7)
  static constexpr int kHeads = 8 * kNTiles;
  static constexpr int kKSteps = D / 16;  // k16 steps of Q.K^T
  static constexpr int kMTiles = D / 16;  // 16-dim tiles of O^T = V^T P^T
  static constexpr int kQBytes = kHeads * D * 2;
  static constexpr int kOutStride = D + 4;  // floats per head of the finalize buffer
  static constexpr int kOutBytes = kHeads * kOutStride * 4;
  static constexpr int kRedBytes = (2 * kWarps + 2) * kHeads * 4;
  static constexpr int kIndexSlots = kStages + 1;  // kv_indices ring (see decode_kernel.cuh)
  // KV tokens per pipeline stage: as many 16-token blocks as fit the budget, at most 8 copy
  // passes of the whole CTA per stage.
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kTokenStep = kRowsPerPass > 16 ? kRowsPerPass : 16;  // both powers of 2
  static constexpr int kItemBytes = kItemSlots * kItemViewBytes;
  static constexpr int kFitTokens =
      ((kSmemBudget - kOutBytes - kRedBytes - kItemBytes) / kStages - kQBytes) /
      (2 * kRowBytes + 8) / kTokenStep * kTokenStep;
  static constexpr int kTileTokens = kFitTokens < 8 * kRowsPerPass ? kFitTokens : 8 * kRowsPerPass;
  static constexpr int kPasses = kTileTokens / kRowsPerPass;
  static constexpr int kBlocks = kTileTokens / 16;
  static constexpr int kTileBytes = kTileTokens * kRowBytes;
  static constexpr int kStageBytes = 2 * kTileBytes + kQBytes;  // K tile, V tile, Q slot
  static constexpr int kIndexBytes = kIndexSlots * kTileTokens * 4;
  static constexpr int kSmemBytes =
      kStages * kStageBytes + kOutBytes + kRedBytes + kIndexBytes + kItemBytes;
  static_assert(kTileTokens >= 16 && kTileTokens % kRowsPerPass == 0, "tile shape");
  static_assert(kSmemBytes <= kSmemBudget, "shared memory budget");
  // The merge at the end lists up to 32 tiles (16 bytes each) in the finalize buffer.
  static_assert(kOutBytes >= 32 * 16 && kRedBytes >= 4, "merge list");
};

// Launches the decode kernel for p (grid: p.num_workers x Hkv x head groups); `programmatic`:
// with programmatic stream serialization (sm_90: may start before the previous kernel ends).
template <int D, typename QT, KvFormat kKv, int kNTiles>
void launch_decode(const AttentionParams& p, cudaStream_t stream, bool programmatic);

// Explicit instantiations of one head dim and head-tile count for every query / KV type pair
// (used by cuda/inst/decode_d*.cu, one file per head dim so the builds run in parallel).
#define FLASHKV_DECODE_INSTANTIATE_ONE(D, QT, KV, NT) \
  template void launch_decode<D, QT, KvFormat::KV, NT>(const AttentionParams&, cudaStream_t, bool);
#define FLASHKV_DECODE_INSTANTIATE(D, NT)                     \
  FLASHKV_DECODE_INSTANTIATE_ONE(D, __nv_bfloat16, kSame, NT) \
  FLASHKV_DECODE_INSTANTIATE_ONE(D, __nv_bfloat16, kE4M3, NT) \
  FLASHKV_DECODE_INSTANTIATE_ONE(D, __nv_bfloat16, kE5M2, NT) \
  FLASHKV_DECODE_INSTANTIATE_ONE(D, half, kSame, NT)          \
  FLASHKV_DECODE_INSTANTIATE_ONE(D, half, kE4M3, NT)          \
  FLASHKV_DECODE_INSTANTIATE_ONE(D, half, kE5M2, NT)

}  // namespace flashkv::cuda::decode_detail
