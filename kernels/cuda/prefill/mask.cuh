// Which keys a block of packed query rows sees: the block's KV range (trimmed by causal and the
// window so no fully hidden tile is visited), whether a KV tile needs per-element masking, and
// the per-element rule of SEMANTICS.md (causal with prefix alignment, window, custom mask), on
// the helpers of core/visibility.h.
#pragma once

#include <climits>
#include <cstdint>

#include "flashkv/core/visibility.h"
#include "flashkv/kernels/params.h"
#include "prefill/primitives.cuh"

namespace flashkv::cuda::prefill_detail {

__device__ __forceinline__ int kv_len_of(const AttentionParams& p, int request) {
  const int n = p.kv_indptr[request + 1] - p.kv_indptr[request];
  if (!p.paged || p.page_size == 1 || n <= 0) return n > 0 ? n : 0;
  return (n - 1) * p.page_size + p.last_page_len[request];
}

// One block of up to kCtaRows packed rows of a work item, for one KV head. Packed row
// x of the item is token x / G (relative to item.q_begin) of query head kv_head * G + x % G.
struct RowBlock {
  int request;
  int q_begin;        // absolute Q/O row of the item's first token
  int row0;           // first packed row of this block inside the item
  int rows;           // packed rows in this block (<= kCtaRows)
  int partial;        // item.partial (-1: final output)
  int pos0;           // KV position of the item's first token: kv_len - q_len_req + local offset
  int kv_len;         // the request's KV length (the custom mask's row length)
  int kv_base;        // kv_indptr[request]: first K/V row (ragged) or kv_indices entry (paged)
  int kv_lo, kv_hi;   // keys [kv_lo, kv_hi) can be visible to some row of the block
  int64_t mask_base;  // custom mask: element of (local query 0, key 0) of the request
  int local_q0;       // request-local query index of the item's first token
  // Keys [full_lo, full_hi) are visible to every row of the block under causal and the window
  // (the custom mask aside): a tile inside needs no per-element mask (tile_is_full). Worked out
  // once a block, since the rows' positions take a division by the group.
  int full_lo, full_hi;

  // Packed row x of the block (its group query heads a token, token-major): the row's token
  // within the item (its Q/O row is q_begin + tok) and its query head.
  struct Packed {
    int tok, head;
  };
  __device__ __forceinline__ Packed packed(int x, int kv_head, int group) const {
    const int item_row = row0 + x;
    const int tok = item_row / group;
    return {tok, kv_head * group + (item_row - tok * group)};
  }
};

// Builds the block geometry; kv_hi <= kv_lo when no row of the block sees any key.
__device__ __forceinline__ RowBlock make_row_block(const AttentionParams& p, const WorkItem& it,
                                                   int group, int row0, int cta_rows) {
  RowBlock b;
  b.request = it.request;
  b.q_begin = it.q_begin;
  b.row0 = row0;
  b.rows = min(cta_rows, it.q_len * group - row0);
  b.partial = it.partial;
  const int q_first = p.qo_indptr[it.request];
  const int q_len_req = p.qo_indptr[it.request + 1] - q_first;
  b.kv_len = kv_len_of(p, it.request);
  b.kv_base = p.kv_indptr[it.request];
  b.local_q0 = it.q_begin - q_first;
  b.pos0 = query_position(b.kv_len, q_len_req, b.local_q0);
  b.mask_base = p.custom_mask ? static_cast<int64_t>(p.mask_indptr[it.request]) : 0;
  int lo = max(0, min(it.kv_begin, b.kv_len));
  int hi = max(0, min(it.kv_end, b.kv_len));
  const int first_pos = b.pos0 + row0 / group;
  const int last_pos = b.pos0 + (row0 + b.rows - 1) / group;
  if (p.causal && !p.custom_mask) hi = min(hi, max(causal_key_end(last_pos), 0));
  if (p.window_left >= 0) lo = max(lo, window_first_key(first_pos, p.window_left));
  b.kv_lo = lo;
  b.kv_hi = hi;
  // block_fully_visible (core/visibility.h) as a key range: the earliest row sees up to its own
  // position (causal), the latest row from its window's first key.
  b.full_lo = p.window_left >= 0 ? window_first_key(last_pos, p.window_left) : INT_MIN;
  b.full_hi = p.causal && !p.custom_mask ? min(hi, causal_key_end(first_pos)) : hi;
  return b;
}

// The persistent CTA's walk (grid (workers, Hkv)): every row block of kCtaRows packed rows of
// worker blockIdx.x's items, for KV head blockIdx.y, each after a __syncthreads (the previous
// block's readers of shared memory are done) unless kSync is false (the warp-specialized
// kernel's producer, which hands each block to its consumers with the block's Q):
// run(block, kv_head, group).
template <int kCtaRows, bool kSync = true, typename Run>
__device__ __forceinline__ void for_each_row_block(const AttentionParams& p, Run&& run) {
  const int worker = blockIdx.x, kv_head = blockIdx.y;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int first = p.worker_indptr[worker], last = p.worker_indptr[worker + 1];
  for (int i = first; i < last; ++i) {
    const WorkItem it = p.items[i];
    const int packed_rows = it.q_len * group;
    for (int row0 = 0; row0 < packed_rows; row0 += kCtaRows) {
      if (kSync) __syncthreads();
      run(make_row_block(p, it, group, row0, kCtaRows), kv_head, group);
    }
  }
}

// True when every element of the KV tile [j0, j0 + tile) is visible to every row of the block,
// so the tile needs no per-element mask (uniform across the CTA).
__device__ __forceinline__ bool tile_is_full(const AttentionParams& p, const RowBlock& b, int j0,
                                             int tile) {
  return !p.custom_mask && j0 >= b.full_lo && j0 + tile <= b.full_hi;
}

// tile_is_full for a tile in which the custom mask hides no element from the block's rows (the
// warp-specialized producer's verdict, custom_mask_hides_none): the custom mask replaces causal,
// so the block's KV range and the window decide (full_hi is kv_hi under a custom mask).
__device__ __forceinline__ bool tile_is_full_unmasked(const RowBlock& b, int j0, int tile) {
  return j0 >= b.full_lo && j0 + tile <= b.full_hi;
}

// Sets the hidden elements of a thread's S fragment to -inf. s[mt][nt][e]: row g (+8 for e >= 2)
// of the warp's MMA tile mt, key j0 + nt * 8 + 2 * (lane % 4) + (e % 2). Row positions are
// recomputed here (only masked tiles pay for them) rather than held in registers for the loop.
// Without a custom mask each row's visible keys are one interval [lo, hi), so the common causal /
// window case is two compares an element and no branches.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4],
                                           const AttentionParams& p, const RowBlock& b, int group,
                                           int warp_row0, int j0, int lane) {
  const float neg_inf = -__int_as_float(0x7f800000);
  const int j_lane = j0 + (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int x = warp_row0 + mt * 16 + (lane >> 2) + h * 8;  // row inside the block
      const int tok = (b.row0 + x) / group;
      const int pos = b.pos0 + tok;
      const int lo = p.window_left >= 0 ? window_first_key(pos, p.window_left) : INT_MIN;
      int hi = b.kv_hi;
      if (p.custom_mask) {
        // Element (this row, key 0) of the request's matrix; padding rows see nothing.
        const uint8_t* mask_row =
            p.custom_mask + b.mask_base + static_cast<int64_t>(b.local_q0 + tok) * b.kv_len;
        if (x >= b.rows) hi = INT_MIN;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = j_lane + nt * 8 + e;
            if (!(j >= lo && j < hi && mask_row[j] != 0)) s[mt][nt][2 * h + e] = neg_inf;
          }
      } else {
        if (p.causal) hi = min(hi, causal_key_end(pos));
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = j_lane + nt * 8 + e;
            if (j < lo || j >= hi) s[mt][nt][2 * h + e] = neg_inf;
          }
      }
    }
}

}  // namespace flashkv::cuda::prefill_detail
