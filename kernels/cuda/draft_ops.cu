// CUDA kernel of build_draft_kv_indices: one block per (request, branch) row.
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/kernels/kv_kernels.h"

namespace flashkv::cuda {
namespace {

__global__ void draft_kv_indices_kernel(const DraftKVIndicesParams p) {
  const int32_t row = blockIdx.x;
  const int32_t r = row / p.topk, b = row % p.topk;
  const int32_t req = p.req_pool_indices[r], len = p.seq_lens[r];
  const int64_t begin = p.kv_indptr[row], end = p.kv_indptr[row + 1];
  // Skip rows whose indices would leave the tensors (the host cannot check device contents).
  if (req < 0 || req >= p.max_reqs || len < 0 || len > p.max_context_len || begin < 0 ||
      end - begin != int64_t{len} + p.step + 1 || end > p.num_indices)
    return;
  const int32_t* src = p.req_to_token + req * p.req_to_token_stride;
  const int32_t* draft = p.draft_loc + (int64_t{r} * p.topk + b) * p.num_steps;
  for (int32_t j = threadIdx.x; j < len + p.step + 1; j += blockDim.x)
    p.kv_indices[begin + j] = j < len ? src[j] : draft[j - len];
  if (threadIdx.x == 0) p.step_loc[row] = draft[p.step];
}

}  // namespace

void build_draft_kv_indices(const DraftKVIndicesParams& p, Stream stream) {
  const int rows = p.bs * p.topk;
  if (rows == 0) return;
  draft_kv_indices_kernel<<<rows, 256, 0, static_cast<cudaStream_t>(stream.handle)>>>(p);
  detail::cuda_check(cudaGetLastError(), "build_draft_kv_indices");
}

}  // namespace flashkv::cuda
