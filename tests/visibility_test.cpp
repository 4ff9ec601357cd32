// core/visibility.h against the rule as docs/SEMANTICS.md states it, checked by brute force over
// every (row, key) pair of random and edge-case requests.
#include "flashkv/core/visibility.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "test_util.h"

namespace flashkv {
namespace {

// The rule written out as SEMANTICS.md has it: row q of a request with qo_len rows and kv_len
// keys sits at kv_len - qo_len + q; key j is allowed iff (!causal || j <= p) and
// (window_left < 0 || j >= p - window_left).
bool brute_visible(int64_t qo_len, int64_t kv_len, int64_t row, int64_t j, bool causal,
                   int64_t window_left) {
  const int64_t p = kv_len - qo_len + row;
  bool ok = true;
  if (causal && j > p) ok = false;
  if (window_left >= 0 && j < p - window_left) ok = false;
  return ok;
}

struct Case {
  int64_t qo_len, kv_len, window_left;
  bool causal;
};

std::vector<Case> cases(test::Rng& rng) {
  std::vector<Case> out;
  // Edge cases: empty requests, one key, windows of 0 / negative / wider than the request, more
  // rows than keys (rows at negative positions).
  for (int64_t q : {0, 1, 2, 5})
    for (int64_t kv : {0, 1, 2, 5, 9})
      for (int64_t w : {-7, -1, 0, 1, 3, 100})
        for (bool c : {false, true}) out.push_back({q, kv, w, c});
  for (int i = 0; i < 400; ++i) {
    const int64_t kv = rng.uniform_int(0, 80);
    const int64_t q = rng.uniform_int(0, 1) ? rng.uniform_int(0, kv) : rng.uniform_int(0, 90);
    const int64_t w = rng.uniform_int(0, 3) == 0 ? -rng.uniform_int(1, 5) : rng.uniform_int(0, 60);
    out.push_back({q, kv, w, rng.uniform_int(0, 1) == 1});
  }
  return out;
}

std::string describe(const Case& c) {
  return ::testing::PrintToString(c.qo_len) + " rows, " + ::testing::PrintToString(c.kv_len) +
         " keys, window_left " + ::testing::PrintToString(c.window_left) +
         (c.causal ? ", causal" : ", not causal");
}

// Compile-time use (the CUDA kernels take the same functions as __host__ __device__).
static_assert(query_position(10, 4, 0) == 6);
static_assert(query_position(3, 5, 0) == -2);
static_assert(window_first_key(6, 2) == 4);
static_assert(causal_last_key(6) == 6 && causal_key_end(6) == 7);
static_assert(first_visible_key(1, 3) == 0 && first_visible_key(9, 3) == 6);
static_assert(first_visible_key(9, -1) == 0);
static_assert(visible_key_end(4, 10, true) == 5 && visible_key_end(4, 10, false) == 10);
static_assert(visible_key_end(-3, 10, true) == 0 && visible_key_end(12, 10, true) == 10);
static_assert(visible(3, 3, true, 0) && !visible(4, 3, true, 0) && !visible(2, 3, true, 0));
static_assert(visible(int32_t{5}, int32_t{3}, false, int32_t{-1}));
static_assert(block_fully_visible(0, 3, 3, 5, true, 5) &&
              !block_fully_visible(0, 4, 3, 5, true, 5));
static_assert(!block_fully_visible(0, 3, 3, 5, true, 4));

TEST(Visibility, QueryPositionIsTheLastRowsOfTheRequest) {
  EXPECT_EQ(query_position<int64_t>(7, 7, 0), 0);   // prefill without prefix
  EXPECT_EQ(query_position<int64_t>(7, 1, 0), 6);   // decode: the last position
  EXPECT_EQ(query_position<int64_t>(10, 3, 2), 9);  // extend on a prefix of 7
  EXPECT_EQ(query_position<int32_t>(0, 1, 0), -1);  // decode of an empty request
}

TEST(Visibility, PredicateMatchesBruteForce) {
  FLASHKV_SEEDED_RNG(rng, 61);
  for (const Case& c : cases(rng)) {
    SCOPED_TRACE(describe(c));
    for (int64_t q = 0; q < c.qo_len; ++q) {
      const int64_t p = query_position(c.kv_len, c.qo_len, q);
      for (int64_t j = 0; j < c.kv_len; ++j) {
        const bool want = brute_visible(c.qo_len, c.kv_len, q, j, c.causal, c.window_left);
        ASSERT_EQ(visible(j, p, c.causal, c.window_left), want) << "row " << q << " key " << j;
        ASSERT_EQ(visible<int32_t>(static_cast<int32_t>(j), static_cast<int32_t>(p), c.causal,
                                   static_cast<int32_t>(c.window_left)),
                  want);
      }
    }
  }
}

// Each row's visible keys are exactly [first_visible_key, visible_key_end) (empty when the end
// is not above the begin), and the raw primitives agree with the clamped forms.
TEST(Visibility, RowRangeMatchesBruteForce) {
  FLASHKV_SEEDED_RNG(rng, 62);
  for (const Case& c : cases(rng)) {
    SCOPED_TRACE(describe(c));
    for (int64_t q = 0; q < c.qo_len; ++q) {
      const int64_t p = query_position(c.kv_len, c.qo_len, q);
      const int64_t begin = first_visible_key(p, c.window_left);
      const int64_t end = visible_key_end(p, c.kv_len, c.causal);
      ASSERT_GE(begin, 0);
      ASSERT_LE(end, c.kv_len);
      ASSERT_GE(end, 0);
      for (int64_t j = 0; j < c.kv_len; ++j)
        ASSERT_EQ(j >= begin && j < end,
                  brute_visible(c.qo_len, c.kv_len, q, j, c.causal, c.window_left))
            << "row " << q << " key " << j << " range [" << begin << ", " << end << ")";
      if (c.window_left >= 0)
        EXPECT_EQ(begin, std::max<int64_t>(window_first_key(p, c.window_left), 0));
      if (c.causal) EXPECT_EQ(end, std::clamp<int64_t>(causal_key_end(p), 0, c.kv_len));
      EXPECT_EQ(causal_key_end(p), causal_last_key(p) + 1);
    }
  }
}

// Rows q0..q1 together see [first_visible_key(first row), visible_key_end(last row)) (what the
// planner and the kernels trim a tile's KV to): no visible key outside it, and its ends visible.
TEST(Visibility, BlockRangeCoversItsRows) {
  FLASHKV_SEEDED_RNG(rng, 63);
  for (const Case& c : cases(rng)) {
    if (c.qo_len == 0) continue;
    SCOPED_TRACE(describe(c));
    for (int t = 0; t < 8; ++t) {
      const int64_t q0 = rng.uniform_int(0, static_cast<int>(c.qo_len - 1));
      const int64_t q1 = rng.uniform_int(static_cast<int>(q0), static_cast<int>(c.qo_len - 1));
      const int64_t first_pos = query_position(c.kv_len, c.qo_len, q0);
      const int64_t last_pos = query_position(c.kv_len, c.qo_len, q1);
      const int64_t begin = first_visible_key(first_pos, c.window_left);
      const int64_t end = visible_key_end(last_pos, c.kv_len, c.causal);
      int64_t lo = c.kv_len, hi = -1;
      for (int64_t q = q0; q <= q1; ++q)
        for (int64_t j = 0; j < c.kv_len; ++j)
          if (brute_visible(c.qo_len, c.kv_len, q, j, c.causal, c.window_left)) {
            lo = std::min(lo, j);
            hi = std::max(hi, j);
          }
      if (hi < 0) {
        EXPECT_LE(end, begin) << "rows " << q0 << ".." << q1;
      } else {
        EXPECT_EQ(begin, lo) << "rows " << q0 << ".." << q1;
        EXPECT_EQ(end, hi + 1) << "rows " << q0 << ".." << q1;
      }
    }
  }
}

// block_fully_visible is true exactly when every (row, key) pair of the block is visible.
TEST(Visibility, BlockFullyVisibleMatchesBruteForce) {
  FLASHKV_SEEDED_RNG(rng, 64);
  for (const Case& c : cases(rng)) {
    if (c.qo_len == 0 || c.kv_len == 0) continue;
    SCOPED_TRACE(describe(c));
    for (int t = 0; t < 16; ++t) {
      const int64_t q0 = rng.uniform_int(0, static_cast<int>(c.qo_len - 1));
      const int64_t q1 = rng.uniform_int(static_cast<int>(q0), static_cast<int>(c.qo_len - 1));
      const int64_t j0 = rng.uniform_int(0, static_cast<int>(c.kv_len - 1));
      const int64_t j1 = rng.uniform_int(static_cast<int>(j0), static_cast<int>(c.kv_len - 1));
      bool all = true;
      for (int64_t q = q0; q <= q1; ++q)
        for (int64_t j = j0; j <= j1; ++j)
          all = all && brute_visible(c.qo_len, c.kv_len, q, j, c.causal, c.window_left);
      EXPECT_EQ(
          block_fully_visible(j0, j1, query_position(c.kv_len, c.qo_len, q0),
                              query_position(c.kv_len, c.qo_len, q1), c.causal, c.window_left),
          all)
          << "rows " << q0 << ".." << q1 << ", keys " << j0 << ".." << j1;
    }
  }
}

}  // namespace
}  // namespace flashkv
