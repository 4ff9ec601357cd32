// Prefill kernels for head_dim_qk = 192, head_dim_v = 128, f16 queries (KV: f16, fp8 e4m3, fp8
// e5m2).
#include "prefill/kernel.cuh"

#if defined(FLASHKV_HEAD_DIM_192)
namespace fp = flashkv::cuda::prefill_detail;
FLASHKV_INSTANTIATE_PREFILL(192, 128, __half, fp::KvFormat::kSame);
FLASHKV_INSTANTIATE_PREFILL(192, 128, __half, fp::KvFormat::kE4M3);
FLASHKV_INSTANTIATE_PREFILL(192, 128, __half, fp::KvFormat::kE5M2);
#endif
