// Device primitives of the prefill kernels (sm_80+), under the names the prefill code uses: the
// generic-pointer cp.async here; ldmatrix, the m16n8k16 MMA, fast exp2/tanh and the cp.async
// groups from common/ptx.cuh; the element conversions (pack2 / unpack2, fp8_to_float) and the KV
// formats from common/convert.cuh and common/kv_format.h.
// Private to cuda/prefill*.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/convert.cuh"
#include "common/kv_format.h"
#include "common/ptx.cuh"

namespace flashkv::cuda::prefill_detail {

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
