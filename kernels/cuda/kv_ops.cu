// CUDA kernels of the KV-cache ops. The params are validated on the host (shapes, dtypes,
// devices); index values live on the device, so every kernel checks each index it reads and
// skips what is out of range instead of reading or writing out of bounds.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"
#include "flashkv/kernels/kv_convert.h"
#include "flashkv/kernels/kv_kernels.h"

namespace flashkv::cuda {
namespace {

using kv_convert::load;
using kv_convert::load_index;
using kv_convert::Store;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

constexpr int kAppendThreads = 128;

// Copies one [Hkv, head_dim] row from src to dst, kVec elements per thread step (kVec divides
// head_dim and the strides, and the pointers are aligned for it: checked by the launcher).
template <typename In, typename Out, int kVec>
__device__ __forceinline__ void append_row(const In* __restrict__ src, int64_t src_stride_h,
                                           Out* __restrict__ dst, int64_t dst_stride_h,
                                           int num_heads, int head_dim, float scale) {
  const int vecs_per_head = head_dim / kVec;
  const int num_vecs = num_heads * vecs_per_head;
  for (int e = threadIdx.x; e < num_vecs; e += blockDim.x) {
    const int h = e / vecs_per_head;
    const int d = (e - h * vecs_per_head) * kVec;
    const Vec<In, kVec> in = *reinterpret_cast<const Vec<In, kVec>*>(src + h * src_stride_h + d);
    Vec<Out, kVec> out;
#pragma unroll
    for (int i = 0; i < kVec; ++i) out.v[i] = Store<Out>::from(load(in.v[i]) / scale);
    *reinterpret_cast<Vec<Out, kVec>*>(dst + h * dst_stride_h + d) = out;
  }
}

// One block per token: writes its K row and V row at slot out_cache_loc[token].
template <typename In, typename Out, int kVec>
__global__ void __launch_bounds__(kAppendThreads)
    append_kv_kernel(const __grid_constant__ AppendKVParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = load_index(p.loc, p.loc_i64, token);
  if (slot < 0 || slot >= p.num_slots) return;
  append_row<In, Out, kVec>(static_cast<const In*>(p.k_new) + token * p.k_new_stride_n,
                            p.k_new_stride_h,
                            static_cast<Out*>(p.k_pool) + slot * p.k_pool_stride_n,
                            p.k_pool_stride_h, p.num_kv_heads, p.head_dim_qk, p.k_scale);
  append_row<In, Out, kVec>(static_cast<const In*>(p.v_new) + token * p.v_new_stride_n,
                            p.v_new_stride_h,
                            static_cast<Out*>(p.v_pool) + slot * p.v_pool_stride_n,
                            p.v_pool_stride_h, p.num_kv_heads, p.head_dim_v, p.v_scale);
}

bool aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// Whether every row/head start of the four tensors is aligned for kVec-element vectors.
template <typename In, typename Out, int kVec>
bool can_vectorize(const AppendKVParams& p) {
  auto ok = [](int64_t stride) { return stride % kVec == 0; };
  return p.head_dim_qk % kVec == 0 && p.head_dim_v % kVec == 0 && ok(p.k_new_stride_n) &&
         ok(p.k_new_stride_h) && ok(p.v_new_stride_n) && ok(p.v_new_stride_h) &&
         ok(p.k_pool_stride_n) && ok(p.k_pool_stride_h) && ok(p.v_pool_stride_n) &&
         ok(p.v_pool_stride_h) && aligned(p.k_new, sizeof(In) * kVec) &&
         aligned(p.v_new, sizeof(In) * kVec) && aligned(p.k_pool, sizeof(Out) * kVec) &&
         aligned(p.v_pool, sizeof(Out) * kVec);
}

template <typename In, typename Out>
void launch_append(const AppendKVParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  if (can_vectorize<In, Out, 4>(p))
    append_kv_kernel<In, Out, 4><<<grid, kAppendThreads, 0, stream>>>(p);
  else
    append_kv_kernel<In, Out, 1><<<grid, kAppendThreads, 0, stream>>>(p);
}

template <typename In>
void launch_append_to_pool(const AppendKVParams& p, cudaStream_t stream) {
  switch (p.pool_dtype) {
    case DType::f32:
      return launch_append<In, float>(p, stream);
    case DType::f16:
      return launch_append<In, f16_t>(p, stream);
    case DType::bf16:
      return launch_append<In, bf16_t>(p, stream);
    case DType::fp8_e4m3:
      return launch_append<In, fp8_e4m3_t>(p, stream);
    case DType::fp8_e5m2:
      return launch_append<In, fp8_e5m2_t>(p, stream);
    default:
      throw_error(str_cat("append_kv: unsupported pool dtype ", dtype_name(p.pool_dtype)));
  }
}

constexpr int kGatherThreads = 256;

// One block per request: copies its req_to_token range into its kv_indices range. A request
// whose indices do not hold (see kv_ops.h) is skipped.
__global__ void __launch_bounds__(kGatherThreads)
    build_kv_indices_kernel(const __grid_constant__ BuildKVIndicesParams p) {
  const int64_t i = blockIdx.x;
  const int64_t row = load_index(p.req_pool_indices, p.req_pool_indices_i64, i);
  const int64_t len = load_index(p.lens, p.lens_i64, i);
  const int64_t start = p.kv_start ? load_index(p.kv_start, p.kv_start_i64, i) : 0;
  const int64_t out_begin = p.kv_indptr[i];
  const bool valid = row >= 0 && row < p.max_reqs && len >= 0 && start >= 0 &&
                     start + len <= p.max_context_len && p.kv_indptr[i + 1] - out_begin == len &&
                     out_begin >= 0 && out_begin + len <= p.num_indices;
  if (!valid) return;
  const int32_t* __restrict__ src = p.req_to_token + row * p.req_to_token_stride + start;
  int32_t* __restrict__ dst = p.kv_indices + out_begin;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) dst[j] = src[j];
}

constexpr int kTranslateThreads = 256;

__global__ void translate_slots_kernel(const __grid_constant__ TranslateSlotsParams p) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < p.n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t slot = load_index(p.full_slots, p.full_slots_i64, i);
    p.out[i] = slot >= 0 && slot < p.table_size ? p.table[slot] : 0;
  }
}

}  // namespace

void append_kv(const AppendKVParams& p, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  FLASHKV_CHECK(p.num_tokens <= INT32_MAX, "append_kv: at most 2^31 - 1 tokens per call, got ",
                p.num_tokens);
  switch (p.new_dtype) {
    case DType::f32:
      launch_append_to_pool<float>(p, s);
      break;
    case DType::f16:
      launch_append_to_pool<f16_t>(p, s);
      break;
    case DType::bf16:
      launch_append_to_pool<bf16_t>(p, s);
      break;
    default:
      throw_error(str_cat("append_kv: unsupported k_new dtype ", dtype_name(p.new_dtype)));
  }
  detail::cuda_check(cudaGetLastError(), "append_kv kernel launch");
}

void build_kv_indices(const BuildKVIndicesParams& p, Stream stream) {
  FLASHKV_CHECK(p.batch_size <= INT32_MAX, "build_kv_indices: at most 2^31 - 1 requests, got ",
                p.batch_size);
  build_kv_indices_kernel<<<static_cast<unsigned>(p.batch_size), kGatherThreads, 0,
                            static_cast<cudaStream_t>(stream.handle)>>>(p);
  detail::cuda_check(cudaGetLastError(), "build_kv_indices kernel launch");
}

void translate_slots(const TranslateSlotsParams& p, Stream stream) {
  const int64_t blocks = std::min<int64_t>((p.n + kTranslateThreads - 1) / kTranslateThreads, 4096);
  translate_slots_kernel<<<static_cast<unsigned>(blocks), kTranslateThreads, 0,
                           static_cast<cudaStream_t>(stream.handle)>>>(p);
  detail::cuda_check(cudaGetLastError(), "translate_slots kernel launch");
}

}  // namespace flashkv::cuda
