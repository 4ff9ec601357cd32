// Compute capability of the calling thread's current CUDA device, for launch options that only
// some architectures take (programmatic dependent launch: sm_90+).
#pragma once

namespace flashkv::cuda {

// major * 10 + minor (90 for sm_90); cached per device. Throws flashkv::Error on a CUDA error.
int current_device_cc();

}  // namespace flashkv::cuda
