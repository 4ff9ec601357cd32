// The sm_90a prefill kernel (head dim 128, 16-bit KV); built when FLASHKV_HEAD_DIMS lists 128.
// Its device code is real only in the sm_90a image (the others trap, and are never launched).
#if FLASHKV_HEAD_DIM_128
#include "prefill/kernel_sm90.cuh"

template void flashkv::cuda::prefill_detail::launch_prefill_sm90<__nv_bfloat16>(
    const flashkv::AttentionParams&, cudaStream_t);
template void flashkv::cuda::prefill_detail::launch_prefill_sm90<__half>(
    const flashkv::AttentionParams&, cudaStream_t);
#endif
