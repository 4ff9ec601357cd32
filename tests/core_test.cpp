#include <gtest/gtest.h>

#include <string>

#include "flashkv/core/buffer.h"
#include "flashkv/core/thread_pool.h"
#include "test_util.h"

namespace flashkv {
namespace {

using test::error_of;

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
  EXPECT_EQ(to_float(to_fp8_e4m3(1.0625f)), 1.0f);      // halfway between 1 and 1.125: even
  EXPECT_EQ(to_float(to_fp8_e4m3(1.1875f)), 1.25f);     // halfway between 1.125 and 1.25: even
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

TEST(Tensor, ExpectMessagesSayWhatWasExpected) {
  Tensor t = Tensor::empty({3, 4, 8}, DType::f32);
  EXPECT_EQ(error_of([&] { Expect(t, "k").dim(1, 2, "num_kv_heads"); }),
            "k: expected size 2 (num_kv_heads) in dimension 1, got 4 (tensor f32[3, 4, 8] on cpu)");
  EXPECT_NE(error_of([&] {
              Expect(t, "v").dtype_in({DType::bf16, DType::f16});
            }).find("v: expected dtype bf16/f16, got f32"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Expect(t, "lse").dim_at_least(0, 5); }).find("expected size >= 5"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              Expect(t, "o").device(Device::cuda(1));
            }).find("o: expected device cuda:1, got cpu"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { Expect(TensorView(), "lse").ndim(2); }),
            "lse: expected a tensor, got none");
  // A strided view: every other head.
  TensorView strided = t.view();
  strided.shape[1] = 2;
  strided.stride[1] = 16;
  EXPECT_FALSE(strided.is_contiguous());
  EXPECT_NO_THROW(Expect(strided, "q").inner_contiguous());
  EXPECT_NE(error_of([&] { Expect(strided, "q").contiguous(); }).find("q: expected a contiguous"),
            std::string::npos);
  // No elements: contiguous whatever the strides (DLPack exporters give empty arrays any stride).
  TensorView empty = t.view();
  empty.shape[0] = 0;
  empty.stride[0] = 0;
  EXPECT_TRUE(empty.is_contiguous());
  EXPECT_NO_THROW(Expect(empty, "kv_len").contiguous());
  TensorView transposed = t.view();
  transposed.stride[2] = 2;
  EXPECT_NE(error_of([&] { Expect(transposed, "q").inner_contiguous(); }).find("stride 1"),
            std::string::npos);
}

TEST(Tensor, IndexAtReadsI32AndI64AndChecksRange) {
  Tensor a = Tensor::from_i32({4, -7, 9});
  EXPECT_EQ(index_at(a, 1), -7);
  Tensor b = Tensor::empty({2}, DType::i64);
  b.ptr<int64_t>()[0] = int64_t{1} << 40;
  b.ptr<int64_t>()[1] = 3;
  EXPECT_EQ(index_at(b, 0), int64_t{1} << 40);
  EXPECT_NE(error_of([&] { index_at(a, 3); }).find("index 3 out of range"), std::string::npos);
  EXPECT_THROW(index_at(a, -1), Error);
  Tensor f = Tensor::empty({2}, DType::f32);
  EXPECT_NE(error_of([&] { index_at(f, 0); }).find("expected an i32/i64 tensor"),
            std::string::npos);
  // A strided 1-D view reads every other element.
  TensorView every_other = a.view();
  every_other.shape[0] = 2;
  every_other.stride[0] = 2;
  EXPECT_EQ(index_at(every_other, 1), 9);
}

TEST(Tensor, CopiesOwnTheirMemoryAndCheckShapes) {
  Tensor a = Tensor::from_i32({1, 2, 3, 4});
  Tensor copy = a.to(Device::cpu());
  EXPECT_NE(copy.data(), a.data());
  a.ptr<int32_t>()[0] = 100;
  EXPECT_EQ(copy.ptr<int32_t>()[0], 1);  // a deep copy
  Tensor alias = a;  // NOLINT(performance-unnecessary-copy-initialization): copies share a buffer
  EXPECT_EQ(alias.ptr<int32_t>()[0], 100);
  Tensor dst = Tensor::empty({4}, DType::i32);
  dst.copy_from(copy);
  EXPECT_EQ(dst.ptr<int32_t>()[3], 4);
  EXPECT_THROW(dst.copy_from(Tensor::empty({5}, DType::i32)), Error);
  EXPECT_THROW(dst.copy_from(Tensor::empty({4}, DType::f32)), Error);
  EXPECT_THROW(Tensor::empty({2, -1}, DType::f32), Error);
  EXPECT_EQ(Tensor::empty({0, 3}, DType::bf16).numel(), 0);
}

TEST(Buffer, IsAlignedAndMovable) {
  Buffer b(100, Device::cpu());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
  void* p = b.data();
  Buffer moved(std::move(b));
  EXPECT_EQ(moved.data(), p);
  EXPECT_EQ(moved.bytes(), 100u);
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is defined
  Buffer other(10, Device::cpu());
  other = std::move(moved);
  EXPECT_EQ(other.data(), p);
  EXPECT_EQ(Buffer(0, Device::cpu()).data(), nullptr);
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
  EXPECT_THROW(pool.parallel_for(100,
                                 [](int64_t i, int) {
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
