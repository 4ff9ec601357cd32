// Paged-decode kernels for head dim 128; built when FLASHKV_HEAD_DIMS lists 128.
#if FLASHKV_HEAD_DIM_128
#include "decode/decode_kernel.cuh"

namespace flashkv::cuda::decode {
FLASHKV_DECODE_INSTANTIATE(128, 1)
FLASHKV_DECODE_INSTANTIATE(128, 2)

#ifdef FLASHKV_DECODE_TRACE
// The records of this file's kernels (head dim 128: the benchmark's shapes).
void decode_trace_reset() {
  const unsigned int zero = 0;
  detail::cuda_check(cudaMemcpyToSymbol(trace::g_count, &zero, sizeof zero), "trace reset");
}
std::vector<TraceRecord> decode_trace_take() {
  unsigned int n = 0;
  detail::cuda_check(cudaMemcpyFromSymbol(&n, trace::g_count, sizeof n), "trace count");
  n = n < trace::kMaxRecords ? n : trace::kMaxRecords;
  std::vector<TraceRecord> r(n);
  if (n > 0)
    detail::cuda_check(cudaMemcpyFromSymbol(r.data(), trace::g_records, n * sizeof(TraceRecord)),
                       "trace read");
  return r;
}
#endif
}  // namespace flashkv::cuda::decode
#endif
