// Paged-decode kernels for head dim 64; built when FLASHKV_HEAD_DIMS lists 64.
#if FLASHKV_HEAD_DIM_64
#include "decode/decode_kernel.cuh"

namespace flashkv::cuda::decode {
FLASHKV_DECODE_INSTANTIATE(64, 1)
FLASHKV_DECODE_INSTANTIATE(64, 2)
}  // namespace flashkv::cuda::decode
#endif
