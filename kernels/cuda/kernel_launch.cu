// current_device_cc (common/kernel_launch.h): the compute capability, cached per device.
#include <cuda_runtime.h>

#include <atomic>

#include "common/kernel_launch.h"
#include "flashkv/core/cuda_runtime.h"

namespace flashkv::cuda {

int current_device_cc() {
  static std::atomic<int> cc_of[64] = {};
  int device = 0;
  detail::cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= 64) return 0;
  int cc = cc_of[device].load(std::memory_order_relaxed);
  if (cc == 0) {
    int major = 0, minor = 0;
    detail::cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                       "cudaDeviceGetAttribute");
    detail::cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                       "cudaDeviceGetAttribute");
    cc = major * 10 + minor;
    cc_of[device].store(cc, std::memory_order_relaxed);
  }
  return cc;
}

}  // namespace flashkv::cuda
