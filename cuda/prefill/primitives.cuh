// Device primitives of the prefill kernels (sm_80+): asynchronous global-to-shared copies,
// ldmatrix, the m16n8k16 tensor-core MMA with fp32 accumulation, fast exp2/tanh, and the
// element conversions (16-bit pairs, fp8 to 16-bit). Private to cuda/prefill*.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

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
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// --- ldmatrix / mma ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ldmatrix on a shared-memory byte address (as from smem_addr).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// d += a * b for one m16n8k16 tile: a 16x16 (row), b 16x8 (col), d 16x8 fp32.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// --- fast math --------------------------------------------------------------------------------

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flashkv::cuda::prefill_detail
