// Stores of one finished row block: normalised O (in Q's dtype, or f32 when p.o_dtype says so)
// plus LSE to the outputs, or (split items) fp32 O and LSE to the partial buffers at rows
// item.partial + token (layout of plan.h).
// Each thread writes its fragment pairs straight from registers (store_block), except where the
// warp-specialized kernel stages a final 16-bit block through shared memory and stores it in
// 16-byte chunks (store_block_staged): its row blocks are short enough that a block's stores
// show in its time.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/merge.cuh"
#include "common/ptx.cuh"
#include "flashkv/kernels/packed_rows.h"
#include "flashkv/kernels/params.h"
#include "prefill/mask.cuh"
#include "prefill/tile_config.cuh"

namespace flashkv::cuda::prefill_detail {

// The row's merge weights over p's merge state (prev_lse), the block's state (cur_lse) and p's
// sink (if any, a third state with O = 0, counted here once): O = a * prev + c * cur, where c
// includes the block's own normalisation `scale`. Returns the merged LSE.
__device__ __forceinline__ float merged_weights(const AttentionParams& p, int head, float prev_lse,
                                                float cur_lse, float scale, float& a, float& c) {
  // common/merge.cuh: an empty state (LSE -inf) weighs 0, and its values (never written,
  // maybe NaN) are unused; a NaN state weighs NaN, so O and LSE are NaN.
  MergeState</*kFastExp2=*/false, /*kFastLog2=*/true> st;
  const float sink = sink_lse(p.sinks, head);
  st.see(prev_lse);
  st.see(cur_lse);
  st.see(sink);
  const float w_prev = st.add(prev_lse);
  const float w_cur = st.add(cur_lse);
  st.add(sink);
  const float inv = st.inv_sum();
  a = w_prev * inv;
  c = w_cur * inv * scale;
  return st.lse();
}

// a * prev + c * cur for a pair of O values (merged_weights' a and c), each term left out where
// its weight is 0: an empty state's values (never written, maybe NaN) add nothing.
__device__ __forceinline__ float2 merged_pair(float a, float2 prev, float c, float cur_lo,
                                              float cur_hi) {
  return make_float2((a != 0.0f ? a * prev.x : 0.0f) + (c != 0.0f ? c * cur_lo : 0.0f),
                     (a != 0.0f ? a * prev.y : 0.0f) + (c != 0.0f ? c * cur_hi : 0.0f));
}

// A final row's scale and LSE: the block's, with p's sink (if any, a state with O = 0) merged
// in once.
__device__ __forceinline__ void final_row(const AttentionParams& p, int head, float& sc,
                                          float& row_lse) {
  if (p.sinks == nullptr) return;
  MergeState</*kFastExp2=*/false, /*kFastLog2=*/true> st;
  float w_cur, w_sink;
  st.pair(row_lse, sink_lse(p.sinks, head), w_cur, w_sink);
  sc *= w_cur * st.inv_sum();
  row_lse = st.lse();
}

// A warp's staging rows in shared memory (store_merged_block, store_block_staged): its own Q rows
// (from warp_row0, kDqk values each), reused as rows of kDv values once its Q.K^T products are
// done. 16-byte chunk c of local row r sits at chunk c ^ (r & 7), so 4-byte accesses by a quad
// of lanes in each of eight rows, to one chunk a row, hit 32 distinct banks.
template <typename Cfg>
struct WarpStaging {
  using QT = typename Cfg::Q;
  static_assert(Cfg::kDqk >= Cfg::kDv && Cfg::kVChunks % 8 == 0,
                "a warp's rows of kDv values must fit its Q rows, in 8k chunks");
  QT* rows;

  __device__ __forceinline__ WarpStaging(unsigned char* smem, int warp_row0)
      : rows(reinterpret_cast<QT*>(smem + Cfg::kQOffset) + warp_row0 * Cfg::kDqk) {}
  // Chunk c (8 values) of local row r.
  __device__ __forceinline__ QT* chunk(int r, int c) const {
    return rows + r * Cfg::kDv + swizzle_chunk(r, c) * 8;
  }
};

// store_merged_block for an f32 merge state and output: its rows are twice the bytes of the
// warp's Q rows, so instead of staging them each thread loads the pairs it writes straight from
// global memory (each pair is read before the same thread writes it, so in place is fine).
template <typename Cfg>
__device__ __forceinline__ void store_merged_block_f32(
    const AttentionParams& p, const RowBlock& b, int kv_head, int group, int warp_row0, int lane,
    const float (&o)[Cfg::kMTiles][Cfg::kDv / 8][4], const float (&scale)[Cfg::kMTiles][2],
    const float (&lse)[Cfg::kMTiles][2]) {
  ptx::grid_dependency_wait();
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int x = warp_row0 + mt * 16 + (lane >> 2) + h * 8;
      if (x >= b.rows) continue;
      const auto [tok, head] = b.packed(x, kv_head, group);
      const int64_t row = static_cast<int64_t>(b.q_begin) + tok;
      const float prev_lse = p.merge_lse[row * p.num_qo_heads + head];
      float a, c;
      const float row_lse = merged_weights(p, head, prev_lse, lse[mt][h], scale[mt][h], a, c);
      const float* prev = static_cast<const float*>(p.merge_o) + row * p.merge_stride_n +
                          head * p.merge_stride_h + (lane & 3) * 2;
      float* dst =
          static_cast<float*>(p.o) + row * p.o_stride_n + head * p.o_stride_h + (lane & 3) * 2;
#pragma unroll
      for (int dt = 0; dt < Cfg::kDv / 8; ++dt) {
        const float2 pv =
            a != 0.0f ? *reinterpret_cast<const float2*>(prev + dt * 8) : make_float2(0.0f, 0.0f);
        *reinterpret_cast<float2*>(dst + dt * 8) =
            merged_pair(a, pv, c, o[mt][dt][2 * h], o[mt][dt][2 * h + 1]);
      }
      if (p.lse && (lane & 3) == 0) p.lse[row * p.num_qo_heads + head] = row_lse;
    }
}

// A final row block merged with p's merge state (p.merge_o / p.merge_lse, possibly the same
// memory as the outputs) and p's sink (if any) as it is stored. Under programmatic dependent launch
// the state comes from the preceding kernel: wait for it here, before the first read of it (and
// write of O).
//
// The warp's rows of the state are copied with cp.async into the warp's own Q rows of shared
// memory (only this warp reads them, and its KV loop is over), all in flight together: one
// memory round trip a row block, where loads into registers would either spill (O already holds
// 128 registers) or, issued between stores that may overwrite the state, wait one round trip
// each (WarpStaging). The LSEs come into registers alongside; an empty state's values are loaded
// too and never used.
template <typename Cfg>
__device__ __forceinline__ void store_merged_block(const AttentionParams& p, const RowBlock& b,
                                                   int kv_head, int group, int warp_row0, int lane,
                                                   unsigned char* smem,
                                                   const float (&o)[Cfg::kMTiles][Cfg::kDv / 8][4],
                                                   const float (&scale)[Cfg::kMTiles][2],
                                                   const float (&lse)[Cfg::kMTiles][2]) {
  using QT = typename Cfg::Q;
  constexpr int kChunks = Cfg::kVChunks;
  const float neg_inf = -__int_as_float(0x7f800000);
  const WarpStaging<Cfg> stage(smem, warp_row0);
  ptx::grid_dependency_wait();
  __syncwarp();  // every lane of the warp is past its last read of its Q rows
#pragma unroll 4
  for (int i = lane; i < Cfg::kRowsPerWarp * kChunks; i += 32) {
    const int r = i / kChunks, c = i - r * kChunks;
    const int x = warp_row0 + r;
    const bool valid = x < b.rows;
    const auto [tok, head] = b.packed(x, kv_head, group);
    const QT* src = static_cast<const QT*>(p.merge_o);
    if (valid)
      src += (static_cast<int64_t>(b.q_begin) + tok) * p.merge_stride_n +
             static_cast<int64_t>(head) * p.merge_stride_h + c * 8;
    cp_async_16(stage.chunk(r, c), src, valid ? 16 : 0);
  }
  cp_async_commit();
  float prev_lse[Cfg::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int x = warp_row0 + mt * 16 + (lane >> 2) + h * 8;
      prev_lse[mt][h] = neg_inf;
      if (x >= b.rows) continue;
      const auto [tok, head] = b.packed(x, kv_head, group);
      prev_lse[mt][h] =
          p.merge_lse[(static_cast<int64_t>(b.q_begin) + tok) * p.num_qo_heads + head];
    }
  cp_async_wait<0>();
  __syncwarp();  // the state is in shared memory, and every lane holds its previous LSEs
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + (lane >> 2) + h * 8;
      const int x = warp_row0 + r;
      if (x >= b.rows) continue;
      const auto [tok, head] = b.packed(x, kv_head, group);
      float a, c;
      const float row_lse =
          merged_weights(p, head, prev_lse[mt][h], lse[mt][h], scale[mt][h], a, c);
      const int64_t row = static_cast<int64_t>(b.q_begin) + tok;
      QT* dst = static_cast<QT*>(p.o) + row * p.o_stride_n + head * p.o_stride_h + (lane & 3) * 2;
#pragma unroll
      for (int dt = 0; dt < Cfg::kDv / 8; ++dt) {
        const float2 pv =
            unpack2<QT>(*reinterpret_cast<const uint32_t*>(stage.chunk(r, dt) + (lane & 3) * 2));
        const float2 merged = merged_pair(a, pv, c, o[mt][dt][2 * h], o[mt][dt][2 * h + 1]);
        *reinterpret_cast<uint32_t*>(dst + dt * 8) = pack2<QT>(merged.x, merged.y);
      }
      if (p.lse && (lane & 3) == 0) p.lse[row * p.num_qo_heads + head] = row_lse;
    }
}

template <typename Cfg>
__device__ __forceinline__ void store_block(const AttentionParams& p, const RowBlock& b,
                                            int kv_head, int group, int warp_row0, int lane,
                                            unsigned char* smem,
                                            const float (&o)[Cfg::kMTiles][Cfg::kDv / 8][4],
                                            const float (&scale)[Cfg::kMTiles][2],
                                            const float (&lse)[Cfg::kMTiles][2]) {
  using QT = typename Cfg::Q;
  const bool merge = p.merge_o != nullptr && b.partial < 0;
  if (merge) {
    if (p.o_dtype == DType::f32)
      store_merged_block_f32<Cfg>(p, b, kv_head, group, warp_row0, lane, o, scale, lse);
    else
      store_merged_block<Cfg>(p, b, kv_head, group, warp_row0, lane, smem, o, scale, lse);
  }
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int x = warp_row0 + mt * 16 + (lane >> 2) + h * 8;
      if (merge || x >= b.rows) continue;
      const auto [tok, head] = b.packed(x, kv_head, group);
      const int col0 = (lane & 3) * 2;
      float sc = scale[mt][h];
      if (b.partial < 0) {
        float row_lse = lse[mt][h];
        final_row(p, head, sc, row_lse);
        const int64_t row = static_cast<int64_t>(b.q_begin) + tok;
        const int64_t dst = row * p.o_stride_n + head * p.o_stride_h + col0;
        // The output type is chosen once a row, not at each store: with it fixed, the row's
        // stores share one address and differ by immediate offsets.
        const auto store_row = [&](auto f32_out) {
#pragma unroll
          for (int dt = 0; dt < Cfg::kDv / 8; ++dt) {
            const float pair[2] = {o[mt][dt][2 * h] * sc, o[mt][dt][2 * h + 1] * sc};
            store_o<QT>(p.o, decltype(f32_out)::value, dst + dt * 8, pair);
          }
        };
        if (p.o_dtype == DType::f32)
          store_row(std::true_type{});
        else
          store_row(std::false_type{});
        if (p.lse && (lane & 3) == 0) p.lse[row * p.num_qo_heads + head] = row_lse;
      } else {
        const int64_t prow = static_cast<int64_t>(b.partial) + tok;
        float* dst = p.partial_o + (prow * p.num_qo_heads + head) * Cfg::kDv + col0;
#pragma unroll
        for (int dt = 0; dt < Cfg::kDv / 8; ++dt)
          *reinterpret_cast<float2*>(dst + dt * 8) =
              make_float2(o[mt][dt][2 * h] * sc, o[mt][dt][2 * h + 1] * sc);
        if ((lane & 3) == 0) p.partial_lse[prow * p.num_qo_heads + head] = lse[mt][h];
      }
    }
}

// True when a final 16-bit O can be stored in 16-byte chunks (store_block_staged): the base and
// both strides keep every row's start 16-byte aligned. Uniform across the kernel.
__device__ __forceinline__ bool o_chunks_aligned(const AttentionParams& p) {
  return p.o_dtype != DType::f32 && reinterpret_cast<uintptr_t>(p.o) % 16 == 0 &&
         p.o_stride_n % 8 == 0 && p.o_stride_h % 8 == 0;
}

// store_block for a final (not split, not merged) row block with 16-bit O whose rows start
// 16-byte aligned (o_chunks_aligned). Each thread writes its normalised pairs into the warp's
// slice of the block's Q stage (`smem`, 16 rows of kDqk elements a warp, which the caller has
// made free: the warpgroup is past its last Q.K^T), then the warp copies its rows out in 16-byte
// chunks, half a warp a 256-byte row at head dim 128, where the fragment's own stores are 4
// bytes each, eight rows an instruction (the rows: WarpStaging).
template <typename Cfg>
__device__ __forceinline__ void store_block_staged(const AttentionParams& p, const RowBlock& b,
                                                   int kv_head, int group, int warp_row0, int lane,
                                                   unsigned char* smem,
                                                   const float (&o)[Cfg::kMTiles][Cfg::kDv / 8][4],
                                                   const float (&scale)[Cfg::kMTiles][2],
                                                   const float (&lse)[Cfg::kMTiles][2]) {
  using QT = typename Cfg::Q;
  static_assert(Cfg::kMTiles == 1, "a warp's 16 rows");
  constexpr int kChunks = Cfg::kVChunks;
  const WarpStaging<Cfg> stage(smem, warp_row0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = (lane >> 2) + h * 8, x = warp_row0 + r;
    float sc = scale[0][h], row_lse = lse[0][h];
    const auto [tok, head] = b.packed(x, kv_head, group);
    final_row(p, head, sc, row_lse);
#pragma unroll
    for (int dt = 0; dt < Cfg::kDv / 8; ++dt)
      *reinterpret_cast<uint32_t*>(stage.chunk(r, dt) + (lane & 3) * 2) =
          pack2<QT>(o[0][dt][2 * h] * sc, o[0][dt][2 * h + 1] * sc);
    if (p.lse && (lane & 3) == 0 && x < b.rows) {
      p.lse[(static_cast<int64_t>(b.q_begin) + tok) * p.num_qo_heads + head] = row_lse;
    }
  }
  __syncwarp();
  // Lane l copies chunk l % kChunks of local rows l / kChunks, + kRows, ..: whole rows an
  // instruction, each row's token and head stepped from the lane's first without a division.
  static_assert(32 % kChunks == 0, "whole rows a copy instruction");
  constexpr int kRows = 32 / kChunks;
  const int c = lane % kChunks, r0 = lane / kChunks;
  QT* const out = static_cast<QT*>(p.o) + static_cast<int64_t>(b.q_begin) * p.o_stride_n +
                  static_cast<int64_t>(kv_head) * group * p.o_stride_h + c * 8;
  PackedRowWalk walk(b.row0 + warp_row0 + r0, group, p.o_stride_n, p.o_stride_h);
#pragma unroll
  for (int k = 0; k < 16 / kRows; ++k) {
    const int r = r0 + k * kRows;
    if (warp_row0 + r < b.rows)
      *reinterpret_cast<uint4*>(out + walk.offset) =
          *reinterpret_cast<const uint4*>(stage.chunk(r, c));
    walk.advance<kRows>(group, p.o_stride_n, p.o_stride_h);
  }
}

}  // namespace flashkv::cuda::prefill_detail
