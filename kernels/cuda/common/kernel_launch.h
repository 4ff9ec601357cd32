// Compute capability of the calling thread's current CUDA device, for launch options that only
// some architectures take (programmatic dependent launch: sm_90+), and the one kernel launch
// that sets that option.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flashkv/core/cuda_runtime.h"

namespace flashkv::cuda {

// major * 10 + minor (90 for sm_90); cached per device. Throws flashkv::Error on a CUDA error.
int current_device_cc();

// Launches kernel(args...). With `programmatic` (the caller checks the architecture), under
// programmatic stream serialization: the kernel's CTAs may be scheduled while the previous
// kernel of the stream finishes, and the kernel waits for it in griddepcontrol.wait.
// Throws flashkv::Error naming `what` when the launch fails.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, bool programmatic, const char* what, const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = programmatic ? 1 : 0;
  detail::cuda_check(cudaLaunchKernelEx(&config, kernel, args...), what);
}

}  // namespace flashkv::cuda
