// Paged-decode kernels for head dim 128; built when FLASHKV_HEAD_DIMS lists 128.
#if FLASHKV_HEAD_DIM_128
#include "decode/decode_kernel.cuh"

namespace flashkv::cuda::decode {
FLASHKV_DECODE_INSTANTIATE(128, 1)
FLASHKV_DECODE_INSTANTIATE(128, 2)
}  // namespace flashkv::cuda::decode
#endif
