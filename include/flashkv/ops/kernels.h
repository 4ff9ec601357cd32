// The kernel entry points behind the ops (internal: only ops/*.cpp call these). The CPU ones
// always exist; the CUDA ones only in a CUDA build (FLASHKV_WITH_CUDA).
#pragma once

#include "flashkv/core/device.h"
#include "flashkv/ops/params.h"

namespace flashkv {
namespace cpu {
// Runs every work item of p (prefill, ragged or paged, and decode), then the merges.
void attention(const AttentionParams& p);
void merge(const MergeParams& p);
}  // namespace cpu

namespace cuda {
void paged_decode(const AttentionParams& p, Stream stream);
void prefill(const AttentionParams& p, Stream stream);  // ragged or paged by p.paged
void merge(const MergeParams& p, Stream stream);
}  // namespace cuda
}  // namespace flashkv
