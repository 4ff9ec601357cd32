// Warpgroup matrix multiply-accumulate (sm_90a wgmma) for the Hopper prefill kernel: shared-memory
// matrix descriptors of 128-byte-swizzled tiles, the m64n128k16 instructions it uses (A from
// shared memory or from registers, B from shared memory; m64n64k16 for P.V at head dim 64 and
// for S over 64-key tiles), and the fences that order them.
//
// Tile layout (both operands of Q.K^T and the V of P.V): a [rows, 128] 16-bit tile is stored as
// two [rows, 64] halves (dims 0-63, then 64-127), each row of a half one 128-byte line whose
// 16-byte chunk c sits at chunk c ^ (row % 8): the 128-byte swizzle of the tensor cores, so
// every 8-row group is one 1024-byte swizzle atom and tile bases are 1024-byte aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/swizzle.cuh"

namespace flashkv::cuda::sm90 {

// 16-byte chunk `chunk` (0..15) of row `row` of a [rows, 128] tile, in bytes from the tile base.
__device__ __forceinline__ uint32_t tile_offset(int rows, int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * rows * 128 + row * 128 +
                               (swizzle_chunk(row, chunk & 7) << 4));
}

// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and
// stride byte offsets (each in 16-byte units, 14 bits), layout type 1 in bits 62-63.
__device__ __forceinline__ uint64_t descriptor(uint32_t smem_addr, uint32_t lead_bytes,
                                               uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3ffffu) >> 4) |
         static_cast<uint64_t>((lead_bytes >> 4) & 0x3fffu) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3fffu) << 32 | uint64_t{1} << 62;
}

// K-major operand (Q as A, K as B): 16 elements of depth at k-step k of a [rows, 128] tile whose
// first row is `row0` (a multiple of 8): 32 bytes a step inside a half. Consecutive 8-row groups
// are 1024 bytes apart; the leading offset is unused with this swizzle.
__host__ __device__ constexpr uint32_t k_major_step(int rows, int k) {
  return static_cast<uint32_t>((k >> 2) * rows * 128 + (k & 3) * 32);
}
__device__ __forceinline__ uint64_t k_major(uint32_t tile, int rows, int row0, int k) {
  return descriptor(tile + row0 * 128 + k_major_step(rows, k), 16, 1024);
}

// N-major B operand (V for P.V, B[key][dim] with dims contiguous): keys 16k .. 16k + 15 of a
// [rows, 128] tile. The two 64-dim halves are `rows` * 128 bytes apart (leading offset), 8-key
// groups 1024 bytes (stride offset).
__host__ __device__ constexpr uint32_t n_major_step(int k) {
  return static_cast<uint32_t>(k * 16 * 128);
}
__device__ __forceinline__ uint64_t n_major(uint32_t tile, int rows, int k) {
  return descriptor(tile + n_major_step(k), rows * 128, 1024);
}

// A descriptor whose start address is `bytes` further on: k_major(tile, rows, row0, k) is
// advance(k_major(tile, rows, row0, 0), k_major_step(rows, k)), n_major likewise. With the steps
// constants (an unrolled k loop), a product's descriptor is one 32-bit add to a tile's, not the
// address arithmetic and masking of descriptor(). The address field (bits 0-13) cannot carry:
// shared-memory addresses stay below 2^18.
__device__ __forceinline__ uint64_t advance(uint64_t desc, uint32_t bytes) {
  uint32_t lo, hi;
  asm("mov.b64 {%0, %1}, %2;\n" : "=r"(lo), "=r"(hi) : "l"(desc));
  lo += bytes >> 4;
  uint64_t out;
  asm("mov.b64 %0, {%1, %2};\n" : "=l"(out) : "r"(lo), "r"(hi));
  return out;
}

// Named barriers (ids 1..15; 0 is __syncthreads): `threads` threads (a multiple of 32) meet.
__device__ __forceinline__ void barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// barrier_sync that also returns whether `pred` holds in every one of the `threads` threads.
__device__ __forceinline__ bool barrier_sync_and(int id, int threads, bool pred) {
  uint32_t all;
  asm volatile(
      "{\n.reg .pred in, out;\nsetp.ne.u32 in, %1, 0;\nbar.red.and.pred out, %2, %3, in;\n"
      "selp.u32 %0, 1, 0, out;\n}\n"
      : "=r"(all)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return all != 0;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory mbarriers (8 bytes each, at a shared address): init with an arrival count,
// plain arrivals, and a wait for the phase of a parity.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's completed generic-proxy writes of shared memory (cp.async included)
// visible to the async proxy that wgmma reads through; a barrier then publishes them to all.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
#else
// Other targets never launch the kernels that use these (see the mma functions below).
__device__ __forceinline__ void fence() {}
__device__ __forceinline__ void commit() {}
template <int N>
__device__ __forceinline__ void wait() {}
__device__ __forceinline__ void fence_async_shared() {}
__device__ __forceinline__ void mbar_init(uint32_t, int) {}
__device__ __forceinline__ void mbar_arrive(uint32_t) {}
__device__ __forceinline__ void mbar_wait(uint32_t, uint32_t) {}
#endif

// Pins accumulators at this point of the program: an empty asm that reads and rewrites each one.
// The compiler sees an MMA's accumulators as ready when its asm returns, so without a pin after
// the wgmma.wait_group that makes them valid it may move their readers above it.
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

#define FLASHKV_WG_ACC8(a, i)                                                                 \
  "+f"(a[i]), "+f"(a[i + 1]), "+f"(a[i + 2]), "+f"(a[i + 3]), "+f"(a[i + 4]), "+f"(a[i + 5]), \
      "+f"(a[i + 6]), "+f"(a[i + 7])
#define FLASHKV_WG_ACC64(a)                                                                     \
  FLASHKV_WG_ACC8(a, 0), FLASHKV_WG_ACC8(a, 8), FLASHKV_WG_ACC8(a, 16), FLASHKV_WG_ACC8(a, 24), \
      FLASHKV_WG_ACC8(a, 32), FLASHKV_WG_ACC8(a, 40), FLASHKV_WG_ACC8(a, 48),                   \
      FLASHKV_WG_ACC8(a, 56)
#define FLASHKV_WG_ACC32(a) \
  FLASHKV_WG_ACC8(a, 0), FLASHKV_WG_ACC8(a, 8), FLASHKV_WG_ACC8(a, 16), FLASHKV_WG_ACC8(a, 24)
#define FLASHKV_WG_REGS32                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FLASHKV_WG_REGS64                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"

// The wgmma products, bf16 or f16 (T), as one asm each. Other targets: never launched (the host
// selects the sm_90a kernels only where sm_90a code was built), so the products trap there.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASHKV_WG_TYPED(ASM)                                                            \
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value, \
                "16-bit operands");                                                      \
  if constexpr (std::is_same<T, __half>::value)                                          \
    ASM("f16");                                                                          \
  else                                                                                   \
    ASM("bf16")
#else
#define FLASHKV_WG_TYPED(ASM) __trap()
#endif

// d[64 rows of the warpgroup, 128] (+)= A[64, 16] . B[16, 128], fp32 accumulators in the
// mma.sync layout per warp (d[4 j + e]: row lane / 4 (+ 8 for e >= 2) of the warp's 16, column
// 8 j + 2 (lane % 4) + e % 2). A and B K-major in shared memory; accumulate = false overwrites d.
#define FLASHKV_WG_SS(TYPE)                                                               \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                        \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE "\n" FLASHKV_WG_REGS64 \
      ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                   \
      : FLASHKV_WG_ACC64(d)                                                               \
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
template <typename T>
__device__ __forceinline__ void mma_ss([[maybe_unused]] float (&d)[64], [[maybe_unused]] uint64_t a,
                                       [[maybe_unused]] uint64_t b,
                                       [[maybe_unused]] bool accumulate) {
  FLASHKV_WG_TYPED(FLASHKV_WG_SS);
}
// A from registers (the mma.sync A fragment of rows lane / 4 (+8), k 2 (lane % 4) (+8)); B
// N-major (transposed: imm-trans-b 1); always accumulates.
#define FLASHKV_WG_RS(TYPE)                                                               \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                        \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE "\n" FLASHKV_WG_REGS64 \
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                     \
      : FLASHKV_WG_ACC64(d)                                                               \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
template <typename T>
__device__ __forceinline__ void mma_rs([[maybe_unused]] float (&d)[64],
                                       [[maybe_unused]] const uint32_t (&a)[4],
                                       [[maybe_unused]] uint64_t b) {
  FLASHKV_WG_TYPED(FLASHKV_WG_RS);
}
// The same two with B[16, 64] (m64n64k16), d[32] in the same layout: S for 64-key tiles (head dim
// 256), and P.V at head dim 64.
#define FLASHKV_WG_SS32(TYPE)                                                            \
  asm volatile(                                                                          \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE "\n" FLASHKV_WG_REGS32 \
      ", %32, %33, p, 1, 1, 0, 0;\n}\n"                                                  \
      : FLASHKV_WG_ACC32(d)                                                              \
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
template <typename T>
__device__ __forceinline__ void mma_ss([[maybe_unused]] float (&d)[32], [[maybe_unused]] uint64_t a,
                                       [[maybe_unused]] uint64_t b,
                                       [[maybe_unused]] bool accumulate) {
  FLASHKV_WG_TYPED(FLASHKV_WG_SS32);
}
#define FLASHKV_WG_RS32(TYPE)                                                            \
  asm volatile(                                                                          \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE "\n" FLASHKV_WG_REGS32 \
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                    \
      : FLASHKV_WG_ACC32(d)                                                              \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
template <typename T>
__device__ __forceinline__ void mma_rs([[maybe_unused]] float (&d)[32],
                                       [[maybe_unused]] const uint32_t (&a)[4],
                                       [[maybe_unused]] uint64_t b) {
  FLASHKV_WG_TYPED(FLASHKV_WG_RS32);
}
#undef FLASHKV_WG_TYPED
#undef FLASHKV_WG_SS
#undef FLASHKV_WG_RS
#undef FLASHKV_WG_SS32
#undef FLASHKV_WG_RS32
#undef FLASHKV_WG_ACC8
#undef FLASHKV_WG_ACC64
#undef FLASHKV_WG_ACC32
#undef FLASHKV_WG_REGS64
#undef FLASHKV_WG_REGS32

}  // namespace flashkv::cuda::sm90
