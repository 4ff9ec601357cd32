// The AVX-512 (F/BW/VL/DQ) CPU attention kernels: fp32 math on 16 lanes. Everything below the
// target switch is compiled for that ISA only and runs only when the CPU has it
// (cpu/attention.cpp).
#include "kernel_common.h"

#if FLASHKV_CPU_X86
#if defined(__clang__)
#pragma clang attribute push(                                                             \
    __attribute__((target("avx2,fma,f16c,bmi,bmi2,avx512f,avx512bw,avx512vl,avx512dq"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,avx512f,avx512bw,avx512vl,avx512dq")
#endif

#define FLASHKV_CPU_ISA_NS avx512
#define FLASHKV_CPU_HAS_BF16 0
#include "attention_isa.h"
#include "simd_avx512.h"

namespace flashkv::cpu::avx512 {
ItemKernel item_kernel(DType kv_dtype) { return item_kernel_for<Avx512F32>(kv_dtype); }
void merge_partials(const AttentionParams& p, const MergeItem& m, int32_t row) {
  merge_partials_impl<Avx512F32>(p, m, row);
}
void merge_row(const MergeParams& p, int64_t row) { merge_row_impl<Avx512F32>(p, row); }
}  // namespace flashkv::cpu::avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // FLASHKV_CPU_X86
