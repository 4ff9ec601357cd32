// Element conversions for the CUDA kernels: fp32 <-> bf16 / f16 pairs packed in 32 bits, and
// fp8 (e4m3 / e5m2) to bf16 / f16 four at a time with integer ops plus one exact power-of-two
// multiply (no float conversion instructions: this is on the decode kernel's hot path).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flashkv::cuda {

// The KV element kinds a kernel is compiled for.
enum class KvKind : int { same16 = 0, e4m3 = 1, e5m2 = 2 };

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<half>(float lo, float hi) {
  half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t x);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t x) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
}
template <>
__device__ __forceinline__ float2 unpack2<half>(uint32_t x) {
  return __half22float2(*reinterpret_cast<half2*>(&x));
}

template <typename T>
__device__ __forceinline__ float to_f32(T x);
template <>
__device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_f32<half>(half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ half from_f32<half>(float x) { return __float2half_rn(x); }

// Multiplies both halves of a bf16x2 / f16x2 by a power of two given as its 16-bit pattern
// (exact for the values the fp8 conversion produces; subnormal inputs are kept).
template <typename T>
__device__ __forceinline__ uint32_t mul_pow2(uint32_t x, uint16_t pow2_bits);
template <>
__device__ __forceinline__ uint32_t mul_pow2<__nv_bfloat16>(uint32_t x, uint16_t pow2_bits) {
  uint32_t y;
  const uint32_t s = (uint32_t{pow2_bits} << 16) | pow2_bits;
  // fma with -0 addend: sm_80 has no bf16x2 multiply instruction.
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(y) : "r"(x), "r"(s), "r"(0x80008000u));
  return y;
}
template <>
__device__ __forceinline__ uint32_t mul_pow2<half>(uint32_t x, uint16_t pow2_bits) {
  uint32_t y;
  const uint32_t s = (uint32_t{pow2_bits} << 16) | pow2_bits;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(y) : "r"(x), "r"(s));
  return y;
}

// Four fp8 values (bytes 0..3 of x) to two 16-bit pairs: lo = (byte 0, byte 2) and
// hi = (byte 1, byte 3). Each byte is moved into the high byte of a 16-bit lane, its exponent
// and mantissa shifted into place, and the exponent-bias difference applied by an exact
// power-of-two multiply. The pairing (0,2)/(1,3) is what the integer shifts give for free;
// callers choose their data layout so that it is the pairing they need. fp8 NaN/inf patterns
// are not preserved (a KV cache holds finite values).
template <KvKind kKind, typename T>
__device__ __forceinline__ void fp8x4_to_16(uint32_t x, uint32_t& lo, uint32_t& hi) {
  static_assert(kKind == KvKind::e4m3 || kKind == KvKind::e5m2, "fp8 kinds only");
  const uint32_t y = x << 8;  // bytes 0 and 2 into the high byte of each lane
  if constexpr (std::is_same_v<T, half> && kKind == KvKind::e5m2) {
    // e5m2 is the high byte of an f16: no arithmetic.
    hi = x & 0xff00ff00u;
    lo = y & 0xff00ff00u;
  } else {
    // e4m3 (bias 7): exponent/mantissa move right by 4 into bf16 (bias 127), by 1 into f16
    // (bias 15); e5m2 (bias 15): by 3 into bf16.
    constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
    constexpr int kShift = kKind == KvKind::e4m3 ? (kBf16 ? 4 : 1) : 3;
    constexpr uint32_t kMask = (0x7f00u >> kShift) * 0x10001u;
    constexpr uint16_t kPow2 = kKind == KvKind::e4m3 ? (kBf16 ? 0x7b80 /* 2^120 */ : 0x5c00 /* 2^8 */)
                                                     : 0x7780 /* bf16 2^112 */;
    hi = mul_pow2<T>((x & 0x80008000u) | ((x >> kShift) & kMask), kPow2);
    lo = mul_pow2<T>((y & 0x80008000u) | ((y >> kShift) & kMask), kPow2);
  }
}

}  // namespace flashkv::cuda
