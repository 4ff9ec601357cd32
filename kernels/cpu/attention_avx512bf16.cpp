// The AVX-512 BF16 CPU attention kernels: bf16 (and fp8, converted exactly to bf16) K/V with
// bf16 dot products (`vdpbf16ps`) accumulating in fp32. Everything below the target switch is
// compiled for that ISA only and runs only when the CPU has it (cpu/attention.cpp).
#include "kernel_common.h"

#if FLASHKV_CPU_X86
#if defined(__clang__)
#pragma clang attribute push(                                                             \
    __attribute__((                                                                       \
        target("avx2,fma,f16c,bmi,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#endif

#define FLASHKV_CPU_ISA_NS avx512bf16
#define FLASHKV_CPU_HAS_BF16 1
#include "attention_isa.h"
#include "simd_avx512.h"

namespace flashkv::cpu::avx512bf16 {
ItemKernel item_kernel(DType kv_dtype) { return item_kernel_for<Avx512Bf16>(kv_dtype); }
}  // namespace flashkv::cpu::avx512bf16

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // FLASHKV_CPU_X86
