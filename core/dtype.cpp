#include "flashkv/core/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "flashkv/core/error.h"

namespace flashkv {
namespace {

// A binary floating format with `mant` mantissa bits and exponent bias `bias`.
struct SmallFloat {
  int exp_bits, mant_bits, bias;
  float max_finite;
  bool has_inf;  // IEEE-like (inf at all-ones exponent); false for e4m3 ("fn": only NaN there)
};
constexpr SmallFloat kF16{5, 10, 15, 65504.0f, true};
constexpr SmallFloat kE4M3{4, 3, 7, kFp8E4M3Max, false};
constexpr SmallFloat kE5M2{5, 2, 15, kFp8E5M2Max, true};

double decode(const SmallFloat& f, uint32_t bits) {
  const uint32_t sign = bits >> (f.exp_bits + f.mant_bits) & 1u;
  const uint32_t exp = bits >> f.mant_bits & ((1u << f.exp_bits) - 1u);
  const uint32_t mant = bits & ((1u << f.mant_bits) - 1u);
  const uint32_t exp_all_ones = (1u << f.exp_bits) - 1u;
  double v;
  if (f.has_inf && exp == exp_all_ones) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (!f.has_inf && exp == exp_all_ones && mant == (1u << f.mant_bits) - 1u) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - f.bias - f.mant_bits);
  } else {
    v = std::ldexp(static_cast<double>(mant | (1u << f.mant_bits)),
                   static_cast<int>(exp) - f.bias - f.mant_bits);
  }
  return sign ? -v : v;
}

// Rounds `x` to the nearest representable value (ties to even). Out of range: saturate to
// max_finite when `saturate`, else infinity.
uint32_t encode(const SmallFloat& f, float x, bool saturate) {
  const uint32_t sign_bit = 1u << (f.exp_bits + f.mant_bits);
  const uint32_t exp_all_ones = (1u << f.exp_bits) - 1u;
  if (std::isnan(x)) {
    return f.has_inf ? (exp_all_ones << f.mant_bits) | (1u << (f.mant_bits - 1))
                     : (exp_all_ones << f.mant_bits) | ((1u << f.mant_bits) - 1u);
  }
  const uint32_t sign = std::signbit(x) ? sign_bit : 0u;
  double a = std::fabs(static_cast<double>(x));
  const int emin = 1 - f.bias;  // exponent of the smallest normal
  if (a != 0 && !std::isinf(a)) {
    int e;
    std::frexp(a, &e);
    e -= 1;  // a in [2^e, 2^(e+1))
    if (e < emin) e = emin;
    const double quantum = std::ldexp(1.0, e - f.mant_bits);
    a = std::nearbyint(a / quantum) * quantum;  // default rounding mode: to nearest even
  }
  if (a > f.max_finite) {
    if (saturate || !f.has_inf)
      a = f.max_finite;
    else
      return sign | (exp_all_ones << f.mant_bits);
  }
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);
  e -= 1;
  if (e < emin) {  // subnormal
    return sign | static_cast<uint32_t>(std::ldexp(a, f.bias - 1 + f.mant_bits));
  }
  const uint32_t mant = static_cast<uint32_t>(std::ldexp(a, f.mant_bits - e)) - (1u << f.mant_bits);
  return sign | (static_cast<uint32_t>(e + f.bias) << f.mant_bits) | mant;
}

}  // namespace

float to_float(f16_t x) { return static_cast<float>(decode(kF16, x.bits)); }
f16_t to_f16(float f) { return f16_t{static_cast<uint16_t>(encode(kF16, f, false))}; }
float to_float(fp8_e4m3_t x) { return static_cast<float>(decode(kE4M3, x.bits)); }
fp8_e4m3_t to_fp8_e4m3(float f) { return fp8_e4m3_t{static_cast<uint8_t>(encode(kE4M3, f, true))}; }
float to_float(fp8_e5m2_t x) { return static_cast<float>(decode(kE5M2, x.bits)); }
fp8_e5m2_t to_fp8_e5m2(float f) { return fp8_e5m2_t{static_cast<uint8_t>(encode(kE5M2, f, true))}; }

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::fp8_e4m3:
    case DType::fp8_e5m2:
    case DType::u8:
      return 1;
    case DType::i64:
      return 8;
  }
  throw_error(str_cat("dtype: unknown value ", static_cast<int>(t)));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::fp8_e4m3:
      return "fp8_e4m3";
    case DType::fp8_e5m2:
      return "fp8_e5m2";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "unknown";
}

DType parse_dtype(const char* name) {
  const std::string s = name ? name : "";
  if (s == "f32" || s == "fp32" || s == "float32") return DType::f32;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::f16;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "fp8_e4m3" || s == "e4m3" || s == "float8_e4m3fn") return DType::fp8_e4m3;
  if (s == "fp8_e5m2" || s == "e5m2" || s == "float8_e5m2") return DType::fp8_e5m2;
  if (s == "i32" || s == "int32") return DType::i32;
  if (s == "i64" || s == "int64") return DType::i64;
  if (s == "u8" || s == "uint8" || s == "bool") return DType::u8;
  throw_error(str_cat(
      "dtype: expected one of f32, f16, bf16, fp8_e4m3, fp8_e5m2, i32, i64, u8; got '", s, "'"));
}

double load_as_double(const void* data, DType t, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(data)[i];
    case DType::f16:
      return to_float(static_cast<const f16_t*>(data)[i]);
    case DType::bf16:
      return to_float(static_cast<const bf16_t*>(data)[i]);
    case DType::fp8_e4m3:
      return to_float(static_cast<const fp8_e4m3_t*>(data)[i]);
    case DType::fp8_e5m2:
      return to_float(static_cast<const fp8_e5m2_t*>(data)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(data)[i];
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    case DType::u8:
      return static_cast<const uint8_t*>(data)[i];
  }
  throw_error("load_as_double: unknown dtype");
}

void store_from_double(void* data, DType t, int64_t i, double v) {
  const float f = static_cast<float>(v);
  switch (t) {
    case DType::f32:
      static_cast<float*>(data)[i] = f;
      return;
    case DType::f16:
      static_cast<f16_t*>(data)[i] = to_f16(f);
      return;
    case DType::bf16:
      static_cast<bf16_t*>(data)[i] = to_bf16(f);
      return;
    case DType::fp8_e4m3:
      static_cast<fp8_e4m3_t*>(data)[i] = to_fp8_e4m3(f);
      return;
    case DType::fp8_e5m2:
      static_cast<fp8_e5m2_t*>(data)[i] = to_fp8_e5m2(f);
      return;
    case DType::i32:
      static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v);
      return;
    case DType::i64:
      static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v);
      return;
    case DType::u8:
      static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(v);
      return;
  }
  throw_error("store_from_double: unknown dtype");
}

}  // namespace flashkv
