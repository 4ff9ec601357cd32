// cuda::paged_decode: picks the kernel instantiation for the runtime parameters (select), runs
// the decode kernel over the plan's workers, then folds the partial states of split requests.
//
// The merge pass is a second kernel launched with programmatic dependent launch on sm_90: the
// decode kernel lets it be scheduled at once, and it waits in griddepcontrol.wait until the
// decode grid has finished, which hides its launch latency. It finds its work from the items on
// the device (not from the plan's merge list, whose length the device does not know), so its
// grid, like the decode grid, depends only on the worker count and a CUDA graph can replay it
// with any batch: the last chunk of a split request (the split item whose KV range ends at the
// request's KV length: a decode tile always reaches the end of its KV) holds the chunk count.
#include <cuda_runtime.h>

#include "common/device_cc.h"
#include "common/merge_state.cuh"
#include "decode/traits.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"
#include "flashkv/ops/kernels.h"

namespace flashkv::cuda {
namespace {

using LaunchFn = void (*)(const AttentionParams&, cudaStream_t);

constexpr int kMergeThreads = 128;

// Folds the partial states of each split request into its output row.
// Grid: x strides over the plan's items, y = KV head (its G query heads).
template <typename QT>
__global__ void __launch_bounds__(kMergeThreads)
    decode_merge_kernel(const __grid_constant__ AttentionParams p) {
  ptx::grid_dependency_wait();
  const int32_t num_items = p.worker_indptr[p.num_workers];
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int dv = p.head_dim_v;
  const int vecs = dv / 4;
  for (int32_t i = blockIdx.x; i < num_items; i += gridDim.x) {
    const WorkItem it = p.items[i];
    if (it.partial < 0) continue;
    const int32_t n = p.kv_indptr[it.request + 1] - p.kv_indptr[it.request];
    const int32_t kv_len = p.page_size == 1 || n <= 0
                               ? max(n, 0)
                               : (n - 1) * p.page_size + p.last_page_len[it.request];
    if (it.kv_end < kv_len) continue;  // not the request's last chunk
    const int32_t chunks = it.chunk + 1;
    const int64_t base = int64_t{it.partial} - int64_t{it.chunk} * it.q_len;
    for (int idx = threadIdx.x; idx < group * vecs; idx += blockDim.x) {
      const int h = blockIdx.y * group + idx / vecs;
      const int d = (idx % vecs) * 4;
      MergeState st;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int32_t ch = 0; ch < chunks; ++ch) {  // in chunk order: deterministic
        const int64_t row = base + int64_t{ch} * it.q_len;
        float rescale, weight;
        st.add(p.partial_lse[row * p.num_qo_heads + h], rescale, weight);
        if (weight == 0.0f) continue;
        const float4 x =
            *reinterpret_cast<const float4*>(p.partial_o + (row * p.num_qo_heads + h) * dv + d);
        acc.x = acc.x * rescale + weight * x.x;
        acc.y = acc.y * rescale + weight * x.y;
        acc.z = acc.z * rescale + weight * x.z;
        acc.w = acc.w * rescale + weight * x.w;
      }
      const float inv = st.inv_sum();
      QT* dst = static_cast<QT*>(p.o) + int64_t{it.q_begin} * p.o_stride_n +
                int64_t{h} * p.o_stride_h + d;
      uint2 packed;
      packed.x = pack2<QT>(acc.x * inv, acc.y * inv);
      packed.y = pack2<QT>(acc.z * inv, acc.w * inv);
      *reinterpret_cast<uint2*>(dst) = packed;
      if (d == 0 && p.lse) p.lse[int64_t{it.q_begin} * p.num_qo_heads + h] = st.lse();
    }
  }
}

template <typename QT>
void launch_merge(const AttentionParams& p, cudaStream_t stream) {
  const int cc = current_device_cc();
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(p.num_workers, p.num_kv_heads, 1);
  config.blockDim = dim3(kMergeThreads, 1, 1);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = cc >= 90 ? 1 : 0;
  detail::cuda_check(cudaLaunchKernelEx(&config, decode_merge_kernel<QT>, p),
                     "paged_decode: merge launch");
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <int D, typename QT, KvKind kKv>
LaunchFn pick_tiles(int group) {
  // 8 query heads per mma column tile. Up to 16 heads share one pass over the KV (two tiles;
  // head dim 256 keeps one, its accumulators would not fit the registers); larger groups run as
  // several CTAs per KV head (grid.z), each reading the KV once.
  if constexpr (D <= 128) {
    if (group > 8) return &decode::launch_decode<D, QT, kKv, 2>;
  }
  return &decode::launch_decode<D, QT, kKv, 1>;
}

template <int D, typename QT>
LaunchFn pick_kv(DType kv, int group) {
  switch (kv) {
    case DType::fp8_e4m3:
      return pick_tiles<D, QT, KvKind::e4m3>(group);
    case DType::fp8_e5m2:
      return pick_tiles<D, QT, KvKind::e5m2>(group);
    default:
      return pick_tiles<D, QT, KvKind::same16>(group);
  }
}

template <int D>
LaunchFn pick_q(const AttentionParams& p, int group) {
  if (p.q_dtype == DType::bf16) return pick_kv<D, __nv_bfloat16>(p.kv_dtype, group);
  return pick_kv<D, half>(p.kv_dtype, group);
}

// The one place that decides which kernel runs; throws flashkv::Error for what no instantiation
// supports, before anything is launched.
LaunchFn select(const AttentionParams& p) {
  FLASHKV_CHECK(p.paged && p.qo_indptr == nullptr,
                "paged_decode (CUDA): expected paged KV and one query row per request");
  FLASHKV_CHECK(p.custom_mask == nullptr,
                "paged_decode (CUDA): custom_mask is not supported by the decode kernel (use "
                "paged_prefill for masked rows)");
  FLASHKV_CHECK(p.q_dtype == DType::bf16 || p.q_dtype == DType::f16,
                "paged_decode (CUDA): q dtype ", dtype_name(p.q_dtype),
                " is unsupported on CUDA (expected bf16 or f16)");
  const bool kv_ok =
      p.kv_dtype == p.q_dtype || p.kv_dtype == DType::fp8_e4m3 || p.kv_dtype == DType::fp8_e5m2;
  FLASHKV_CHECK(kv_ok, "paged_decode (CUDA): kv dtype ", dtype_name(p.kv_dtype), " with q dtype ",
                dtype_name(p.q_dtype), " is unsupported");
  FLASHKV_CHECK(p.head_dim_qk == p.head_dim_v, "paged_decode (CUDA): head_dim_v: expected ",
                p.head_dim_qk, " (the same as head_dim_qk), got ", p.head_dim_v);
  FLASHKV_CHECK(p.num_kv_heads > 0 && p.num_qo_heads % p.num_kv_heads == 0,
                "paged_decode (CUDA): num_qo_heads must be a multiple of num_kv_heads");
  FLASHKV_CHECK(p.num_kv_heads <= 65535,
                "paged_decode (CUDA): num_kv_heads: expected <= 65535, got ", p.num_kv_heads);
  // 16-byte vectors: rows of q, o, k and v must start on 16-byte boundaries.
  const int64_t kv_bytes = is_fp8(p.kv_dtype) ? 1 : 2;
  FLASHKV_CHECK(aligned16(p.q) && aligned16(p.o) && p.q_stride_n % 8 == 0 &&
                    p.q_stride_h % 8 == 0 && p.o_stride_n % 8 == 0 && p.o_stride_h % 8 == 0,
                "paged_decode (CUDA): q/out rows must be 16-byte aligned (strides in multiples "
                "of 8 elements)");
  FLASHKV_CHECK(aligned16(p.k) && aligned16(p.v) && (p.k_stride_n * kv_bytes) % 16 == 0 &&
                    (p.k_stride_h * kv_bytes) % 16 == 0 && (p.v_stride_n * kv_bytes) % 16 == 0 &&
                    (p.v_stride_h * kv_bytes) % 16 == 0,
                "paged_decode (CUDA): k/v rows must be 16-byte aligned");
  const int group = p.num_qo_heads / p.num_kv_heads;
  switch (p.head_dim_qk) {
#if FLASHKV_HEAD_DIM_64
    case 64:
      return pick_q<64>(p, group);
#endif
#if FLASHKV_HEAD_DIM_128
    case 128:
      return pick_q<128>(p, group);
#endif
#if FLASHKV_HEAD_DIM_256
    case 256:
      return pick_q<256>(p, group);
#endif
    default: {
      const int d = p.head_dim_qk;
      const bool kernel_exists = d == 64 || d == 128 || d == 256;
      throw_error(str_cat("paged_decode (CUDA): head_dim ", d,
                          kernel_exists
                              ? " is not in this build's FLASHKV_HEAD_DIMS"
                              : " is unsupported (the decode kernels cover 64, 128, 256)"));
    }
  }
}

}  // namespace

void check_paged_decode(const AttentionParams& p) { (void)select(p); }

void paged_decode(const AttentionParams& p, Stream stream) {
  const LaunchFn launch = select(p);
  if (p.num_items == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  launch(p, s);
  // A graph plan may split on replay even when this batch did not, whenever its layout has
  // room for merges.
  const bool may_merge = p.num_merges > 0 || (p.cuda_graph && p.max_merges > 0);
  if (!may_merge) return;
  if (p.q_dtype == DType::bf16)
    launch_merge<__nv_bfloat16>(p, s);
  else
    launch_merge<half>(p, s);
}

}  // namespace flashkv::cuda
