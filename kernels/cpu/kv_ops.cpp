// CPU kernels of the KV-cache ops (params validated by ops/kv_ops.cpp).
#include <algorithm>
#include <cstring>

#include "flashkv/core/error.h"
#include "flashkv/core/thread_pool.h"
#include "flashkv/kernels/kv_convert.h"
#include "flashkv/kernels/kv_kernels.h"

namespace flashkv::cpu {
namespace {

using kv_convert::load;
using kv_convert::load_index;
using kv_convert::Store;

// Tokens per parallel_for task: enough rows to amortize the hand-out.
constexpr int64_t kTokensPerTask = 16;

template <typename In, typename Out>
void append_rows(const AppendKVParams& p, const In* src, int64_t src_stride_n, int64_t src_stride_h,
                 Out* dst, int64_t dst_stride_n, int64_t dst_stride_h, int head_dim, float scale,
                 int64_t token) {
  const int64_t slot = load_index(p.loc, p.loc_i64, token);
  for (int h = 0; h < p.num_kv_heads; ++h) {
    const In* s = src + token * src_stride_n + h * src_stride_h;
    Out* d = dst + slot * dst_stride_n + h * dst_stride_h;
    for (int i = 0; i < head_dim; ++i) d[i] = Store<Out>::from(load(s[i]) / scale);
  }
}

template <typename In, typename Out>
void append_kv_typed(const AppendKVParams& p) {
  const int64_t num_tasks = (p.num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  ThreadPool::global().parallel_for(num_tasks, [&](int64_t task, int) {
    const int64_t end = std::min(p.num_tokens, (task + 1) * kTokensPerTask);
    for (int64_t t = task * kTokensPerTask; t < end; ++t) {
      append_rows(p, static_cast<const In*>(p.k_new), p.k_new_stride_n, p.k_new_stride_h,
                  static_cast<Out*>(p.k_pool), p.k_pool_stride_n, p.k_pool_stride_h, p.head_dim_qk,
                  p.k_scale, t);
      append_rows(p, static_cast<const In*>(p.v_new), p.v_new_stride_n, p.v_new_stride_h,
                  static_cast<Out*>(p.v_pool), p.v_pool_stride_n, p.v_pool_stride_h, p.head_dim_v,
                  p.v_scale, t);
    }
  });
}

template <typename In>
void append_kv_to_pool(const AppendKVParams& p) {
  switch (p.pool_dtype) {
    case DType::f32:
      return append_kv_typed<In, float>(p);
    case DType::f16:
      return append_kv_typed<In, f16_t>(p);
    case DType::bf16:
      return append_kv_typed<In, bf16_t>(p);
    case DType::fp8_e4m3:
      return append_kv_typed<In, fp8_e4m3_t>(p);
    case DType::fp8_e5m2:
      return append_kv_typed<In, fp8_e5m2_t>(p);
    default:
      throw_error(str_cat("append_kv: unsupported pool dtype ", dtype_name(p.pool_dtype)));
  }
}

}  // namespace

void append_kv(const AppendKVParams& p) {
  switch (p.new_dtype) {
    case DType::f32:
      return append_kv_to_pool<float>(p);
    case DType::f16:
      return append_kv_to_pool<f16_t>(p);
    case DType::bf16:
      return append_kv_to_pool<bf16_t>(p);
    default:
      throw_error(str_cat("append_kv: unsupported k_new dtype ", dtype_name(p.new_dtype)));
  }
}

void build_kv_indices(const BuildKVIndicesParams& p) {
  // Requests copy disjoint ranges; a task per request keeps long and short ones balanced.
  ThreadPool::global().parallel_for(p.batch_size, [&](int64_t i, int) {
    const int64_t row = load_index(p.req_pool_indices, p.req_pool_indices_i64, i);
    const int64_t len = load_index(p.lens, p.lens_i64, i);
    const int64_t start = p.kv_start ? load_index(p.kv_start, p.kv_start_i64, i) : 0;
    if (len > 0)
      std::memcpy(p.kv_indices + p.kv_indptr[i],
                  p.req_to_token + row * p.req_to_token_stride + start,
                  static_cast<size_t>(len) * sizeof(int32_t));
  });
}

void translate_slots(const TranslateSlotsParams& p) {
  for (int64_t i = 0; i < p.n; ++i)
    p.out[i] = p.table[load_index(p.full_slots, p.full_slots_i64, i)];
}

void build_draft_kv_indices(const DraftKVIndicesParams& p) {
  for (int32_t r = 0; r < p.bs; ++r) {
    const int32_t* src = p.req_to_token + p.req_pool_indices[r] * p.req_to_token_stride;
    const int32_t len = p.seq_lens[r];
    for (int32_t b = 0; b < p.topk; ++b) {
      const int32_t row = r * p.topk + b;
      int32_t* dst = p.kv_indices + p.kv_indptr[row];
      for (int32_t j = 0; j < len; ++j) dst[j] = src[j];
      const int32_t* draft = p.draft_loc + (int64_t{r} * p.topk + b) * p.num_steps;
      for (int32_t s = 0; s <= p.step; ++s) dst[len + s] = draft[s];
      p.step_loc[row] = draft[p.step];
    }
  }
}

}  // namespace flashkv::cpu
