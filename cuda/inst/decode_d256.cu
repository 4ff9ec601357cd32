// Paged-decode kernels for head dim 256 (built when FLASHKV_HEAD_DIMS lists it).
#if FLASHKV_HEAD_DIM_256
#include "decode/decode_kernel.cuh"

namespace flashkv::cuda::decode {

#define FLASHKV_DECODE_INSTANTIATE(QT, KV)                              \
  template void launch_decode<256, QT, KV, 1>(const AttentionParams&, cudaStream_t);

FLASHKV_DECODE_INSTANTIATE(__nv_bfloat16, KvKind::same16)
FLASHKV_DECODE_INSTANTIATE(__nv_bfloat16, KvKind::e4m3)
FLASHKV_DECODE_INSTANTIATE(__nv_bfloat16, KvKind::e5m2)
FLASHKV_DECODE_INSTANTIATE(half, KvKind::same16)
FLASHKV_DECODE_INSTANTIATE(half, KvKind::e4m3)
FLASHKV_DECODE_INSTANTIATE(half, KvKind::e5m2)

#undef FLASHKV_DECODE_INSTANTIATE

}  // namespace flashkv::cuda::decode
#endif
