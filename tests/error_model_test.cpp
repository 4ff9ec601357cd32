// docs/ERRORS.md: every misuse of a public entry point is a flashkv::Error, never another
// exception or undefined behaviour. Regression tests for the cases that were not.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "flashkv/backend/forward_batch.h"
#include "flashkv/core/buffer.h"
#include "flashkv/core/device.h"
#include "test_util.h"

namespace flashkv {
namespace {

using test::error_of;

// std::stoi threw std::out_of_range for a CUDA index past INT_MAX.
TEST(ErrorModel, ParseDeviceWithAHugeIndexIsAnError) {
  EXPECT_EQ(parse_device("cuda:7").index, 7);
  EXPECT_EQ(parse_device("cuda:123456789").index, 123456789);
  for (const char* s : {"cuda:99999999999", "cuda:2147483648", "cuda:0000000000000000000001"}) {
    SCOPED_TRACE(s);
    EXPECT_NE(error_of([&] { parse_device(s); }).find("expected cpu, cuda or cuda:N"),
              std::string::npos);
  }
}

// The element count overflowed int64 (undefined behaviour) before the allocation failed.
TEST(ErrorModel, TensorOfMoreThanTwoToTheSixtyThreeBytesIsAnError) {
  const int64_t big = int64_t{1} << 40;
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{big, big},
        std::vector<int64_t>{std::numeric_limits<int64_t>::max(), 2},
        std::vector<int64_t>{int64_t{1} << 61, 4}}) {
    const std::string e = error_of([&] { Tensor::empty(shape, DType::f32); });
    EXPECT_NE(e.find("more than 2^63 bytes"), std::string::npos) << e;
  }
  // A zero dimension does not excuse the others: numel() and the strides multiply them all.
  EXPECT_NE(error_of([&] {
              Tensor::empty({big, big, 0}, DType::f32);
            }).find("2^63 bytes"),
            std::string::npos);
  EXPECT_EQ(Tensor::empty({big, 0}, DType::f32).numel(), 0);
}

// extend_len indexed the per-request lists with .at(): std::out_of_range for a short list.
TEST(ErrorModel, ForwardBatchExtendLenOfAShortListIsAnError) {
  ForwardBatch b;
  b.batch_size = 3;
  b.mode = ForwardMode::EXTEND;
  b.extend_seq_lens_cpu = {4, 5};
  EXPECT_EQ(b.extend_len(1), 5);
  EXPECT_NE(error_of([&] { b.num_tokens(); }).find("batch.extend_seq_lens_cpu: expected 3"),
            std::string::npos);
  b.mode = ForwardMode::DRAFT_EXTEND;
  b.spec.accept_length_cpu = {1};
  EXPECT_NE(error_of([&] { b.extend_len(2); }).find("batch.spec.accept_length_cpu"),
            std::string::npos);
  b.mode = ForwardMode::DECODE;
  EXPECT_EQ(b.num_tokens(), 3);
  EXPECT_NE(error_of([&] { b.extend_len(3); }).find("outside the batch of 3"), std::string::npos);
  EXPECT_THROW(b.extend_len(-1), Error);
}

}  // namespace
}  // namespace flashkv
