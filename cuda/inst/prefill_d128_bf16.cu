// Prefill kernels for head_dim_qk = 128, head_dim_v = 128, bf16 queries (KV: bf16, fp8 e4m3, fp8
// e5m2).
#include "prefill/kernel.cuh"

#if defined(FLASHKV_HEAD_DIM_128)
namespace fp = flashkv::cuda::prefill_detail;
FLASHKV_INSTANTIATE_PREFILL(128, 128, __nv_bfloat16, fp::KvFormat::kSame);
FLASHKV_INSTANTIATE_PREFILL(128, 128, __nv_bfloat16, fp::KvFormat::kE4M3);
FLASHKV_INSTANTIATE_PREFILL(128, 128, __nv_bfloat16, fp::KvFormat::kE5M2);
#endif
