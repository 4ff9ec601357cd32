// CUDA roofline: device-to-device copy bandwidth (cudaMemcpy), read bandwidth (a vectorized
// streaming-read kernel) and the cuBLAS bf16 GEMM rate, timed with CUDA events.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda_timing.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"
#include "roofline_cuda.h"

namespace flashkv::bench::detail {
namespace {

using flashkv::detail::cuda_check;

void cublas_check(cublasStatus_t s, const char* what) {
  FLASHKV_CHECK(s == CUBLAS_STATUS_SUCCESS, what, ": cuBLAS status ", static_cast<int>(s));
}

// Owns a device allocation for the duration of the measurement.
struct DeviceMem {
  void* p = nullptr;
  explicit DeviceMem(size_t bytes) { cuda_check(cudaMalloc(&p, bytes), "roofline: cudaMalloc"); }
  ~DeviceMem() { cudaFree(p); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
};

// Fastest of `repeats` timed calls of launch() (after one warm-up call), in milliseconds.
template <typename Launch>
float best_ms(int repeats, const Launch& launch) {
  EventTimer timer(Stream{});
  launch();
  cuda_check(cudaDeviceSynchronize(), "roofline warm-up");
  float best = 0;
  for (int r = 0; r < repeats; ++r) {
    const float ms = timer.time_ms([&] { launch(); });
    if (r == 0 || ms < best) best = ms;
  }
  return best;
}

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

__global__ void fill_words(uint32_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x)
    p[i] = hash32(seed + i);
}

// Uniform values in [-1, 1).
__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x)
    p[i] =
        __float2bfloat16(static_cast<float>(hash32(seed + i) >> 8) * (2.0f / 16777216.0f) - 1.0f);
}

// Streams n 16-byte words, four loads in flight per thread; writes only if the XOR of all
// words equals a value it practically never does, so the loads cannot be dropped.
__global__ void read_words(const int4* __restrict__ p, size_t n, int4* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const int4 a = __ldcs(p + i), b = __ldcs(p + i + stride);
    const int4 c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
    acc.x ^= a.x ^ b.x ^ c.x ^ d.x;
    acc.y ^= a.y ^ b.y ^ c.y ^ d.y;
    acc.z ^= a.z ^ b.z ^ c.z ^ d.z;
    acc.w ^= a.w ^ b.w ^ c.w ^ d.w;
  }
  for (; i < n; i += stride) {
    const int4 a = __ldcs(p + i);
    acc.x ^= a.x;
    acc.y ^= a.y;
    acc.z ^= a.z;
    acc.w ^= a.w;
  }
  if (acc.x == 0x13572468 && acc.y == 0x2468ace0 && acc.z == 0x7f7f7f7f && acc.w == 0x1)
    *sink = acc;
}

}  // namespace

Roofline measure_roofline_cuda(Device device, const RooflineOptions& opt) {
  FLASHKV_CHECK(opt.repeats >= 1, "repeats: expected >= 1, got ", opt.repeats);
  FLASHKV_CHECK(opt.gemm_sustain_seconds >= 0 && opt.gemm_sustain_seconds <= 60,
                "gemm_sustain_seconds: expected 0 to 60, got ", opt.gemm_sustain_seconds);
  FLASHKV_CHECK(opt.gemm_n >= 256 && opt.gemm_n % 8 == 0,
                "gemm_n: expected a multiple of 8 >= 256, got ", opt.gemm_n);
  flashkv::detail::cuda_set_device(device);
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, device.index), "cudaGetDeviceProperties");
  Roofline r;
  r.device = device;
  r.name = prop.name;
  r.cores_or_sms = prop.multiProcessorCount;

  // Bandwidth: one buffer of `bytes` copied into another, and read on its own.
  const size_t bytes = (opt.buffer_bytes ? opt.buffer_bytes : size_t{2} << 30) / 64 * 64;
  FLASHKV_CHECK(bytes >= (size_t{1} << 20), "buffer_bytes: expected at least 1 MiB, got ", bytes);
  r.buffer_bytes = bytes;
  {
    DeviceMem src(bytes), dst(bytes), sink(sizeof(int4));
    const int fill_blocks = prop.multiProcessorCount * 8;
    fill_words<<<fill_blocks, 256>>>(static_cast<uint32_t*>(src.p), bytes / 4, 1);
    cuda_check(cudaGetLastError(), "roofline fill");
    const float copy_ms = best_ms(opt.repeats, [&] {
      cuda_check(cudaMemcpyAsync(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
    });
    r.copy_gbps = 2.0 * double(bytes) / (copy_ms * 1e-3) / 1e9;
    const int read_blocks = prop.multiProcessorCount * 4;
    const float read_ms = best_ms(opt.repeats, [&] {
      read_words<<<read_blocks, 512>>>(static_cast<const int4*>(src.p), bytes / 16,
                                       static_cast<int4*>(sink.p));
      cuda_check(cudaGetLastError(), "roofline read kernel");
    });
    r.read_gbps = double(bytes) / (read_ms * 1e-3) / 1e9;
  }

  // cuBLAS bf16 GEMM, fp32 accumulation, C = A * B on uniform random inputs.
  {
    const int n = opt.gemm_n;
    const size_t elems = size_t(n) * n;
    DeviceMem a(elems * 2), b(elems * 2), c(elems * 2);
    const int fill_blocks = prop.multiProcessorCount * 8;
    fill_bf16<<<fill_blocks, 256>>>(static_cast<__nv_bfloat16*>(a.p), elems, 2);
    fill_bf16<<<fill_blocks, 256>>>(static_cast<__nv_bfloat16*>(b.p), elems, 3);
    cuda_check(cudaGetLastError(), "roofline fill");
    cublasHandle_t handle = nullptr;
    cublas_check(cublasCreate(&handle), "cublasCreate");
    const float alpha = 1.0f, beta = 0.0f;
    const auto gemm = [&] {
      cublas_check(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.p, CUDA_R_16BF,
                                n, b.p, CUDA_R_16BF, n, &beta, c.p, CUDA_R_16BF, n,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
    };
    const double flop = 2.0 * double(n) * n * n;
    try {
      const float gemm_ms = best_ms(opt.repeats, gemm);
      r.matmul_gflops = flop / (gemm_ms * 1e-3) / 1e9;
      if (opt.gemm_sustain_seconds > 0) {
        // Back to back: the first half brings the card to where a long run holds it, the second
        // half is timed.
        const int half = std::max(
            1, static_cast<int>(std::ceil(opt.gemm_sustain_seconds / 2 / (gemm_ms * 1e-3))));
        for (int i = 0; i < half; ++i) gemm();
        EventTimer timer(Stream{});
        const float ms = timer.time_ms([&] {
          for (int i = 0; i < half; ++i) gemm();
        });
        r.matmul_sustained_gflops = flop * half / (ms * 1e-3) / 1e9;
      }
    } catch (...) {
      cublasDestroy(handle);
      throw;
    }
    cublasDestroy(handle);
    r.matmul_kind = str_cat("cuBLAS bf16 GEMM ", n, "^3, fp32 accumulation");
  }
  return r;
}

}  // namespace flashkv::bench::detail
