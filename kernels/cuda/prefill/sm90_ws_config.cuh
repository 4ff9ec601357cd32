// The warp-specialized Hopper prefill kernel (kernel_sm90_ws.cuh), part 1: its shapes and shared
// memory layout (Sm90Shape, which the cp.async sm_90a kernel shares, and Sm90WsConfig), the TMA
// maps, the PTX it issues beyond wgmma.cuh (mbarrier transactions, TMA, register reallocation),
// and the rings and barriers the producer and the consumers hand stages over on.
//
// Included by kernel_sm90_ws.cuh.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "common/kv_format.h"
#include "prefill/launch.h"
#include "prefill/mask.cuh"
#include "prefill/wgmma.cuh"

namespace flashkv::cuda::prefill_detail {

// What both sm_90a kernels share: 16-bit Q/K/V at head dims D (Q.K^T) and DV (P.V) (the
// warp-specialized kernel: 64, 128 or 256 for both, or 192 / 128; the cp.async one: 128),
// 128-row blocks of 16 rows a consumer warp (one mma.sync-layout tile, so the sm_80 masks, softmax
// and epilogue apply), and K/V tiles of D / 64 (DV / 64) halves, each [KvTile, 64] half one
// 128-byte line a key. The tiles are 128 keys, 64 at head dim 256 (there a consumer thread's O is
// already 128 registers, 64 rows x 256 dims over 128 threads, and a 128-key stage would be 64 KB)
// and with fp8 K/V at 192 / 128 (ws_kv_tile).
template <typename QT, int D = 128, int DV = D, int KvTile = D == 256 ? 64 : 128>
struct Sm90Shape {
  static_assert((D == DV && (D == 64 || D == 128 || D == 256)) || (D == 192 && DV == 128),
                "the sm_90a kernels take head dims 64, 128, 256 and 192 / 128");
  using Q = QT;
  static constexpr KvFormat kKvFormat = KvFormat::kSame;
  static constexpr bool kFp8 = false;
  static constexpr int kDqk = D, kDv = DV;
  // 64-dim halves of a row (128-byte swizzle lines) of Q and K, and of V.
  static constexpr int kQkHalves = D / 64, kVHalves = DV / 64;
  static constexpr int kMTiles = 1;  // 16 rows a warp
  static constexpr int kRowsPerWarp = 16;
  static constexpr int kCtaRows = 128;
  static constexpr int kKvTile = KvTile;
  static_assert(KvTile == 64 || KvTile == 128, "64- or 128-key tiles");
  static constexpr int kQkChunks = kDqk / 8, kVChunks = kDv / 8;
  static constexpr int kQTileBytes = kCtaRows * D * 2;  // one Q stage
  static constexpr int kKTileBytes = kKvTile * D * 2;   // one stage of K
  static constexpr int kVTileBytes = kKvTile * DV * 2;  // one stage of V
  // The plan's row tile is 128 packed rows at every head dim (plan.cpp, q_tile_of); the sm_80
  // kernel walks it in blocks of its own 64 rows at head dim 256.
  static_assert(D == 256 || kCtaRows == prefill_cta_rows_of(kDv), "the plan's row tile");
};

// The warp-specialized kernel's K/V tile: Sm90Shape's, but 64 keys with fp8 K/V at 192 / 128,
// where 128-key tiles leave no room for a staging stage (one Q stage of 48 KB, two K stages of 48
// KB and two V stages of 32 KB: 208 KB); with 64-key tiles two Q stages, two K and V stages and
// two staging stages fit.
template <int D, int DV, KvFormat F>
constexpr int ws_kv_tile() {
  return D == 256 || (F != KvFormat::kSame && D != DV) ? 64 : 128;
}

// F: K/V in Q's type (kSame), or fp8 (kE4M3 / kE5M2), which the producer copies into a staging
// ring of plain fp8 rows and widens (exactly) into the 16-bit K and V rings the consumers read.
template <typename QT, int D, int DV = D, KvFormat F = KvFormat::kSame>
struct Sm90WsConfig : Sm90Shape<QT, D, DV, ws_kv_tile<D, DV, F>()> {
  using Base = Sm90Shape<QT, D, DV, ws_kv_tile<D, DV, F>()>;
  static constexpr KvFormat kKvFormat = F;
  static constexpr bool kFp8 = F != KvFormat::kSame;
  // The 16-bit type of both products (Q.K^T and P.V): Q's, but f16 with fp8 K/V. e4m3 and e5m2
  // widen to f16 in one conversion a pair against four to bf16, and the producer is short of
  // issue slots; P, in [0, 1], keeps three more mantissa bits in f16 than in bf16. With bf16 Q
  // (kQToF16) the consumers rewrite their Q rows in f16 first, scaled by a power of two
  // (q_rows_to_f16).
  using Mma = std::conditional_t<kFp8, __half, QT>;
  static constexpr bool kQToF16 = !std::is_same<QT, Mma>::value;
  static constexpr int kThreads = 384;  // producer warpgroup, then two consumer warpgroups
  static constexpr int kWgRows = 64;    // a consumer warpgroup's rows
  using Base::kKTileBytes;
  using Base::kKvTile;
  using Base::kQTileBytes;
  using Base::kVTileBytes;
  static constexpr int kKvStages = 2;
  static constexpr int kSmemLimit = 227 * 1024 - 2048;  // less the barriers and alignment slack
  static constexpr int kRingBytes = kKvStages * (kKTileBytes + kVTileBytes);
  // fp8: one staging stage holds a tile's fp8 K and V rows. Two where they fit beside two Q
  // stages and the K and V rings (head dim 64), so that a tile's copies are in flight while
  // the one before is widened; else one, whose copies run an operand ahead of the widening (head
  // dims 128 and 256). Two Q stages and one staging stage ran faster at 128 than one Q stage and
  // two staging stages (docs/perf/prefill.md). At 192 / 128, in 64-key tiles, two fit.
  static constexpr int kStagingBytes = kFp8 ? kKvTile * (D + DV) : 0;
  static constexpr int kFp8Stages =
      !kFp8 ? 0 : (2 * kQTileBytes + kRingBytes + 2 * kStagingBytes <= kSmemLimit ? 2 : 1);
  // Two Q stages where they fit beside the K and V rings, so that the next block's Q arrives
  // while this one runs (one Q stage and three of K and V were slower at head dim 128, see
  // docs/perf/prefill.md); one at head dim 256 and with 16-bit K/V at 192 / 128.
  static constexpr int kQStages =
      2 * kQTileBytes + kRingBytes + kFp8Stages * kStagingBytes <= kSmemLimit ? 2 : 1;
  // With one Q stage a block's Q can only land after the previous block's epilogue: the producer
  // fills the block's first K/V tiles (as many as the ring holds) before it, so that they land
  // meanwhile.
  static __device__ __forceinline__ int tiles_before_q(int num_tiles) {
    return kQStages == 1 ? min(num_tiles, kKvStages) : 0;
  }
  // Offsets from a Q stage (the epilogue stages a merge state in its warp's 16 Q rows, which
  // lie inside its warpgroup's own [64, D] Q tile: warp w's 32 D bytes at w * 32 D).
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQStages * kQTileBytes;
  static constexpr int kVOffset = kKOffset + kKvStages * kKTileBytes;
  // fp8 staging: stage s holds K's [kKvTile, D] bytes, then V's [kKvTile, DV].
  static constexpr int kStagingOffset = kVOffset + kKvStages * kVTileBytes;
  static constexpr int kBarOffset = kStagingOffset + kFp8Stages * kStagingBytes;
  static constexpr int kBars = 2 * kQStages + 4 * kKvStages + 2 * kFp8Stages;
  // The row blocks (RowBlock, 64 bytes each) that the producer hands the consumers with their Q
  // (produce, fill_q_stage): the consumers read a block's geometry here instead of loading the
  // plan's item and the request's fields from global memory themselves. Block n's slot is n %
  // kBlockSlots: twice the Q stages, so that the producer can write a block's slot as it starts
  // the block, before it waits for the block's Q stage. (The slot last held block n - 2 Q, which
  // the consumers read as they started it; the producer starts block n once it has waited for
  // them to free the Q stage of block n - 1 - Q, and n - 1 - Q >= n - 2 Q.)
  static constexpr int kBlockSlots = 2 * kQStages;
  static constexpr int kBlockSlotBytes = 64;
  static constexpr int kBlockSlotOffset = (kBarOffset + kBars * 8 + 63) / 64 * 64;
  // With a custom mask, the producer's verdict on each tile (tile_hides_none, a 32-bit word a
  // tile): whether the mask hides none of the tile's keys from the block's rows. Use n of the K
  // ring has word n % kTileFlags: twice the K stages, so that the consumers can read it after
  // they released the stage (the producer writes word n once it holds K stage n, which the
  // consumers released after S_{n-2}, past their softmax of tile n - 3 and the read of word n - 4).
  static constexpr int kTileFlags = 2 * kKvStages;
  // Which kernels hand the verdicts over: paged 16-bit K/V below head dim 256. (The test's
  // registers spill into the tile loops of the other producers: the TMA producer of ragged K/V,
  // the fp8 producer and the paged one at head dim 256. Their consumers mask every element.)
  static constexpr bool kPagedMaskVerdicts = !kFp8 && D < 256;
  static constexpr int kTileFlagOffset = kBlockSlotOffset + kBlockSlots * kBlockSlotBytes;
  // Tiles must start on 1024-byte swizzle atoms: the dynamic allocation has that much slack.
  static constexpr int kSmemBytes = kTileFlagOffset + kTileFlags * 4 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "an SM's shared memory");
};

// The tensor maps of the TMA copies, with the 128-byte swizzle: K and V as [rows, Hkv, D], boxes
// of kKvTile rows x 64 dims (one half of a tile); Q as [tokens, Hq, D], boxes of one consumer
// warpgroup's 64 packed rows (64 / G tokens x the G query heads of a K/V head) x 64 dims.
struct Sm90TmaMaps {
  CUtensorMap k, v, q;
  // Paged 16-bit K/V: the page size when k and v map the pool in boxes of one page (whole tiles
  // then come by TMA, see produce_paged_tiles); 0 where paged tiles are gathered with cp.async.
  int paged_box = 0;
  // Whether q maps Q (the group divides 64 and Q's layout allows a map): a block of 128 rows then
  // takes its Q by TMA (fill_q_stage).
  bool q_by_tma = false;
};

namespace ws {

// Named barriers (0 is __syncthreads): the producer warpgroup, each consumer warpgroup, and the
// two consumers' turns to issue products.
constexpr int kProducerBarrier = 1;
constexpr int kConsumerBarrier0 = 2;  // + consumer warpgroup
constexpr int kTurnBarrier0 = 4;      // + consumer warpgroup: that warpgroup's turn

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Box (dims c0.., head h, rows from r) of a 3-d tensor map into shared memory, completing on bar.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int h,
                                            int r, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(h), "r"(r), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// An arrival on `bar` once every cp.async this thread issued so far has landed; it counts
// towards the barrier's arrival count (noinc), so the barrier is initialised with one arrival per
// copying thread.
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// An arrival on `bar` once every cp.async this thread issued so far has landed, which does not
// count towards the barrier's arrival count: the barrier's phase completes once its counted
// arrivals are in and every such tracked arrival has followed. So a barrier that expects one
// arrival (TMA's) can also wait for a warpgroup's copies: each thread calls this, then, after
// they all have, one thread arrives.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
#else
__device__ __forceinline__ void arrive_expect_tx(uint32_t, uint32_t) {}
__device__ __forceinline__ void tma_load_3d(uint32_t, const CUtensorMap*, int, int, int, uint32_t) {
}
__device__ __forceinline__ void fence_barrier_init() {}
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t) {}
__device__ __forceinline__ void cp_async_arrive(uint32_t) {}
template <int kRegs>
__device__ __forceinline__ void release_registers() {}
template <int kRegs>
__device__ __forceinline__ void claim_registers() {}
#endif

// threadIdx.x, read where it is used (an asm statement the compiler front end does not move), so
// that the fp8 producer's addresses computed from it are not hoisted out of its tile loop:
// hoisted, they did not fit in its 40 registers and were spilled.
__device__ __forceinline__ int tid_here() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
}

// A ring of kStages stages: use n of the ring is stage n % kStages, and its full/empty barriers
// complete phase n / kStages; waits are on that phase's parity (empty: the phase before, which
// a fresh barrier counts as complete). A parity tells apart only neighbouring phases, so a
// thread must wait for every use of a stage in turn, never skip ahead two.
template <int kStages>
struct Ring {
  static __device__ __forceinline__ int stage(int n) { return n % kStages; }
  static __device__ __forceinline__ uint32_t full_parity(int n) { return (n / kStages) & 1; }
  static __device__ __forceinline__ uint32_t empty_parity(int n) { return full_parity(n) ^ 1; }
};

}  // namespace ws

// The barriers, 8 bytes each from kBarOffset: Q full/empty, then K full/empty, V full/empty.
template <typename Cfg>
struct WsBarriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t q_full(int s) const { return base + s * 8; }
  __device__ __forceinline__ uint32_t q_empty(int s) const {
    return base + (Cfg::kQStages + s) * 8;
  }
  __device__ __forceinline__ uint32_t kv(int kind, int s) const {
    return base + (2 * Cfg::kQStages + kind * Cfg::kKvStages + s) * 8;
  }
  __device__ __forceinline__ uint32_t k_full(int s) const { return kv(0, s); }
  __device__ __forceinline__ uint32_t k_empty(int s) const { return kv(1, s); }
  __device__ __forceinline__ uint32_t v_full(int s) const { return kv(2, s); }
  __device__ __forceinline__ uint32_t v_empty(int s) const { return kv(3, s); }
  // fp8: staging stage s's K and V copies have landed.
  __device__ __forceinline__ uint32_t staged(int kind, int s) const {
    return base + (2 * Cfg::kQStages + 4 * Cfg::kKvStages + kind * Cfg::kFp8Stages + s) * 8;
  }
};

static_assert(sizeof(RowBlock) <= 64 && alignof(RowBlock) <= 64, "a row block's slot");

// The slot of the CTA's block_n-th row block (see kBlockSlotOffset). A block of no rows marks the
// end of the CTA's blocks.
template <typename Cfg>
__device__ __forceinline__ RowBlock* block_slot(unsigned char* smem, int block_n) {
  return reinterpret_cast<RowBlock*>(smem + Cfg::kBlockSlotOffset +
                                     block_n % Cfg::kBlockSlots * Cfg::kBlockSlotBytes);
}

// The custom-mask verdict on use n of the K ring (see kTileFlagOffset). The producer writes it
// once it holds the stage (after its empty wait) and before the arrival that completes the
// stage's full barrier; the consumers read it after their full wait.
template <typename Cfg>
__device__ __forceinline__ uint32_t* tile_hides_none(unsigned char* smem, int n) {
  return reinterpret_cast<uint32_t*>(smem + Cfg::kTileFlagOffset) + n % Cfg::kTileFlags;
}

template <typename Cfg>
__device__ __forceinline__ int num_kv_tiles(const RowBlock& b) {
  return b.kv_hi > b.kv_lo ? (b.kv_hi - b.kv_lo + Cfg::kKvTile - 1) / Cfg::kKvTile : 0;
}

// Byte offset of 16-byte chunk `chunk` of packed row `row` in a Q stage: the consumer warpgroup
// row / 64's own swizzled [64, D] tile.
template <int D>
__device__ __forceinline__ uint32_t q_stage_offset(int row, int chunk) {
  return (row >> 6) * (64 * D * 2) + sm90::tile_offset(64, row & 63, chunk);
}

}  // namespace flashkv::cuda::prefill_detail
