// Global -> shared loads of the prefill kernel: the block's packed Q rows and the KV tiles (ragged
// or paged, 16-bit or fp8), all as 16-byte cp.async copies; rows past the range are zero-filled
// so that no NaN from an unused cache slot can reach the MMAs. fp8 tiles are then widened in
// shared memory.
#pragma once

#include <cstdint>

#include "common/paging.cuh"
#include "flashkv/kernels/params.h"
#include "prefill/mask.cuh"
#include "prefill/tile_config.cuh"

namespace flashkv::cuda::prefill_detail {

// Thread layout of the 16-bit tile loads: 8 threads per row, thread t copying chunks
// (t % 8) + 8k of rows t / 8 + 16i. A row's 8 threads then write one 128-byte group of 8
// chunks, and the swizzled chunk ((t % 8) ^ row % 8) + 8k is the same for all of a thread's rows,
// so its shared-memory offsets are one base plus constants.
constexpr int kLoadRowsPerPass = kPrefillThreads / 8;

__device__ __forceinline__ int load_row_of(int tid) { return tid >> 3; }
__device__ __forceinline__ int load_swizzled_chunk_of(int tid) { return (tid ^ (tid >> 3)) & 7; }

// Element `col` of packed Q row `row` of the block (token row / G of query head kv_head * G +
// row % G); `valid` false for a padding row past the block, whose copies read q itself and
// zero-fill.
template <typename QT>
__device__ __forceinline__ const QT* q_row_source(const AttentionParams& p, const RowBlock& b,
                                                  int kv_head, int group, int row, int col,
                                                  bool& valid) {
  const QT* q = static_cast<const QT*>(p.q);
  valid = row < b.rows;
  if (!valid) return q;
  const auto [tok, head] = b.packed(row, kv_head, group);
  return q + (static_cast<int64_t>(b.q_begin) + tok) * p.q_stride_n +
         static_cast<int64_t>(head) * p.q_stride_h + col;
}

// Q rows of the block -> swizzled sQ [kCtaRows, D_qk]. Padding rows are zero-filled.
template <typename Cfg>
__device__ __forceinline__ void load_q(const AttentionParams& p, const RowBlock& b, int kv_head,
                                       int group, typename Cfg::Q* sq, int tid) {
  using QT = typename Cfg::Q;
  const int r0 = load_row_of(tid), sw = load_swizzled_chunk_of(tid);
#pragma unroll
  for (int i = 0; i < Cfg::kCtaRows / kLoadRowsPerPass; ++i) {
    const int row = r0 + i * kLoadRowsPerPass;
    bool valid;
    const QT* src = q_row_source<QT>(p, b, kv_head, group, row, (tid & 7) * 8, valid);
#pragma unroll
    for (int k = 0; k < Cfg::kQkChunks / 8; ++k)
      cp_async_16(sq + row * Cfg::kDqk + (sw + 8 * k) * 8, valid ? src + 64 * k : src,
                  valid ? 16 : 0);
  }
}

// Copies one operand (K or V) of a KV tile whose rows this thread loads: `rows[i]` is the element
// offset of row load_row_of(tid) + 16i inside the operand's tensor (head included), or -1 when
// that key is past the range (the row is zero-filled).
template <typename Cfg, int kDim>
__device__ __forceinline__ void load_operand_16(const typename Cfg::Q* src,
                                                const int64_t (&rows)[Cfg::kKvTile / 16],
                                                typename Cfg::Q* dst, int tid) {
  const int r0 = load_row_of(tid), sw = load_swizzled_chunk_of(tid);
#pragma unroll
  for (int i = 0; i < Cfg::kKvTile / kLoadRowsPerPass; ++i) {
    const bool valid = rows[i] >= 0;
    const typename Cfg::Q* row_src = src + (valid ? rows[i] + (tid & 7) * 8 : 0);
#pragma unroll
    for (int k = 0; k < kDim / 64; ++k)
      cp_async_16(dst + (r0 + i * kLoadRowsPerPass) * kDim + (sw + 8 * k) * 8,
                  valid ? row_src + 64 * k : row_src, valid ? 16 : 0);
  }
}

// fp8: 4 threads per row, thread t copying 16-byte chunks (t % 4) + 4k of rows t / 4 + 32i into
// a plain [kKvTile, kDim] byte tile.
template <typename Cfg, int kDim>
__device__ __forceinline__ void load_operand_fp8(const unsigned char* src,
                                                 const int64_t (&rows)[Cfg::kKvTile / 32],
                                                 unsigned char* dst, int tid) {
#pragma unroll
  for (int i = 0; i < Cfg::kKvTile / 32; ++i) {
    const bool valid = rows[i] >= 0;
    const unsigned char* row_src = src + (valid ? rows[i] + (tid & 3) * 16 : 0);
#pragma unroll
    for (int k = 0; k < kDim / 64; ++k)
      cp_async_16(dst + ((tid >> 2) + 32 * i) * kDim + ((tid & 3) + 4 * k) * 16,
                  valid ? row_src + 64 * k : row_src, valid ? 16 : 0);
  }
}

// The rows this thread copies for one KV tile: keys j0 + r0 + i * kRowsPerPass. With paged KV
// each row's slot comes from kv_indices, a dependent global load; fetch() issues those loads a
// tile ahead (into registers), so that by the time the copies are issued the indices are there
// and no warp stalls on them before its next tile of MMAs.
template <typename Cfg>
struct KvTileRows {
  static constexpr int kRowsPerPass = Cfg::kFp8 ? 32 : Cfg::kThreads / 8;
  static constexpr int kRows = Cfg::kKvTile / kRowsPerPass;
  int32_t entry[kRows];  // paged: the kv_indices entry (slot or page) of each row

  static __device__ __forceinline__ int first_row(int tid) {
    return Cfg::kFp8 ? (tid >> 2) : load_row_of(tid);
  }

  __device__ __forceinline__ void fetch(const AttentionParams& p, const RowBlock& b, int j0,
                                        int tid) {
    if (!p.paged) return;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int j = j0 + first_row(tid) + i * kRowsPerPass;
      const int e = page_index(p, j);
      entry[i] = j < b.kv_hi ? p.kv_indices[b.kv_base + e] : 0;
    }
  }

  // Element offsets (head included) of the rows in a K or V tensor; -1 for keys past the range.
  // Rows are clamped into the tensor so that a bad index can never address outside it.
  __device__ __forceinline__ void offsets(const AttentionParams& p, const RowBlock& b, int j0,
                                          int tid, int64_t stride_n, int64_t head_off,
                                          int64_t (&out)[kRows]) const {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int j = j0 + first_row(tid) + i * kRowsPerPass;
      const int64_t row = p.paged ? paged_pool_row(p, entry[i], j) : ragged_kv_row(p, b.kv_base, j);
      out[i] = j < b.kv_hi ? row * stride_n + head_off : -1;
    }
  }
};

// Issues the copies of KV tile [j0, j0 + kKvTile) (rows from `rows`, fetched for this tile) into
// pipeline stage `stage` (16-bit KV: swizzled tiles; fp8 KV: plain staging tiles). Keys at or
// past b.kv_hi are zero-filled.
template <typename Cfg>
__device__ __forceinline__ void load_kv_tile(const AttentionParams& p, const RowBlock& b,
                                             const KvTileRows<Cfg>& rows, int kv_head, int j0,
                                             unsigned char* smem, int stage, int tid) {
  using QT = typename Cfg::Q;
  int64_t k_rows[KvTileRows<Cfg>::kRows], v_rows[KvTileRows<Cfg>::kRows];
  rows.offsets(p, b, j0, tid, p.k_stride_n, kv_head * p.k_stride_h, k_rows);
  rows.offsets(p, b, j0, tid, p.v_stride_n, kv_head * p.v_stride_h, v_rows);
  if constexpr (Cfg::kFp8) {
    load_operand_fp8<Cfg, Cfg::kDqk>(static_cast<const unsigned char*>(p.k), k_rows,
                                     smem + Cfg::kK8Offset + stage * Cfg::kK8StageBytes, tid);
    load_operand_fp8<Cfg, Cfg::kDv>(static_cast<const unsigned char*>(p.v), v_rows,
                                    smem + Cfg::kV8Offset + stage * Cfg::kV8StageBytes, tid);
  } else {
    load_operand_16<Cfg, Cfg::kDqk>(
        static_cast<const QT*>(p.k), k_rows,
        reinterpret_cast<QT*>(smem + Cfg::kKOffset + stage * Cfg::kKStageBytes), tid);
    load_operand_16<Cfg, Cfg::kDv>(
        static_cast<const QT*>(p.v), v_rows,
        reinterpret_cast<QT*>(smem + Cfg::kVOffset + stage * Cfg::kVStageBytes), tid);
  }
}

// fp8 staging tile [kKvTile, kDim] bytes -> swizzled 16-bit tile (exact; the scales are applied
// later, k_scale to the logits and v_scale to the output).
template <typename Cfg, int kDim>
__device__ __forceinline__ void widen_fp8_tile(const unsigned char* src, typename Cfg::Q* dst,
                                               int tid) {
  using QT = typename Cfg::Q;
  constexpr int kSrcChunks = Cfg::kKvTile * kDim / 16;  // 16 fp8 values each
#pragma unroll
  for (int i = 0; i < (kSrcChunks + kPrefillThreads - 1) / kPrefillThreads; ++i) {
    const int c = tid + i * kPrefillThreads;
    if (kSrcChunks % kPrefillThreads != 0 && c >= kSrcChunks) break;
    const int row = c / (kDim / 16), chunk16 = c % (kDim / 16);
    const uint4 raw = *reinterpret_cast<const uint4*>(src + row * kDim + chunk16 * 16);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t out[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t x = words[w];
      out[2 * w] = pack2<QT>(fp8_to_float<Cfg::kKvFormat>(x & 0xffu),
                             fp8_to_float<Cfg::kKvFormat>((x >> 8) & 0xffu));
      out[2 * w + 1] = pack2<QT>(fp8_to_float<Cfg::kKvFormat>((x >> 16) & 0xffu),
                                 fp8_to_float<Cfg::kKvFormat>(x >> 24));
    }
    *reinterpret_cast<uint4*>(dst + swizzle<kDim / 8>(row, 2 * chunk16)) =
        make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(dst + swizzle<kDim / 8>(row, 2 * chunk16 + 1)) =
        make_uint4(out[4], out[5], out[6], out[7]);
  }
}

}  // namespace flashkv::cuda::prefill_detail
