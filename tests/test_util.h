// Shared test helpers: seeded random tensors, NaN poisoning, the error metrics of
// docs/SEMANTICS.md, and GPU skipping.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/reference/reference.h"

namespace flashkv::test {

// A file name in the test temporary directory, distinct per process: two test binaries on one
// machine (a CI run beside a developer's) must not use each other's files.
inline std::string temp_file(const std::string& name) {
  return ::testing::TempDir() + "flashkv_" + std::to_string(getpid()) + "_" + name;
}

// A seeded generator; the seed shows in every failure message through SCOPED_TRACE.
class Rng {
 public:
  explicit Rng(uint64_t seed) : seed_(seed), gen_(seed) {}
  uint64_t seed() const { return seed_; }
  int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen_); }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen_); }
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(gen_); }
  std::mt19937_64& gen() { return gen_; }

 private:
  uint64_t seed_;
  std::mt19937_64 gen_;
};

// Seed for a test: FLASHKV_TEST_SEED if set, else a fixed value derived from `salt`.
uint64_t test_seed(uint64_t salt);
#define FLASHKV_SEEDED_RNG(rng, salt)                         \
  ::flashkv::test::Rng rng(::flashkv::test::test_seed(salt)); \
  SCOPED_TRACE(::testing::Message() << "seed=" << (rng).seed())

// Host tensor of the given shape with unit-normal values (times `scale`), rounded to dtype.
Tensor random_tensor(Rng& rng, std::initializer_list<int64_t> shape, DType dtype,
                     double scale = 1.0);
Tensor random_tensor(Rng& rng, const std::vector<int64_t>& shape, DType dtype, double scale = 1.0);
// Fills every element with NaN (floats) or 0x7f.. patterns (integers): an unwritten output shows.
void poison(const TensorView& t);
// A host i32 tensor.
inline Tensor i32_tensor(const std::vector<int32_t>& v) { return Tensor::from_i32(v); }
// Prefix sums of lengths: {0, l0, l0+l1, ...}.
std::vector<int32_t> indptr_of(const std::vector<int32_t>& lengths);

// ||out - ref|| / ||ref|| over all elements (out: host tensor [rows, heads, dim]).
double rel_error(const TensorView& out, const std::vector<double>& ref);
double max_abs_error(const TensorView& out, const std::vector<double>& ref);
// Max |lse - ref| where both finite; infinite where exactly one is -inf or either is NaN.
double lse_max_error(const TensorView& lse, const std::vector<double>& ref);
bool has_nan(const TensorView& t);

// Checks out/lse against a reference result with the tolerances of docs/SEMANTICS.md for `dtype`
// (fp8_kv widens the output tolerance).
void expect_close(const TensorView& out, const TensorView& lse, const reference::Result& ref,
                  DType dtype, bool fp8_kv = false);

// An output written in f32 (an out tensor of dtype f32) against the same call's output in the
// inputs' 16-bit dtype: each f32 value rounds (to nearest even) to the 16-bit value, bit for bit,
// and most f32 values are not 16-bit values themselves (the f32 output was not rounded).
void expect_unrounded_f32(const TensorView& out_f32, const TensorView& out_16);

// Puts that NaN into row `row` (a pool slot, or a ragged K/V row) of [rows, Hkv, D] k or v:
// element 0 of K's KV head 0 (nan_k), or dims 0 and 1 of V's.
void put_nan_in_kv_row(const Tensor& k, const Tensor& v, int64_t row, bool nan_k);
// A NaN in the first K row (nan_k; element 0) or V row (dims 0 and 1) of KV head 0 of the first
// request, which its first `rows` query rows see: checks that the query heads [0, group) of those
// rows are NaN in every dim and in the LSE (nan_k), or in dims 0 and 1 only (V), and that nothing
// else of out [rows, heads, dim] or lse [rows, heads] (when defined) is NaN.
void expect_nan_from_first_kv_row(const TensorView& out, const TensorView& lse, int64_t rows,
                                  int group, bool nan_k);

// The message of the flashkv::Error that fn throws ("" when none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// An environment variable for a scope, then put back as it was (value or absence; a CI run may
// set it). Constructed with a value, it sets it (nullptr: unsets it); with a name only, it keeps
// the outer value until set() is called.
class ScopedEnv {
 public:
  explicit ScopedEnv(const char* name) : name_(name) {
    const char* outer = std::getenv(name);
    had_ = outer != nullptr;
    if (had_) saved_ = outer;
  }
  ScopedEnv(const char* name, const char* value) : ScopedEnv(name) { set(value); }
  ~ScopedEnv() { EXPECT_EQ(had_ ? setenv(name_, saved_.c_str(), 1) : unsetenv(name_), 0); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  void set(const char* value) { EXPECT_EQ(value ? setenv(name_, value, 1) : unsetenv(name_), 0); }
  bool had() const { return had_; }  // whether the variable was set outside the scope

 private:
  const char* name_;
  bool had_ = false;
  std::string saved_;
};

// Skips the current test when no GPU is visible.
#define FLASHKV_REQUIRE_GPU()                                           \
  do {                                                                  \
    if (!::flashkv::cuda_available()) GTEST_SKIP() << "no GPU visible"; \
  } while (0)

}  // namespace flashkv::test
