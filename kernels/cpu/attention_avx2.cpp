// The AVX2 + FMA + F16C CPU attention kernels: fp32 math on 8 lanes. Everything below the target
// switch is compiled for that ISA only and runs only when the CPU has it (cpu/attention.cpp).
#include "kernel_common.h"

#if FLASHKV_CPU_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#endif

#define FLASHKV_CPU_ISA_NS avx2
#include "attention_isa.h"
#include "simd_avx2.h"

namespace flashkv::cpu::avx2 {
ItemKernel item_kernel(DType kv_dtype) { return item_kernel_for<Avx2F32>(kv_dtype); }
void merge_partials(const AttentionParams& p, const MergeItem& m, int32_t row) {
  merge_partials_impl<Avx2F32>(p, m, row);
}
void merge_row(const MergeParams& p, int64_t row) { merge_row_impl<Avx2F32>(p, row); }
}  // namespace flashkv::cpu::avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // FLASHKV_CPU_X86
