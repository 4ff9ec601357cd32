// The grow-only i32 device buffers of the backends (kv_indptr, kv_indices, qo_indptr, ...):
// rewritten for every batch, reallocated when a batch needs more room, and never moved once a
// captured CUDA graph holds their addresses ("fixed").
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/core/error.h"

namespace flashkv::backend_detail {

// Entries a buffer for n values holds (at least one, so that every buffer has an address).
inline int64_t index_room(int64_t n) { return std::max<int64_t>(n, 1); }

// Throws, naming `what`, when `t` is fixed (a captured graph may hold its address) and smaller
// than n entries: the batch does not fit the CUDA-graph capacities. A buffer not allocated yet
// is in no graph, so it may still be allocated.
inline void check_index_room(const Tensor& t, int64_t n, bool fixed, const char* what) {
  const int64_t have = t.defined() ? t.numel() : 0;
  FLASHKV_CHECK(!fixed || have == 0 || have >= index_room(n), what, ": the batch needs ",
                index_room(n), " entries, past the CUDA-graph capacity ", have,
                " (init_cuda_graph_state)");
}

// `t` when it holds n entries, else a new i32 buffer of that size on `device` (contents
// undefined). Leaves `t` alone, so a caller can prepare every buffer before installing any.
inline Tensor with_index_room(const Tensor& t, int64_t n, Device device, bool fixed,
                              const char* what) {
  check_index_room(t, n, fixed, what);
  if (t.defined() && t.numel() >= index_room(n)) return t;
  return Tensor::empty({index_room(n)}, DType::i32, device);
}

// Copies `src` to the start of `dst`, ordered on `stream`.
inline void upload_indices(const Tensor& dst, const std::vector<int32_t>& src, Stream stream) {
  FLASHKV_CHECK(static_cast<int64_t>(src.size()) <= dst.numel(), "upload_indices: ", src.size(),
                " values into a buffer of ", dst.numel());
  copy_bytes(dst.data(), dst.device(), src.data(), Device::cpu(), src.size() * sizeof(int32_t),
             stream);
}

}  // namespace flashkv::backend_detail
