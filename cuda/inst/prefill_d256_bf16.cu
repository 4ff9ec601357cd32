// Prefill kernels for head_dim_qk = 256, head_dim_v = 256, bf16 queries (KV: bf16, fp8 e4m3, fp8
// e5m2).
#include "prefill/kernel.cuh"

#if defined(FLASHKV_HEAD_DIM_256)
namespace fp = flashkv::cuda::prefill_detail;
FLASHKV_INSTANTIATE_PREFILL(256, 256, __nv_bfloat16, fp::KvFormat::kSame);
FLASHKV_INSTANTIATE_PREFILL(256, 256, __nv_bfloat16, fp::KvFormat::kE4M3);
FLASHKV_INSTANTIATE_PREFILL(256, 256, __nv_bfloat16, fp::KvFormat::kE5M2);
#endif
