// Instruction-throughput benchmark for the instructions the Hopper prefill kernels lean on: the
// exponential (ex2.approx, the special-function unit), the fp8 -> f16 widening the fp8 producer
// issues (cvt e4m3x2 -> f16x2), the f32 -> bf16 pack of P, and exp2 as a cubic on the FMA pipe.
// The first three go through the kernels' own helpers (common/ptx.cuh, common/convert.cuh).
// Also the packed exponential of two bf16 values (ex2.approx.ftz.bf16x2, which sm_90a issues as
// two 16-bit MUFU.EX2): whether it retires exponentials faster than the f32 form.
// Each case runs one such step per chain on 8 independent chains a thread; a pair case runs two
// kinds of step a chain. A pair that takes as long as its two parts one after the other shares
// a pipe; one that takes as long as the slower part does not.
//
//   cuda_pipes_bench [--threads N] [--iters N]
//
// Per case: the time of one launch (one CTA an SM, N threads; median of 5), the steps a
// streaming multiprocessor retires per clock (clock64 in each CTA), and that against the
// special-function unit's 16 a clock (its documented rate at compute capability 8.x and 9.0).
// For a pair, also the rate if the two kinds shared one pipe (the harmonic sum of their own
// rates) and if they did not (the slower one's). Needs compute capability 8.9 or later (the fp8
// conversion).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "cuda_timing.h"
#include "flashkv/core/cuda_runtime.h"

namespace {

using flashkv::bench::detail::EventTimer;
using flashkv::cuda::fp8x2_to_f16x2;
using flashkv::cuda::pack2;
using flashkv::cuda::ptx::exp2_fast;
using flashkv::detail::cuda_check;
constexpr auto kE4M3 = flashkv::cuda::KvFormat::kE4M3;

enum Step : int {
  kEx2,
  kCvt,
  kPack,
  kPoly,
  kEx2Cvt,
  kEx2Pack,
  kEx2Poly8,
  kFfma,
  kEx2Bf16x2,
  kSteps
};
const char* const kNames[kSteps] = {"ex2.approx.f32 (MUFU)",
                                    "cvt e4m3x2 -> f16x2",
                                    "cvt f32x2 -> bf16x2 (pack)",
                                    "exp2 by a cubic (FMA pipe)",
                                    "ex2 + cvt e4m3x2, a step each",
                                    "ex2 + pack, a step each",
                                    "ex2, one chain in 8 by the cubic",
                                    "ffma",
                                    "ex2.approx.bf16x2 (2 exps a step)"};

// 2^x: x = j + f, |f| <= 1/2, 2^f by a cubic, 2^j in the exponent field (x >= -127).
__device__ __forceinline__ float exp2_cubic(float x) {
  x = fmaxf(x, -127.0f);
  const float t = x + 0x1.8p23f;
  const float f = x - (t - 0x1.8p23f);
  float p = fmaf(0x1.c2a15ap-5f, f, 0x1.f00bfep-3f);
  p = fmaf(p, f, 0x1.62f5fap-1f);
  p = fmaf(p, f, 1.0f);
  return p * __int_as_float((__float_as_int(t) << 23) + 0x3f800000);
}

template <int kStep>
__global__ void steps(float* out, int iters, long long* cycles) {
  float a[8];
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    a[i] = -1e-3f * static_cast<float>(threadIdx.x + i);
    w[i] = 0x3c38u + threadIdx.x + i;
  }
  __syncthreads();
  const long long t0 = clock64();
  // Only the chains keep the steps (the helpers' asm is not volatile): each step's result feeds
  // its chain's next step, and the chains end in the store below. cvt e4m3x2 widens w's low two
  // bytes; the pack puts a in the high half.
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (kStep == kEx2) a[i] = exp2_fast(a[i]) - 1.5f;
      if constexpr (kStep == kCvt)
        w[i] = fp8x2_to_f16x2<kE4M3>(static_cast<uint16_t>(w[i])) ^ 0x5a5au;
      if constexpr (kStep == kPack)
        w[i] = pack2<__nv_bfloat16>(__uint_as_float(w[i]), a[i]) ^ 0x5a5au;
      if constexpr (kStep == kPoly) a[i] = exp2_cubic(a[i]) - 1.5f;
      if constexpr (kStep == kEx2Cvt) {
        a[i] = exp2_fast(a[i]) - 1.5f;
        w[i] = fp8x2_to_f16x2<kE4M3>(static_cast<uint16_t>(w[i])) ^ 0x5a5au;
      }
      if constexpr (kStep == kEx2Pack) {
        a[i] = exp2_fast(a[i]) - 1.5f;
        w[i] = pack2<__nv_bfloat16>(__uint_as_float(w[i]), a[i]) ^ 0x5a5au;
      }
      if constexpr (kStep == kEx2Poly8) a[i] = (i == 7 ? exp2_cubic(a[i]) : exp2_fast(a[i])) - 1.5f;
      if constexpr (kStep == kFfma) a[i] = fmaf(a[i], 0.999f, 0.5f);
      if constexpr (kStep == kEx2Bf16x2) {
        // 2^x of both halves, then both signs flipped: the values stay in (-1, 1).
        asm("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(w[i]) : "r"(w[i]));
        w[i] ^= 0x80008000u;
      }
    }
  }
  const long long t1 = clock64();
  __syncthreads();
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += a[i] + __uint_as_float(w[i]);
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;  // keeps the chains live
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

struct Rate {
  double us = 0, per_clock = 0;  // launch time; steps an SM retires a clock
};

template <int kStep>
Rate measure(int sms, int threads, int iters, float* out, long long* cycles) {
  const auto launch = [&] { steps<kStep><<<sms, threads>>>(out, iters, cycles); };
  launch();  // warm-up
  const float ms = EventTimer(flashkv::Stream{}).median_ms(5, launch);
  cuda_check(cudaGetLastError(), "steps launch");
  std::vector<long long> host(sms);
  cuda_check(cudaMemcpy(host.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost),
             "cycles");
  double mean = 0;  // the last launch's clocks, averaged over the SMs
  for (long long c : host) mean += static_cast<double>(c) / sms;
  return {1e3 * ms, static_cast<double>(threads) * iters * 8 / mean};
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1024, iters = 4096;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: cuda_pipes_bench [--threads N] [--iters N]\n");
      return 2;
    }
  }
  if (threads < 32 || threads > 1024 || threads % 32 != 0 || iters < 1) {
    std::fprintf(stderr,
                 "cuda_pipes_bench: --threads takes 32 .. 1024 (a multiple of 32), "
                 "--iters at least 1\n");
    return 2;
  }
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  if (prop.major * 10 + prop.minor < 89) {
    std::fprintf(stderr, "cuda_pipes_bench: needs compute capability 8.9 or later (this: %d.%d)\n",
                 prop.major, prop.minor);
    return 1;
  }
  const int sms = prop.multiProcessorCount;
  float* out = nullptr;
  long long* cycles = nullptr;
  cuda_check(cudaMalloc(&out, sizeof(float) * sms * threads), "cudaMalloc");
  cuda_check(cudaMalloc(&cycles, sizeof(long long) * sms), "cudaMalloc");
  std::printf(
      "machine: %s (%d SMs); one CTA of %d threads an SM, 8 chains a thread, %d steps a "
      "chain\n",
      prop.name, sms, threads, iters);
  Rate r[kSteps];
  r[kEx2] = measure<kEx2>(sms, threads, iters, out, cycles);
  r[kCvt] = measure<kCvt>(sms, threads, iters, out, cycles);
  r[kPack] = measure<kPack>(sms, threads, iters, out, cycles);
  r[kPoly] = measure<kPoly>(sms, threads, iters, out, cycles);
  r[kEx2Cvt] = measure<kEx2Cvt>(sms, threads, iters, out, cycles);
  r[kEx2Pack] = measure<kEx2Pack>(sms, threads, iters, out, cycles);
  r[kEx2Poly8] = measure<kEx2Poly8>(sms, threads, iters, out, cycles);
  r[kFfma] = measure<kFfma>(sms, threads, iters, out, cycles);
  r[kEx2Bf16x2] = measure<kEx2Bf16x2>(sms, threads, iters, out, cycles);
  std::printf("%-34s %10s %14s %10s %14s %14s\n", "step", "us", "steps/SM clk", "of SFU",
              "if one pipe", "if two pipes");
  const auto pair = [&](int a, int b, double& shared, double& apart) {
    shared = 1.0 / (1.0 / r[a].per_clock + 1.0 / r[b].per_clock);
    apart = std::min(r[a].per_clock, r[b].per_clock);
  };
  for (int s = 0; s < kSteps; ++s) {
    std::printf("%-34s %10.1f %14.2f %9.1f%%", kNames[s], r[s].us, r[s].per_clock,
                100.0 * r[s].per_clock / 16.0);
    double shared = 0, apart = 0;
    if (s == kEx2Cvt) pair(kEx2, kCvt, shared, apart);
    if (s == kEx2Pack) pair(kEx2, kPack, shared, apart);
    if (shared > 0)
      std::printf(" %14.2f %14.2f\n", shared, apart);
    else
      std::printf("\n");
  }
  cuda_check(cudaFree(out), "cudaFree");
  cuda_check(cudaFree(cycles), "cudaFree");
  return 0;
}
