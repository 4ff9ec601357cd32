// Thin wrappers over the PTX instructions the attention kernels are built from: asynchronous
// 16-byte copies (sm_80+), ldmatrix / movmatrix, mma.sync m16n8k16 with fp32 accumulators,
// shared-memory vector loads, fast exp2/log2, and programmatic dependent launch (sm_90).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashkv::cuda::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// p, as a value the compiler cannot take apart: a sum formed before the call stays one 64-bit
// register, so `opaque(base) + 32-bit x 32-bit` is a single wide multiply-add.
template <typename T>
__device__ __forceinline__ const T* opaque(const T* p) {
  asm("" : "+l"(p));
  return p;
}

// 16 bytes global -> shared, bypassing L1 (.cg). valid == false zero-fills the destination
// without reading `src` (which must still be a mapped address).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
// 4 bytes global -> shared (.ca: the only form for sizes under 16); zero-fills when !valid.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Transposes an 8x8 b16 matrix held in the mma fragment layout (lane l: row l / 4, columns
// 2 (l % 4), +1) across the warp, into the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

// d += a * b for a 16x16 (row-major) by 16x8 (column-major) tile; T is __nv_bfloat16 or half.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]);
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                            const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<half>(float (&d)[4], const uint32_t (&a)[4],
                                                   const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 2^x and log2(x), approximate (ex2.approx / lg2.approx: ~2 ulp), -inf -> 0 and 0 -> -inf.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Prefetches the 128-byte line holding addr into L2 (a hint: no register, no completion). The
// L2 is the point of coherence of every SM's global accesses, so a line prefetched before
// another kernel writes it is updated in place: a prefetch may be issued at any time.
// A read-only global load issued where it is written: volatile, so the compiler cannot sink it
// to its first use, and its latency overlaps whatever runs in between.
__device__ __forceinline__ float ld_global_now(const float* addr) {
  float x;
  asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(x) : "l"(addr));
  return x;
}
// The same, only where `load` holds: `x` keeps its value otherwise. One predicated load into x's
// own register, so that nothing (a select between the loaded value and the old one) reads the
// load's result before the caller's first use.
__device__ __forceinline__ void ld_global_now_if(bool load, const float* addr, float& x) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p ld.global.nc.f32 %0, [%1];\n}\n"
               : "+f"(x)
               : "l"(addr), "r"(static_cast<int>(load)));
}

__device__ __forceinline__ void prefetch_l2(const void* addr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(addr));
}

// *addr += value at GPU scope with acquire-release semantics (returns the old value): after a
// CTA barrier, one thread's release publishes the whole CTA's earlier stores, and its acquire
// makes other CTAs' released stores visible to the CTA past the next barrier.
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* addr, int value) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n"
               : "=r"(old)
               : "l"(addr), "r"(value)
               : "memory");
  return old;
}

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream
// serialization may start before its predecessor ends; it must wait before reading what the
// predecessor wrote. The predecessor lets it start early with launch_dependents. Both are
// no-ops without the launch attribute, and compiled out below sm_90.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

}  // namespace flashkv::cuda::ptx
