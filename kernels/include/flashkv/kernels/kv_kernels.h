// The kernels behind the KV-cache ops (internal: only ops/kv_ops.cpp calls these). The params
// are built and validated by ops/kv_ops.cpp; the CPU kernels trust them, the CUDA kernels also
// guard every index they read from device memory (skipping a bad entry rather than writing out
// of bounds). Strides are in elements.
#pragma once

#include <cstdint>

#include "flashkv/core/device.h"
#include "flashkv/core/dtype.h"

namespace flashkv {

// k_pool[loc[t], h, :] = k_new[t, h, :] / k_scale (and likewise V), rounded to the pool dtype.
struct AppendKVParams {
  const void* k_new = nullptr;    // [num_tokens, Hkv, D_qk]
  const void* v_new = nullptr;    // [num_tokens, Hkv, D_v]
  DType new_dtype = DType::bf16;  // f32 / f16 / bf16
  int64_t k_new_stride_n = 0, k_new_stride_h = 0;
  int64_t v_new_stride_n = 0, v_new_stride_h = 0;
  const void* loc = nullptr;  // [num_tokens] i32 or i64
  bool loc_i64 = false;
  void* k_pool = nullptr;          // [num_slots, Hkv, D_qk]
  void* v_pool = nullptr;          // [num_slots, Hkv, D_v]
  DType pool_dtype = DType::bf16;  // f32 / f16 / bf16 / fp8_e4m3 / fp8_e5m2
  int64_t k_pool_stride_n = 0, k_pool_stride_h = 0;
  int64_t v_pool_stride_n = 0, v_pool_stride_h = 0;
  int64_t num_slots = 0;
  int64_t num_tokens = 0;
  int32_t num_kv_heads = 0, head_dim_qk = 0, head_dim_v = 0;
  float k_scale = 1.0f, v_scale = 1.0f;
};

// kv_indices[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j],
// j < lens[i].
struct BuildKVIndicesParams {
  const int32_t* req_to_token = nullptr;  // [max_reqs, max_context_len], row stride below
  int64_t req_to_token_stride = 0;
  int64_t max_reqs = 0, max_context_len = 0;
  const void* req_pool_indices = nullptr;  // [B] i32 / i64
  bool req_pool_indices_i64 = false;
  const void* lens = nullptr;  // [B] i32 / i64
  bool lens_i64 = false;
  const void* kv_start = nullptr;  // [B] i32 / i64, or null (0)
  bool kv_start_i64 = false;
  const int32_t* kv_indptr = nullptr;  // [B + 1]
  int32_t* kv_indices = nullptr;       // [num_indices]
  int64_t num_indices = 0;
  int64_t batch_size = 0;
};

// out[i] = table[full_slots[i]].
struct TranslateSlotsParams {
  const void* full_slots = nullptr;  // [n] i32 / i64
  bool full_slots_i64 = false;
  const int32_t* table = nullptr;  // [table_size]
  int64_t table_size = 0;
  int32_t* out = nullptr;  // [n]
  int64_t n = 0;
};

// Multi-step draft indices (build_draft_kv_indices in flashkv/ops/draft_ops.h).
struct DraftKVIndicesParams {
  const int32_t* req_to_token = nullptr;
  int64_t req_to_token_stride = 0, max_reqs = 0, max_context_len = 0;
  const int32_t* req_pool_indices = nullptr;
  const int32_t* seq_lens = nullptr;
  const int32_t* draft_loc = nullptr;
  int32_t bs = 0, topk = 0, num_steps = 0, step = 0;
  const int32_t* kv_indptr = nullptr;
  int32_t* kv_indices = nullptr;
  int64_t num_indices = 0;
  int32_t* step_loc = nullptr;
};
namespace cpu {
void append_kv(const AppendKVParams& p);
void build_kv_indices(const BuildKVIndicesParams& p);
void translate_slots(const TranslateSlotsParams& p);
void build_draft_kv_indices(const DraftKVIndicesParams& p);
}  // namespace cpu

namespace cuda {
void append_kv(const AppendKVParams& p, Stream stream);
void build_kv_indices(const BuildKVIndicesParams& p, Stream stream);
void translate_slots(const TranslateSlotsParams& p, Stream stream);
void build_draft_kv_indices(const DraftKVIndicesParams& p, Stream stream);
}  // namespace cuda

}  // namespace flashkv
