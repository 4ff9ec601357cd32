// The KV-cache operators a forward pass runs (SEMANTICS.md): writing new K/V rows into the pool,
// turning req_to_token rows into a batch's kv_indices, and translating full-attention slots to
// sliding-window slots. The device is chosen by the tensors (all on the host: CPU kernels; all
// on one GPU: CUDA kernels, ordered on `stream`, never synchronizing, allocating nothing).
//
// Validation: shapes, dtypes and devices always; for host tensors also every index and range,
// all before any memory is written (a bad call throws flashkv::Error and changes nothing). The
// index contents of CUDA tensors cannot be read without a synchronization, so the CUDA kernels
// instead skip entries whose indices are out of range (they never read or write out of bounds;
// the skipped outputs are left as they were, or written as the dummy slot 0 where noted).
#pragma once

#include <memory>
#include <utility>

#include "flashkv/core/tensor.h"

namespace flashkv {

struct AppendKVParams;  // the kernel contract (internal)

// Writes the K/V rows of new tokens into a layer's pool: for each token t,
//   k_pool[out_cache_loc[t], h, :] = k_new[t, h, :] / k_scale   (v likewise with v_scale),
// rounded to the pool dtype (to nearest even; fp8 saturates to its largest finite value).
//   k_new [T, Hkv, D_qk], v_new [T, Hkv, D_v]: f32/f16/bf16 (the same), any row/head strides
//   out_cache_loc [T] i32/i64: slots in [0, num_slots) (slot 0, the dummy, takes padded rows)
//   k_pool [num_slots, Hkv, D_qk], v_pool [num_slots, Hkv, D_v]: f32/f16/bf16/fp8 (the same)
//   k_scale, v_scale: finite, > 0 (the attention kernels multiply by them when reading)
// Two tokens naming the same slot (other than padding into slot 0) leave either one's row.
void append_kv(const TensorView& k_new, const TensorView& v_new, const TensorView& out_cache_loc,
               const TensorView& k_pool, const TensorView& v_pool, float k_scale = 1.0f,
               float v_scale = 1.0f, Stream stream = {});

// An append_kv call validated (every check append_kv makes) but not run yet, so that a caller can
// validate the rest of its work before the pool changes; run() writes. Keep the tensors alive and
// the host slot list unchanged until then.
class PreparedAppendKV {
 public:
  void run(Stream stream = {}) const;

 private:
  friend PreparedAppendKV prepare_append_kv(const TensorView&, const TensorView&, const TensorView&,
                                            const TensorView&, const TensorView&, float, float);
  PreparedAppendKV(std::shared_ptr<const AppendKVParams> params, Device device)
      : params_(std::move(params)), device_(device) {}

  std::shared_ptr<const AppendKVParams> params_;
  Device device_;
};
PreparedAppendKV prepare_append_kv(const TensorView& k_new, const TensorView& v_new,
                                   const TensorView& out_cache_loc, const TensorView& k_pool,
                                   const TensorView& v_pool, float k_scale = 1.0f,
                                   float v_scale = 1.0f);

// Gathers each request's token slots: for i < B and j < lens[i],
//   kv_indices[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j]
//   req_to_token [max_reqs, max_context_len] i32 (row stride free, unit column stride)
//   req_pool_indices [B], lens [B], kv_start [B] (optional: absent means 0): i32/i64
//   kv_indptr [B + 1] i32 with kv_indptr[i + 1] - kv_indptr[i] == lens[i], kv_indptr[0] >= 0
//   kv_indices [>= kv_indptr[B]] i32 (written only inside the requests' ranges)
// Host checks: rows in [0, max_reqs), lens >= 0, kv_start >= 0, kv_start + lens <=
// max_context_len, the indptr identity and kv_indptr[B] <= kv_indices.numel(). CUDA: a request
// failing any of these (with kv_indptr[i] + lens[i] <= numel) is skipped.
void build_kv_indices(const TensorView& req_to_token, const TensorView& req_pool_indices,
                      const TensorView& lens, const TensorView& kv_start,
                      const TensorView& kv_indptr, const TensorView& kv_indices,
                      Stream stream = {});

// out[i] = table[full_slots[i]]: full-attention slots to sliding-window slots through an
// SWAAllocator's table.
//   full_slots [N] i32/i64 in [0, table.numel()); table [S] i32; out [N] i32 (may not alias
//   full_slots unless both are i32 and the same tensor).
// CUDA: an out-of-range full slot translates to the dummy slot 0.
void translate_slots(const TensorView& full_slots, const TensorView& table, const TensorView& out,
                     Stream stream = {});

}  // namespace flashkv
