// Device primitives of the prefill kernels (sm_80+), under the names the prefill code uses:
// the element conversions (16-bit pairs, fp8 to 16-bit) and the generic-pointer cp.async here;
// ldmatrix, the m16n8k16 MMA, fast exp2/tanh and the cp.async groups from common/ptx.cuh.
// Private to cuda/prefill*.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/ptx.cuh"

namespace flashkv::cuda::prefill_detail {

// --- element types ----------------------------------------------------------------------------

// How the KV cache stores its elements relative to Q: the same 16-bit type, or fp8 that the
// kernel widens (exactly) to Q's type in shared memory.
enum class KvFormat : int { kSame = 0, kE4M3 = 1, kE5M2 = 2 };

template <typename T>
struct Pack2;
template <>
struct Pack2<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t from_floats(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 to_floats(uint32_t bits) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  }
};
template <>
struct Pack2<__half> {
  static __device__ __forceinline__ uint32_t from_floats(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 to_floats(uint32_t bits) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
};

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

// --- asynchronous copies ----------------------------------------------------------------------

// 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (0: all zeros, and `src`
// is not read, though it must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}
using ptx::cp_async_commit;
using ptx::cp_async_wait;

// --- ldmatrix / mma ---------------------------------------------------------------------------

using ptx::ldmatrix_x4;  // on a shared-memory byte address (as from smem_addr)
using ptx::ldmatrix_x4_trans;
using ptx::smem_addr;

// d += a * b for one m16n8k16 tile: a 16x16 (row), b 16x8 (col), d 16x8 fp32.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  const uint32_t b[2] = {b0, b1};
  ptx::mma_m16n8k16<T>(d, a, b);
}

// --- fast math --------------------------------------------------------------------------------

using ptx::exp2_fast;
using ptx::tanh_fast;

}  // namespace flashkv::cuda::prefill_detail
