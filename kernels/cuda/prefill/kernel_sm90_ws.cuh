// The warp-specialized Hopper (sm_90a) prefill kernel for 16-bit K/V at head dims 64, 128, 256
// and 192 / 128, and fp8 K/V at 64, 128 and 256, ragged (contiguous) or paged. A CTA is three
// warpgroups:
//   - a producer, which fills two-stage rings of K and V tiles (128 keys; 64 at head dim 256),
//     each stage handed over on mbarriers (full: the bytes landed; empty: every consumer warp is
//     done reading it), and copies the block's packed Q rows (two Q stages, so the next block's Q
//     arrives while this one runs; one at head dim 256, whose Q tile is 64 KB, and there the
//     block's first K/V tiles go ahead of its Q). Ragged K/V: one thread issues the
//     tensor-memory-access (TMA) copies of whole tiles, and the warpgroup copies a tile that runs
//     past the block's keys with zero-filled cp.async copies, so that no key outside the range can
//     put a NaN into P.V. Paged K/V: the threads gather every tile's rows with cp.async (thread t
//     looks up key t's slot a tile ahead), and the copies themselves arrive on the full barrier as
//     they land (cp.async.mbarrier.arrive.noinc), so the producer never waits for its own copies.
//     fp8 K/V (ragged or paged): the threads copy each tile's fp8 rows into a staging ring the
//     same way, then widen them exactly into the 16-bit rings in f16, in which both products then
//     run (produce_fp8_block; Sm90WsConfig::Qk and Pv: with bf16 Q the consumers first rewrite
//     their Q rows in f16, q_rows_to_f16);
//   - two consumers of 64 packed query rows each (the plan's 128-row tile), issuing as
//     kernel_sm90.cuh does S_t = Q.K_t^T with P_{t-1}.V_{t-1} behind it. They take turns to issue
//     their products (two named barriers), so one warpgroup's softmax runs under the other's
//     products. (Inside a warpgroup ptxas waits for P.V before the softmax's exponentials: with
//     S, O and P live at once it is short of registers otherwise; docs/perf/prefill.md.)
// No barrier spans the CTA inside the KV loop: the warpgroups only meet through the rings.
// Masks, the online softmax and the epilogue are the sm_80 kernel's, one 16-row tile a warp.
//
// Included only by cuda/inst/prefill_sm90_d*.cu.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/kernel_launch.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/options.h"
#include "prefill/epilogue.cuh"
#include "prefill/launch.h"
#include "prefill/load.cuh"
#include "prefill/mainloop.cuh"
#include "prefill/mask.cuh"
#include "prefill/softmax.cuh"
#include "prefill/wgmma.cuh"

namespace flashkv::cuda::prefill_detail {

// What both sm_90a kernels share: 16-bit Q/K/V at head dims D (Q.K^T) and DV (P.V) (the
// warp-specialized kernel: 64, 128 or 256 for both, or 192 / 128; the cp.async one: 128),
// 128-row blocks of 16 rows a consumer warp (one mma.sync-layout tile, so the sm_80 masks, softmax
// and epilogue apply), and K/V tiles of D / 64 (DV / 64) halves, each [kKvTile, 64] half one
// 128-byte line a key. The tiles are 128 keys, 64 at head dim 256: there a consumer thread's O is
// already 128 registers (64 rows x 256 dims over 128 threads), and a 128-key stage would be 64 KB.
template <typename QT, int D = 128, int DV = D>
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
  static constexpr int kKvTile = D == 256 ? 64 : 128;
  static constexpr int kQkChunks = kDqk / 8, kVChunks = kDv / 8;
  static constexpr int kQTileBytes = kCtaRows * D * 2;  // one Q stage
  static constexpr int kKTileBytes = kKvTile * D * 2;   // one stage of K
  static constexpr int kVTileBytes = kKvTile * DV * 2;  // one stage of V
  // The plan's row tile is 128 packed rows at every head dim (plan.cpp, q_tile_of); the sm_80
  // kernel walks it in blocks of its own 64 rows at head dim 256.
  static_assert(D == 256 || kCtaRows == prefill_cta_rows_of(kDv), "the plan's row tile");
};

// F: K/V in Q's type (kSame), or fp8 (kE4M3 / kE5M2), which the producer copies into a staging
// ring of plain fp8 rows and widens (exactly) into the 16-bit K and V rings the consumers read.
template <typename QT, int D, int DV = D, KvFormat F = KvFormat::kSame>
struct Sm90WsConfig : Sm90Shape<QT, D, DV> {
  using Base = Sm90Shape<QT, D, DV>;
  static constexpr KvFormat kKvFormat = F;
  static constexpr bool kFp8 = F != KvFormat::kSame;
  // The 16-bit types of the products, Q's but f16 with fp8 K/V: e4m3 and e5m2 widen to f16 in
  // one conversion a pair against three to bf16, and the producer is short of issue slots.
  // Q.K^T (Qk): with bf16 Q the consumers rewrite their Q rows in f16 first, scaled by a power of
  // two (q_rows_to_f16). P.V (Pv): P, in [0, 1], keeps three more mantissa bits in f16 than in
  // bf16.
  using Qk = std::conditional_t<kFp8, __half, QT>;
  using Pv = std::conditional_t<kFp8, __half, QT>;
  static constexpr bool kQToF16 = !std::is_same<QT, Qk>::value;
  static constexpr int kThreads = 384;  // producer warpgroup, then two consumer warpgroups
  static constexpr int kWgRows = 64;    // a consumer warpgroup's rows
  using Base::kKTileBytes;
  using Base::kKvTile;
  using Base::kQTileBytes;
  using Base::kVTileBytes;
  static constexpr int kKvStages = 2;
  static constexpr int kSmemLimit = 227 * 1024 - 2048;  // less the barriers and alignment slack
  static constexpr int kRingBytes = kKvStages * (kKTileBytes + kVTileBytes);
  // fp8: one staging stage holds a tile's fp8 K and V rows. Two where they fit beside one Q stage
  // (head dims 64 and 128), so that a tile's copies are in flight while the one before is
  // widened; one at head dim 256. (192 / 128 fits no staging stage: fp8 runs the sm_80 kernel.)
  static constexpr int kStagingBytes = kFp8 ? kKvTile * (D + DV) : 0;
  static constexpr int kFp8Stages =
      !kFp8 ? 0 : (kQTileBytes + kRingBytes + 2 * kStagingBytes <= kSmemLimit ? 2 : 1);
  // Two Q stages where they fit beside the K and V rings, so that the next block's Q arrives
  // while this one runs (one Q stage and three of K and V were slower at head dim 128, see
  // docs/perf/prefill.md); one at head dims 256 and 192 / 128, and with fp8 K/V but at 64.
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
  // Tiles must start on 1024-byte swizzle atoms: the dynamic allocation has that much slack.
  static constexpr int kSmemBytes = kBarOffset + kBars * 8 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "an SM's shared memory");
};

// The two tensor maps of the TMA copies: K and V as [rows, Hkv, D] with the 128-byte swizzle,
// boxes of kKvTile rows x 64 dims (one half of a tile).
struct Sm90TmaMaps {
  CUtensorMap k, v;
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

// Paged K/V: producer thread t's key of a tile, key t (its kv_indices entry is loaded a tile
// ahead, so the load's latency passes while the tile before is copied).
struct PagedKey {
  int32_t entry = 0;  // the kv_indices entry (slot, or page) of key j of the next fetch

  __device__ __forceinline__ void fetch(const AttentionParams& p, const RowBlock& b, int j) {
    entry = j < b.kv_hi ? p.kv_indices[b.kv_base + page_index(p, j)] : 0;
  }
  // The pool row of key j (fetched last), clamped into the pool so that a bad index can never
  // address outside it; -1 past the block's keys.
  __device__ __forceinline__ int32_t row(const AttentionParams& p, const RowBlock& b, int j) const {
    return j < b.kv_hi ? static_cast<int32_t>(paged_pool_row(p, entry, j)) : -1;
  }
};

// Copies one operand (K or V) of a paged tile into a stage: warp w of the producer copies keys
// 32w .. 32w + 31, whose rows its own lanes hold (`key_row`, -1: zero-fill), 4 rows a pass and 8
// threads a row, each thread the row's 16-byte chunk c of each of the kHalves 64-dim halves
// (c = lane % 8).
template <typename Cfg, int kHalves>
__device__ __forceinline__ void copy_paged_operand(const typename Cfg::Q* src, int64_t stride_n,
                                                   int64_t head_off, int32_t key_row,
                                                   unsigned char* stage, int warp, int lane) {
  const int c = lane & 7;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int holder = 4 * i + (lane >> 3);
    const int32_t r = __shfl_sync(0xffffffffu, key_row, holder);
    const int key = 32 * warp + holder;
    const bool valid = r >= 0;
    const typename Cfg::Q* row_src = src + (valid ? r * stride_n + head_off + c * 8 : 0);
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
      cp_async_16(stage + sm90::tile_offset(Cfg::kKvTile, key, c + 8 * h), row_src + 64 * h,
                  valid ? 16 : 0);
  }
}

// The producer's K/V tiles [t_begin, t_end) of one row block, ragged K/V: TMA copies of whole
// tiles by thread 0; the warpgroup copies a tile that runs past the block's keys. `tile_n` counts
// the ring's uses.
template <typename Cfg>
__device__ __forceinline__ void produce_ragged_tiles(const AttentionParams& p,
                                                     const Sm90TmaMaps& maps, unsigned char* smem,
                                                     const WsBarriers<Cfg>& bars, const RowBlock& b,
                                                     int kv_head, int t_begin, int t_end,
                                                     int& tile_n, int tid) {
  using QT = typename Cfg::Q;
  using Ring = ws::Ring<Cfg::kKvStages>;
  const uint32_t base = smem_addr(smem);
  for (int t = t_begin; t < t_end; ++t, ++tile_n) {
    const int j0 = b.kv_lo + t * Cfg::kKvTile;
    const int s = Ring::stage(tile_n);
    const uint32_t k_dst = base + Cfg::kKOffset + s * Cfg::kKTileBytes;
    const uint32_t v_dst = base + Cfg::kVOffset + s * Cfg::kVTileBytes;
    const int row = b.kv_base + j0;  // ragged: K/V row of key j0
    if (j0 + Cfg::kKvTile <= b.kv_hi) {
      if (tid == 0) {
        sm90::mbar_wait(bars.k_empty(s), Ring::empty_parity(tile_n));
        constexpr uint32_t kHalfBytes = Cfg::kKvTile * 128;
        ws::arrive_expect_tx(bars.k_full(s), Cfg::kKTileBytes);
#pragma unroll
        for (int h = 0; h < Cfg::kQkHalves; ++h)
          ws::tma_load_3d(k_dst + h * kHalfBytes, &maps.k, 64 * h, kv_head, row, bars.k_full(s));
        sm90::mbar_wait(bars.v_empty(s), Ring::empty_parity(tile_n));
        ws::arrive_expect_tx(bars.v_full(s), Cfg::kVTileBytes);
#pragma unroll
        for (int h = 0; h < Cfg::kVHalves; ++h)
          ws::tma_load_3d(v_dst + h * kHalfBytes, &maps.v, 64 * h, kv_head, row, bars.v_full(s));
      }
      continue;
    }
    // The block's last tile runs past its keys: copy the keys in range, zero the rest. Only
    // thread 0 has waited for every earlier use of the ring (a parity wait tells phases apart
    // only one apart), so it waits for the stage and the others follow it.
    if (tid == 0) {
      sm90::mbar_wait(bars.k_empty(s), Ring::empty_parity(tile_n));
      sm90::mbar_wait(bars.v_empty(s), Ring::empty_parity(tile_n));
    }
    sm90::barrier_sync(ws::kProducerBarrier, 128);
    const QT* k = static_cast<const QT*>(p.k) + static_cast<int64_t>(kv_head) * p.k_stride_h;
    const QT* v = static_cast<const QT*>(p.v) + static_cast<int64_t>(kv_head) * p.v_stride_h;
#pragma unroll 2
    for (int i = 0; i < Cfg::kKvTile / 16; ++i) {
      const int key = (tid >> 3) + 16 * i;
      const bool valid = j0 + key < b.kv_hi;
      const int64_t r = valid ? static_cast<int64_t>(row) + key : 0;
      const QT* k_src = k + r * p.k_stride_n + (tid & 7) * 8;
      const QT* v_src = v + r * p.v_stride_n + (tid & 7) * 8;
      constexpr int kHalves = Cfg::kQkHalves > Cfg::kVHalves ? Cfg::kQkHalves : Cfg::kVHalves;
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint32_t off = sm90::tile_offset(Cfg::kKvTile, key, (tid & 7) + 8 * h);
        if (h < Cfg::kQkHalves)
          cp_async_16(smem + (k_dst - base) + off, k_src + 64 * h, valid ? 16 : 0);
        if (h < Cfg::kVHalves)
          cp_async_16(smem + (v_dst - base) + off, v_src + 64 * h, valid ? 16 : 0);
      }
    }
    cp_async_commit();
    cp_async_wait<0>();
    sm90::fence_async_shared();
    sm90::barrier_sync(ws::kProducerBarrier, 128);
    if (tid == 0) {
      sm90::mbar_arrive(bars.k_full(s));
      sm90::mbar_arrive(bars.v_full(s));
    }
  }
}

// The producer's K/V tiles [t_begin, t_end) of one row block, paged K/V: every thread waits for
// every use of a stage itself (so none skips a phase), copies its part of the tile, and its copies
// arrive on the stage's full barrier when they land.
template <typename Cfg>
__device__ __forceinline__ void produce_paged_tiles(const AttentionParams& p, unsigned char* smem,
                                                    const WsBarriers<Cfg>& bars, const RowBlock& b,
                                                    int kv_head, int t_begin, int t_end,
                                                    int& tile_n, int tid) {
  using QT = typename Cfg::Q;
  using Ring = ws::Ring<Cfg::kKvStages>;
  const int warp = tid >> 5, lane = tid & 31;
  const QT* k = static_cast<const QT*>(p.k);
  const QT* v = static_cast<const QT*>(p.v);
  const int64_t k_head = static_cast<int64_t>(kv_head) * p.k_stride_h;
  const int64_t v_head = static_cast<int64_t>(kv_head) * p.v_stride_h;
  // Thread t holds key t of each tile; with 64-key tiles the upper two warps hold none and copy
  // nothing, but still arrive on the full barriers (which count all 128 threads).
  const bool holds_key = tid < Cfg::kKvTile;
  const bool copies = warp < Cfg::kKvTile / 32;
  PagedKey key;
  if (t_begin < t_end && holds_key) key.fetch(p, b, b.kv_lo + t_begin * Cfg::kKvTile + tid);
  for (int t = t_begin; t < t_end; ++t, ++tile_n) {
    const int j = b.kv_lo + t * Cfg::kKvTile + tid;
    const int32_t key_row = holds_key ? key.row(p, b, j) : -1;
    if (holds_key && t + 1 < t_end) key.fetch(p, b, j + Cfg::kKvTile);
    const int s = Ring::stage(tile_n);
    sm90::mbar_wait(bars.k_empty(s), Ring::empty_parity(tile_n));
    if (copies)
      copy_paged_operand<Cfg, Cfg::kQkHalves>(k, p.k_stride_n, k_head, key_row,
                                              smem + Cfg::kKOffset + s * Cfg::kKTileBytes, warp,
                                              lane);
    ws::cp_async_arrive_noinc(bars.k_full(s));
    sm90::mbar_wait(bars.v_empty(s), Ring::empty_parity(tile_n));
    if (copies)
      copy_paged_operand<Cfg, Cfg::kVHalves>(v, p.v_stride_n, v_head, key_row,
                                             smem + Cfg::kVOffset + s * Cfg::kVTileBytes, warp,
                                             lane);
    ws::cp_async_arrive_noinc(bars.v_full(s));
  }
}

// The block's 128 packed Q rows into Q stage `qs`, 8 threads a row, 16 chunks each; padding rows
// zero-filled. A block without keys copies nothing (its epilogue may stage a merge state there).
template <typename Cfg>
__device__ __forceinline__ void copy_q_block(const AttentionParams& p, const RowBlock& b,
                                             int kv_head, int group, bool has_keys,
                                             unsigned char* q_stage, int tid) {
  using QT = typename Cfg::Q;
#pragma unroll
  for (int i = 0; i < (has_keys ? Cfg::kCtaRows / 16 : 0); ++i) {
    const int row = (tid >> 3) + 16 * i;
    bool valid;
    const QT* src = q_row_source<QT>(p, b, kv_head, group, row, (tid & 7) * 8, valid);
#pragma unroll
    for (int h = 0; h < Cfg::kQkHalves; ++h)
      cp_async_16(q_stage + q_stage_offset<Cfg::kDqk>(row, (tid & 7) + 8 * h),
                  valid ? src + 64 * h : src, valid ? 16 : 0);
  }
}

// fp8 K/V. Each producer warp takes a quarter of a tile's keys; lane l < kKvTile / 4 of warp w
// holds key w * kKvTile / 4 + l (its pool row). The warp copies those keys' rows kRowsPerPass
// rows a pass, kLanes lanes a row, each lane the row's 16-byte chunks (16 fp8 values) c, c +
// kLanes, .. (c = lane % kLanes). A lane later widens exactly the chunks it copied, so it needs no
// barrier with the others between its copies and its reads.
template <typename Cfg, int kDim, typename Out>
struct Fp8Operand {
  static constexpr int kLanes = kDim / 16 < 8 ? kDim / 16 : 8;  // lanes a row
  static constexpr int kRowsPerPass = 32 / kLanes;
  static constexpr int kKeysPerWarp = Cfg::kKvTile / 4;
  static constexpr int kPasses = kKeysPerWarp / kRowsPerPass;
  static constexpr int kChunks = kDim / 16 / kLanes;  // a lane's chunks of a row

  // The row of a pass this lane copies and widens. fp8 chunk q widens to 16-bit chunks 2q and 2q +
  // 1, in the 64-dim half q / 4, whose swizzled places in a row are {0, 2, 4, 6} ^ (row % 8) for
  // the first of each pair. With 8 lanes a row, lanes 4-7 of each group of 8 (chunks in an odd
  // half) take the row next to their group's, so that the 8 lanes of a store phase hit 8
  // different bank groups (and 64 bytes of each of two rows when they read or copy).
  static __device__ __forceinline__ int row_in_pass(int lane) {
    const int row = lane / kLanes;
    return kLanes == 8 ? row ^ ((lane >> 2) & 1) : row;
  }

  // Copies the operand's fp8 rows (`key_row`: the pool row of the key this lane holds; -1:
  // zero-fill) into the staging tile [kKvTile, kDim] bytes.
  static __device__ __forceinline__ void copy(const unsigned char* src, int64_t stride_n,
                                              int64_t head_off, int32_t key_row,
                                              unsigned char* staging) {
    const int tid = ws::tid_here(), warp = tid >> 5, lane = tid & 31, c = lane % kLanes;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int holder = kRowsPerPass * i + row_in_pass(lane);
      const int32_t r = __shfl_sync(0xffffffffu, key_row, holder);
      const int key = kKeysPerWarp * warp + holder;
      const bool valid = r >= 0;
      const unsigned char* row_src = src + (valid ? r * stride_n + head_off : 0);
#pragma unroll
      for (int m = 0; m < kChunks; ++m)
        cp_async_16(staging + key * kDim + (c + kLanes * m) * 16, row_src + (c + kLanes * m) * 16,
                    valid ? 16 : 0);
    }
  }

  // 16 fp8 values to pairs of Out, by the hardware conversions (fp8_pair_to_16: one instruction a
  // pair to f16, three to bf16). An integer path for bf16 (byte placement and an exact multiply)
  // ran slower: the producer is short of issue slots, not of conversion throughput
  // (docs/perf/prefill.md).
  static __device__ __forceinline__ void widen_chunk(const uint32_t (&words)[4],
                                                     uint32_t (&out)[8]) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      out[2 * w] = fp8_pair_to_16<Out, Cfg::kKvFormat, false>(words[w]);
      out[2 * w + 1] = fp8_pair_to_16<Out, Cfg::kKvFormat, true>(words[w]);
    }
  }

  // Widens the chunks this lane copied into the swizzled 16-bit tile.
  static __device__ __forceinline__ void widen(const unsigned char* staging, unsigned char* tile) {
    const int tid = ws::tid_here(), warp = tid >> 5, lane = tid & 31, c = lane % kLanes;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int key = kKeysPerWarp * warp + kRowsPerPass * i + row_in_pass(lane);
#pragma unroll
      for (int m = 0; m < kChunks; ++m) {
        const int q = c + kLanes * m;
        const uint4 raw = *reinterpret_cast<const uint4*>(staging + key * kDim + q * 16);
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t out[8];
        widen_chunk(words, out);
        *reinterpret_cast<uint4*>(tile + sm90::tile_offset(Cfg::kKvTile, key, 2 * q)) =
            make_uint4(out[0], out[1], out[2], out[3]);
        *reinterpret_cast<uint4*>(tile + sm90::tile_offset(Cfg::kKvTile, key, 2 * q + 1)) =
            make_uint4(out[4], out[5], out[6], out[7]);
      }
    }
  }
};

// One row block of the producer with fp8 K/V. Tile u's fp8 K and V rows go to staging stage
// (tile_n + u) % kFp8Stages with cp.async, their landing counted on that stage's `staged`
// barriers (each thread's copies arrive as they land); the producer then widens each into the
// K and V rings and arrives on their full barriers (128 arrivals: every thread fences its own
// stores to the async proxy first). The copies of tile u + kFp8Stages are issued as soon as tile
// u's staging is widened. Q is copied with cp.async too, its landing counted on the Q stage's
// full barrier, so the producer never waits for its own copies but through the barriers.
template <typename Cfg, bool kPaged>
__device__ __forceinline__ void produce_fp8_block(const AttentionParams& p, unsigned char* smem,
                                                  const WsBarriers<Cfg>& bars, const RowBlock& b,
                                                  int kv_head, int group, int block_n, int& tile_n,
                                                  int tid) {
  using QRing = ws::Ring<Cfg::kQStages>;
  using Ring = ws::Ring<Cfg::kKvStages>;
  using Staging = ws::Ring<Cfg::kFp8Stages>;
  using KOp = Fp8Operand<Cfg, Cfg::kDqk, typename Cfg::Qk>;
  using VOp = Fp8Operand<Cfg, Cfg::kDv, typename Cfg::Pv>;
  const int warp = tid >> 5, lane = tid & 31;
  const auto* k = static_cast<const unsigned char*>(p.k);
  const auto* v = static_cast<const unsigned char*>(p.v);
  const int64_t k_head = static_cast<int64_t>(kv_head) * p.k_stride_h;
  const int64_t v_head = static_cast<int64_t>(kv_head) * p.v_stride_h;
  const int num_tiles = num_kv_tiles<Cfg>(b);
  const bool holds_key = lane < KOp::kKeysPerWarp;
  const int held = KOp::kKeysPerWarp * warp + lane;  // the key of a tile this lane holds
  PagedKey key;
  if (kPaged && num_tiles > 0 && holds_key) key.fetch(p, b, b.kv_lo + held);
  int32_t key_row = -1;  // the held key's pool row in the tile being issued
  const auto staging = [&](int n) {
    return smem + Cfg::kStagingOffset + Staging::stage(n) * Cfg::kStagingBytes;
  };
  const auto issue_k = [&](int u) {
    const int j = b.kv_lo + u * Cfg::kKvTile + held;
    if constexpr (kPaged) {
      key_row = holds_key ? key.row(p, b, j) : -1;
      if (holds_key && u + 1 < num_tiles) key.fetch(p, b, j + Cfg::kKvTile);
    } else {
      key_row =
          holds_key && j < b.kv_hi ? static_cast<int32_t>(ragged_kv_row(p, b.kv_base, j)) : -1;
    }
    KOp::copy(k, p.k_stride_n, k_head, key_row, staging(tile_n + u));
    ws::cp_async_arrive_noinc(bars.staged(0, Staging::stage(tile_n + u)));
  };
  const auto issue_v = [&](int u) {  // the tile issue_k issued last
    VOp::copy(v, p.v_stride_n, v_head, key_row, staging(tile_n + u) + Cfg::kKvTile * Cfg::kDqk);
    ws::cp_async_arrive_noinc(bars.staged(1, Staging::stage(tile_n + u)));
  };
  const auto widen = [&](int t) {
    const int n = tile_n + t, s = Ring::stage(n);
    sm90::mbar_wait(bars.staged(0, Staging::stage(n)), Staging::full_parity(n));
    sm90::mbar_wait(bars.k_empty(s), Ring::empty_parity(n));
    KOp::widen(staging(n), smem + Cfg::kKOffset + s * Cfg::kKTileBytes);
    sm90::fence_async_shared();
    sm90::mbar_arrive(bars.k_full(s));
    if (t + Cfg::kFp8Stages < num_tiles) issue_k(t + Cfg::kFp8Stages);
    sm90::mbar_wait(bars.staged(1, Staging::stage(n)), Staging::full_parity(n));
    sm90::mbar_wait(bars.v_empty(s), Ring::empty_parity(n));
    VOp::widen(staging(n) + Cfg::kKvTile * Cfg::kDqk, smem + Cfg::kVOffset + s * Cfg::kVTileBytes);
    sm90::fence_async_shared();
    sm90::mbar_arrive(bars.v_full(s));
    if (t + Cfg::kFp8Stages < num_tiles) issue_v(t + Cfg::kFp8Stages);
  };
  for (int u = 0; u < min(num_tiles, Cfg::kFp8Stages); ++u) {
    issue_k(u);
    issue_v(u);
  }
  const int early = Cfg::tiles_before_q(num_tiles);
  for (int t = 0; t < early; ++t) widen(t);
  const int qs = QRing::stage(block_n);
  sm90::mbar_wait(bars.q_empty(qs), QRing::empty_parity(block_n));
  copy_q_block<Cfg>(p, b, kv_head, group, num_tiles > 0, smem + qs * Cfg::kQTileBytes, tid);
  ws::cp_async_arrive_noinc(bars.q_full(qs));
  for (int t = early; t < num_tiles; ++t) widen(t);
  tile_n += num_tiles;
}

// The producer warpgroup (threads 0..127 of the CTA; `tid` is the thread's index in it).
template <typename Cfg, bool kPaged>
__device__ __forceinline__ void produce(const AttentionParams& p, const Sm90TmaMaps& maps,
                                        unsigned char* smem, const WsBarriers<Cfg>& bars, int tid) {
  using QT = typename Cfg::Q;
  using QRing = ws::Ring<Cfg::kQStages>;
  using Ring = ws::Ring<Cfg::kKvStages>;
  const uint32_t base = smem_addr(smem);
  int block_n = 0, tile_n = 0;
  for_each_row_block<Cfg::kCtaRows, false>(p, [&](const RowBlock& b, int kv_head, int group) {
    if constexpr (Cfg::kFp8) {
      produce_fp8_block<Cfg, kPaged>(p, smem, bars, b, kv_head, group, block_n, tile_n, tid);
      ++block_n;
      return;
    }
    const int num_tiles = num_kv_tiles<Cfg>(b);
    const auto tiles = [&](int t_begin, int t_end) {
      if constexpr (kPaged)
        produce_paged_tiles<Cfg>(p, smem, bars, b, kv_head, t_begin, t_end, tile_n, tid);
      else
        produce_ragged_tiles<Cfg>(p, maps, smem, bars, b, kv_head, t_begin, t_end, tile_n, tid);
    };
    const int early = Cfg::tiles_before_q(num_tiles);  // then Q, then the rest
    tiles(0, early);
    // Q (a block without keys takes a Q stage too, unfilled).
    const int qs = QRing::stage(block_n);
    sm90::mbar_wait(bars.q_empty(qs), QRing::empty_parity(block_n));
    copy_q_block<Cfg>(p, b, kv_head, group, num_tiles > 0, smem + qs * Cfg::kQTileBytes, tid);
    cp_async_commit();
    cp_async_wait<0>();
    sm90::fence_async_shared();  // generic-proxy writes -> the consumers' wgmma reads
    sm90::barrier_sync(ws::kProducerBarrier, 128);
    if (tid == 0) sm90::mbar_arrive(bars.q_full(qs));
    ++block_n;
    tiles(early, num_tiles);
  });
}

// fp8 K/V with bf16 Q: consumer warp w of a warpgroup rewrites its 16 rows of the warpgroup's
// [64, D] Q tile from bf16 to f16, each value times 2^e, one e for the warp's rows, chosen from
// their largest finite |q|, m, so that m lands in [2^14, 2^15) (f16's top binade is [2^15,
// 65504]). Every value from 2^-32 m up converts exactly (down to there f16 holds bf16's 8
// significant bits), smaller ones to within 2^-39 m, so a logit's error is at most 2^-39 of the
// largest any of the rows could make with that key (m times the sum of its |k|); inf and NaN stay
// as they are. Returns 2^-e. Lane l takes row l % 16 and half the row's 16-byte chunks, so that
// the 8 lanes of a shared-memory phase hit 8 rows (8 different swizzled bank groups).
template <typename Cfg>
__device__ __forceinline__ float q_rows_to_f16(unsigned char* wg_q_tile, int warp_in_wg, int lane) {
  constexpr int kMine = Cfg::kDqk / 16;  // a lane's chunks of 8 values: half a row
  const int row = 16 * warp_in_wg + (lane & 15), first = (lane >> 4) * kMine;
  const auto chunk = [&](int i) {
    return reinterpret_cast<uint4*>(wg_q_tile + sm90::tile_offset(64, row, first + i));
  };
  const auto finite_abs = [](float x) {
    const float a = fabsf(x);
    return a < __int_as_float(0x7f800000) ? a : 0.0f;  // NaN compares false
  };
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kMine; ++i) {
    const uint4 raw = *chunk(i);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 f = unpack2<__nv_bfloat16>(words[w]);
      m = fmaxf(m, fmaxf(finite_abs(f.x), finite_abs(f.y)));
    }
  }
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  // e = 14 - floor(log2 m), kept where both 2^e and 2^-e are normal floats; m = 0: e = 0.
  const int e = m > 0.0f ? max(-126, min(126, 14 - (((__float_as_int(m) >> 23) & 0xff) - 127))) : 0;
  const float up = __int_as_float((127 + e) << 23);
#pragma unroll
  for (int i = 0; i < kMine; ++i) {
    const uint4 raw = *chunk(i);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t out[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 f = unpack2<__nv_bfloat16>(words[w]);
      out[w] = pack2<__half>(f.x * up, f.y * up);
    }
    *chunk(i) = make_uint4(out[0], out[1], out[2], out[3]);
  }
  return __int_as_float((127 - e) << 23);
}

// A consumer warpgroup's turn to issue its products: wait for it, then (after issuing) pass it.
__device__ __forceinline__ void take_turn(int wg) {
  sm90::barrier_sync(ws::kTurnBarrier0 + wg, 256);
}
__device__ __forceinline__ void pass_turn(int wg) {
  sm90::barrier_arrive(ws::kTurnBarrier0 + (wg ^ 1), 256);
}

// The row block of this CTA's walk (for_each_row_block's order) after the one at packed row `row0`
// of item `item` (the first block: item = the worker's first - 1), for a consumer that looks
// ahead: its number of K/V tiles, or -1 where there is none.
template <typename Cfg>
__device__ __forceinline__ int next_block_tiles(const AttentionParams& p, int item, int row0,
                                                int group) {
  if (item >= p.worker_indptr[blockIdx.x] && row0 + Cfg::kCtaRows < p.items[item].q_len * group)
    return num_kv_tiles<Cfg>(
        make_row_block(p, p.items[item], group, row0 + Cfg::kCtaRows, Cfg::kCtaRows));
  for (int i = item + 1; i < p.worker_indptr[blockIdx.x + 1]; ++i)
    if (p.items[i].q_len > 0)
      return num_kv_tiles<Cfg>(make_row_block(p, p.items[i], group, 0, Cfg::kCtaRows));
  return -1;
}

// The consumer warpgroups (threads 128..383; `ctid` is the thread's index among them).
// kOverlap (FLASHKV_PREFILL_SM90_OVERLAP=1; two Q stages and 16-bit K/V only): a block's S_0 is
// issued before the block starts, with the previous block's last P.V, so that it runs under that
// block's epilogue instead of alone after it (the next block's Q has its own stage, and its first
// K tile follows the last one in the ring); the first block's before the walk, and one after a
// block without keys in that block's place. Every block thus starts with one S_0 in flight and
// ends having issued the next: where the next block has no keys (or there is none) that S_0 is a
// dummy product of the block's own Q stage, discarded. ptxas serialises every wgmma of the kernel
// where the products in flight differ between paths (a product issued under a condition).
template <typename Cfg, bool kPaged, bool kOverlap = false>
__device__ __forceinline__ void consume(const AttentionParams& p, unsigned char* smem,
                                        const WsBarriers<Cfg>& bars, int ctid) {
  static_assert(!kOverlap || (Cfg::kQStages == 2 && !Cfg::kFp8),
                "the overlap needs the next block's Q in its own stage");
  using QT = typename Cfg::Q;
  using QRing = ws::Ring<Cfg::kQStages>;
  using Ring = ws::Ring<Cfg::kKvStages>;
  constexpr int kNTiles = Cfg::kKvTile / 8;
  const int lane = ctid & 31, cwarp = ctid >> 5, wg = cwarp >> 2;
  const int warp_row0 = cwarp * Cfg::kRowsPerWarp;
  const uint32_t base = smem_addr(smem);

  // Logit scale (fp8 K's scale folds in here) and the softmax's base-2 factor.
  const float logit_scale = p.sm_scale * (Cfg::kFp8 ? p.k_scale : 1.0f);
  const bool soft_cap = p.logits_soft_cap > 0.0f;
  const float c = soft_cap ? kLog2e : logit_scale * kLog2e;
  const float scale_over_cap = soft_cap ? logit_scale / p.logits_soft_cap : 0.0f;

  // Warpgroup 1 lets warpgroup 0 go first.
  if (wg == 1) pass_turn(1);
  int block_n = 0, tile_n = 0;
  using Scores = float[1][kNTiles][4];
  using ScoresAcc = float[kNTiles * 4];
  // kOverlap: S of the tile in hand, carried from block to block (else each block has its own).
  [[maybe_unused]] Scores s_carried;
  [[maybe_unused]] ScoresAcc& s_carried_acc = reinterpret_cast<ScoresAcc&>(s_carried);
  int item = p.worker_indptr[blockIdx.x] - 1;  // kOverlap: the block's item
  // The warpgroup's Q tile in Q stage `q_stage_index`.
  const auto q_tile_of = [&](int q_stage_index) {
    return base + q_stage_index * Cfg::kQTileBytes + wg * (Cfg::kQTileBytes / 2);
  };
  // Paged K/V tiles, and with fp8 Q and the K/V tiles, were written by the producer's threads
  // (the generic proxy); wgmma reads through the async proxy. (TMA writes through the async
  // proxy itself.)
  constexpr bool kGenericWrites = kPaged || Cfg::kFp8;
  // S = Q.K^T into s_acc, one product group (Q: the warpgroup's tile at q_tile, K: the tile at
  // k_tile).
  const auto qk_products = [&](ScoresAcc& s_acc, uint32_t q_tile, uint32_t k_tile) {
    sm90::fence();
#pragma unroll
    for (int k = 0; k < Cfg::kDqk / 16; ++k)
      sm90::mma_ss<typename Cfg::Qk>(s_acc, sm90::k_major(q_tile, Cfg::kWgRows, 0, k),
                                     sm90::k_major(k_tile, Cfg::kKvTile, 0, k), k > 0);
    sm90::commit();
  };
  // S_t = Q.K_t^T into s_acc (K stage n, once it has landed).
  const auto issue_qk = [&](ScoresAcc& s_acc, int n, uint32_t q_tile) {
    sm90::mbar_wait(bars.k_full(Ring::stage(n)), Ring::full_parity(n));
    if constexpr (kGenericWrites) sm90::fence_async_shared();
    qk_products(s_acc, q_tile, base + Cfg::kKOffset + Ring::stage(n) * Cfg::kKTileBytes);
  };
  // kOverlap: the operands of block block_n's S_0, Q's tile and K tile n where `real` (once they
  // have landed), else those of the dummy product, both from Q stage `own` (see above).
  struct S0Operands {
    uint32_t q_tile, k_tile;
  };
  const auto s0_operands = [&](bool real, int block_n, int n, int own) {
    if (!real) return S0Operands{q_tile_of(own), base + own * Cfg::kQTileBytes};
    sm90::mbar_wait(bars.q_full(QRing::stage(block_n)), QRing::full_parity(block_n));
    sm90::mbar_wait(bars.k_full(Ring::stage(n)), Ring::full_parity(n));
    if constexpr (kGenericWrites) sm90::fence_async_shared();
    return S0Operands{q_tile_of(QRing::stage(block_n)),
                      base + Cfg::kKOffset + Ring::stage(n) * Cfg::kKTileBytes};
  };
  // One wgmma sequence for both, so that the products in flight never depend on a branch.
  const auto issue_s0 = [&](const S0Operands& op) {
    qk_products(s_carried_acc, op.q_tile, op.k_tile);
  };
  if constexpr (kOverlap) {
    const int group = p.num_qo_heads / p.num_kv_heads;
    const S0Operands op = s0_operands(next_block_tiles<Cfg>(p, item, 0, group) > 0, 0, 0, 0);
    take_turn(wg);
    issue_s0(op);
    pass_turn(wg);
  }
  for_each_row_block<Cfg::kCtaRows, false>(p, [&](const RowBlock& b, int kv_head, int group) {
    const int num_tiles = num_kv_tiles<Cfg>(b);
    if constexpr (kOverlap) {
      sm90::wait<0>();  // this block's S_0 (or the dummy)
      sm90::pin(s_carried_acc);
      if (b.row0 == 0) {  // a new item (for_each_row_block skips those without rows)
        do {
          ++item;
        } while (p.items[item].q_len == 0);
      }
    }
    float o[1][Cfg::kDv / 8][4];
    zero_output(o);
    float(&o_acc)[Cfg::kDv / 2] = reinterpret_cast<float(&)[Cfg::kDv / 2]>(o);
    OnlineSoftmax<1> softmax;
    softmax.init();
    const int qs = QRing::stage(block_n);
    unsigned char* q_stage = smem + qs * Cfg::kQTileBytes;
    sm90::mbar_wait(bars.q_full(qs), QRing::full_parity(block_n));
    if constexpr (Cfg::kFp8) sm90::fence_async_shared();
    // The softmax's factors for this block: the kernel's, or with Q rewritten in f16 scaled by
    // 2^e, times 2^-e (the warp's logits come out 2^e too large).
    float c_blk = c, scale_over_cap_blk = scale_over_cap;
    // kOverlap: the number of K/V tiles of the next block (-1: none).
    const int next_tiles = kOverlap ? next_block_tiles<Cfg>(p, item, b.row0, group) : -1;
    if (num_tiles > 0) {
      const uint32_t q_tile = q_tile_of(qs);
      Scores s_block;
      Scores& s = kOverlap ? s_carried : s_block;
      ScoresAcc& s_acc = reinterpret_cast<ScoresAcc&>(s);
      if constexpr (Cfg::kQToF16) {
        const float unscale =
            q_rows_to_f16<Cfg>(q_stage + wg * (Cfg::kQTileBytes / 2), cwarp & 3, lane);
        (soft_cap ? scale_over_cap_blk : c_blk) *= unscale;
        sm90::fence_async_shared();  // this thread's f16 rows -> the warpgroup's wgmma reads
        sm90::barrier_sync(ws::kConsumerBarrier0 + wg, 128);
      }
      PFragments<Cfg> pf;  // P of the previous tile, the A operand of its P.V
      // O += P_{n}.V_{n} (pf, V stage n). N is 64 dims at head dim 64; else O goes in parts of
      // 128 dims (two 64-dim halves of the V tile each), two parts at head dim 256.
      constexpr int kParts = Cfg::kDv >= 128 ? Cfg::kDv / 128 : 1;
      constexpr int kPartAcc = Cfg::kDv / 2 / kParts;
      float(&o_parts)[kParts][kPartAcc] = reinterpret_cast<float(&)[kParts][kPartAcc]>(o);
      const auto issue_pv = [&](int n) {
        const uint32_t v_tile = base + Cfg::kVOffset + Ring::stage(n) * Cfg::kVTileBytes;
#pragma unroll
        for (int kk = 0; kk < Cfg::kKvTile / 16; ++kk)
#pragma unroll
          for (int part = 0; part < kParts; ++part)
            sm90::mma_rs<typename Cfg::Pv>(
                o_parts[part], pf[0][kk],
                sm90::n_major(v_tile + part * 2 * Cfg::kKvTile * 128, Cfg::kKvTile, kk));
        sm90::commit();
      };
      // The soft cap, the mask and the online softmax of tile t: s becomes P (in place).
      const auto scores = [&](int t, float(&corr)[1][2]) {
        const int j0 = b.kv_lo + t * Cfg::kKvTile;
        if (soft_cap) apply_soft_cap<Cfg>(s, p.logits_soft_cap, scale_over_cap_blk);
        if (!tile_is_full(p, b, group, j0, Cfg::kKvTile))
          apply_mask<1, kNTiles>(s, p, b, group, warp_row0, j0, lane);
        return softmax.update_scores(s, c_blk, corr);
      };

      // Tile 0: S_0 alone (kOverlap: issued and waited for already).
      if constexpr (!kOverlap) {
        take_turn(wg);
        issue_qk(s_acc, tile_n, q_tile);
        pass_turn(wg);
        sm90::wait<0>();
        sm90::pin(s_acc);
      }
      if (lane == 0) sm90::mbar_arrive(bars.k_empty(Ring::stage(tile_n)));
      {
        float corr[1][2];
        scores(0, corr);  // O is still 0: nothing to rescale
        pack_p<Cfg, typename Cfg::Pv>(s, pf);
      }
      // Tile t: S_t, then P_{t-1}.V_{t-1} behind it, which runs while S_t is read. (ptxas waits
      // for P.V before the softmax's exponentials, short of registers otherwise, so the overlap
      // left is between the warpgroups.)
      for (int t = 1; t < num_tiles; ++t) {
        const int n = tile_n + t;
        sm90::mbar_wait(bars.v_full(Ring::stage(n - 1)), Ring::full_parity(n - 1));
        if constexpr (kGenericWrites) sm90::fence_async_shared();
        take_turn(wg);
        issue_qk(s_acc, n, q_tile);
        issue_pv(n - 1);
        pass_turn(wg);
        sm90::wait<1>();  // S_t
        sm90::pin(s_acc);
        if (lane == 0) sm90::mbar_arrive(bars.k_empty(Ring::stage(n)));
        float corr[1][2];
        const bool moved = scores(t, corr);
        sm90::wait<0>();  // P_{t-1}.V_{t-1}: O, pf and V stage n - 1 are free
        sm90::pin(o_acc);
        if (lane == 0) sm90::mbar_arrive(bars.v_empty(Ring::stage(n - 1)));
        if (moved) softmax.rescale(o, corr);
        pack_p<Cfg, typename Cfg::Pv>(s, pf);
      }
      // The last tile's P.V (kOverlap: and the next block's S_0 behind it; the wait for P.V
      // leaves that S_0 in flight).
      const int n = tile_n + num_tiles - 1;
      sm90::mbar_wait(bars.v_full(Ring::stage(n)), Ring::full_parity(n));
      if constexpr (kGenericWrites) sm90::fence_async_shared();
      [[maybe_unused]] S0Operands next_s0{};
      if constexpr (kOverlap) next_s0 = s0_operands(next_tiles > 0, block_n + 1, n + 1, qs);
      take_turn(wg);
      sm90::fence();
      issue_pv(n);
      if constexpr (kOverlap) issue_s0(next_s0);
      pass_turn(wg);
      if constexpr (kOverlap)
        sm90::wait<1>();
      else
        sm90::wait<0>();
      sm90::pin(o_acc);
      if (lane == 0) sm90::mbar_arrive(bars.v_empty(Ring::stage(n)));
    } else if constexpr (kOverlap) {
      const S0Operands op = s0_operands(next_tiles > 0, block_n + 1, tile_n, qs);
      take_turn(wg);
      issue_s0(op);
      pass_turn(wg);
    }
    float scale[1][2], lse[1][2];
    softmax.finish(c_blk, scale, lse, Cfg::kFp8 ? p.v_scale : 1.0f);
    // A merged store stages the state in the warp's Q rows, which hold other warps' rows of the
    // same warpgroup: the warpgroup must be past its last Q.K^T first.
    if (p.merge_o != nullptr && b.partial < 0) sm90::barrier_sync(ws::kConsumerBarrier0 + wg, 128);
    store_block<Cfg>(p, b, kv_head, group, warp_row0, lane, q_stage, o, scale, lse);
    if (lane == 0) sm90::mbar_arrive(bars.q_empty(qs));
    ++block_n;
    tile_n += num_tiles;
  });
  if constexpr (kOverlap) sm90::wait<0>();  // the last block's dummy S_0
  // Balance the turns: warpgroup 1 passed one more than warpgroup 0 took.
  if (wg == 0) take_turn(0);
}

// grid (workers, Hkv), 384 threads; CTA (w, h) runs worker w's items for KV head h. `maps` is
// unused with paged or fp8 K/V.
template <typename QT, int D, int DV, KvFormat F, bool kPaged, bool kOverlap = false>
__global__ void __launch_bounds__(384, 1)
    prefill_sm90_ws_kernel(const __grid_constant__ AttentionParams p,
                           const __grid_constant__ Sm90TmaMaps maps) {
  using Cfg = Sm90WsConfig<QT, D, DV, F>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  const WsBarriers<Cfg> bars{smem_addr(smem + Cfg::kBarOffset)};
  const int tid = threadIdx.x;
  if (tid == 0) {
    // Q full: one arrival after the producer's barrier, or (fp8) one per producer thread's
    // copies.
    for (int s = 0; s < Cfg::kQStages; ++s) {
      sm90::mbar_init(bars.q_full(s), Cfg::kFp8 ? 128 : 1);
      sm90::mbar_init(bars.q_empty(s), 8);
    }
    // K/V full: one arrival with the TMA's byte count, or one per producer thread (its copies
    // with paged K/V, its widened stores with fp8).
    const int full_arrivals = kPaged || Cfg::kFp8 ? 128 : 1;
    for (int s = 0; s < Cfg::kKvStages; ++s) {
      sm90::mbar_init(bars.k_full(s), full_arrivals);
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
    consume<Cfg, kPaged, kOverlap>(p, smem, bars, tid - 128);
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

// K or V (16-bit, [num_kv_rows, Hkv, head_dim] with the given element strides) as a TMA tensor
// map of box_rows-row x 64-dim boxes; false where the layout does not allow one (the caller then
// runs a kernel that copies with cp.async).
inline bool encode_kv_map(CUtensorMap* map, const void* data, CUtensorMapDataType type,
                          const AttentionParams& p, int head_dim, int box_rows, int64_t stride_n,
                          int64_t stride_h) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || p.num_kv_rows <= 0 || p.num_kv_rows > (int64_t{1} << 31) - 1)
    return false;
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0) return false;
  const uint64_t dims[3] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(p.num_kv_heads),
                            static_cast<uint64_t>(p.num_kv_rows)};
  const uint64_t strides[2] = {static_cast<uint64_t>(stride_h) * 2,
                               static_cast<uint64_t>(stride_n) * 2};
  for (const uint64_t st : strides)
    if (st % 16 != 0 || st >= (uint64_t{1} << 40)) return false;
  const uint32_t box[3] = {64, 1, static_cast<uint32_t>(box_rows)};
  const uint32_t element_strides[3] = {1, 1, 1};
  return encode(map, type, 3, const_cast<void*>(data), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Launches the warp-specialized kernel; false (nothing launched) where it does not apply: paged
// K/V with FLASHKV_PREFILL_SM90_WS_PAGED=0, paged or fp8 K/V in a pool of 2^31 rows or more (the
// producer addresses rows with 32 bits), or 16-bit ragged K/V in a layout no tensor map can
// describe. FLASHKV_PREFILL_SM90_OVERLAP=1 takes the kernel whose consumers overlap a block's S_0
// with the previous block's epilogue where it applies (consume, kOverlap).
template <typename QT, int D, int DV, KvFormat F>
bool launch_prefill_sm90_ws(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = Sm90WsConfig<QT, D, DV, F>;
  Sm90TmaMaps maps{};
  if (p.paged && !env_prefill_sm90_ws_paged()) return false;
  if (p.paged || Cfg::kFp8) {
    if (p.num_kv_rows > (int64_t{1} << 31) - 1) return false;
  } else {
    const CUtensorMapDataType type = std::is_same<QT, __half>::value
                                         ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    if (!encode_kv_map(&maps.k, p.k, type, p, D, Cfg::kKvTile, p.k_stride_n, p.k_stride_h) ||
        !encode_kv_map(&maps.v, p.v, type, p, DV, Cfg::kKvTile, p.v_stride_n, p.v_stride_h))
      return false;
  }
  auto kernel = p.paged ? prefill_sm90_ws_kernel<QT, D, DV, F, true>
                        : prefill_sm90_ws_kernel<QT, D, DV, F, false>;
  if constexpr (Cfg::kQStages == 2 && !Cfg::kFp8) {
    if (env_prefill_sm90_overlap())
      kernel = p.paged ? prefill_sm90_ws_kernel<QT, D, DV, F, true, true>
                       : prefill_sm90_ws_kernel<QT, D, DV, F, false, true>;
  }
  detail::cuda_check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes),
      "prefill: cudaFuncSetAttribute");
  launch_kernel(kernel, dim3(p.num_workers, p.num_kv_heads, 1), dim3(Cfg::kThreads, 1, 1),
                Cfg::kSmemBytes, stream, p.merge_o && p.overlap_previous, "prefill: kernel launch",
                p, maps);
  return true;
}

}  // namespace flashkv::cuda::prefill_detail
