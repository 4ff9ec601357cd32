// Thin, always-declared wrappers over the CUDA runtime. In a build without CUDA they throw
// flashkv::Error ("built without CUDA"), so no caller needs #ifdefs.
#pragma once

#include <cstddef>

#include "flashkv/core/device.h"

namespace flashkv::detail {

void* cuda_malloc(size_t bytes, Device device);
void cuda_free(void* p, Device device) noexcept;
// Makes `device` current on the calling thread.
void cuda_set_device(Device device);
// Throws flashkv::Error naming `what` when `status` (a cudaError_t) is not success.
void cuda_check(int status, const char* what);

}  // namespace flashkv::detail
