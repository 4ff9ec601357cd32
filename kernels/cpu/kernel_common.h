// What the CPU attention schedule (cpu/attention.cpp) and its per-ISA kernels
// (cpu/attention_<isa>.cpp) share. Every header an ISA translation unit needs is included here,
// BEFORE that unit switches its code generation target: inline functions of the standard library
// and of flashkv are then compiled for plain x86-64 in every unit, so the linker can pick any
// copy (the one-definition rule holds), and only the kernels themselves use the wider ISA.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports its own `_mm512_undefined_*` placeholders inside inlined intrinsics as
// uninitialized; the warnings point into the intrinsic headers, so they are silenced there only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#define FLASHKV_CPU_X86 1
#else
#define FLASHKV_CPU_X86 0
#endif

#include "flashkv/core/dtype.h"
#include "flashkv/kernels/kernels.h"
#include "flashkv/kernels/params.h"

namespace flashkv::cpu {

// Per-thread scratch memory, 64-byte aligned; grows on demand and is kept, so steady-state
// calls allocate nothing. Valid until the same thread asks again.
void* thread_scratch(size_t bytes);

// fp8 -> bf16 bits and fp8 -> f32, exact (every fp8 value is a bf16 value), built from
// flashkv's own conversions. Index [0]: e4m3, [1]: e5m2; then the fp8 byte.
struct Fp8Tables {
  alignas(64) uint16_t bf16[2][256];
  alignas(64) float f32[2][256];
  // The low and high bytes of bf16[f][m] for the 128 magnitudes m (the sign is bit 7 of both
  // the fp8 byte and the bf16 high byte): the byte-permute tables of stage_fp8_vbmi.
  alignas(64) uint8_t bf16_lo[2][128];
  alignas(64) uint8_t bf16_hi[2][128];
};
const Fp8Tables& fp8_tables();

// The fp8 rows at base + rows[i] * row_bytes (i < n) of `dim` values (a multiple of 64) -> bf16
// steps (two values each) at dst + i * pitch, in the order of fp8_vbmi_value, through the
// byte tables of one fp8 format (cpu/fp8_vbmi.cpp; AVX512_VBMI CPUs only).
void stage_fp8_vbmi(const char* base, int64_t row_bytes, const int64_t* rows, int n, int dim,
                    int pitch, uint32_t* dst, const uint8_t* lo_table, const uint8_t* hi_table);
// Which value of its group of 64 stage_fp8_vbmi puts at position k (0 .. 63) of the group:
// values 16 L + 0 .. 7 of the four 128-bit lanes L first, then values 16 L + 8 .. 15.
constexpr int fp8_vbmi_value(int k) { return 16 * ((k % 32) / 8) + 8 * (k / 32) + k % 8; }

// One task of a plan: a work item for KV heads head0 .. head0 + heads - 1; one partial-state
// merge (all heads of one row of a merge item); one row (all heads) of merge_state /
// merge_states.
// What attention() reads once per call, on the calling thread, for every task.
struct TaskOptions {
  bool split_prefetch = false;  // split_prefetch()
  bool fp8_vbmi = false;        // fp8_vbmi()
};
using ItemKernel = void (*)(const AttentionParams& p, const WorkItem& item, int32_t head0,
                            int32_t heads, const TaskOptions& options);
using PartialMergeKernel = void (*)(const AttentionParams& p, const MergeItem& m, int32_t row);
using MergeRowKernel = void (*)(const MergeParams& p, int64_t row);

// What each ISA translation unit provides. item_kernel returns null for a KV dtype that the
// unit's math does not take (the bf16 dot-product unit takes bf16 and fp8 KV only); merges run
// in fp32 and come from the fp32 units.
#define FLASHKV_DECLARE_CPU_ISA(ns)                                               \
  namespace ns {                                                                  \
  ItemKernel item_kernel(DType kv_dtype);                                         \
  void merge_partials(const AttentionParams& p, const MergeItem& m, int32_t row); \
  void merge_row(const MergeParams& p, int64_t row);                              \
  }
FLASHKV_DECLARE_CPU_ISA(scalar)
#if FLASHKV_CPU_X86
FLASHKV_DECLARE_CPU_ISA(avx2)
FLASHKV_DECLARE_CPU_ISA(avx512)
namespace avx512bf16 {
ItemKernel item_kernel(DType kv_dtype);
}
#endif
#undef FLASHKV_DECLARE_CPU_ISA

}  // namespace flashkv::cpu
