// The paged-decode kernel's optional in-kernel timeline (built only with -DFLASHKV_DECODE_TRACE):
// the record each CTA appends, and the host calls that read them back (bench/cuda_decode_bench).
// The device side is kernels/cuda/decode/trace.cuh.
#pragma once

#include <cstdint>
#include <vector>

namespace flashkv::cuda::decode_detail {

// Points: 0 entry, 1 past griddepcontrol.wait, 2 item views made, 3 first indices in shared
// memory, 4 first K/V tile in shared memory, 5 last tile computed, 6 arrivals counted (first
// round), 7 first batch of a merge's loads folded (merging CTAs; else 0), 8 exit.
constexpr int kTracePoints = 9;
struct TraceRecord {
  uint64_t gt[kTracePoints];  // %globaltimer, ns
  int64_t clk[kTracePoints];  // clock64 of the CTA's SM
  int32_t smid, block, items, merged;
};

#ifdef FLASHKV_DECODE_TRACE
// Host side (written into the head dim 128 decode instantiation): resets the record count; returns
// the records so far.
void decode_trace_reset();

std::vector<TraceRecord> decode_trace_take();
#endif

}  // namespace flashkv::cuda::decode_detail
