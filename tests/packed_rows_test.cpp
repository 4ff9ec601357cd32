// PackedRowWalk (the prefill epilogue's rows): every step lands where a division puts the row.
#include "flashkv/kernels/packed_rows.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace flashkv {
namespace {

template <int kStep>
void expect_walk_matches_division() {
  for (int group = 1; group <= 16; ++group)
    for (int start = 0; start < 70; ++start) {
      // Tokens 3 * group + 5 elements apart, heads 7: no two rows share an offset.
      const int64_t stride_tok = 3 * group + 5, stride_head = 7;
      PackedRowWalk walk(start, group, stride_tok, stride_head);
      for (int step = 0; step < 40; ++step) {
        const int row = start + step * kStep;
        ASSERT_EQ(walk.tok, row / group) << "group " << group << " row " << row;
        ASSERT_EQ(walk.head, row % group) << "group " << group << " row " << row;
        ASSERT_EQ(walk.offset, row / group * stride_tok + row % group * stride_head)
            << "group " << group << " row " << row;
        walk.advance<kStep>(group, stride_tok, stride_head);
      }
    }
}

TEST(PackedRowWalk, StepsMatchDivisionForEveryGroup) {
  expect_walk_matches_division<1>();
  expect_walk_matches_division<2>();
  expect_walk_matches_division<4>();
  expect_walk_matches_division<8>();
}

}  // namespace
}  // namespace flashkv
