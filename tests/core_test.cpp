#include <gtest/gtest.h>

#include "flashkv/core/buffer.h"
#include "flashkv/core/thread_pool.h"
#include "test_util.h"

namespace flashkv {
namespace {

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(to_float(to_bf16(1.00390625f)), 1.0f);
  EXPECT_EQ(to_float(to_bf16(1.01171875f)), 1.015625f);  // halfway, rounds up to even
  EXPECT_TRUE(std::isnan(to_float(to_bf16(NAN))));
}

TEST(DType, Fp8SaturatesAndRounds) {
  EXPECT_EQ(to_float(to_fp8_e4m3(1000.0f)), 448.0f);
  EXPECT_EQ(to_float(to_fp8_e4m3(-1000.0f)), -448.0f);
  EXPECT_EQ(to_float(to_fp8_e5m2(1e6f)), 57344.0f);
  EXPECT_EQ(to_float(to_fp8_e4m3(0.0f)), 0.0f);
  EXPECT_EQ(to_float(to_fp8_e4m3(1.0625f)), 1.0f);    // halfway between 1 and 1.125: even
  EXPECT_EQ(to_float(to_fp8_e4m3(1.1875f)), 1.25f);   // halfway between 1.125 and 1.25: even
  EXPECT_EQ(to_float(fp8_e4m3_t{0x01}), 0.001953125f);  // smallest subnormal 2^-9
  EXPECT_TRUE(std::isnan(to_float(to_fp8_e4m3(NAN))));
}

TEST(DType, F16RoundTripsEveryValue) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const f16_t x{static_cast<uint16_t>(b)};
    const float f = to_float(x);
    if (std::isnan(f)) continue;
    EXPECT_EQ(to_f16(f).bits, x.bits) << "bits " << b;
  }
  EXPECT_TRUE(std::isinf(to_float(to_f16(70000.0f))));
}

TEST(DType, Fp8RoundTripsEveryValue) {
  for (uint32_t b = 0; b < 256; ++b) {
    const float a = to_float(fp8_e4m3_t{static_cast<uint8_t>(b)});
    if (!std::isnan(a)) EXPECT_EQ(to_fp8_e4m3(a).bits, b);
    const float c = to_float(fp8_e5m2_t{static_cast<uint8_t>(b)});
    if (!std::isnan(c) && !std::isinf(c)) EXPECT_EQ(to_fp8_e5m2(c).bits, b);
  }
}

TEST(DType, ParseRejectsUnknownNames) {
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_dtype("e4m3"), DType::fp8_e4m3);
  EXPECT_THROW(parse_dtype("int4"), Error);
}

TEST(Tensor, ExpectNamesArgumentAndValues) {
  Tensor t = Tensor::empty({3, 4, 8}, DType::f32);
  try {
    Expect(t, "q").dtype(DType::bf16);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("q: expected dtype bf16, got f32"), std::string::npos) << msg;
  }
  EXPECT_THROW(Expect(t, "q").ndim(2), Error);
  EXPECT_THROW(Expect(t, "q").dim(1, 5), Error);
  EXPECT_THROW(Expect(TensorView(), "lse").defined(), Error);
  EXPECT_NO_THROW(Expect(t, "q").ndim(3).dim(2, 8).float_dtype().contiguous());
}

TEST(Tensor, AtChecksBoundsAndRows) {
  Tensor t = Tensor::empty({2, 3}, DType::i32);
  for (int i = 0; i < 6; ++i) t.ptr<int32_t>()[i] = i;
  EXPECT_EQ(t.view().at({1, 2}), 5);
  EXPECT_THROW(t.view().at({2, 0}), Error);
  EXPECT_EQ(t.view().rows(1, 2).at({0, 0}), 3);
  EXPECT_THROW(t.view().rows(1, 3), Error);
  EXPECT_THROW(t.ptr<float>(), Error);
}

TEST(Device, ParseAndCudaAbsenceIsClean) {
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("cuda:1"), Device::cuda(1));
  EXPECT_THROW(parse_device("tpu"), Error);
  if (!cuda_available()) {
    EXPECT_THROW(Tensor::empty({4}, DType::f32, Device::cuda(0)), Error);
  }
}

TEST(ThreadPool, RunsEveryIndexOnceAndPropagatesErrors) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, [&](int64_t i, int) { hits[i]++; });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  EXPECT_THROW(pool.parallel_for(100, [](int64_t i, int) {
                 if (i == 57) throw Error("boom");
               }),
               Error);
  // Still usable after an error.
  std::atomic<int> n{0};
  pool.parallel_for(10, [&](int64_t, int) { n++; });
  EXPECT_EQ(n.load(), 10);
}

}  // namespace
}  // namespace flashkv
