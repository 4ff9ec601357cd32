// Internal: the CUDA half of measure_roofline (roofline_cuda.cu, built only with CUDA).
#pragma once

#include "roofline.h"

namespace flashkv::bench::detail {

#if FLASHKV_WITH_CUDA
// Device-to-device cudaMemcpy bandwidth, a vectorized read kernel's bandwidth and the rate of a
// cuBLAS bf16 GEMM (fp32 accumulation) on random data, each timed with CUDA events.
Roofline measure_roofline_cuda(Device device, const RooflineOptions& options);
#endif

}  // namespace flashkv::bench::detail
