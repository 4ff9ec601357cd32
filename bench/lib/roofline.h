// Machine ceilings measured in the same run as the benchmarks: memory read/copy bandwidth and
// the matrix rate (CPU: threaded loops; CUDA: a device copy and a cuBLAS bf16 GEMM).
#pragma once

#include <string>

#include "flashkv/core/device.h"

namespace flashkv::bench {

struct Roofline {
  Device device;
  std::string name;
  int cores_or_sms = 0;
  double read_gbps = 0;      // streaming read
  double copy_gbps = 0;      // bytes read + written
  double matmul_gflops = 0;  // bf16 dot products (CPU) / cuBLAS bf16 GEMM (CUDA)
  std::string matmul_kind;
};

Roofline measure_roofline(Device device);

}  // namespace flashkv::bench
