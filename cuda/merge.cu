// cuda::merge: merge_state / merge_states (SEMANTICS.md, "Merging partial states") on CUDA.
// One warp per (row, head): the lanes read the states' LSEs (a handful), then stride over the
// head dim with coalesced loads of every state. Outputs may alias the first state (merge_state
// in place): each lane writes only the elements it has read, and the LSE is written last.
#include <cuda_runtime.h>

#include <cmath>

#include "common/convert.cuh"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"
#include "flashkv/ops/kernels.h"

namespace flashkv::cuda {
namespace {

constexpr int kMergeWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kMergeWarps * 32)
    merge_kernel(const __grid_constant__ MergeParams p) {
  const int64_t pair = int64_t{blockIdx.x} * kMergeWarps + threadIdx.x / 32;
  if (pair >= p.rows * p.heads) return;
  const int64_t r = pair / p.heads;
  const int h = static_cast<int>(pair % p.heads);
  const int lane = threadIdx.x % 32;
  auto lse_of = [&](int s) {
    const float* base = p.stacked ? p.lse_in[0] : p.lse_in[s];
    return base[r * p.lse_stride_n + (p.stacked ? s * p.lse_stride_s : 0) + h];
  };
  auto state_of = [&](int s) {
    const T* base = static_cast<const T*>(p.stacked ? p.o_in[0] : p.o_in[s]);
    return base + r * p.in_stride_n + (p.stacked ? s * p.in_stride_s : 0) + h * p.in_stride_h;
  };
  float mx = -INFINITY;
  for (int s = 0; s < p.num_states; ++s) mx = fmaxf(mx, lse_of(s));
  float sum = 0.0f;
  if (mx != -INFINITY)
    for (int s = 0; s < p.num_states; ++s) {
      const float l = lse_of(s);
      if (l != -INFINITY) sum += exp2f(l - mx);
    }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  T* out = static_cast<T*>(p.o_out) + r * p.out_stride_n + int64_t{h} * p.out_stride_h;
  for (int d = lane; d < p.head_dim; d += 32) {
    float acc = 0.0f;
    for (int s = 0; s < p.num_states; ++s) {
      const float l = lse_of(s);
      if (l == -INFINITY) continue;  // contributes nothing (and may hold anything)
      acc += exp2f(l - mx) * to_f32<T>(state_of(s)[d]);
    }
    out[d] = from_f32<T>(acc * inv);
  }
  __syncwarp();  // every lane has read the LSEs before they may be overwritten
  if (lane == 0 && p.lse_out) p.lse_out[r * p.heads + h] = sum > 0.0f ? mx + log2f(sum) : -INFINITY;
}

}  // namespace

void merge(const MergeParams& p, Stream stream) {
  FLASHKV_CHECK(p.dtype == DType::f32 || p.dtype == DType::bf16 || p.dtype == DType::f16,
                "merge_state (CUDA): dtype ", dtype_name(p.dtype),
                " unsupported (expected f32, bf16 or f16)");
  const int64_t pairs = p.rows * p.heads;
  if (pairs == 0 || p.head_dim == 0) return;
  const int64_t blocks = (pairs + kMergeWarps - 1) / kMergeWarps;
  FLASHKV_CHECK(blocks <= 0x7fffffff, "merge_state (CUDA): rows * heads = ", pairs, " too large");
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const dim3 grid(static_cast<unsigned>(blocks)), block(kMergeWarps * 32);
  switch (p.dtype) {
    case DType::f32: merge_kernel<float><<<grid, block, 0, s>>>(p); break;
    case DType::bf16: merge_kernel<__nv_bfloat16><<<grid, block, 0, s>>>(p); break;
    default: merge_kernel<half><<<grid, block, 0, s>>>(p); break;
  }
  detail::cuda_check(cudaGetLastError(), "merge_state (CUDA): kernel launch");
}

}  // namespace flashkv::cuda
