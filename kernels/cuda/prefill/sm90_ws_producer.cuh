// The warp-specialized Hopper prefill kernel (kernel_sm90_ws.cuh), part 2: the producer
// warpgroup, which fills the Q, K and V stages: TMA copies of ragged 16-bit K/V, cp.async gathers
// of paged K/V, and fp8 K/V copied into a staging ring and widened.
//
// Included by kernel_sm90_ws.cuh.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "common/paging.cuh"
#include "flashkv/kernels/params.h"
#include "prefill/load.cuh"
#include "prefill/mask.cuh"
#include "prefill/primitives.cuh"
#include "prefill/sm90_ws_config.cuh"
#include "prefill/wgmma.cuh"

namespace flashkv::cuda::prefill_detail {

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

// Whether the custom mask hides none of the keys [j0, j0 + tile) (all inside the request) from
// any of the block's rows (the consumers then skip apply_mask where tile_is_full_unmasked): the
// producer's 128 threads together (thread t < tile tests key j0 + t of each of the block's tokens,
// so a warp loads consecutive bytes, where the per-element path of apply_mask loads a consumer
// thread's scattered bytes one after the other), each getting the verdict through the producer's
// named barrier.
__device__ __forceinline__ bool custom_mask_hides_none(const AttentionParams& p, const RowBlock& b,
                                                       int group, int j0, int tile, int t) {
  bool none = true;
  if (t < tile) {
    const int tok_first = b.row0 / group, tok_last = (b.row0 + b.rows - 1) / group;
    const uint8_t* key = p.custom_mask + b.mask_base +
                         static_cast<int64_t>(b.local_q0 + tok_first) * b.kv_len + j0 + t;
    for (int tok = tok_first; tok <= tok_last; ++tok, key += b.kv_len) none &= *key != 0;
  }
  return sm90::barrier_sync_and(ws::kProducerBarrier, 128, none);
}

// Copies one operand (K or V) of a paged tile into a stage: warp w of the producer copies keys
// 32w .. 32w + 31, whose rows its own lanes hold (`key_row`, -1: zero-fill), 4 rows a pass and 8
// threads a row, each thread the row's 16-byte chunk c of each of the kHalves 64-dim halves
// (c = lane % 8). Pass i's row is pass i % 2's moved down by i / 2 whole 8-row swizzle periods,
// so the thread works out its two passes' places in the stage once and every copy's shared
// address is one of them plus a constant.
template <typename Cfg, int kHalves>
__device__ __forceinline__ void copy_paged_operand(const typename Cfg::Q* src, int64_t stride_n,
                                                   int64_t head_off, int32_t key_row,
                                                   unsigned char* stage, int warp, int lane) {
  const int c = lane & 7, key0 = 32 * warp + (lane >> 3);
  const uint32_t stage_addr = smem_addr(stage);
  uint32_t dst[2];
#pragma unroll
  for (int par = 0; par < 2; ++par)
    dst[par] = stage_addr + sm90::tile_offset(Cfg::kKvTile, key0 + 4 * par, c);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int32_t r = __shfl_sync(0xffffffffu, key_row, 4 * i + (lane >> 3));
    const bool valid = r >= 0;
    const typename Cfg::Q* row_src = src + (valid ? r * stride_n + head_off + c * 8 : 0);
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
      ptx::cp_async_16(dst[i % 2] + (i / 2) * 8 * 128 + h * Cfg::kKvTile * 128, row_src + 64 * h,
                       valid);
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
    // The full barriers expect one arrival (the TMA path's): each thread's copies are tracked
    // on them, then thread 0 arrives once all threads have issued theirs. The producer moves on
    // while the copies land; the consumers fence them for wgmma (consume).
    ws::cp_async_arrive(bars.k_full(s));
    ws::cp_async_arrive(bars.v_full(s));
    sm90::barrier_sync(ws::kProducerBarrier, 128);
    if (tid == 0) {
      sm90::mbar_arrive(bars.k_full(s));
      sm90::mbar_arrive(bars.v_full(s));
    }
  }
}

// One page of a paged tile by TMA, from the thread holding the page's first key (`key`, pool row
// `row`): the page's rows of each 128-byte half go to the same rows of the stage as the
// cp.async gather puts them (a page starts at a multiple of 16 rows, so the 128-byte swizzle's
// phase, which follows the shared address, agrees), and the thread's arrival on the full barrier
// adds the page's bytes to those it waits for.
template <int kHalves, int kTile>
__device__ __forceinline__ void load_page(const CUtensorMap* map, uint32_t stage, uint32_t full,
                                          int page_size, int kv_head, int key, int32_t row) {
  constexpr uint32_t kHalfBytes = kTile * 128;
  ws::arrive_expect_tx(full, static_cast<uint32_t>(page_size) * 128 * kHalves);
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
    ws::tma_load_3d(stage + h * kHalfBytes + key * 128, map, 64 * h, kv_head, row, full);
}

// The producer's K/V tiles [t_begin, t_end) of one row block, paged K/V: every thread waits for
// every use of a stage itself (so none skips a phase), copies its part of the tile, and its copies
// arrive on the stage's full barrier when they land. Where the pool maps in boxes of one page
// (maps.paged_box) and the tile's keys fill whole pages of the request, the thread holding each
// page's first key loads the page by TMA instead and the others arrive at once: the barrier's
// 128 arrivals stay, and it also waits for the pages' bytes.
template <typename Cfg>
__device__ __forceinline__ void produce_paged_tiles(const AttentionParams& p,
                                                    const Sm90TmaMaps& maps, unsigned char* smem,
                                                    const WsBarriers<Cfg>& bars, const RowBlock& b,
                                                    int kv_head, int group, int t_begin, int t_end,
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
  // One tile's K and V, by pages (kByPages) or gathered.
  const auto tile = [&](auto by_pages, int t) {
    constexpr bool kByPages = decltype(by_pages)::value;
    const int j = b.kv_lo + t * Cfg::kKvTile + tid;
    const int32_t key_row = holds_key ? key.row(p, b, j) : -1;
    if (holds_key && t + 1 < t_end) key.fetch(p, b, j + Cfg::kKvTile);
    const int s = Ring::stage(tile_n), j0 = b.kv_lo + t * Cfg::kKvTile;
    const bool hides_none = Cfg::kPagedMaskVerdicts && p.custom_mask &&
                            j0 + Cfg::kKvTile <= b.kv_hi &&
                            custom_mask_hides_none(p, b, group, j0, Cfg::kKvTile, tid);
    const bool loads_page = kByPages && holds_key && (tid & (maps.paged_box - 1)) == 0;
    sm90::mbar_wait(bars.k_empty(s), Ring::empty_parity(tile_n));
    if constexpr (kByPages) {
      if (loads_page)
        load_page<Cfg::kQkHalves, Cfg::kKvTile>(
            &maps.k, smem_addr(smem + Cfg::kKOffset + s * Cfg::kKTileBytes), bars.k_full(s),
            maps.paged_box, kv_head, tid, key_row);
      else
        sm90::mbar_arrive(bars.k_full(s));
    } else {
      if (copies)
        copy_paged_operand<Cfg, Cfg::kQkHalves>(k, p.k_stride_n, k_head, key_row,
                                                smem + Cfg::kKOffset + s * Cfg::kKTileBytes, warp,
                                                lane);
      ws::cp_async_arrive_noinc(bars.k_full(s));
    }
    // The full barrier counts this arrival too: it publishes the custom mask's verdict.
    if (Cfg::kPagedMaskVerdicts && tid == 0) {
      if (p.custom_mask) *tile_hides_none<Cfg>(smem, tile_n) = hides_none;
      sm90::mbar_arrive(bars.k_full(s));
    }
    sm90::mbar_wait(bars.v_empty(s), Ring::empty_parity(tile_n));
    if constexpr (kByPages) {
      if (loads_page)
        load_page<Cfg::kVHalves, Cfg::kKvTile>(
            &maps.v, smem_addr(smem + Cfg::kVOffset + s * Cfg::kVTileBytes), bars.v_full(s),
            maps.paged_box, kv_head, tid, key_row);
      else
        sm90::mbar_arrive(bars.v_full(s));
    } else {
      if (copies)
        copy_paged_operand<Cfg, Cfg::kVHalves>(v, p.v_stride_n, v_head, key_row,
                                               smem + Cfg::kVOffset + s * Cfg::kVTileBytes, warp,
                                               lane);
      ws::cp_async_arrive_noinc(bars.v_full(s));
    }
  };
  // The tiles whose keys fill whole pages of the request come first (the block's keys start on a
  // page boundary, so all its tiles do, or none), then the rest (a last tile past the block's
  // keys, or all of them).
  int t = t_begin;
  const int ps = maps.paged_box;
  if (ps != 0 && (b.kv_lo & (ps - 1)) == 0) {
    const int t_pages = min(t_end, (b.kv_hi - b.kv_lo) / Cfg::kKvTile);
    for (; t < t_pages; ++t, ++tile_n) tile(std::true_type{}, t);
  }
  for (; t < t_end; ++t, ++tile_n) tile(std::false_type{}, t);
}

// The CTA's block_n-th row block's Q, once its stage is free: thread 0 arrives on the stage's
// full barrier (which publishes the block's slot, written earlier, see produce), and the block's
// 128 packed Q rows go into the stage. A whole block (128 rows) comes by TMA where Q has a map:
// thread 0's arrival expects its bytes, and it issues one box a consumer warpgroup's rows and 64
// dims: a few instructions, where the warpgroup's 16-byte copies stall at issue for thousands of
// cycles a block (docs/perf/prefill.md, the blocks probe). Otherwise the
// warpgroup copies the rows, 8 threads a row, 16 chunks each, padding rows zero-filled. A block
// without keys takes its stage too and copies nothing (its epilogue may stage a merge state
// there), and so does the end mark (a block of no rows). Each thread's copies arrive on the full
// barrier as they land; the consumers fence them for wgmma.
template <typename Cfg>
__device__ __forceinline__ void fill_q_stage(const AttentionParams& p, const Sm90TmaMaps& maps,
                                             unsigned char* smem, const WsBarriers<Cfg>& bars,
                                             const RowBlock& b, int kv_head, int group, int block_n,
                                             bool has_keys, int tid) {
  using QT = typename Cfg::Q;
  using QRing = ws::Ring<Cfg::kQStages>;
  const int qs = QRing::stage(block_n);
  sm90::mbar_wait(bars.q_empty(qs), QRing::empty_parity(block_n));
  unsigned char* const q_stage = smem + qs * Cfg::kQTileBytes;
  const bool by_tma = has_keys && maps.q_by_tma && b.rows == Cfg::kCtaRows;
  // The arrival releases thread 0's store of the block's slot to the consumers, whose wait on
  // the barrier acquires it.
  if (tid == 0) {
    if (by_tma) {
      ws::arrive_expect_tx(bars.q_full(qs), Cfg::kQTileBytes);
      // Rows 64 w .. 64 w + 63 of the block: tokens from row0 / G + 64 w / G, all G heads.
      const int tok = b.q_begin + b.row0 / group;
#pragma unroll
      for (int w = 0; w < 2; ++w)
#pragma unroll
        for (int h = 0; h < Cfg::kQkHalves; ++h)
          ws::tma_load_3d(
              smem_addr(q_stage) + w * (Cfg::kWgRows * Cfg::kDqk * 2) + h * (Cfg::kWgRows * 128),
              &maps.q, 64 * h, kv_head * group, tok + w * Cfg::kWgRows / group, bars.q_full(qs));
    } else {
      sm90::mbar_arrive(bars.q_full(qs));
    }
  }
#pragma unroll
  for (int i = 0; i < (has_keys && !by_tma ? Cfg::kCtaRows / 16 : 0); ++i) {
    const int row = (tid >> 3) + 16 * i;
    bool valid;
    const QT* src = q_row_source<QT>(p, b, kv_head, group, row, (tid & 7) * 8, valid);
#pragma unroll
    for (int h = 0; h < Cfg::kQkHalves; ++h)
      cp_async_16(q_stage + q_stage_offset<Cfg::kDqk>(row, (tid & 7) + 8 * h),
                  valid ? src + 64 * h : src, valid ? 16 : 0);
  }
  ws::cp_async_arrive_noinc(bars.q_full(qs));
}

// fp8 K/V. Each producer warp takes a quarter of a tile's keys; lane l < kKvTile / 4 of warp w
// holds key w * kKvTile / 4 + l (its pool row). The warp copies those keys' rows kRowsPerPass
// rows a pass, kLanes lanes a row, each lane the row's 16-byte chunks (16 fp8 values) c, c +
// kLanes, .. (c = lane % kLanes). A lane later widens exactly the chunks it copied, so it needs no
// barrier with the others between its copies and its reads.
template <typename Cfg, int kDim>
struct Fp8Operand {
  // Lanes a row: 8, or a row's chunks where fewer (head dim 64); 4 at 192, whose 12 chunks 8
  // lanes would not share evenly.
  static constexpr int kLanes = kDim / 16 < 8 ? kDim / 16 : (kDim / 16) % 8 == 0 ? 8 : 4;
  static_assert((kDim / 16) % kLanes == 0, "a row's chunks shared evenly among its lanes");
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

  // 16 fp8 values to f16 pairs (Sm90WsConfig::Mma), one conversion a pair. Widening to bf16
  // took four (the f16 conversion, two to fp32 and a pack); an integer path for bf16 (byte
  // placement and an exact multiply) ran slower still: the producer is short of issue slots, not
  // of conversion throughput (docs/perf/prefill.md).
  static __device__ __forceinline__ void widen_chunk(const uint32_t (&words)[4],
                                                     uint32_t (&out)[8]) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      out[2 * w] = fp8_pair_to_f16x2<Cfg::kKvFormat, false>(words[w]);
      out[2 * w + 1] = fp8_pair_to_f16x2<Cfg::kKvFormat, true>(words[w]);
    }
  }

  // Widens the chunks this lane copied into the swizzled 16-bit tile. The places are worked out
  // once a call, not once a pass: pass i's key is key_0 + kRowsPerPass * i, so its staging row
  // lies i * kRowsPerPass * kDim bytes past pass 0's, and its 16-bit chunks lie where pass i %
  // kParities put them, kParities * kRowsPerPass rows further down (a whole number of 8-row
  // swizzle periods, so the swizzle agrees). The loop then takes constant offsets only.
  static constexpr int kParities = kRowsPerPass % 8 == 0 ? 1 : 8 / kRowsPerPass;
  static __device__ __forceinline__ void widen(const unsigned char* staging, unsigned char* tile) {
    const int tid = ws::tid_here(), warp = tid >> 5, lane = tid & 31, c = lane % kLanes;
    const int key0 = kKeysPerWarp * warp + row_in_pass(lane);
    const unsigned char* const src = staging + key0 * kDim + c * 16;
    uint32_t dst[kParities][kChunks][2];
#pragma unroll
    for (int par = 0; par < kParities; ++par)
#pragma unroll
      for (int m = 0; m < kChunks; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          dst[par][m][h] =
              sm90::tile_offset(Cfg::kKvTile, key0 + kRowsPerPass * par, 2 * (c + kLanes * m) + h);
    constexpr int kPeriodBytes = kParities * kRowsPerPass * 128;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
#pragma unroll
      for (int m = 0; m < kChunks; ++m) {
        const uint4 raw =
            *reinterpret_cast<const uint4*>(src + i * kRowsPerPass * kDim + kLanes * m * 16);
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t out[8];
        widen_chunk(words, out);
        unsigned char* const row = tile + (i / kParities) * kPeriodBytes;
        *reinterpret_cast<uint4*>(row + dst[i % kParities][m][0]) =
            make_uint4(out[0], out[1], out[2], out[3]);
        *reinterpret_cast<uint4*>(row + dst[i % kParities][m][1]) =
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
__device__ __forceinline__ void produce_fp8_block(const AttentionParams& p, const Sm90TmaMaps& maps,
                                                  unsigned char* smem, const WsBarriers<Cfg>& bars,
                                                  const RowBlock& b, int kv_head, int group,
                                                  int block_n, int& tile_n, int tid) {
  using Ring = ws::Ring<Cfg::kKvStages>;
  using Staging = ws::Ring<Cfg::kFp8Stages>;
  using KOp = Fp8Operand<Cfg, Cfg::kDqk>;
  using VOp = Fp8Operand<Cfg, Cfg::kDv>;
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
  fill_q_stage<Cfg>(p, maps, smem, bars, b, kv_head, group, block_n, num_tiles > 0, tid);
  for (int t = early; t < num_tiles; ++t) widen(t);
  tile_n += num_tiles;
}

// The producer warpgroup (threads 0..127 of the CTA; `tid` is the thread's index in it).
template <typename Cfg, bool kPaged>
__device__ __forceinline__ void produce(const AttentionParams& p, const Sm90TmaMaps& maps,
                                        unsigned char* smem, const WsBarriers<Cfg>& bars, int tid) {
  int block_n = 0, tile_n = 0;
  for_each_row_block<Cfg::kCtaRows, false>(p, [&](const RowBlock& b, int kv_head, int group) {
    // The block's slot for the consumers, published with its Q (fill_q_stage).
    if (tid == 0) *block_slot<Cfg>(smem, block_n) = b;
    if constexpr (Cfg::kFp8) {
      produce_fp8_block<Cfg, kPaged>(p, maps, smem, bars, b, kv_head, group, block_n, tile_n, tid);
      ++block_n;
      return;
    }
    const int num_tiles = num_kv_tiles<Cfg>(b);
    const auto tiles = [&](int t_begin, int t_end) {
      if constexpr (kPaged)
        produce_paged_tiles<Cfg>(p, maps, smem, bars, b, kv_head, group, t_begin, t_end, tile_n,
                                 tid);
      else
        produce_ragged_tiles<Cfg>(p, maps, smem, bars, b, kv_head, t_begin, t_end, tile_n, tid);
    };
    const int early = Cfg::tiles_before_q(num_tiles);  // then Q, then the rest
    tiles(0, early);
    fill_q_stage<Cfg>(p, maps, smem, bars, b, kv_head, group, block_n, num_tiles > 0, tid);
    ++block_n;
    tiles(early, num_tiles);
  });
  // The end mark: the consumers stop at a block of no rows.
  RowBlock end{};
  end.rows = 0;
  if (tid == 0) *block_slot<Cfg>(smem, block_n) = end;
  fill_q_stage<Cfg>(p, maps, smem, bars, end, 0, 1, block_n, false, tid);
}

}  // namespace flashkv::cuda::prefill_detail
