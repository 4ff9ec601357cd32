// The x86 instruction-set extensions of this CPU that are usable: the CPU has them (cpuid) AND
// the operating system saves their register state (xgetbv: the YMM state for AVX2/FMA/F16C,
// also the ZMM and opmask state for AVX-512). Read once; all false on other architectures.
// The CPU attention picks its kernels from it (cpu/attention.cpp) and `flashkv info` prints it,
// so the two cannot disagree.
#pragma once

namespace flashkv {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512dq = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
  bool avx512vbmi = false;
  bool amd = false;  // vendor "AuthenticAMD" (the CPU attention's prefetch policy follows it)
  int family = 0;    // display family and model (cpuid leaf 1, extended fields included)
  int model = 0;
};

const CpuFeatures& cpu_features();

}  // namespace flashkv
