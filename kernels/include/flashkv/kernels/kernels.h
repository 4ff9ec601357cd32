// The kernel entry points behind the ops (internal: only ops/*.cpp call these). The CPU ones
// always exist; the CUDA ones only in a CUDA build (FLASHKV_WITH_CUDA).
#pragma once

#include "flashkv/core/cpu_features.h"
#include "flashkv/core/device.h"
#include "flashkv/kernels/params.h"

namespace flashkv {
namespace cpu {
// Runs every work item of p (prefill, ragged or paged, and decode), then the merges.
void attention(const AttentionParams& p);
void merge(const MergeParams& p);

// Instruction-set levels of the CPU kernels, each a superset of the one before. One binary holds
// them all and picks the best the CPU supports at run time.
enum class Isa : int {
  scalar = 0,       // any CPU: plain C++
  avx2 = 1,         // AVX2 + FMA + F16C: fp32 math on 8 lanes
  avx512 = 2,       // AVX-512 F/BW/VL/DQ: fp32 math on 16 lanes
  avx512_bf16 = 3,  // + AVX512_BF16: bf16 dot products (bf16 and fp8 KV)
};
const char* isa_name(Isa isa);
// The best level this CPU and OS support.
Isa detected_isa();
// The level the kernels use: the detected one, capped by set_isa_cap() or by the environment
// variable FLASHKV_CPU_ISA (scalar / avx2 / avx512 / avx512_bf16).
Isa active_isa();
// Caps the level (tests and benchmarks run every path this way); returns the previous cap.
// Throws flashkv::Error for a value outside the enum (and active_isa() for a bad
// FLASHKV_CPU_ISA).
Isa set_isa_cap(Isa cap);

// Software prefetch on the AVX2 decode path (tasks of few rows per KV head, bf16 or fp8 KV,
// whose K is read slot by slot). Default (split_prefetch_default): off on AMD cores before Zen 4,
// whose hardware prefetchers follow the slot-major order on their own, where the software
// prefetch only adds traffic; on elsewhere, where it is what keeps the loads in flight (figures:
// docs/perf/cpu.md). FLASHKV_CPU_PREFETCH=on|off overrides the default, set_split_prefetch()
// both.
enum class Prefetch : int { by_cpu = -1, off = 0, on = 1 };
bool split_prefetch();
bool split_prefetch_default(const CpuFeatures& cpu);
// Sets the policy (tests run both); returns the previous setting. Throws flashkv::Error for a
// value outside the enum (and split_prefetch() for a bad FLASHKV_CPU_PREFETCH).
Prefetch set_split_prefetch(Prefetch mode);

// fp8 K/V on the AVX-512 BF16 decode path converted 64 values at a time with byte permutes
// (AVX512_VBMI), where the CPU has them and head dims are multiples of 64: about a third of the
// operations of the 16-bit table lookups per value, on a path bound by those conversions
// (figures: docs/perf/cpu.md, "fp8 KV on the AVX-512 BF16 decode path").
// fp8_vbmi(): whether it is used; set_fp8_vbmi(false) keeps the lookups (tests run both);
// returns the previous setting.
bool fp8_vbmi();
bool set_fp8_vbmi(bool enabled);
}  // namespace cpu

namespace cuda {
void paged_decode(const AttentionParams& p, Stream stream);
void prefill(const AttentionParams& p, Stream stream);  // ragged or paged by p.paged
// Throw what paged_decode / prefill would throw for p (no kernel for these dtypes, head dims or
// alignments), launching nothing.
void check_paged_decode(const AttentionParams& p);
void check_prefill(const AttentionParams& p);
void merge(const MergeParams& p, Stream stream);
// Packed query rows (tokens x G query heads) of the prefill kernel's CTA tile for these head
// dims: plan prefill with PlanOptions.q_tile = prefill_cta_rows(D_qk, D_v) / G for full tiles.
int prefill_cta_rows(int head_dim_qk, int head_dim_v);
}  // namespace cuda
}  // namespace flashkv
