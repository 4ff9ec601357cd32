// Element types and their exact host conversions (round-to-nearest-even; fp8 saturating).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace flashkv {

enum class DType : uint8_t { f32, f16, bf16, fp8_e4m3, fp8_e5m2, i32, i64, u8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Parses "f32", "fp16"/"f16", "bf16", "fp8_e4m3"/"e4m3", "fp8_e5m2"/"e5m2", "i32", "i64", "u8".
DType parse_dtype(const char* name);
inline bool is_float(DType t) { return t <= DType::fp8_e5m2; }
inline bool is_fp8(DType t) { return t == DType::fp8_e4m3 || t == DType::fp8_e5m2; }

// Storage types: plain bit containers, so they can live in any buffer and cross to CUDA.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
struct fp8_e4m3_t {
  uint8_t bits;
};
struct fp8_e5m2_t {
  uint8_t bits;
};

// Largest finite value of each fp8 format (what saturation clamps to).
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8E5M2Max = 57344.0f;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float to_float(bf16_t x) { return bits_to_float(uint32_t{x.bits} << 16); }
inline bf16_t to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}
float to_float(f16_t x);
f16_t to_f16(float f);  // overflow rounds to +-inf, as IEEE does
float to_float(fp8_e4m3_t x);
fp8_e4m3_t to_fp8_e4m3(float f);  // saturates to +-448; NaN stays NaN
float to_float(fp8_e5m2_t x);
fp8_e5m2_t to_fp8_e5m2(float f);  // saturates to +-57344; NaN stays NaN

// Maps a C++ storage type to its DType.
template <typename T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<f16_t> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<bf16_t> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<fp8_e4m3_t> {
  static constexpr DType value = DType::fp8_e4m3;
};
template <>
struct dtype_of<fp8_e5m2_t> {
  static constexpr DType value = DType::fp8_e5m2;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::u8;
};

// Reads element `i` of a buffer of type `t` as a double (floats and integers alike).
double load_as_double(const void* data, DType t, int64_t i);
// Writes `v` into element `i` of a buffer of type `t`, rounding as the to_* functions above.
void store_from_double(void* data, DType t, int64_t i, double v);

}  // namespace flashkv
