// The whole per-ISA CPU attention. Included by cpu/attention_<isa>.cpp after its target switch
// and FLASHKV_CPU_ISA_NS, next to its simd_<isa>.h (the kernels are templates over the simd
// type, so either order works). Each piece includes the pieces it uses and kernel_common.h,
// which the unit already included before its target switch, so no order matters here; the
// pieces never include a standard header themselves, so none is compiled for the wider ISA.
#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/attention_isa.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

#include "attention_few_rows.h"  // the decode-style path
#include "attention_item.h"      // one task
#include "attention_kernel.h"    // tiles, softmax, QK and PV micro-kernels
#include "attention_loads.h"     // K/V rows, tiles, Q rows in, O rows out
#include "merge_kernel.h"        // merges of states
