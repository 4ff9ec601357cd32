// Paged-decode kernels for head dim 256 (one head tile: see pick_tiles in cuda/decode.cu); built
// when FLASHKV_HEAD_DIMS lists 256.
#if FLASHKV_HEAD_DIM_256
#include "decode/decode_kernel.cuh"

namespace flashkv::cuda::decode {
FLASHKV_DECODE_INSTANTIATE(256, 1)
}  // namespace flashkv::cuda::decode
#endif
