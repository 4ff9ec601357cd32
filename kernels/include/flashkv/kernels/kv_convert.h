// Element conversions of append_kv, compiled for the host and the device from one source so the
// CPU and CUDA kernels store bit-identical values. They equal the exact conversions of
// core/dtype.h (to_f16, to_bf16, to_fp8_e4m3, to_fp8_e5m2: round to nearest even; fp8
// saturating; NaN to the same canonical NaN), which the tests check on every float class.
#pragma once

#include <cstdint>

#include "flashkv/core/dtype.h"
#include "flashkv/kernels/float_bits.h"

#if defined(__CUDACC__)
#define FLASHKV_KV_HD __host__ __device__ __forceinline__
#else
#define FLASHKV_KV_HD inline
#endif

namespace flashkv::kv_convert {

using float_bits::bits_of;
using float_bits::float_of;

// Element i of an i32 or i64 index array.
FLASHKV_KV_HD int64_t load_index(const void* data, bool is_i64, int64_t i) {
  return is_i64 ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
}

// ---- loads (exact) ----
FLASHKV_KV_HD float load(float x) { return x; }
FLASHKV_KV_HD float load(bf16_t x) { return float_of(uint32_t{x.bits} << 16); }
FLASHKV_KV_HD float load(f16_t x) {
  const uint32_t sign = uint32_t{x.bits} >> 15 << 31;
  const uint32_t exp = (x.bits >> 10) & 0x1fu;
  const uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return float_of(bits_of(mag) | sign);
  }
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

// ---- stores ----
// A binary format with kExp exponent bits, kMant mantissa bits and bias kBias; kIeee: the
// all-ones exponent holds inf/NaN (else, as in e4m3, only the all-ones pattern is NaN);
// kMaxBits: the largest finite magnitude's bit pattern; kSaturate: overflow clamps to it
// (else rounds to inf).
template <int kExp, int kMant, int kBias, bool kIeee, uint32_t kMaxBits, bool kSaturate>
FLASHKV_KV_HD uint32_t small_float_bits(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 31) << (kExp + kMant);
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t exp_ones = (1u << kExp) - 1u;
  if (a > 0x7f800000u)  // NaN: the canonical quiet NaN, no sign (as core/dtype.cpp)
    return kIeee ? (exp_ones << kMant) | (1u << (kMant - 1))
                 : (exp_ones << kMant) | ((1u << kMant) - 1u);
  uint32_t mag;
  if (a == 0x7f800000u) {
    mag = 0xffffffffu;  // overflows below
  } else {
    // a = m * 2^(e - 23), m with the implicit bit for a normal float.
    const int biased = static_cast<int>(a >> 23);
    const int e = biased == 0 ? -126 : biased - 127;
    const uint32_t m = biased == 0 ? (a & 0x7fffffu) : ((a & 0x7fffffu) | 0x800000u);
    const int emin = 1 - kBias;
    // Keep kMant bits below the leading one (fewer when subnormal in the target): drop `shift`.
    const int shift = 23 - kMant + (e < emin ? emin - e : 0);
    uint32_t r;
    if (shift >= 25) {
      r = 0;  // below half the smallest subnormal
    } else {
      r = m >> shift;
      const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
      if (rem > half || (rem == half && (r & 1u))) ++r;  // to nearest, ties to even
    }
    // Subnormal: r is the mantissa field (r == 2^kMant is the smallest normal, same bits).
    // Normal: r in [2^kMant, 2^(kMant+1)], and a carry into the exponent is just the addition.
    mag = e < emin ? r : (static_cast<uint32_t>(e + kBias - 1) << kMant) + r;
  }
  if (mag > kMaxBits) mag = kSaturate ? kMaxBits : (exp_ones << kMant);
  return sign | mag;
}

template <typename T>
struct Store;
template <>
struct Store<float> {
  FLASHKV_KV_HD static float from(float f) { return f; }
};
template <>
struct Store<bf16_t> {
  FLASHKV_KV_HD static bf16_t from(float f) {
    uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40u)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return bf16_t{static_cast<uint16_t>(u >> 16)};
  }
};
template <>
struct Store<f16_t> {
  FLASHKV_KV_HD static f16_t from(float f) {
    return f16_t{static_cast<uint16_t>(small_float_bits<5, 10, 15, true, 0x7bffu, false>(f))};
  }
};
template <>
struct Store<fp8_e4m3_t> {
  FLASHKV_KV_HD static fp8_e4m3_t from(float f) {
    return fp8_e4m3_t{static_cast<uint8_t>(small_float_bits<4, 3, 7, false, 0x7eu, true>(f))};
  }
};
template <>
struct Store<fp8_e5m2_t> {
  FLASHKV_KV_HD static fp8_e5m2_t from(float f) {
    return fp8_e5m2_t{static_cast<uint8_t>(small_float_bits<5, 2, 15, true, 0x7bu, true>(f))};
  }
};

}  // namespace flashkv::kv_convert
