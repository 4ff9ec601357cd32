// Machine ceilings measured in the same run as the benchmarks: memory read/copy bandwidth and
// the matrix rate (CPU: threaded loops; CUDA: a device copy and a cuBLAS bf16 GEMM).
#pragma once

#include <cstddef>
#include <string>

#include "flashkv/core/device.h"

namespace flashkv::bench {

struct Roofline {
  Device device;
  std::string name;
  int cores_or_sms = 0;      // CPU: threads of the global pool; CUDA: multiprocessors
  double read_gbps = 0;      // streaming read
  double copy_gbps = 0;      // bytes read + written
  double matmul_gflops = 0;  // bf16 dot products (CPU) / cuBLAS bf16 GEMM (CUDA)
  std::string matmul_kind;   // which loop or library call produced matmul_gflops
  // CUDA: the same GEMM run back to back for RooflineOptions::gemm_sustain_seconds, its rate
  // over the second half. A GPU at full load soon reaches its power limit and lowers its clock;
  // matmul_gflops (the fastest single GEMM) is the rate before that, this the rate after, which
  // is where a case timed for as long finds the card. 0 on a CPU, or when not measured.
  double matmul_sustained_gflops = 0;
  size_t buffer_bytes = 0;  // size of the buffer the bandwidths streamed over
};

// Sizes and durations of the measurement; the defaults are what `flashkv bench` uses.
struct RooflineOptions {
  // Bytes streamed by the bandwidth loops. 0: CPU 8x the last-level cache, clamped to
  // [256 MiB, 1 GiB]; CUDA 2 GiB (copied from one 2 GiB buffer into another).
  size_t buffer_bytes = 0;
  // Timed passes of each bandwidth measurement (the fastest counts).
  int repeats = 8;
  // CPU: seconds each of the 3 timed rounds of the dot-product loop runs.
  double matmul_seconds = 0.1;
  // CPU: which dot-product loop to run: "" (the best this CPU has), "avx512bf16", "avx2",
  // "portable". Asking for one the CPU lacks throws flashkv::Error.
  std::string cpu_matmul;
  // CUDA: n of the n x n x n bf16 GEMM.
  int gemm_n = 8192;
  // CUDA: how long the GEMM also runs back to back for matmul_sustained_gflops (the attention
  // cases' default timing, BenchOptions::min_seconds); 0: not measured.
  double gemm_sustain_seconds = 0.25;
};

Roofline measure_roofline(Device device);
Roofline measure_roofline(Device device, const RooflineOptions& options);

}  // namespace flashkv::bench
