// 2^x without the special-function unit: a polynomial on the FMA pipe, compiled for the host and
// the device from one source (the host tests check the device's arithmetic bit for bit: adds,
// fused multiply-adds and one integer op, all correctly rounded on both).
//
// Why: at head dim 64 a 128 x 128 tile of the sm_90a prefill kernel costs the tensor cores about
// as many cycles as its 16384 exponentials cost the special-function unit (16 a cycle an SM), so
// the softmax cannot hide under the products. Taking a quarter of the exponentials to the FMA
// pipe, which runs 128 lanes a cycle, shortens the special-function unit's share
// (FLASHKV_PREFILL_SM90_EXP2_POLY=1; docs/perf/prefill.md).
#pragma once

#include <cmath>
#include <cstdint>

#include "flashkv/kernels/float_bits.h"

#if defined(__CUDACC__)
#define FLASHKV_EXP2_HD __host__ __device__ __forceinline__
#else
#define FLASHKV_EXP2_HD inline
#endif

namespace flashkv::exp2_poly_detail {

using float_bits::bits_of;
using float_bits::float_of;

// 2^f ~ 1 + f (c1 + f (c2 + f c3)) on [-1/2, 1/2], the constant term held at exactly 1 so that
// 2^0 = 1 and 2^-127 = 0 come out exact; the other three minimise the largest relative error
// (1.02e-4, a twentieth of a bf16 rounding of P).
constexpr float kC1 = 0.693282961845398f;
constexpr float kC2 = 0.2422109991312027f;
constexpr float kC3 = 0.055008914321660995f;
// 1.5 * 2^23: x + kRound rounds x to the nearest integer j, held in kRound's low mantissa bits.
constexpr float kRound = 12582912.0f;

}  // namespace flashkv::exp2_poly_detail

namespace flashkv {

// 2^x within 1.02e-4 relative for -126 <= x <= 127, exactly for integers; 0 for x <= -127 (-inf
// included) and, between -127 and -126, 0 or a value below 2^-126 (ex2.approx.ftz flushes those
// to 0); NaN for NaN. Not defined above 127: the softmax passes at most 8 (its lazy rescale).
FLASHKV_EXP2_HD float exp2_poly(float x) {
  using namespace exp2_poly_detail;
  x = x < -127.0f ? -127.0f : x;     // NaN compares false and passes through
  const float r = x + kRound;        // kRound + j, j = x rounded to the nearest integer
  const float f = x - (r - kRound);  // exact, in [-1/2, 1/2]
  const float p = std::fma(std::fma(std::fma(kC3, f, kC2), f, kC1), f, 1.0f);
  // 2^j = bits (j + 127) << 23. r's bits are kRound's plus j, and kRound's shift out above bit
  // 31, so (bits(r) << 23) is j << 23. j = -127 gives 0; a NaN stays NaN through the product.
  return p * float_of((bits_of(r) << 23) + 0x3f800000u);
}

}  // namespace flashkv

#undef FLASHKV_EXP2_HD
