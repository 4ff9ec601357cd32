// The portable CPU attention kernels (any CPU): the generic kernel over one-lane helpers.
#include "kernel_common.h"

#define FLASHKV_CPU_ISA_NS scalar
#include "attention_isa.h"
#include "simd_scalar.h"

namespace flashkv::cpu::scalar {
ItemKernel item_kernel(DType kv_dtype) { return item_kernel_for<ScalarF32>(kv_dtype); }
void merge_partials(const AttentionParams& p, const MergeItem& m, int32_t row) {
  merge_partials_impl<ScalarF32>(p, m, row);
}
void merge_row(const MergeParams& p, int64_t row) { merge_row_impl<ScalarF32>(p, row); }
}  // namespace flashkv::cpu::scalar
