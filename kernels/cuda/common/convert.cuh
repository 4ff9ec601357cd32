// Element conversions for the CUDA kernels: fp32 <-> bf16 / f16 (pairs packed in 32 bits), and
// fp8 (e4m3 / e5m2) to f16 pairs or to fp32, exactly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/kv_format.h"

namespace flashkv::cuda {

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

// Stores N consecutive values of an output row (N = 2, 4 or 8) at element `at` of `o`: as they
// are when the output is f32 (`f32_out`), else rounded to QT (bf16 / f16) and packed in pairs.
// `at` must be a multiple of N (one vector store of 8, 16 or 32 bytes).
template <typename QT, int N>
__device__ __forceinline__ void store_o(void* o, bool f32_out, int64_t at, const float (&x)[N]) {
  static_assert(N == 2 || N == 4 || N == 8, "2, 4 or 8 values");
  if (f32_out) {
    float* dst = static_cast<float*>(o) + at;
    if constexpr (N == 2) {
      *reinterpret_cast<float2*>(dst) = make_float2(x[0], x[1]);
    } else {
#pragma unroll
      for (int i = 0; i < N; i += 4)
        *reinterpret_cast<float4*>(dst + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
    }
    return;
  }
  uint32_t w[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) w[i] = pack2<QT>(x[2 * i], x[2 * i + 1]);
  QT* dst = static_cast<QT*>(o) + at;
  if constexpr (N == 2)
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  else if constexpr (N == 4)
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  else
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
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
__device__ __forceinline__ float to_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_f32<half>(half x) {
  return __half2float(x);
}

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ half from_f32<half>(float x) {
  return __float2half_rn(x);
}

// Two fp8 values (the low byte first) to an f16x2: exact, since every e4m3 and e5m2 value is an
// f16 value. sm_89+ converts in hardware; older targets move the byte into the high half of the
// lane (e5m2 is the high byte of an f16) or, for e4m3, shift exponent and mantissa into place and
// apply the bias difference 2^8 with an exact multiply. fp8 NaN maps to NaN only on sm_89+.
template <KvFormat kFormat>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint16_t pair) {
  static_assert(kFormat == KvFormat::kE4M3 || kFormat == KvFormat::kE5M2, "fp8 formats only");
  uint32_t y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (kFormat == KvFormat::kE4M3)
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(y) : "h"(pair));
  else
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(y) : "h"(pair));
#else
  const uint32_t t = __byte_perm(uint32_t{pair}, 0u, 0x1404);  // byte i into lane i's high byte
  if constexpr (kFormat == KvFormat::kE5M2) {
    y = t;
  } else {
    const uint32_t bits = (t & 0x80008000u) | ((t >> 1) & 0x3f803f80u);
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(y) : "r"(bits), "r"(0x5c005c00u));  // x 2^8
  }
#endif
  return y;
}

// fp8x2_to_f16x2 of the low (kHigh false) or high fp8 pair of a 32-bit word. The word is split
// into its half-words (a register view, no instruction): on sm_89+ the conversion then reads the
// high half in place, so that pair costs no shift.
template <KvFormat kFormat, bool kHigh>
__device__ __forceinline__ uint32_t fp8_pair_to_f16x2(uint32_t word) {
  uint16_t lo, hi;
  asm("mov.b32 {%0, %1}, %2;\n" : "=h"(lo), "=h"(hi) : "r"(word));
  return fp8x2_to_f16x2<kFormat>(kHigh ? hi : lo);
}

// fp8 byte -> float, exact (every e4m3/e5m2 value is representable in f16 and bf16, so the
// later narrowing to the 16-bit type is exact too). Done by bit placement and one multiply by a
// power of two, which also handles subnormals; NaN stays NaN.
__device__ __forceinline__ float e4m3_to_float(uint32_t x) {
  const uint32_t mag = x & 0x7fu;
  if (mag == 0x7fu) return __int_as_float(0x7fc00000);  // e4m3 has NaN only at S.1111.111
  // Place E (4 bits) and M (3 bits) at the top of a float's exponent/mantissa fields: the value
  // is then 2^(E - 127) * 1.M (or a float subnormal), off from the e4m3 value by 2^(127 - 7).
  const float f = __uint_as_float(((x & 0x80u) << 24) | (mag << 20));
  return f * 0x1p120f;
}
__device__ __forceinline__ float e5m2_to_float(uint32_t x) {
  // e5m2 is the upper byte of an f16.
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x << 8)));
}
template <KvFormat F>
__device__ __forceinline__ float fp8_to_float(uint32_t x) {
  if constexpr (F == KvFormat::kE4M3)
    return e4m3_to_float(x);
  else
    return e5m2_to_float(x);
}

}  // namespace flashkv::cuda
