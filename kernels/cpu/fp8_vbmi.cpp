// fp8 K/V rows -> bf16 steps with the AVX512_VBMI byte permutes, for the AVX-512 BF16 decode path
// (cpu/attention_item.h). Its own translation unit: the AVX-512 BF16 unit is compiled for CPUs
// without VBMI too (Cooper Lake), so this code runs only where cpu_features() has it.
#include "kernel_common.h"

#if FLASHKV_CPU_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vbmi"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vbmi")
#endif

namespace flashkv::cpu {

// 64 values a step of the loop: each byte's magnitude indexes the low- and high-byte tables of
// its bf16 value (vpermi2b reads 7 index bits, so the sign bit is ignored), the sign goes into
// the high byte, and the byte unpacks make the bf16 values: one permute per 32 values, where a
// 16-bit table lookup takes two permutes, a blend and a sign fix-up. The unpacks work per
// 128-bit lane, hence the order of fp8_vbmi_value().
void stage_fp8_vbmi(const char* base, int64_t row_bytes, const int64_t* rows, int n, int dim,
                    int pitch, uint32_t* dst, const uint8_t* lo_table, const uint8_t* hi_table) {
  const __m512i lo0 = _mm512_load_si512(lo_table), lo1 = _mm512_load_si512(lo_table + 64);
  const __m512i hi0 = _mm512_load_si512(hi_table), hi1 = _mm512_load_si512(hi_table + 64);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int i = 0; i < n; ++i) {
    const char* src = base + rows[i] * row_bytes;
    uint32_t* out = dst + static_cast<size_t>(i) * pitch;
    for (int d = 0; d < dim; d += 64) {
      const __m512i w = _mm512_loadu_si512(src + d);
      const __m512i lo = _mm512_permutex2var_epi8(lo0, w, lo1);
      const __m512i hi =
          _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, w, hi1), w, sign, 0xf8);
      _mm512_storeu_si512(out + d / 2, _mm512_unpacklo_epi8(lo, hi));
      _mm512_storeu_si512(out + d / 2 + 16, _mm512_unpackhi_epi8(lo, hi));
    }
  }
}

}  // namespace flashkv::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // FLASHKV_CPU_X86
