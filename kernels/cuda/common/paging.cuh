// Token j of a request's KV in a paged cache: its page (the kv_indices entry, counted from the
// request's first) and its row within the page. With a power-of-two page size (the usual one)
// these are a shift and a mask; a division by a run-time value costs a long instruction sequence,
// and the KV loads compute them for every row of every tile.
#pragma once

#include <cstdint>

#include "flashkv/kernels/params.h"

namespace flashkv::cuda {

__device__ __forceinline__ int32_t page_index(const AttentionParams& p, int32_t j) {
  return p.page_shift >= 0 ? j >> p.page_shift : j / p.page_size;
}

__device__ __forceinline__ int32_t page_offset(const AttentionParams& p, int32_t j) {
  return p.page_shift >= 0 ? j & (p.page_size - 1) : j % p.page_size;
}

// The pool row of token j whose kv_indices entry (slot, or page) is `entry`, clamped into the
// pool [0, num_kv_rows) so that a bad index can never address outside it.
__device__ __forceinline__ int64_t paged_pool_row(const AttentionParams& p, int32_t entry,
                                                  int32_t j) {
  const int64_t row = p.page_size == 1
                          ? int64_t{entry}
                          : static_cast<int64_t>(entry) * p.page_size + page_offset(p, j);
  return min(max(row, int64_t{0}), p.num_kv_rows - 1);
}

// The K/V row of token j of a ragged request whose rows start at `kv_base`, clamped into the
// tensor the same way.
__device__ __forceinline__ int64_t ragged_kv_row(const AttentionParams& p, int32_t kv_base,
                                                 int32_t j) {
  return min(max(static_cast<int64_t>(kv_base) + j, int64_t{0}), p.num_kv_rows - 1);
}

}  // namespace flashkv::cuda
