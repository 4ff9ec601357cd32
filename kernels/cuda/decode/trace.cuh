// Optional in-kernel timeline of the paged-decode kernel (built only with -DFLASHKV_DECODE_TRACE):
// thread 0 of each CTA reads %globaltimer and clock64 at fixed points and appends one record
// when the CTA exits. bench/cuda_decode_bench reads the records back (decode_trace_take) to
// place the fixed cost of small decode calls: launch, PDL wait, start-up loads, KV, merge. The
// record and the host side are in flashkv/kernels/decode_trace.h; this is the device side.
#pragma once

#include "flashkv/kernels/decode_trace.h"

#if defined(FLASHKV_DECODE_TRACE) && defined(__CUDACC__)
namespace flashkv::cuda::decode_detail::trace {
constexpr int kMaxRecords = 1 << 17;
static __device__ TraceRecord g_records[kMaxRecords];
static __device__ unsigned int g_count;

struct Timeline {
  uint64_t gt[kTracePoints];
  int64_t clk[kTracePoints];
  __device__ void clear() {
    for (int i = 0; i < kTracePoints; ++i) gt[i] = 0, clk[i] = 0;
  }
  __device__ void mark(int i) {
    if (threadIdx.x != 0) return;
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    gt[i] = t;
    clk[i] = clock64();
  }
  __device__ void commit(int items, int merged) {
    if (threadIdx.x != 0) return;
    const unsigned int i = atomicAdd(&g_count, 1u);
    if (i >= kMaxRecords) return;
    TraceRecord& r = g_records[i];
    for (int k = 0; k < kTracePoints; ++k) r.gt[k] = gt[k], r.clk[k] = clk[k];
    int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    r.smid = sm;
    r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    r.items = items;
    r.merged = merged;
  }
};
}  // namespace flashkv::cuda::decode_detail::trace
#define FLASHKV_TRACE(...) __VA_ARGS__
#else
#define FLASHKV_TRACE(...)
#endif
