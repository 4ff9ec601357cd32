// Argument validation and device dispatch of the KV-cache operators.
#include "flashkv/ops/kv_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "flashkv/core/cuda_runtime.h"
#include "flashkv/kernels/kv_kernels.h"

namespace flashkv {
namespace {

// Checks that a 1-D index tensor lives on `dev`, has `n` elements (n < 0: any) and is
// contiguous; returns whether it is i64.
bool check_index_vector(const TensorView& t, const char* name, Device dev, int64_t n,
                        const char* what) {
  Expect e(t, name);
  e.ndim(1).device(dev).index_dtype().contiguous();
  if (n >= 0) e.dim(0, n, what);
  return t.dtype == DType::i64;
}

void check_dims_fit_int32(const char* op, const TensorView& t) {
  for (int d = 1; d < t.ndim; ++d)
    FLASHKV_CHECK(t.shape[d] <= INT32_MAX, op, ": dimension ", d, " of ", t.str(),
                  " exceeds int32");
}

void set_cuda_device(Device dev) {
#if FLASHKV_WITH_CUDA
  detail::cuda_set_device(dev);
#else
  throw_error(str_cat("tensors on ", dev.str(), " given, but this flashkv was built without CUDA"));
#endif
}

}  // namespace

PreparedAppendKV prepare_append_kv(const TensorView& k_new, const TensorView& v_new,
                                   const TensorView& out_cache_loc, const TensorView& k_pool,
                                   const TensorView& v_pool, float k_scale, float v_scale) {
  Expect(k_new, "k_new").ndim(3).float_dtype().inner_contiguous();
  const Device dev = k_new.device;
  const int64_t num_tokens = k_new.shape[0], hkv = k_new.shape[1];
  Expect(v_new, "v_new")
      .ndim(3)
      .device(dev)
      .dtype(k_new.dtype)
      .inner_contiguous()
      .dim(0, num_tokens, "num_tokens")
      .dim(1, hkv, "num_kv_heads");
  const bool loc_i64 =
      check_index_vector(out_cache_loc, "out_cache_loc", dev, num_tokens, "num_tokens");
  Expect(k_pool, "k_pool")
      .ndim(3)
      .device(dev)
      .inner_contiguous()
      .dtype_in({DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3, DType::fp8_e5m2})
      .dim(1, hkv, "num_kv_heads")
      .dim(2, k_new.shape[2], "head_dim_qk");
  Expect(v_pool, "v_pool")
      .ndim(3)
      .device(dev)
      .dtype(k_pool.dtype)
      .inner_contiguous()
      .dim(0, k_pool.shape[0], "num_slots")
      .dim(1, hkv, "num_kv_heads")
      .dim(2, v_new.shape[2], "head_dim_v");
  FLASHKV_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
                "append_kv: k_scale/v_scale: expected finite values > 0, got ", k_scale, "/",
                v_scale);
  check_dims_fit_int32("append_kv", k_new);
  check_dims_fit_int32("append_kv", v_new);
  FLASHKV_CHECK(hkv * std::max(k_new.shape[2], v_new.shape[2]) <= INT32_MAX,
                "append_kv: num_kv_heads * head_dim exceeds int32: ", hkv, " * ",
                std::max(k_new.shape[2], v_new.shape[2]));
  const int64_t num_slots = k_pool.shape[0];
  if (dev.is_cpu()) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = index_at(out_cache_loc, t);
      FLASHKV_CHECK(slot >= 0 && slot < num_slots, "out_cache_loc[", t,
                    "]: expected a slot in [0, ", num_slots, "), got ", slot);
    }
  }
  AppendKVParams p;
  p.k_new = k_new.data;
  p.v_new = v_new.data;
  p.new_dtype = k_new.dtype;
  p.k_new_stride_n = k_new.stride[0];
  p.k_new_stride_h = k_new.stride[1];
  p.v_new_stride_n = v_new.stride[0];
  p.v_new_stride_h = v_new.stride[1];
  p.loc = out_cache_loc.data;
  p.loc_i64 = loc_i64;
  p.k_pool = k_pool.data;
  p.v_pool = v_pool.data;
  p.pool_dtype = k_pool.dtype;
  p.k_pool_stride_n = k_pool.stride[0];
  p.k_pool_stride_h = k_pool.stride[1];
  p.v_pool_stride_n = v_pool.stride[0];
  p.v_pool_stride_h = v_pool.stride[1];
  p.num_slots = num_slots;
  p.num_tokens = num_tokens;
  p.num_kv_heads = static_cast<int32_t>(hkv);
  p.head_dim_qk = static_cast<int32_t>(k_new.shape[2]);
  p.head_dim_v = static_cast<int32_t>(v_new.shape[2]);
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  if (!dev.is_cpu()) {
    FLASHKV_CHECK(num_tokens <= INT32_MAX, "append_kv: at most 2^31 - 1 tokens per call, got ",
                  num_tokens);
#if !FLASHKV_WITH_CUDA
    set_cuda_device(dev);  // throws: built without CUDA
#endif
  }
  return PreparedAppendKV(std::make_shared<const AppendKVParams>(p), dev);
}

void PreparedAppendKV::run(Stream stream) const {
  if (params_->num_tokens == 0) return;
  if (device_.is_cpu()) {
    cpu::append_kv(*params_);
    return;
  }
  set_cuda_device(device_);
#if FLASHKV_WITH_CUDA
  cuda::append_kv(*params_, stream);
#endif
}

void append_kv(const TensorView& k_new, const TensorView& v_new, const TensorView& out_cache_loc,
               const TensorView& k_pool, const TensorView& v_pool, float k_scale, float v_scale,
               Stream stream) {
  prepare_append_kv(k_new, v_new, out_cache_loc, k_pool, v_pool, k_scale, v_scale).run(stream);
}

void build_kv_indices(const TensorView& req_to_token, const TensorView& req_pool_indices,
                      const TensorView& lens, const TensorView& kv_start,
                      const TensorView& kv_indptr, const TensorView& kv_indices, Stream stream) {
  Expect(req_to_token, "req_to_token").ndim(2).dtype(DType::i32).inner_contiguous();
  const Device dev = req_to_token.device;
  const bool rows_i64 = check_index_vector(req_pool_indices, "req_pool_indices", dev, -1, "");
  const int64_t batch = req_pool_indices.shape[0];
  const bool lens_i64 = check_index_vector(lens, "lens", dev, batch, "batch size");
  const bool start_i64 =
      kv_start.defined() && check_index_vector(kv_start, "kv_start", dev, batch, "batch size");
  Expect(kv_indptr, "kv_indptr")
      .ndim(1)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, batch + 1, "batch size + 1");
  Expect(kv_indices, "kv_indices").ndim(1).device(dev).dtype(DType::i32).contiguous();
  const int64_t max_reqs = req_to_token.shape[0], max_context_len = req_to_token.shape[1];
  const int64_t num_indices = kv_indices.shape[0];
  if (dev.is_cpu()) {
    const int32_t* indptr = static_cast<const int32_t*>(kv_indptr.data);
    FLASHKV_CHECK(indptr[0] >= 0, "kv_indptr[0]: expected >= 0, got ", indptr[0]);
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t row = index_at(req_pool_indices, i);
      const int64_t len = index_at(lens, i);
      const int64_t start = kv_start.defined() ? index_at(kv_start, i) : 0;
      FLASHKV_CHECK(row >= 0 && row < max_reqs, "req_pool_indices[", i,
                    "]: expected a row in [0, max_reqs = ", max_reqs, "), got ", row);
      FLASHKV_CHECK(len >= 0, "lens[", i, "]: expected >= 0, got ", len);
      FLASHKV_CHECK(start >= 0, "kv_start[", i, "]: expected >= 0, got ", start);
      FLASHKV_CHECK(start + len <= max_context_len, "request ", i, ": kv_start + lens = ", start,
                    " + ", len, " exceeds max_context_len ", max_context_len);
      FLASHKV_CHECK(int64_t{indptr[i + 1]} - indptr[i] == len, "kv_indptr: expected kv_indptr[",
                    i + 1, "] - kv_indptr[", i, "] == lens[", i, "] = ", len, ", got ",
                    indptr[i + 1], " - ", indptr[i]);
    }
    FLASHKV_CHECK(indptr[batch] <= num_indices,
                  "kv_indices: expected at least kv_indptr[B] = ", indptr[batch], " elements, got ",
                  num_indices);
  }
  if (batch == 0) return;

  BuildKVIndicesParams p;
  p.req_to_token = static_cast<const int32_t*>(req_to_token.data);
  p.req_to_token_stride = req_to_token.stride[0];
  p.max_reqs = max_reqs;
  p.max_context_len = max_context_len;
  p.req_pool_indices = req_pool_indices.data;
  p.req_pool_indices_i64 = rows_i64;
  p.lens = lens.data;
  p.lens_i64 = lens_i64;
  p.kv_start = kv_start.defined() ? kv_start.data : nullptr;
  p.kv_start_i64 = start_i64;
  p.kv_indptr = static_cast<const int32_t*>(kv_indptr.data);
  p.kv_indices = static_cast<int32_t*>(kv_indices.data);
  p.num_indices = num_indices;
  p.batch_size = batch;
  if (dev.is_cpu()) {
    cpu::build_kv_indices(p);
    return;
  }
  set_cuda_device(dev);
#if FLASHKV_WITH_CUDA
  cuda::build_kv_indices(p, stream);
#endif
}

void translate_slots(const TensorView& full_slots, const TensorView& table, const TensorView& out,
                     Stream stream) {
  Expect(table, "table").ndim(1).dtype(DType::i32).contiguous();
  const Device dev = table.device;
  const bool slots_i64 = check_index_vector(full_slots, "full_slots", dev, -1, "");
  const int64_t n = full_slots.shape[0];
  Expect(out, "out").ndim(1).device(dev).dtype(DType::i32).contiguous().dim(0, n, "num_slots");
  const char* out_begin = static_cast<const char*>(out.data);
  const char* slots_begin = static_cast<const char*>(full_slots.data);
  const bool overlap = n > 0 && out_begin < slots_begin + full_slots.nbytes() &&
                       slots_begin < out_begin + out.nbytes();
  FLASHKV_CHECK(!overlap || (!slots_i64 && out_begin == slots_begin),
                "translate_slots: out may overlap full_slots only when both are the same i32 "
                "tensor");
  if (dev.is_cpu()) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = index_at(full_slots, i);
      FLASHKV_CHECK(slot >= 0 && slot < table.shape[0], "full_slots[", i,
                    "]: expected a slot in [0, ", table.shape[0], "), got ", slot);
    }
  }
  if (n == 0) return;
  TranslateSlotsParams p;
  p.full_slots = full_slots.data;
  p.full_slots_i64 = slots_i64;
  p.table = static_cast<const int32_t*>(table.data);
  p.table_size = table.shape[0];
  p.out = static_cast<int32_t*>(out.data);
  p.n = n;
  if (dev.is_cpu()) {
    cpu::translate_slots(p);
    return;
  }
  set_cuda_device(dev);
#if FLASHKV_WITH_CUDA
  cuda::translate_slots(p, stream);
#endif
}

}  // namespace flashkv
