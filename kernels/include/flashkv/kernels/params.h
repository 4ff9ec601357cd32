// The plain parameter structs the kernels receive (by value on CUDA). Built and validated by the
// ops layer; a kernel trusts them. Strides are in elements.
#pragma once

#include <cstdint>

#include "flashkv/core/dtype.h"
#include "flashkv/plan/plan.h"

namespace flashkv {

struct AttentionParams {
  // Q [num_qo_tokens, Hq, D_qk] and O [num_qo_tokens, Hq, D_v]; Q f32/f16/bf16, O Q's dtype or
  // f32 (fp32 outputs, e.g. partial states that a later merge_state combines without rounding).
  const void* q = nullptr;
  void* o = nullptr;
  DType q_dtype = DType::bf16;
  DType o_dtype = DType::bf16;
  int64_t q_stride_n = 0, q_stride_h = 0;
  int64_t o_stride_n = 0, o_stride_h = 0;
  float* lse = nullptr;  // [num_qo_tokens, Hq] contiguous, base 2; null when not wanted
  // Prefill only: a state over a disjoint KV set that each final output row is merged with
  // before it is written (AttentionOptions::merge_o). merge_o has O's dtype and shape;
  // merge_lse [num_qo_tokens, Hq] contiguous. Either may be the same memory as o / lse: a row is
  // read before it is written, by the same thread. Null: no merge.
  const void* merge_o = nullptr;
  int64_t merge_stride_n = 0, merge_stride_h = 0;
  const float* merge_lse = nullptr;
  // CUDA sm_90: launched with programmatic stream serialization, the kernel waits for the
  // preceding kernel only before it reads merge_o / merge_lse or writes o / lse
  // (AttentionOptions::overlap_previous).
  bool overlap_previous = false;
  // Decode, CUDA sm_90: the request layout may be read before griddepcontrol.wait
  // (AttentionOptions::layout_ready).
  bool layout_ready = false;

  // K [slots, Hkv, D_qk], V [slots, Hkv, D_v]: f32/f16/bf16 (the same as q) or fp8.
  const void* k = nullptr;
  const void* v = nullptr;
  DType kv_dtype = DType::bf16;
  int64_t k_stride_n = 0, k_stride_h = 0;
  int64_t v_stride_n = 0, v_stride_h = 0;
  float k_scale = 1.0f, v_scale = 1.0f;
  int64_t num_kv_rows = 0;  // rows of K/V (pool slots or ragged rows): indices are clamped below it

  // Request layout (device-resident on CUDA, host on CPU; int32).
  // qo_indptr null: decode, query row i is request i.
  const int32_t* qo_indptr = nullptr;
  // paged: request i owns entries kv_indices[kv_indptr[i]..kv_indptr[i+1]) (slots if page_size
  // is 1, else pages with last_page_len[i] tokens in the last one).
  // ragged: request i owns K/V rows kv_indptr[i]..kv_indptr[i+1] (kv_indices null).
  bool paged = false;
  const int32_t* kv_indptr = nullptr;
  const int32_t* kv_indices = nullptr;
  const int32_t* last_page_len = nullptr;
  int32_t page_size = 1;
  int32_t page_shift = 0;  // log2(page_size) when it is a power of two (the usual case), else -1

  int32_t batch_size = 0;
  int64_t num_qo_tokens = 0;
  int32_t num_qo_heads = 0, num_kv_heads = 0, head_dim_qk = 0, head_dim_v = 0;

  // Variant.
  bool causal = true;
  int32_t window_left = -1;
  float logits_soft_cap = 0;
  float sm_scale = 0;                    // already resolved (never 0 here)
  const uint8_t* custom_mask = nullptr;  // [sum qo_len * kv_len] u8; replaces causal
  const int32_t* mask_indptr = nullptr;  // [B + 1], required with custom_mask
  // [Hq] f32 (natural-log logits) or null: joins each row's softmax denominator once, at the
  // row's final write (unsplit epilogue, split merge, or the merge with merge_o); the state it
  // adds is (O = 0, LSE = sinks[h] * log2(e)).
  const float* sinks = nullptr;

  // The plan, as uploaded into the workspace (device copy on CUDA), and partial-state buffers.
  // Under a CUDA graph the counts below are frozen at capture: kernels then read the current
  // ones from `plan_header` (and a merge pass sized for layout.max_merges finds empty merges).
  const PlanHeader* plan_header = nullptr;
  const WorkItem* items = nullptr;
  const int32_t* worker_indptr = nullptr;
  const MergeItem* merges = nullptr;
  int32_t num_items = 0, num_merges = 0, num_workers = 0;
  // The plan is a CUDA-graph plan: launches must not depend on the batch (grids from
  // num_workers only; a merge pass whenever the layout has room for partial states, since a
  // replayed batch may split where the captured one did not).
  bool cuda_graph = false;
  int32_t max_merges = 0;        // merge capacity of the layout (graph mode: the merge grid's size)
  float* partial_o = nullptr;    // [partial_rows, Hq, D_v]
  float* partial_lse = nullptr;  // [partial_rows, Hq]
  // [max_merges, Hq] arrival counters of split tiles (workspace, zero between runs).
  int32_t* merge_counters = nullptr;
};

// merge_state / merge_states: `num_states` states of [rows, heads, dim] each.
struct MergeParams {
  // State s of row r, head h: o_in + r * in_stride_n + s * in_stride_s + h * in_stride_h,
  // lse_in + r * lse_stride_n + s * lse_stride_s + h.
  const void* o_in[2] = {nullptr, nullptr};  // merge_state: two separate tensors
  const float* lse_in[2] = {nullptr, nullptr};
  int64_t in_stride_n = 0, in_stride_s = 0, in_stride_h = 0;
  int64_t lse_stride_n = 0, lse_stride_s = 0;
  int32_t num_states = 2;
  bool stacked = false;  // true: merge_states (o_in[0]/lse_in[0] hold all states)
  DType dtype = DType::f32;
  void* o_out = nullptr;
  int64_t out_stride_n = 0, out_stride_h = 0;
  float* lse_out = nullptr;  // [rows, heads] contiguous; may be null
  int64_t rows = 0;
  int32_t heads = 0, head_dim = 0;
};

}  // namespace flashkv
