#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "flashkv/core/thread_pool.h"
#include "flashkv/reference/compare.h"

namespace flashkv::test {

uint64_t test_seed(uint64_t salt) {
  const char* env = std::getenv("FLASHKV_TEST_SEED");
  const uint64_t base = env ? std::strtoull(env, nullptr, 10) : 20261129ull;
  return base * 1000003ull + salt;
}

Tensor random_tensor(Rng& rng, std::initializer_list<int64_t> shape, DType dtype, double scale) {
  return random_tensor(rng, std::vector<int64_t>(shape), dtype, scale);
}

namespace {
// SplitMix64: a small generator for one chunk of a random tensor, seeded from the chunk's index.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform_open() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1p-53; }  // (0, 1)
};
}  // namespace

// The tensor is filled in chunks of 64k elements, each from its own generator seeded by one draw
// of `rng` and the chunk's index, with unit normals by Box-Muller (two a pair of uniforms): the
// values depend on the seed only, not on the thread count, and a large tensor (the prefill
// tests' inputs reach 10^8 elements) fills on every core.
Tensor random_tensor(Rng& rng, const std::vector<int64_t>& shape, DType dtype, double scale) {
  Tensor t = Tensor::empty(shape, dtype);
  const uint64_t base = rng.gen()();
  constexpr int64_t kChunk = int64_t{1} << 16;
  const int64_t n = t.numel();
  void* data = t.data();
  ThreadPool::global().parallel_for((n + kChunk - 1) / kChunk, [&](int64_t c, int) {
    SplitMix64 g{base ^ (static_cast<uint64_t>(c) * 0xd1b54a32d192ed03ull)};
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; i += 2) {
      const double r = std::sqrt(-2.0 * std::log(g.uniform_open())) * scale;
      const double theta = 6.283185307179586 * g.uniform_open();
      store_from_double(data, dtype, i, r * std::cos(theta));
      if (i + 1 < end) store_from_double(data, dtype, i + 1, r * std::sin(theta));
    }
  });
  return t;
}

void poison(const TensorView& t) {
  FLASHKV_CHECK(t.device.is_cpu() && t.is_contiguous(),
                "poison: expected a contiguous host tensor");
  if (is_float(t.dtype)) {
    for (int64_t i = 0; i < t.numel(); ++i)
      store_from_double(t.data, t.dtype, i, std::numeric_limits<double>::quiet_NaN());
  } else {
    std::memset(t.data, 0x7f, t.nbytes());
  }
}

std::vector<int32_t> indptr_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> p(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) p[i + 1] = p[i] + lengths[i];
  return p;
}

namespace {
void check_size(const TensorView& t, const std::vector<double>& ref) {
  FLASHKV_CHECK(t.device.is_cpu() && t.is_contiguous(),
                "test metrics: expected a contiguous host tensor, got ", t.str());
  FLASHKV_CHECK(t.numel() == static_cast<int64_t>(ref.size()), "test metrics: tensor ", t.str(),
                " vs reference of ", ref.size(), " elements");
}
}  // namespace

double rel_error(const TensorView& out, const std::vector<double>& ref) {
  check_size(out, ref);
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = load_as_double(out.data, out.dtype, static_cast<int64_t>(i)) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  if (std::isnan(num)) return std::numeric_limits<double>::infinity();
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double max_abs_error(const TensorView& out, const std::vector<double>& ref) {
  check_size(out, ref);
  double m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d =
        std::fabs(load_as_double(out.data, out.dtype, static_cast<int64_t>(i)) - ref[i]);
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    m = std::max(m, d);
  }
  return m;
}

double lse_max_error(const TensorView& lse, const std::vector<double>& ref) {
  check_size(lse, ref);
  double m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double a = load_as_double(lse.data, lse.dtype, static_cast<int64_t>(i));
    if (std::isnan(a)) return std::numeric_limits<double>::infinity();
    if (std::isinf(ref[i]) || std::isinf(a)) {
      if (a != ref[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    m = std::max(m, std::fabs(a - ref[i]));
  }
  return m;
}

bool has_nan(const TensorView& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (std::isnan(load_as_double(t.data, t.dtype, i))) return true;
  return false;
}

void expect_close(const TensorView& out, const TensorView& lse, const reference::Result& ref,
                  DType dtype, bool fp8_kv) {
  const Errors e = compare(out, lse, ref);
  const Tolerance tol = tolerance_for(dtype, fp8_kv);
  EXPECT_TRUE(e.within(tol)) << "errors " << e.str() << " past tolerance rel " << tol.rel
                             << ", max_abs " << tol.max_abs << ", lse " << tol.lse;
}

void expect_unrounded_f32(const TensorView& out_f32, const TensorView& out_16) {
  ASSERT_EQ(out_f32.dtype, DType::f32);
  ASSERT_EQ(out_f32.numel(), out_16.numel());
  int64_t mismatched = 0, representable = 0, first = -1;
  uint16_t rounded = 0;
  for (int64_t i = 0; i < out_f32.numel(); ++i) {
    const double x = load_as_double(out_f32.data, DType::f32, i);
    store_from_double(&rounded, out_16.dtype, 0, x);
    const double r = load_as_double(&rounded, out_16.dtype, 0);
    const double y = load_as_double(out_16.data, out_16.dtype, i);
    const bool same = std::isnan(r) ? std::isnan(y) : r == y;
    if (!same && mismatched++ == 0) first = i;
    if (r == x) ++representable;
  }
  EXPECT_EQ(mismatched, 0) << "element " << first << ": f32 "
                           << load_as_double(out_f32.data, DType::f32, first) << " vs "
                           << dtype_name(out_16.dtype) << " "
                           << load_as_double(out_16.data, out_16.dtype, first);
  EXPECT_LT(representable * 2, out_f32.numel() + 2)
      << representable << " of " << out_f32.numel() << " f32 outputs are "
      << dtype_name(out_16.dtype) << " values: rounded before the store?";
}

void put_nan_in_kv_row(const Tensor& k, const Tensor& v, int64_t row, bool nan_k) {
  const Tensor& t = nan_k ? k : v;
  for (int64_t e = 0; e < (nan_k ? 1 : 2); ++e)
    store_from_double(t.data(), t.dtype(), row * t.size(1) * t.size(2) + e,
                      std::numeric_limits<double>::quiet_NaN());
}

void expect_nan_from_first_kv_row(const TensorView& out, const TensorView& lse, int64_t rows,
                                  int group, bool nan_k) {
  const int64_t n = out.size(0), heads = out.size(1), dim = out.size(2);
  int64_t wrong = 0;
  std::string first;
  auto check = [&](bool is_nan, bool want, const char* what, int64_t r, int64_t h, int64_t d) {
    if (is_nan == want) return;
    if (wrong++ == 0)
      first = str_cat(what, " row ", r, " head ", h, d >= 0 ? str_cat(" dim ", d) : "",
                      want ? " should be NaN" : " is NaN");
  };
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      const bool sees = r < rows && h < group;
      for (int64_t d = 0; d < dim; ++d)
        check(std::isnan(load_as_double(out.data, out.dtype, (r * heads + h) * dim + d)),
              sees && (nan_k || d < 2), "out", r, h, d);
      if (lse.defined())
        check(std::isnan(static_cast<const float*>(lse.data)[r * heads + h]), sees && nan_k, "lse",
              r, h, -1);
    }
  EXPECT_EQ(wrong, 0) << "NaN pattern: " << first;
}

}  // namespace flashkv::test
