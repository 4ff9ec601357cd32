// exp2_poly (the sm_90a prefill kernel's 2^x on the FMA pipe) against exp2 in double: the host
// runs the same correctly rounded additions and fused multiply-adds as the device.
#include "flashkv/kernels/exp2_poly.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace flashkv {
namespace {

float float_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t bits_from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Every 4099th float of [-126, 127] (about 550,000, both signs and every binade), against the
// bound the coefficients were fitted to: an exhaustive pass over all 2.25e9 floats of the range
// gives a largest relative error of 1.014e-4.
TEST(Exp2Poly, WithinItsBoundOverTheSoftmaxRange) {
  double worst = 0;
  float worst_x = 0;
  int64_t checked = 0;
  auto scan = [&](float from, float to) {  // |from| < |to|, same sign
    const uint32_t a = bits_from_float(from), b = bits_from_float(to);
    for (uint64_t u = a; u <= b; u += 4099) {
      const float x = float_from_bits(static_cast<uint32_t>(u));
      const double err = std::fabs(exp2_poly(x) / std::exp2(double{x}) - 1.0);
      if (!(err <= worst)) {
        worst = err;
        worst_x = x;
      }
      ++checked;
    }
  };
  scan(0.0f, 127.0f);
  scan(-0.0f, -126.0f);
  EXPECT_GT(checked, 500000);
  EXPECT_LE(worst, 1.02e-4) << "at x = " << worst_x;
  // The bound is tight (fitted: degree 2 would be off by 2.0e-3, degree 4 by 2.8e-6).
  EXPECT_GT(worst, 0.9e-4);
}

TEST(Exp2Poly, ExactAtIntegersAndAtTheEnds) {
  for (int j = -126; j <= 127; ++j)
    EXPECT_EQ(exp2_poly(static_cast<float>(j)), std::ldexp(1.0f, j)) << "x = " << j;
  const float inf = std::numeric_limits<float>::infinity();
  // The masked logits: 2^-inf is exactly 0, so a row that sees no key sums to 0.
  EXPECT_EQ(bits_from_float(exp2_poly(-inf)), 0u);
  for (const float x : {-127.0f, -127.5f, -1000.0f, -std::numeric_limits<float>::max()})
    EXPECT_EQ(bits_from_float(exp2_poly(x)), 0u) << "x = " << x;
  // Between -127 and -126: 0 or below 2^-126 (ex2.approx.ftz gives 0 there), never negative.
  for (float x = -127.0f; x < -126.0f; x += 1.0f / 64) {
    const float y = exp2_poly(x);
    EXPECT_GE(y, 0.0f) << "x = " << x;
    EXPECT_LE(y, std::ldexp(1.0f, -126)) << "x = " << x;
  }
  EXPECT_TRUE(std::isnan(exp2_poly(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(exp2_poly(-std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace flashkv
