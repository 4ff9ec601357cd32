// A float's bits and back, for code compiled for the host and the device from one source
// (kv_convert.h): the intrinsics on the device, memcpy on the host.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FLASHKV_FLOAT_BITS_HD __host__ __device__ __forceinline__
#else
#define FLASHKV_FLOAT_BITS_HD inline
#endif

namespace flashkv::float_bits {

FLASHKV_FLOAT_BITS_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

FLASHKV_FLOAT_BITS_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

}  // namespace flashkv::float_bits

#undef FLASHKV_FLOAT_BITS_HD
