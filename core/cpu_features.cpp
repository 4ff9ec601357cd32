#include "flashkv/core/cpu_features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define FLASHKV_CPUID_X86 1
#else
#define FLASHKV_CPUID_X86 0
#endif

namespace flashkv {
namespace {

constexpr bool bit(unsigned reg, int i) { return (reg >> i) & 1u; }

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
#if FLASHKV_CPUID_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "Auth" "enti" "cAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const int base_family = static_cast<int>((a >> 8) & 0xf);
  const int base_model = static_cast<int>((a >> 4) & 0xf);
  f.family = base_family == 0xf ? base_family + static_cast<int>((a >> 20) & 0xff) : base_family;
  f.model = base_family == 0xf || base_family == 0x6
                ? base_model | static_cast<int>(((a >> 16) & 0xf) << 4)
                : base_model;
  // xgetbv exists only when the OS has enabled XSAVE (OSXSAVE); without it no AVX state is saved.
  const bool osxsave = bit(c, 27), avx = bit(c, 28);
  if (!osxsave || !avx) return f;
  const bool fma = bit(c, 12), f16c = bit(c, 29);
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool os_ymm = (xcr0_lo & 0x6) == 0x6;    // SSE + AVX state
  const bool os_zmm = (xcr0_lo & 0xe6) == 0xe6;  // + opmask and both ZMM halves
  if (!os_ymm) return f;
  f.fma = fma;
  f.f16c = f16c;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned max_subleaf = a;
  f.avx2 = bit(b, 5);
  if (!os_zmm) return f;
  f.avx512f = bit(b, 16);
  f.avx512dq = bit(b, 17);
  f.avx512bw = bit(b, 30);
  f.avx512vl = bit(b, 31);
  f.avx512vbmi = f.avx512f && bit(c, 1);
  if (max_subleaf >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512bf16 = f.avx512f && bit(a, 5);
  }
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect_cpu_features();
  return features;
}

}  // namespace flashkv
