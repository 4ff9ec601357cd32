// Tests of the float64 reference itself: cases small enough to work out by hand, invariants of
// the attention function on random inputs, equivalences between its ragged / paged / masked /
// merged forms, and argument checks.
#include "flashkv/reference/reference.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "flashkv/core/thread_pool.h"
#include "flashkv/reference/compare.h"
#include "test_util.h"

namespace flashkv {
namespace {

using reference::Result;
using test::Rng;

constexpr double kInf = std::numeric_limits<double>::infinity();
const double kLn2 = std::log(2.0);

// A host f32 tensor with the given values (row-major).
Tensor f32_tensor(std::initializer_list<int64_t> shape, const std::vector<float>& values) {
  Tensor t = Tensor::empty(shape, DType::f32);
  EXPECT_EQ(t.numel(), static_cast<int64_t>(values.size()));
  std::copy(values.begin(), values.end(), t.ptr<float>());
  return t;
}

AttentionOptions options(bool causal, float sm_scale = 0) {
  AttentionOptions opt;
  opt.causal = causal;
  opt.sm_scale = sm_scale;
  return opt;
}

// Element-wise comparison of two results: |a - b| <= tol * (1 + |b|); LSE -inf must match.
void expect_same(const Result& a, const Result& b, double tol) {
  ASSERT_EQ(a.rows, b.rows);
  ASSERT_EQ(a.heads, b.heads);
  ASSERT_EQ(a.head_dim, b.head_dim);
  for (size_t i = 0; i < a.o.size(); ++i)
    ASSERT_NEAR(a.o[i], b.o[i], tol * (1 + std::fabs(b.o[i]))) << "o element " << i;
  for (size_t i = 0; i < a.lse.size(); ++i) {
    if (std::isinf(b.lse[i])) {
      ASSERT_EQ(a.lse[i], b.lse[i]) << "lse element " << i;
    } else {
      ASSERT_NEAR(a.lse[i], b.lse[i], tol * (1 + std::fabs(b.lse[i]))) << "lse element " << i;
    }
  }
}

// True when row r, head h is an empty row: O all zero and LSE -inf.
bool is_empty_row(const Result& r, int64_t row, int h) {
  for (int d = 0; d < r.head_dim; ++d)
    if (r.o_at(row, h, d) != 0.0) return false;
  return r.lse_at(row, h) == -kInf;
}

// Softmax-weighted average of `values` under `scores`, and log2 of the partition sum.
struct Expected {
  std::vector<double> o;
  double lse;
};
Expected softmax_average(const std::vector<double>& scores,
                         const std::vector<std::vector<double>>& values) {
  Expected e{std::vector<double>(values[0].size(), 0.0), 0};
  double sum = 0;
  for (size_t j = 0; j < scores.size(); ++j) {
    sum += std::exp(scores[j]);
    for (size_t d = 0; d < e.o.size(); ++d) e.o[d] += std::exp(scores[j]) * values[j][d];
  }
  for (double& x : e.o) x /= sum;
  e.lse = std::log(sum) / kLn2;
  return e;
}

void expect_row(const Result& r, int64_t row, int h, const Expected& e, double tol = 1e-12) {
  for (size_t d = 0; d < e.o.size(); ++d)
    EXPECT_NEAR(r.o_at(row, h, static_cast<int>(d)), e.o[d], tol)
        << "row " << row << " head " << h << " d " << d;
  EXPECT_NEAR(r.lse_at(row, h), e.lse, tol) << "row " << row << " head " << h;
}

// ---------------------------------------------------------------------------------------------
// Cases small enough to compute by hand.

TEST(Reference, OneQueryTwoKeysKnownSoftmax) {
  // Scores q.k0 = 1, q.k1 = 2 (sm_scale 1); V is the identity, so O is the softmax itself.
  Tensor q = f32_tensor({1, 1, 2}, {1, 2});
  Tensor k = f32_tensor({2, 1, 2}, {1, 0, 0, 1});
  Tensor v = f32_tensor({2, 1, 2}, {1, 0, 0, 1});
  Tensor qo = Tensor::from_i32({0, 1}), kvp = Tensor::from_i32({0, 2});
  const double e = std::exp(1.0);
  for (bool causal : {false, true}) {  // one query at position 1 sees both keys either way
    Result r = reference::ragged_attention(q, k, v, qo, kvp, options(causal, 1.0f));
    EXPECT_NEAR(r.o_at(0, 0, 0), 1 / (1 + e), 1e-15);
    EXPECT_NEAR(r.o_at(0, 0, 1), e / (1 + e), 1e-15);
    EXPECT_NEAR(r.lse_at(0, 0), std::log(e + e * e) / kLn2, 1e-14);
  }
}

TEST(Reference, DefaultSmScaleIsInverseSqrtHeadDim) {
  // D = 4: dots 1 and 4, scaled by 1/2 to 0.5 and 2.
  Tensor q = f32_tensor({1, 1, 4}, {1, 1, 1, 1});
  Tensor k = f32_tensor({2, 1, 4}, {1, 0, 0, 0, 1, 1, 1, 1});
  Tensor v = f32_tensor({2, 1, 4}, {1, 2, 3, 4, -1, -2, -3, -4});
  Tensor qo = Tensor::from_i32({0, 1}), kvp = Tensor::from_i32({0, 2});
  Result r = reference::ragged_attention(q, k, v, qo, kvp, options(false));
  expect_row(r, 0, 0, softmax_average({0.5, 2.0}, {{1, 2, 3, 4}, {-1, -2, -3, -4}}));
}

TEST(Reference, LseIsBase2AndSingleKeyCopiesValue) {
  Tensor q = f32_tensor({1, 1, 2}, {1, 1});
  Tensor k = f32_tensor({1, 1, 2}, {2, 0.5f});
  Tensor v = f32_tensor({1, 1, 2}, {-3, 7});
  Tensor qo = Tensor::from_i32({0, 1}), kvp = Tensor::from_i32({0, 1});
  Result r = reference::ragged_attention(q, k, v, qo, kvp, options(true, 1.0f));
  EXPECT_DOUBLE_EQ(r.o_at(0, 0, 0), -3.0);
  EXPECT_DOUBLE_EQ(r.o_at(0, 0, 1), 7.0);
  EXPECT_NEAR(r.lse_at(0, 0), 2.5 / kLn2, 1e-14);  // log2(e^2.5), not ln
}

// NaN propagates as plain arithmetic does, also when the NaN key is the only one a row sees; a
// NaN nobody may see changes nothing; a NaN state makes a merge NaN.
TEST(Reference, NaNInKvReachesExactlyTheRowsAndDimsThatUseIt) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor q = f32_tensor({2, 1, 2}, {1, 2, 0.5f, -1});
  Tensor k = f32_tensor({2, 1, 2}, {static_cast<float>(nan), 0, 0, 1});
  Tensor v = f32_tensor({2, 1, 2}, {1, 0, 0, 1});
  Tensor qo = Tensor::from_i32({0, 2}), kvp = Tensor::from_i32({0, 2});
  // Causal: row 0 sees key 0 alone (its score is NaN), row 1 both.
  Result r = reference::ragged_attention(q, k, v, qo, kvp, options(true, 1.0f));
  for (int row : {0, 1}) {
    EXPECT_TRUE(std::isnan(r.lse_at(row, 0))) << row;
    for (int d : {0, 1}) EXPECT_TRUE(std::isnan(r.o_at(row, 0, d))) << row << " " << d;
  }
  // NaN in key 1's value dim 1: row 0 (which may not see key 1) keeps its numbers.
  Tensor k2 = f32_tensor({2, 1, 2}, {1, 0, 0, 1});
  Tensor v2 = f32_tensor({2, 1, 2}, {1, 0, 0, static_cast<float>(nan)});
  Result s = reference::ragged_attention(q, k2, v2, qo, kvp, options(true, 1.0f));
  EXPECT_DOUBLE_EQ(s.o_at(0, 0, 0), 1.0);
  EXPECT_DOUBLE_EQ(s.o_at(0, 0, 1), 0.0);
  EXPECT_FALSE(std::isnan(s.lse_at(1, 0)));
  EXPECT_FALSE(std::isnan(s.o_at(1, 0, 0)));
  EXPECT_TRUE(std::isnan(s.o_at(1, 0, 1)));
  // A NaN state next to an empty one (max over the numbers: -inf) merges to NaN.
  Result empty = s, bad = s;
  std::fill(empty.o.begin(), empty.o.end(), 0.0);
  std::fill(empty.lse.begin(), empty.lse.end(), -kInf);
  bad.lse[0] = nan;
  const Result m = reference::merge_states({empty, bad});
  EXPECT_TRUE(std::isnan(m.lse_at(0, 0)));
  EXPECT_TRUE(std::isnan(m.o_at(0, 0, 0)));
  EXPECT_DOUBLE_EQ(m.lse_at(1, 0), s.lse_at(1, 0));
}

// compare(): NaN in the output passes only where the reference is NaN, and must be there.
TEST(Compare, NaNMustBeWhereTheReferenceHasIt) {
  Result ref;
  ref.rows = 1;
  ref.heads = 2;
  ref.head_dim = 2;
  ref.o = {1.0, std::numeric_limits<double>::quiet_NaN(), 0.5, 0.25};
  ref.lse = {std::numeric_limits<double>::quiet_NaN(), 2.0};
  Tensor out = f32_tensor({1, 2, 2}, {1.0f, NAN, 0.5f, 0.25f});
  Tensor lse = f32_tensor({1, 2}, {NAN, 2.0f});
  EXPECT_TRUE(compare(out, lse, ref).within(Tolerance{}));
  out.ptr<float>()[1] = 3.0f;  // a number where the reference has NaN
  EXPECT_TRUE(compare(out, lse, ref).nan);
  out.ptr<float>()[1] = NAN;
  out.ptr<float>()[2] = NAN;  // NaN where it has a number
  EXPECT_TRUE(compare(out, lse, ref).nan);
  out.ptr<float>()[2] = 0.5f;
  lse.ptr<float>()[0] = 1.0f;
  EXPECT_TRUE(compare(out, lse, ref).nan);
}

TEST(Reference, SoftCapSquashesScoresWithTanh) {
  // Scores 3 and 6, cap 2: 2 tanh(1.5) and 2 tanh(3).
  Tensor q = f32_tensor({1, 1, 2}, {3, 6});
  Tensor k = f32_tensor({2, 1, 2}, {1, 0, 0, 1});
  Tensor v = f32_tensor({2, 1, 2}, {1, 5, -2, 3});
  Tensor qo = Tensor::from_i32({0, 1}), kvp = Tensor::from_i32({0, 2});
  AttentionOptions opt = options(false, 1.0f);
  opt.logits_soft_cap = 2.0f;
  Result r = reference::ragged_attention(q, k, v, qo, kvp, opt);
  expect_row(r, 0, 0, softmax_average({2 * std::tanh(1.5), 2 * std::tanh(3.0)}, {{1, 5}, {-2, 3}}));
}

// D = 1 data shared by the alignment and window cases: keys 0..3 (scores 0..3 with q = 1),
// values 10, 20, 30, 40; two queries, so query row q sits at position 4 - 2 + q.
struct LineCase {
  Tensor q = f32_tensor({2, 1, 1}, {1, 1});
  Tensor k = f32_tensor({4, 1, 1}, {0, 1, 2, 3});
  Tensor v = f32_tensor({4, 1, 1}, {10, 20, 30, 40});
  Tensor qo = Tensor::from_i32({0, 2}), kvp = Tensor::from_i32({0, 4});
  Result run(const AttentionOptions& opt) const {
    return reference::ragged_attention(q, k, v, qo, kvp, opt);
  }
  // Expected row seeing keys [lo, hi].
  static Expected seeing(int lo, int hi) {
    std::vector<double> s;
    std::vector<std::vector<double>> vals;
    for (int j = lo; j <= hi; ++j) {
      s.push_back(j);
      vals.push_back({10.0 * (j + 1)});
    }
    return softmax_average(s, vals);
  }
};

TEST(Reference, CausalWithPrefixAlignsQueriesToTheEnd) {
  LineCase c;
  Result r = c.run(options(true, 1.0f));
  expect_row(r, 0, 0, LineCase::seeing(0, 2));  // position 2
  expect_row(r, 1, 0, LineCase::seeing(0, 3));  // position 3
}

TEST(Reference, WindowLeftBoundsKeysFromBelow) {
  LineCase c;
  AttentionOptions opt = options(true, 1.0f);
  opt.window_left = 1;  // key j visible iff p - 1 <= j (<= p when causal)
  Result r = c.run(opt);
  expect_row(r, 0, 0, LineCase::seeing(1, 2));
  expect_row(r, 1, 0, LineCase::seeing(2, 3));
  // Without causal the window has no upper bound.
  opt.causal = false;
  r = c.run(opt);
  expect_row(r, 0, 0, LineCase::seeing(1, 3));
  expect_row(r, 1, 0, LineCase::seeing(2, 3));
  // window_left = 0 leaves only the diagonal.
  opt.causal = true;
  opt.window_left = 0;
  r = c.run(opt);
  expect_row(r, 0, 0, LineCase::seeing(2, 2));
  expect_row(r, 1, 0, LineCase::seeing(3, 3));
}

TEST(Reference, GqaQueryHeadReadsKvHeadHDivGroup) {
  // Hq = 4, Hkv = 2: heads 0, 1 read KV head 0 (all-zero keys: uniform weights), heads 2, 3
  // read KV head 1 (scores 1, 2, 3). A head % Hkv mapping would swap heads 1 and 2.
  Tensor q = f32_tensor({1, 4, 2}, {1, 2, 1, 2, 1, 2, 1, 2});
  Tensor k = f32_tensor({3, 2, 2}, {0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 1});
  Tensor v = f32_tensor({3, 2, 2}, {0, 0, 1, 0, 1, -1, 1, 2, 2, -2, 1, 4});
  Tensor qo = Tensor::from_i32({0, 1}), kvp = Tensor::from_i32({0, 3});
  Result r = reference::ragged_attention(q, k, v, qo, kvp, options(false, 1.0f));
  const Expected uniform = softmax_average({0, 0, 0}, {{0, 0}, {1, -1}, {2, -2}});
  EXPECT_NEAR(uniform.lse, std::log2(3.0), 1e-15);
  const Expected scored = softmax_average({1, 2, 3}, {{1, 0}, {1, 2}, {1, 4}});
  expect_row(r, 0, 0, uniform);
  expect_row(r, 0, 1, uniform);
  expect_row(r, 0, 2, scored);
  expect_row(r, 0, 3, scored);
}

TEST(Reference, HeadDimOfValuesMayDifferFromKeys) {
  // D_qk = 3, D_v = 2: scores 2 and 0.
  Tensor q = f32_tensor({1, 1, 3}, {1, 0, 1});
  Tensor k = f32_tensor({2, 1, 3}, {1, 1, 1, 0, 1, 0});
  Tensor v = f32_tensor({2, 1, 2}, {1, 2, 3, 4});
  Tensor qo = Tensor::from_i32({0, 1}), kvp = Tensor::from_i32({0, 2});
  Result r = reference::ragged_attention(q, k, v, qo, kvp, options(false, 1.0f));
  EXPECT_EQ(r.head_dim, 2);
  EXPECT_EQ(r.o.size(), 2u);
  expect_row(r, 0, 0, softmax_average({2, 0}, {{1, 2}, {3, 4}}));
  // The default sm_scale follows D_qk, not D_v.
  r = reference::ragged_attention(q, k, v, qo, kvp, options(false));
  expect_row(r, 0, 0, softmax_average({2 / std::sqrt(3.0), 0}, {{1, 2}, {3, 4}}));
}

TEST(Reference, RowsWithoutVisibleKeysGiveZeroAndMinusInfinity) {
  FLASHKV_SEEDED_RNG(rng, 101);
  // Request 0: 2 queries, no KV. Request 1: 3 queries, 1 key, causal: positions -2, -1, 0, so
  // only the last row sees the key.
  const std::vector<int32_t> q_lens = {2, 3}, kv_lens = {0, 1};
  Tensor q = test::random_tensor(rng, {5, 2, 4}, DType::f32);
  Tensor k = test::random_tensor(rng, {1, 1, 4}, DType::f32);
  Tensor v = test::random_tensor(rng, {1, 1, 4}, DType::f32);
  Tensor qo = Tensor::from_i32(test::indptr_of(q_lens));
  Tensor kvp = Tensor::from_i32(test::indptr_of(kv_lens));
  Result r = reference::ragged_attention(q, k, v, qo, kvp, options(true, 0.5f));
  for (int64_t row : {0, 1, 2, 3})
    for (int h = 0; h < 2; ++h) EXPECT_TRUE(is_empty_row(r, row, h)) << "row " << row;
  for (int h = 0; h < 2; ++h) {
    double dot = 0;
    for (int d = 0; d < 4; ++d) dot += q.view().at({4, h, d}) * k.view().at({0, 0, d});
    EXPECT_NEAR(r.lse_at(4, h), 0.5 * dot / kLn2, 1e-12);
    for (int d = 0; d < 4; ++d) EXPECT_DOUBLE_EQ(r.o_at(4, h, d), v.view().at({0, 0, d}));
  }
  // A custom mask row of zeros is empty too, and no NaN appears anywhere.
  AttentionOptions opt = options(false);
  std::vector<int32_t> mask_values = {1, 0, 1};  // request 1: rows 0 and 2 see the key
  Tensor mask = Tensor::empty({3}, DType::u8);
  for (int i = 0; i < 3; ++i) mask.ptr<uint8_t>()[i] = static_cast<uint8_t>(mask_values[i]);
  opt.custom_mask = mask;
  r = reference::ragged_attention(q, k, v, qo, kvp, opt);
  EXPECT_TRUE(is_empty_row(r, 3, 0));
  EXPECT_FALSE(is_empty_row(r, 2, 0));
  EXPECT_FALSE(is_empty_row(r, 4, 1));
  for (double x : r.o) EXPECT_FALSE(std::isnan(x));
  for (double x : r.lse) EXPECT_FALSE(std::isnan(x));
}

TEST(Reference, Fp8KvWithScalesEqualsDequantizedF32) {
  FLASHKV_SEEDED_RNG(rng, 102);
  // Scales with few mantissa bits, so float(fp8) * scale is exact in f32 and the two paths see
  // identical values; scales other than powers of two catch a scale applied to the wrong tensor.
  const float k_scale = 0.75f, v_scale = 1.25f;
  const std::vector<int32_t> q_lens = {3, 1}, kv_lens = {9, 5};
  Tensor q = test::random_tensor(rng, {4, 4, 8}, DType::bf16);
  Tensor qo = Tensor::from_i32(test::indptr_of(q_lens));
  Tensor kvp = Tensor::from_i32(test::indptr_of(kv_lens));
  for (DType fp8 : {DType::fp8_e4m3, DType::fp8_e5m2}) {
    SCOPED_TRACE(dtype_name(fp8));
    Tensor k8 = test::random_tensor(rng, {14, 2, 8}, fp8, 2.0);
    Tensor v8 = test::random_tensor(rng, {14, 2, 8}, fp8, 2.0);
    Tensor kf = Tensor::empty({14, 2, 8}, DType::f32), vf = Tensor::empty({14, 2, 8}, DType::f32);
    for (int64_t i = 0; i < kf.numel(); ++i) {
      kf.ptr<float>()[i] = static_cast<float>(load_as_double(k8.data(), fp8, i)) * k_scale;
      vf.ptr<float>()[i] = static_cast<float>(load_as_double(v8.data(), fp8, i)) * v_scale;
    }
    const AttentionOptions opt = options(true);
    Result want = reference::ragged_attention(q, kf, vf, qo, kvp, opt);
    expect_same(reference::ragged_attention(q, k8, v8, qo, kvp, opt, k_scale, v_scale), want,
                1e-13);
    // Paged form: page size 1, identity slots.
    std::vector<int32_t> slots(14);
    std::iota(slots.begin(), slots.end(), 0);
    Tensor idx = Tensor::from_i32(slots);
    PagedKV kv{k8, v8, kvp, idx, TensorView(), 1, k_scale, v_scale};
    expect_same(reference::paged_attention(q, qo, kv, opt), want, 1e-13);
    // And without the scales the result differs.
    kv.k_scale = kv.v_scale = 1.0f;
    Result unscaled = reference::paged_attention(q, qo, kv, opt);
    EXPECT_GT(std::fabs(unscaled.o[0] - want.o[0]) + std::fabs(unscaled.lse[0] - want.lse[0]),
              1e-3);
  }
}

TEST(Reference, HalfPrecisionInputsAreReadExactly) {
  FLASHKV_SEEDED_RNG(rng, 103);
  const std::vector<int32_t> lens = {6, 3};
  const Tensor qo = Tensor::from_i32(test::indptr_of(lens));
  const TensorView& kvp = qo;  // the same lengths for Q and KV
  for (DType t : {DType::bf16, DType::f16}) {
    Tensor q = test::random_tensor(rng, {9, 2, 16}, t);
    Tensor k = test::random_tensor(rng, {9, 1, 16}, t);
    Tensor v = test::random_tensor(rng, {9, 1, 16}, t);
    auto widen = [](const Tensor& x) {
      Tensor f = Tensor::empty({x.size(0), x.size(1), x.size(2)}, DType::f32);
      for (int64_t i = 0; i < x.numel(); ++i)
        f.ptr<float>()[i] = static_cast<float>(load_as_double(x.data(), x.dtype(), i));
      return f;
    };
    expect_same(reference::ragged_attention(q, k, v, qo, kvp, options(true)),
                reference::ragged_attention(widen(q), widen(k), widen(v), qo, kvp, options(true)),
                0.0);
  }
}

TEST(Reference, StridedViewsAreRead) {
  FLASHKV_SEEDED_RNG(rng, 104);
  // q as every other head of a wider tensor; the result equals that of a packed copy.
  Tensor wide = test::random_tensor(rng, {5, 4, 8}, DType::f32);
  TensorView q = wide.view();
  q.shape[1] = 2;
  q.stride[1] = 2 * 8;
  Tensor packed = Tensor::empty({5, 2, 8}, DType::f32);
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t d = 0; d < 8; ++d)
        packed.ptr<float>()[(r * 2 + h) * 8 + d] = wide.ptr<float>()[(r * 4 + 2 * h) * 8 + d];
  Tensor k = test::random_tensor(rng, {7, 1, 8}, DType::f32);
  Tensor v = test::random_tensor(rng, {7, 1, 8}, DType::f32);
  Tensor qo = Tensor::from_i32({0, 5}), kvp = Tensor::from_i32({0, 7});
  expect_same(reference::ragged_attention(q, k, v, qo, kvp, options(true)),
              reference::ragged_attention(packed, k, v, qo, kvp, options(true)), 0.0);
}

// ---------------------------------------------------------------------------------------------
// Invariants and equivalences on random inputs.

// A random ragged batch: q [sum q_lens, hq, d], k/v [sum kv_lens, hkv, d(_v)].
struct RaggedBatch {
  std::vector<int32_t> q_lens, kv_lens;
  Tensor q, k, v, qo, kvp;
  RaggedBatch(Rng& rng, std::vector<int32_t> ql, std::vector<int32_t> kl, int hq, int hkv, int d,
              int dv = 0)
      : q_lens(std::move(ql)), kv_lens(std::move(kl)) {
    const auto qi = test::indptr_of(q_lens), ki = test::indptr_of(kv_lens);
    q = test::random_tensor(rng, {qi.back(), hq, d}, DType::f32);
    k = test::random_tensor(rng, {ki.back(), hkv, d}, DType::f32);
    v = test::random_tensor(rng, {ki.back(), hkv, dv ? dv : d}, DType::f32);
    qo = Tensor::from_i32(qi);
    kvp = Tensor::from_i32(ki);
  }
  Result run(const AttentionOptions& opt) const {
    return reference::ragged_attention(q, k, v, qo, kvp, opt);
  }
};

TEST(Reference, AddingAConstantToEveryLogitOfARowChangesNothing) {
  FLASHKV_SEEDED_RNG(rng, 201);
  // Every key's last component is 1, so setting the query's last component to c adds
  // c * sm_scale to every logit of the row: O stays, LSE moves by c * sm_scale / ln 2.
  RaggedBatch b(rng, {4, 1, 7}, {9, 6, 7}, 4, 2, 16, 12);
  const int d = 16;
  for (int64_t j = 0; j < b.k.size(0); ++j)
    for (int h = 0; h < 2; ++h) b.k.ptr<float>()[(j * 2 + h) * d + d - 1] = 1.0f;
  const float sm_scale = 0.25f;
  auto with_last = [&](float c) {
    for (int64_t r = 0; r < b.q.size(0); ++r)
      for (int h = 0; h < 4; ++h) b.q.ptr<float>()[(r * 4 + h) * d + d - 1] = c;
    return b.run(options(true, sm_scale));
  };
  const Result base = with_last(0.0f);
  const Result shifted = with_last(12.0f);
  for (size_t i = 0; i < base.o.size(); ++i) EXPECT_NEAR(shifted.o[i], base.o[i], 1e-12);
  for (size_t i = 0; i < base.lse.size(); ++i)
    EXPECT_NEAR(shifted.lse[i], base.lse[i] + 12.0 * sm_scale / kLn2, 1e-12);
}

TEST(Reference, PermutingKvOfANonCausalRowChangesNothing) {
  FLASHKV_SEEDED_RNG(rng, 202);
  RaggedBatch b(rng, {3, 2}, {11, 8}, 6, 3, 8);
  const Result base = b.run(options(false));
  // Permute each request's K/V rows (the same permutation for K and V).
  const auto ki = test::indptr_of(b.kv_lens);
  Tensor k2 = Tensor::empty({b.k.size(0), 3, 8}, DType::f32);
  Tensor v2 = Tensor::empty({b.v.size(0), 3, 8}, DType::f32);
  const int64_t row = 3 * 8;
  for (size_t i = 0; i < b.kv_lens.size(); ++i) {
    std::vector<int> perm(b.kv_lens[i]);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.gen());
    for (int j = 0; j < b.kv_lens[i]; ++j) {
      std::copy_n(b.k.ptr<float>() + (ki[i] + perm[j]) * row, row,
                  k2.ptr<float>() + (ki[i] + j) * row);
      std::copy_n(b.v.ptr<float>() + (ki[i] + perm[j]) * row, row,
                  v2.ptr<float>() + (ki[i] + j) * row);
    }
  }
  expect_same(reference::ragged_attention(b.q, k2, v2, b.qo, b.kvp, options(false)), base, 1e-12);
  // With causal masking the order matters (a sanity check that the permutation did something).
  Result causal_a = b.run(options(true));
  Result causal_b = reference::ragged_attention(b.q, k2, v2, b.qo, b.kvp, options(true));
  double diff = 0;
  for (size_t i = 0; i < causal_a.o.size(); ++i) diff += std::fabs(causal_a.o[i] - causal_b.o[i]);
  EXPECT_GT(diff, 1e-3);
}

TEST(Reference, SplittingKvAndMergingEqualsTheWhole) {
  FLASHKV_SEEDED_RNG(rng, 203);
  // One request, non-causal, KV cut into three parts (one of them empty) at random points.
  const int n = 23;
  RaggedBatch b(rng, {4}, {n}, 4, 2, 8);
  const Result whole = b.run(options(false));
  const int cut1 = rng.uniform_int(1, n - 2), cut2 = rng.uniform_int(cut1 + 1, n - 1);
  std::vector<Result> parts;
  for (auto [lo, hi] :
       {std::pair{0, cut1}, std::pair{cut1, cut1}, std::pair{cut1, cut2}, std::pair{cut2, n}}) {
    Tensor kvp = Tensor::from_i32({lo, hi});
    parts.push_back(reference::ragged_attention(b.q, b.k, b.v, b.qo, kvp, options(false)));
  }
  expect_same(reference::merge_states(parts), whole, 1e-12);
  // Order of the parts does not matter.
  std::reverse(parts.begin(), parts.end());
  expect_same(reference::merge_states(parts), whole, 1e-12);
}

TEST(Reference, MergeIgnoresEmptyStatesAndKeepsAllEmptyRowsEmpty) {
  FLASHKV_SEEDED_RNG(rng, 204);
  RaggedBatch b(rng, {2, 2}, {5, 0}, 2, 1, 4);  // request 1 has no KV: its rows are empty
  const Result full = b.run(options(false));
  Result empty = full;
  std::fill(empty.o.begin(), empty.o.end(), 0.0);
  std::fill(empty.lse.begin(), empty.lse.end(), -kInf);
  const Result merged = reference::merge_states({empty, full, empty});
  expect_same(merged, full, 1e-15);
  for (int64_t row : {2, 3})
    for (int h = 0; h < 2; ++h) EXPECT_TRUE(is_empty_row(merged, row, h));
  // A single state merges to itself.
  expect_same(reference::merge_states({full}), full, 0.0);
}

TEST(Reference, MergeOfTwoStatesFollowsTheFormula) {
  // (O_a, LSE_a) = (1, 1), (O_b, LSE_b) = (3, 2): LSE = log2(2 + 4), weights 2/6 and 4/6.
  Result a, b;
  a.rows = b.rows = 1;
  a.heads = b.heads = 1;
  a.head_dim = b.head_dim = 1;
  a.o = {1};
  a.lse = {1};
  b.o = {3};
  b.lse = {2};
  const Result m = reference::merge_states({a, b});
  EXPECT_NEAR(m.lse[0], std::log2(6.0), 1e-15);
  EXPECT_NEAR(m.o[0], (2.0 * 1 + 4.0 * 3) / 6.0, 1e-15);
}

// A u8 mask tensor from per-request predicates allowed(i, q, j), packed back to back.
template <typename Allowed>
Tensor build_mask(const std::vector<int32_t>& q_lens, const std::vector<int32_t>& kv_lens,
                  Allowed allowed) {
  int64_t total = 0;
  for (size_t i = 0; i < q_lens.size(); ++i) total += int64_t{q_lens[i]} * kv_lens[i];
  Tensor m = Tensor::empty({std::max<int64_t>(total, 1)}, DType::u8);
  int64_t at = 0;
  for (size_t i = 0; i < q_lens.size(); ++i)
    for (int32_t q = 0; q < q_lens[i]; ++q)
      for (int32_t j = 0; j < kv_lens[i]; ++j) m.ptr<uint8_t>()[at++] = allowed(i, q, j) ? 1 : 0;
  return m;
}

TEST(Reference, CausalSquareEqualsLowerTriangularMask) {
  FLASHKV_SEEDED_RNG(rng, 205);
  const std::vector<int32_t> lens = {1, 7, 16, 5};
  RaggedBatch b(rng, lens, lens, 4, 4, 8);
  AttentionOptions masked = options(false);
  Tensor mask = build_mask(lens, lens, [](size_t, int32_t q, int32_t j) { return j <= q; });
  masked.custom_mask = mask;
  expect_same(b.run(masked), b.run(options(true)), 0.0);
}

TEST(Reference, CausalWithPrefixEqualsShiftedTriangularMask) {
  FLASHKV_SEEDED_RNG(rng, 206);
  // Query row q of a request sits at kv_len - q_len + q; includes q_len > kv_len (the first
  // rows see nothing).
  const std::vector<int32_t> q_lens = {3, 5, 4, 6}, kv_lens = {10, 5, 17, 2};
  RaggedBatch b(rng, q_lens, kv_lens, 2, 1, 8);
  Tensor mask = build_mask(q_lens, kv_lens, [&](size_t i, int32_t q, int32_t j) {
    return j <= kv_lens[i] - q_lens[i] + q;
  });
  AttentionOptions masked = options(false);
  masked.custom_mask = mask;
  expect_same(b.run(masked), b.run(options(true)), 0.0);
  // The same with a window: the mask gets a lower bound too, and a mask keeps the window.
  AttentionOptions win = options(true);
  win.window_left = 2;
  Tensor band = build_mask(q_lens, kv_lens, [&](size_t i, int32_t q, int32_t j) {
    const int32_t p = kv_lens[i] - q_lens[i] + q;
    return j <= p && j >= p - 2;
  });
  AttentionOptions band_opt = options(false);
  band_opt.custom_mask = band;
  expect_same(b.run(band_opt), b.run(win), 0.0);
  masked.window_left = 2;
  expect_same(b.run(masked), b.run(win), 0.0);
}

TEST(Reference, MaskIndptrLocatesEachRequestsMatrix) {
  FLASHKV_SEEDED_RNG(rng, 207);
  const std::vector<int32_t> q_lens = {2, 3}, kv_lens = {4, 5};
  RaggedBatch b(rng, q_lens, kv_lens, 2, 2, 8);
  Tensor packed =
      build_mask(q_lens, kv_lens, [&](size_t, int32_t, int32_t) { return rng.uniform() < 0.6; });
  AttentionOptions opt = options(false);
  opt.custom_mask = packed;
  const Result want = b.run(opt);
  // The same matrices stored in reverse order with a gap, located through mask_indptr.
  const int64_t n0 = 2 * 4, n1 = 3 * 5, gap = 3;
  Tensor spread = Tensor::empty({n1 + gap + n0}, DType::u8);
  std::fill_n(spread.ptr<uint8_t>(), spread.numel(), uint8_t{1});
  std::copy_n(packed.ptr<uint8_t>() + n0, n1, spread.ptr<uint8_t>());
  std::copy_n(packed.ptr<uint8_t>(), n0, spread.ptr<uint8_t>() + n1 + gap);
  Tensor mask_indptr = Tensor::from_i32({static_cast<int32_t>(n1 + gap), 0, 0});
  opt.custom_mask = spread;
  opt.mask_indptr = mask_indptr;
  expect_same(b.run(opt), want, 0.0);
}

TEST(Reference, ExplicitSmScaleEqualsScalingQueries) {
  FLASHKV_SEEDED_RNG(rng, 208);
  RaggedBatch b(rng, {3, 4}, {5, 9}, 2, 1, 8);
  const Result want = b.run(options(true, 0.5f));
  Tensor q2 = Tensor::empty({7, 2, 8}, DType::f32);
  for (int64_t i = 0; i < q2.numel(); ++i) q2.ptr<float>()[i] = b.q.ptr<float>()[i] * 0.5f;
  expect_same(reference::ragged_attention(q2, b.k, b.v, b.qo, b.kvp, options(true, 1.0f)), want,
              1e-14);
}

// K/V of a ragged batch copied into a paged pool: each request's tokens on pages drawn from a
// shuffled page list, unused slots (including the tails of last pages) NaN.
struct PagedCopy {
  Tensor k, v, indptr, indices, last_page_len;
  PagedKV kv(int page_size) const {
    return PagedKV{
        k, v, indptr, indices, page_size > 1 ? last_page_len.view() : TensorView(), page_size};
  }
};
PagedCopy to_paged(Rng& rng, const Tensor& k, const Tensor& v, const std::vector<int32_t>& kv_lens,
                   int page_size) {
  const int64_t hkv = k.size(1), dk = k.size(2), dv = v.size(2);
  std::vector<int32_t> pages_of(kv_lens.size()), last(kv_lens.size());
  int32_t num_pages = 3;  // spare pages nobody owns
  for (size_t i = 0; i < kv_lens.size(); ++i) {
    pages_of[i] = (kv_lens[i] + page_size - 1) / page_size;
    last[i] = kv_lens[i] == 0 ? 0 : kv_lens[i] - (pages_of[i] - 1) * page_size;
    num_pages += pages_of[i];
  }
  std::vector<int32_t> order(num_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng.gen());
  PagedCopy p;
  p.k = Tensor::empty({int64_t{num_pages} * page_size, hkv, dk}, k.dtype());
  p.v = Tensor::empty({int64_t{num_pages} * page_size, hkv, dv}, v.dtype());
  test::poison(p.k);
  test::poison(p.v);
  std::vector<int32_t> indices;
  int64_t src = 0;
  for (size_t i = 0; i < kv_lens.size(); ++i) {
    for (int32_t pg = 0; pg < pages_of[i]; ++pg) indices.push_back(order[indices.size()]);
    for (int32_t j = 0; j < kv_lens[i]; ++j, ++src) {
      const int64_t page = indices[indices.size() - pages_of[i] + j / page_size];
      const int64_t slot = page * page_size + j % page_size;
      const size_t es = dtype_size(k.dtype());
      std::memcpy(static_cast<char*>(p.k.data()) + slot * hkv * dk * es,
                  static_cast<const char*>(k.data()) + src * hkv * dk * es, hkv * dk * es);
      std::memcpy(static_cast<char*>(p.v.data()) + slot * hkv * dv * es,
                  static_cast<const char*>(v.data()) + src * hkv * dv * es, hkv * dv * es);
    }
  }
  p.indptr = Tensor::from_i32(test::indptr_of(pages_of));
  p.indices = Tensor::from_i32(indices);
  p.last_page_len = Tensor::from_i32(last);
  return p;
}

TEST(Reference, PagedWithShuffledPagesEqualsRaggedOverTheGatheredKv) {
  FLASHKV_SEEDED_RNG(rng, 209);
  const std::vector<int32_t> q_lens = {1, 5, 3, 0, 7}, kv_lens = {1, 17, 33, 4, 16};
  RaggedBatch b(rng, q_lens, kv_lens, 8, 2, 16, 8);
  for (int page_size : {1, 16, 5}) {
    SCOPED_TRACE(testing::Message() << "page_size " << page_size);
    const PagedCopy paged = to_paged(rng, b.k, b.v, kv_lens, page_size);
    for (bool causal : {true, false}) {
      AttentionOptions opt = options(causal);
      opt.logits_soft_cap = causal ? 0.0f : 3.0f;
      opt.window_left = causal ? 6 : -1;
      expect_same(reference::paged_attention(b.q, b.qo, paged.kv(page_size), opt), b.run(opt), 0.0);
    }
  }
}

TEST(Reference, PagedDecodeIsOneQueryRowPerRequest) {
  FLASHKV_SEEDED_RNG(rng, 210);
  const std::vector<int32_t> kv_lens = {7, 0, 30, 1};
  RaggedBatch b(rng, {1, 1, 1, 1}, kv_lens, 4, 1, 8);
  const PagedCopy paged = to_paged(rng, b.k, b.v, kv_lens, 4);
  const Result with_indptr = reference::paged_attention(b.q, b.qo, paged.kv(4), options(true));
  expect_same(reference::paged_attention(b.q, TensorView(), paged.kv(4), options(true)),
              with_indptr, 0.0);
  expect_same(with_indptr, b.run(options(false)), 0.0);  // a last-position query sees everything
  for (int h = 0; h < 4; ++h) EXPECT_TRUE(is_empty_row(with_indptr, 1, h));
}

TEST(Reference, SameBitsOnThePoolAsOnOneThread) {
  FLASHKV_SEEDED_RNG(rng, 211);
  // The pool computes a group of requests (4 a thread) at a time, in items of one query row and
  // a range of its heads (every head when there are many rows; a few rows have their heads
  // split); called from a pool worker, the reference runs serially. Many requests with row
  // counts of 0 - 13, and a check-like batch of 3 rows of long contexts; a window and GQA.
  const std::vector<std::vector<int32_t>> q_lens = {{13, 1, 0, 6, 9, 1, 1, 2, 5, 1, 0, 3, 1},
                                                    {2, 1}};
  const std::vector<std::vector<int32_t>> kv_lens = {{40, 3, 5, 6, 64, 0, 17, 9, 5, 33, 2, 3, 1},
                                                     {700, 300}};
  for (size_t c = 0; c < q_lens.size(); ++c) {
    SCOPED_TRACE(testing::Message() << "batch " << c);
    RaggedBatch b(rng, q_lens[c], kv_lens[c], 8, 2, 24, 16);
    AttentionOptions opt = options(true);
    opt.window_left = c == 0 ? 20 : 500;
    const Result pooled = b.run(opt);
    Result serial;
    ThreadPool other(2);
    other.parallel_for(2, [&](int64_t i, int) {
      if (i == 0) serial = b.run(opt);
    });
    ASSERT_EQ(serial.o.size(), pooled.o.size());
    ASSERT_EQ(serial.lse.size(), pooled.lse.size());
    EXPECT_EQ(std::memcmp(serial.o.data(), pooled.o.data(), pooled.o.size() * sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(serial.lse.data(), pooled.lse.data(), pooled.lse.size() * sizeof(double)),
              0);
    // And the rows are what the reference gives request by request.
    const auto qi = test::indptr_of(q_lens[c]), ki = test::indptr_of(kv_lens[c]);
    for (size_t i = 0; i < q_lens[c].size(); ++i) {
      const Result one = reference::ragged_attention(
          b.q.view().rows(qi[i], qi[i + 1]), b.k.view().rows(ki[i], ki[i + 1]),
          b.v.view().rows(ki[i], ki[i + 1]), Tensor::from_i32({0, q_lens[c][i]}),
          Tensor::from_i32({0, kv_lens[c][i]}), opt);
      for (int64_t r = 0; r < q_lens[c][i]; ++r)
        for (int h = 0; h < 8; ++h) {
          EXPECT_EQ(one.lse_at(r, h), pooled.lse_at(qi[i] + r, h));
          for (int d = 0; d < 16; ++d) EXPECT_EQ(one.o_at(r, h, d), pooled.o_at(qi[i] + r, h, d));
        }
    }
  }
}

TEST(Reference, EachCausalRowEqualsADecodeOverItsVisiblePrefix) {
  FLASHKV_SEEDED_RNG(rng, 211);
  const int q_len = 5, kv_len = 12;
  RaggedBatch b(rng, {q_len}, {kv_len}, 4, 2, 8);
  const Result prefill = b.run(options(true));
  for (int qi = 0; qi < q_len; ++qi) {
    const int pos = kv_len - q_len + qi;
    TensorView q_row = b.q.view().rows(qi, qi + 1);
    Tensor kvp = Tensor::from_i32({0, pos + 1}), qo1 = Tensor::from_i32({0, 1});
    const Result decode = reference::ragged_attention(q_row, b.k, b.v, qo1, kvp, options(false));
    for (int h = 0; h < 4; ++h) {
      for (int d = 0; d < 8; ++d) EXPECT_NEAR(prefill.o_at(qi, h, d), decode.o_at(0, h, d), 1e-15);
      EXPECT_NEAR(prefill.lse_at(qi, h), decode.lse_at(0, h), 1e-15);
    }
  }
}

TEST(Reference, ExtendEqualsCausalNewTokensMergedWithThePrefix) {
  FLASHKV_SEEDED_RNG(rng, 212);
  // docs/SEMANTICS.md: extend = ragged causal attention over the new tokens, merged with non-causal
  // paged attention over the cached prefix. Prefix lengths include 0.
  const std::vector<int32_t> new_lens = {4, 1, 6}, prefix_lens = {9, 0, 20};
  std::vector<int32_t> total(3);
  for (int i = 0; i < 3; ++i) total[i] = new_lens[i] + prefix_lens[i];
  RaggedBatch all(rng, new_lens, total, 4, 2, 8);
  const PagedCopy paged_all = to_paged(rng, all.k, all.v, total, 1);
  const Result want = reference::paged_attention(all.q, all.qo, paged_all.kv(1), options(true));
  // Split all.k/v (request-major, prefix then new) into prefix and new tensors.
  const auto ti = test::indptr_of(total);
  const auto ni = test::indptr_of(new_lens), pi = test::indptr_of(prefix_lens);
  const int64_t row = 2 * 8;
  Tensor kn = Tensor::empty({ni.back(), 2, 8}, DType::f32),
         vn = Tensor::empty({ni.back(), 2, 8}, DType::f32);
  Tensor kp = Tensor::empty({pi.back(), 2, 8}, DType::f32),
         vp = Tensor::empty({pi.back(), 2, 8}, DType::f32);
  for (int i = 0; i < 3; ++i) {
    std::copy_n(all.k.ptr<float>() + ti[i] * row, prefix_lens[i] * row,
                kp.ptr<float>() + pi[i] * row);
    std::copy_n(all.v.ptr<float>() + ti[i] * row, prefix_lens[i] * row,
                vp.ptr<float>() + pi[i] * row);
    std::copy_n(all.k.ptr<float>() + (ti[i] + prefix_lens[i]) * row, new_lens[i] * row,
                kn.ptr<float>() + ni[i] * row);
    std::copy_n(all.v.ptr<float>() + (ti[i] + prefix_lens[i]) * row, new_lens[i] * row,
                vn.ptr<float>() + ni[i] * row);
  }
  Tensor new_indptr = Tensor::from_i32(ni);
  const Result ragged =
      reference::ragged_attention(all.q, kn, vn, all.qo, new_indptr, options(true));
  const PagedCopy prefix = to_paged(rng, kp, vp, prefix_lens, 16);
  const Result cached = reference::paged_attention(all.q, all.qo, prefix.kv(16), options(false));
  expect_same(reference::merge_states({ragged, cached}), want, 1e-12);
}

// ---------------------------------------------------------------------------------------------
// Argument checks: each bad argument throws flashkv::Error naming it.

template <typename Fn>
void expect_error_naming(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no flashkv::Error thrown (expected one mentioning '" << needle << "')";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not mention '" << needle << "'";
  }
}

TEST(ReferenceArgs, RaggedRejectsBadTensors) {
  FLASHKV_SEEDED_RNG(rng, 301);
  RaggedBatch b(rng, {2, 3}, {4, 5}, 4, 2, 8);
  const AttentionOptions opt = options(true);
  Tensor q_int = Tensor::empty({5, 4, 8}, DType::i32);
  expect_error_naming([&] { reference::ragged_attention(q_int, b.k, b.v, b.qo, b.kvp, opt); },
                      "q: expected dtype");
  Tensor q2d = Tensor::empty({5, 32}, DType::f32);
  expect_error_naming([&] { reference::ragged_attention(q2d, b.k, b.v, b.qo, b.kvp, opt); },
                      "q: expected 3 dims");
  Tensor k_wrong_d = test::random_tensor(rng, {9, 2, 4}, DType::f32);
  expect_error_naming([&] { reference::ragged_attention(b.q, k_wrong_d, b.v, b.qo, b.kvp, opt); },
                      "k: expected size 8 (head_dim_qk)");
  Tensor v_bf16 = test::random_tensor(rng, {9, 2, 8}, DType::bf16);
  expect_error_naming([&] { reference::ragged_attention(b.q, b.k, v_bf16, b.qo, b.kvp, opt); },
                      "v: expected dtype f32");
  Tensor v_short = test::random_tensor(rng, {8, 2, 8}, DType::f32);
  expect_error_naming([&] { reference::ragged_attention(b.q, b.k, v_short, b.qo, b.kvp, opt); },
                      "v: expected size 9");
  Tensor k3 = test::random_tensor(rng, {9, 3, 8}, DType::f32),
         v3 = test::random_tensor(rng, {9, 3, 8}, DType::f32);
  expect_error_naming([&] { reference::ragged_attention(b.q, k3, v3, b.qo, b.kvp, opt); },
                      "num_qo_heads");
  // A tensor that claims to live on a GPU is rejected before any read.
  TensorView q_gpu = b.q.view();
  q_gpu.device = Device::cuda(0);
  expect_error_naming([&] { reference::ragged_attention(q_gpu, b.k, b.v, b.qo, b.kvp, opt); },
                      "q: expected device cpu");
}

TEST(ReferenceArgs, RaggedRejectsBadIndptr) {
  FLASHKV_SEEDED_RNG(rng, 302);
  RaggedBatch b(rng, {2, 3}, {4, 5}, 4, 2, 8);
  const AttentionOptions opt = options(true);
  Tensor qo_past = Tensor::from_i32({0, 2, 6});
  expect_error_naming([&] { reference::ragged_attention(b.q, b.k, b.v, qo_past, b.kvp, opt); },
                      "qo_indptr: request 1");
  Tensor kv_past = Tensor::from_i32({0, 4, 10});
  expect_error_naming([&] { reference::ragged_attention(b.q, b.k, b.v, b.qo, kv_past, opt); },
                      "kv_indptr: request 1");
  Tensor kv_decreasing = Tensor::from_i32({0, 5, 4});
  expect_error_naming([&] { reference::ragged_attention(b.q, b.k, b.v, b.qo, kv_decreasing, opt); },
                      "kv_indptr");
  Tensor kv_negative = Tensor::from_i32({-1, 4, 9});
  expect_error_naming([&] { reference::ragged_attention(b.q, b.k, b.v, b.qo, kv_negative, opt); },
                      "kv_indptr: request 0");
  Tensor kv_count = Tensor::from_i32({0, 9});
  expect_error_naming([&] { reference::ragged_attention(b.q, b.k, b.v, b.qo, kv_count, opt); },
                      "kv_indptr: expected size 3");
  Tensor qo_empty = Tensor::empty({0}, DType::i32);
  expect_error_naming([&] { reference::ragged_attention(b.q, b.k, b.v, qo_empty, qo_empty, opt); },
                      "qo_indptr: expected size >= 1");
  Tensor qo_float = Tensor::empty({3}, DType::f32);
  expect_error_naming([&] { reference::ragged_attention(b.q, b.k, b.v, qo_float, b.kvp, opt); },
                      "qo_indptr: expected dtype i32/i64");
}

TEST(ReferenceArgs, RejectsBadCustomMask) {
  FLASHKV_SEEDED_RNG(rng, 303);
  RaggedBatch b(rng, {2, 3}, {4, 5}, 4, 2, 8);
  AttentionOptions opt = options(false);
  Tensor small = Tensor::empty({2 * 4 + 3 * 5 - 1}, DType::u8);
  std::fill_n(small.ptr<uint8_t>(), small.numel(), uint8_t{1});
  opt.custom_mask = small;
  expect_error_naming([&] { b.run(opt); }, "custom_mask: request 1");
  Tensor wrong_type = Tensor::empty({23}, DType::i32);
  opt.custom_mask = wrong_type;
  expect_error_naming([&] { b.run(opt); }, "custom_mask: expected dtype u8");
  Tensor ok = Tensor::empty({23}, DType::u8);
  std::fill_n(ok.ptr<uint8_t>(), ok.numel(), uint8_t{1});
  opt.custom_mask = ok;
  Tensor short_indptr = Tensor::from_i32({0, 8});
  opt.mask_indptr = short_indptr;
  expect_error_naming([&] { b.run(opt); }, "mask_indptr: expected size >= 3");
  Tensor far_indptr = Tensor::from_i32({0, 9, 23});
  opt.mask_indptr = far_indptr;
  expect_error_naming([&] { b.run(opt); }, "custom_mask: request 1");
}

TEST(ReferenceArgs, PagedRejectsBadIndices) {
  FLASHKV_SEEDED_RNG(rng, 304);
  const std::vector<int32_t> kv_lens = {5, 9};
  RaggedBatch b(rng, {1, 1}, kv_lens, 2, 1, 8);
  PagedCopy p = to_paged(rng, b.k, b.v, kv_lens, 4);
  const AttentionOptions opt = options(true);
  PagedKV kv = p.kv(4);
  EXPECT_NO_THROW(reference::paged_attention(b.q, TensorView(), kv, opt));
  Tensor bad_idx = Tensor::from_i32({0, 1, 2, 3, 1000});
  kv.indices = bad_idx;
  expect_error_naming([&] { reference::paged_attention(b.q, TensorView(), kv, opt); },
                      "kv.indices: request 1");
  kv = p.kv(4);
  Tensor short_idx = Tensor::from_i32({0, 1, 2});
  kv.indices = short_idx;
  expect_error_naming([&] { reference::paged_attention(b.q, TensorView(), kv, opt); },
                      "kv.indptr: request 1");
  kv = p.kv(4);
  kv.last_page_len = TensorView();
  expect_error_naming([&] { reference::paged_attention(b.q, TensorView(), kv, opt); },
                      "kv.last_page_len");
  Tensor lpl_big = Tensor::from_i32({1, 5});
  kv.last_page_len = lpl_big;
  expect_error_naming([&] { reference::paged_attention(b.q, TensorView(), kv, opt); },
                      "kv.last_page_len: request 1");
  kv = p.kv(4);
  kv.page_size = 0;
  expect_error_naming([&] { reference::paged_attention(b.q, TensorView(), kv, opt); },
                      "kv.page_size");
  kv = p.kv(4);
  Tensor q3 = test::random_tensor(rng, {3, 2, 8}, DType::f32);
  expect_error_naming([&] { reference::paged_attention(q3, TensorView(), kv, opt); },
                      "q: expected size 2");
  Tensor qo_short = Tensor::from_i32({0, 1});
  expect_error_naming([&] { reference::paged_attention(b.q, qo_short, kv, opt); },
                      "qo_indptr: expected size 3");
}

TEST(ReferenceArgs, MergeRejectsMismatchedStates) {
  FLASHKV_SEEDED_RNG(rng, 305);
  RaggedBatch a(rng, {2}, {3}, 2, 1, 4), c(rng, {3}, {3}, 2, 1, 4);
  expect_error_naming([&] { reference::merge_states({}); }, "at least one state");
  expect_error_naming(
      [&] {
        reference::merge_states({a.run(options(false)), c.run(options(false))});
      },
      "state 1");
}

// ---------------------------------------------------------------------------------------------
// Attention sinks: one more logit per query head in the softmax denominator, with no value.

// softmax_average with a sink: O = sum_j e^s_j v_j / (sum_j e^s_j + e^sink),
// LSE = log2(sum_j e^s_j + e^sink).
Expected with_sink(const std::vector<double>& scores,
                   const std::vector<std::vector<double>>& values, double sink, size_t dim) {
  Expected e{std::vector<double>(dim, 0.0), 0};
  double sum = std::exp(sink);
  for (size_t j = 0; j < scores.size(); ++j) {
    sum += std::exp(scores[j]);
    for (size_t d = 0; d < dim; ++d) e.o[d] += std::exp(scores[j]) * values[j][d];
  }
  for (double& x : e.o) x /= sum;
  e.lse = std::log(sum) / kLn2;
  return e;
}

TEST(ReferenceSinks, OneKeyAndASink) {
  // Score 2.5, sink 1: O = v * e^2.5 / (e^2.5 + e), LSE = log2(e^2.5 + e).
  Tensor q = f32_tensor({1, 1, 2}, {1, 1});
  Tensor k = f32_tensor({1, 1, 2}, {2, 0.5f});
  Tensor v = f32_tensor({1, 1, 2}, {-3, 7});
  Tensor qo = Tensor::from_i32({0, 1}), kvp = Tensor::from_i32({0, 1});
  Tensor sinks = f32_tensor({1}, {1.0f});
  AttentionOptions opt = options(true, 1.0f);
  opt.sinks = sinks;
  Result r = reference::ragged_attention(q, k, v, qo, kvp, opt);
  const double w = std::exp(2.5) / (std::exp(2.5) + std::exp(1.0));
  EXPECT_NEAR(r.o_at(0, 0, 0), -3.0 * w, 1e-14);
  EXPECT_NEAR(r.o_at(0, 0, 1), 7.0 * w, 1e-14);
  EXPECT_NEAR(r.lse_at(0, 0), std::log(std::exp(2.5) + std::exp(1.0)) / kLn2, 1e-14);
  expect_row(r, 0, 0, with_sink({2.5}, {{-3, 7}}, 1.0, 2));
  // A sink of -inf is no sink.
  sinks.ptr<float>()[0] = -std::numeric_limits<float>::infinity();
  Result none = reference::ragged_attention(q, k, v, qo, kvp, opt);
  EXPECT_DOUBLE_EQ(none.o_at(0, 0, 0), -3.0);
  EXPECT_NEAR(none.lse_at(0, 0), 2.5 / kLn2, 1e-14);
}

TEST(ReferenceSinks, EmptyKvGivesZeroAndTheSinkAsLse) {
  // Request 0 has no KV, request 1 one key; heads 0 and 1 have sinks 0.5 and -2.
  Tensor q = f32_tensor({2, 2, 1}, {1, 1, 1, 1});
  Tensor k = f32_tensor({1, 1, 1}, {3});
  Tensor v = f32_tensor({1, 1, 1}, {5});
  Tensor qo = Tensor::from_i32({0, 1, 2}), kvp = Tensor::from_i32({0, 0, 1});
  Tensor sinks = f32_tensor({2}, {0.5f, -2.0f});
  AttentionOptions opt = options(true, 1.0f);
  opt.sinks = sinks;
  Result r = reference::ragged_attention(q, k, v, qo, kvp, opt);
  for (int h = 0; h < 2; ++h) {
    const double sink = h == 0 ? 0.5 : -2.0;
    EXPECT_EQ(r.o_at(0, h, 0), 0.0);
    EXPECT_NEAR(r.lse_at(0, h), sink / kLn2, 1e-15);  // log2(e^sink): base 2
    expect_row(r, 1, h, with_sink({3.0}, {{5}}, sink, 1));
  }
  // The paged form, decode (one row per request), agrees.
  Tensor indptr = Tensor::from_i32({0, 0, 1}), indices = Tensor::from_i32({0});
  PagedKV kv;
  kv.k = k;
  kv.v = v;
  kv.indptr = indptr;
  kv.indices = indices;
  Result p = reference::paged_attention(q, TensorView(), kv, opt);
  expect_same(p, r, 1e-15);
}

TEST(ReferenceSinks, SoftCapAppliesToScoresNotToTheSink) {
  // Scores 3 and 6, cap 2: 2 tanh(1.5) and 2 tanh(3); the sink 1.5 stays 1.5.
  Tensor q = f32_tensor({1, 1, 2}, {3, 6});
  Tensor k = f32_tensor({2, 1, 2}, {1, 0, 0, 1});
  Tensor v = f32_tensor({2, 1, 2}, {1, 5, -2, 3});
  Tensor qo = Tensor::from_i32({0, 1}), kvp = Tensor::from_i32({0, 2});
  Tensor sinks = f32_tensor({1}, {1.5f});
  AttentionOptions opt = options(false, 1.0f);
  opt.logits_soft_cap = 2.0f;
  opt.sinks = sinks;
  Result r = reference::ragged_attention(q, k, v, qo, kvp, opt);
  expect_row(r, 0, 0,
             with_sink({2 * std::tanh(1.5), 2 * std::tanh(3.0)}, {{1, 5}, {-2, 3}}, 1.5, 2));
}

TEST(ReferenceSinks, WindowLimitsTheKeysAndTheSinkStays) {
  LineCase c;
  Tensor sinks = f32_tensor({1}, {2.0f});
  AttentionOptions opt = options(true, 1.0f);
  opt.window_left = 1;
  opt.sinks = sinks;
  Result r = c.run(opt);
  expect_row(r, 0, 0, with_sink({1, 2}, {{20}, {30}}, 2.0, 1));
  expect_row(r, 1, 0, with_sink({2, 3}, {{30}, {40}}, 2.0, 1));
}

TEST(ReferenceSinks, EachQueryHeadTakesItsOwnSinkUnderGqa) {
  // Hq = 4, Hkv = 2 as in the GQA case above; sinks differ per query head.
  Tensor q = f32_tensor({1, 4, 2}, {1, 2, 1, 2, 1, 2, 1, 2});
  Tensor k = f32_tensor({3, 2, 2}, {0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 1});
  Tensor v = f32_tensor({3, 2, 2}, {0, 0, 1, 0, 1, -1, 1, 2, 2, -2, 1, 4});
  Tensor qo = Tensor::from_i32({0, 1}), kvp = Tensor::from_i32({0, 3});
  Tensor sinks = f32_tensor({4}, {-1, 0, 1, 2});
  AttentionOptions opt = options(false, 1.0f);
  opt.sinks = sinks;
  Result r = reference::ragged_attention(q, k, v, qo, kvp, opt);
  for (int h = 0; h < 4; ++h) {
    const std::vector<double> s =
        h < 2 ? std::vector<double>{0, 0, 0} : std::vector<double>{1, 2, 3};
    const std::vector<std::vector<double>> vals =
        h < 2 ? std::vector<std::vector<double>>{{0, 0}, {1, -1}, {2, -2}}
              : std::vector<std::vector<double>>{{1, 0}, {1, 2}, {1, 4}};
    expect_row(r, 0, h, with_sink(s, vals, h - 1.0, 2));
  }
}

TEST(ReferenceSinks, SinkIsTheStateZeroAndSinkInBase2MergedOnce) {
  FLASHKV_SEEDED_RNG(rng, 207);
  // Split KV: the parts without the sink, merged with one part that has it, equal the whole.
  const int n = 19;
  RaggedBatch b(rng, {3, 5}, {n, 7}, 4, 2, 8);
  Tensor sinks = test::random_tensor(rng, {4}, DType::f32);
  AttentionOptions with = options(true);
  with.sinks = sinks;
  const Result whole = b.run(with);
  Result plain = b.run(options(true));
  // The sink alone: O = 0, LSE = sink * log2(e).
  Result sink_state = plain;
  for (int64_t row = 0; row < plain.rows; ++row)
    for (int h = 0; h < 4; ++h) {
      for (int d = 0; d < plain.head_dim; ++d) sink_state.o[(row * 4 + h) * plain.head_dim + d] = 0;
      sink_state.lse[row * 4 + h] = sinks.ptr<float>()[h] / kLn2;
    }
  expect_same(reference::merge_states({plain, sink_state}), whole, 1e-12);
  // Extend form: causal new tokens (with the sink) merged with the non-causal prefix (without).
  RaggedBatch one(rng, {4}, {n}, 4, 2, 8);
  const Result full = one.run(with);
  const int prefix = n - 4;
  TensorView k_new = one.k.view().rows(prefix, n), v_new = one.v.view().rows(prefix, n);
  TensorView k_old = one.k.view().rows(0, prefix), v_old = one.v.view().rows(0, prefix);
  Tensor qo = Tensor::from_i32({0, 4});
  const Result news = reference::ragged_attention(one.q, k_new, v_new, qo, qo, with);
  AttentionOptions prefix_opt = options(false);
  const Result old = reference::ragged_attention(one.q, k_old, v_old, qo,
                                                 Tensor::from_i32({0, prefix}), prefix_opt);
  expect_same(reference::merge_states({news, old}), full, 1e-12);
}

TEST(ReferenceArgs, RejectsBadSinks) {
  FLASHKV_SEEDED_RNG(rng, 305);
  RaggedBatch b(rng, {2, 3}, {4, 5}, 4, 2, 8);
  AttentionOptions opt = options(true);
  Tensor bf = test::random_tensor(rng, {4}, DType::bf16);
  opt.sinks = bf;
  expect_error_naming([&] { b.run(opt); }, "sinks: expected dtype f32");
  Tensor short_sinks = test::random_tensor(rng, {2}, DType::f32);
  opt.sinks = short_sinks;
  expect_error_naming([&] { b.run(opt); }, "sinks: expected size 4");
  Tensor two_d = test::random_tensor(rng, {1, 4}, DType::f32);
  opt.sinks = two_d;
  expect_error_naming([&] { b.run(opt); }, "sinks: expected 1 dims");
}

}  // namespace
}  // namespace flashkv
