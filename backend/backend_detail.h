// What FlashKVBackend's ordinary path (flashkv_backend.cpp) and its context-parallel path
// (context_parallel.cpp) share: the pool and index checks of a batch and the resolution of one
// layer call. Internal to backend/.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "flashkv/backend/flashkv_backend.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/ops/kv_ops.h"

namespace flashkv::backend_detail {

// A pool the backend reads and writes must match the model it was built for.
void check_pool(const KVPool& pool, const BackendOptions& o, const char* name);
// Prefix sums that must fit the i32 index arrays the kernels read.
void prefix_sums_into(const std::vector<int32_t>& lens, const char* what,
                      std::vector<int32_t>* out);
// Host index tensors are read before anything is planned: each entry must lie in [0, limit).
void check_host_entries(const TensorView& t, int64_t limit, const char* name, const char* what);

// One layer call, resolved: 3-D views of its tensors, the pool it writes, where, and the
// attention options the layer gives (scale, soft cap, window, sinks).
struct LayerIO {
  TensorView q, k, v, out;  // 3-D views
  KVPool* pool = nullptr;
  TensorView cache_loc;
  const char* cache_loc_name = "batch.out_cache_loc";
  AttentionOptions opt;
};
// The decode operator's options: the layer's, plus layout_ready (flashkv_backend.cpp says why).
AttentionOptions decode_options(AttentionOptions opt);
// Resolves everything a layer call needs, validating before anything is written. T: the query
// rows of the call; own_out: the backend's output buffer, used when `out` is undefined.
LayerIO layer_io(const BackendOptions& o, const LayerSpec& layer, const ForwardBatch& b,
                 const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& out, const TensorView& own_out, int64_t T,
                 const TensorView& swa_loc);
// The layer's K/V append, validated; run it once the attention calls are validated too.
PreparedAppendKV prepare_save(const LayerIO& io, const LayerSpec& layer);
// Layer `layer` of `pool` as a paged KV of token slots (page size 1) over an index set.
PagedKV paged_view(const KVPool& pool, int layer, const TensorView& indptr,
                   const TensorView& indices, const Tensor& last_page_len, int32_t B);
// [rows, heads, dim] as [rows, heads * dim].
TensorView flat_output(const TensorView& out3);

}  // namespace flashkv::backend_detail

namespace flashkv {

// The context-parallel path's state (BackendOptions::cp_comm): the sharded operators, one per kind
// of layer, and the rank's index set of the planned batch.
struct FlashKVBackend::CpState {
  CpState(parallel::Communicator& comm, const parallel::CpOptions& options, bool has_window);
  parallel::Communicator& comm;
  parallel::CpShard shard;
  // [0]: full-attention layers; [1]: sliding-window layers (a model with a window).
  std::vector<std::unique_ptr<parallel::CpDecode>> decode;
  std::vector<std::unique_ptr<parallel::CpExtend>> extend;
  bool planned = false;
  ForwardMode mode = ForwardMode::IDLE;
  int32_t batch_size = 0;
  int64_t query_rows = 0;
  // The rank's KV entries of each request that the local passes read: decode, the whole sequence;
  // the extend modes, the cached prefix (the new tokens come from the ranks' k / v).
  std::vector<int32_t> kv_len, kv_indptr;
  std::vector<int32_t> kept_loc;     // extend: the slots of the new tokens this rank keeps
  std::vector<int32_t> mask_indptr;  // TARGET_VERIFY: each request's tree mask in the batch's
  Tensor h_mask_indptr;              // ... the same on the host, as CpExtend takes it
  // A batch on a GPU: the host copies of what the plan reads on the host (out_cache_loc, and
  // TARGET_VERIFY's tree mask, viewed by h_custom_mask_view).
  Tensor h_out_cache_loc, h_custom_mask;
  TensorView h_custom_mask_view;
  Tensor d_kv_len, d_kv_indptr, d_kv_indices, d_last_page_len, d_kept_loc;
  Tensor out;  // [rows, Hq, Dv]: the output when forward() is given none
};

}  // namespace flashkv
