// The whole per-ISA CPU attention, in dependency order. Included by cpu/attention_<isa>.cpp after
// its target switch, FLASHKV_CPU_ISA_NS and its simd_<isa>.h.
#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/attention_isa.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

// clang-format off
#include "attention_kernel.h"    // tiles, softmax, QK and PV micro-kernels
#include "attention_loads.h"     // K/V rows, tiles, Q rows in, O rows out
#include "attention_few_rows.h"  // the decode-style path
#include "attention_item.h"      // one task
#include "merge_kernel.h"        // merges of states
// clang-format on
