// The KV-cache ops (append_kv, build_kv_indices, translate_slots): bit-exact against naive loops
// built on core/dtype.h, bad input rejected before any write, and the CUDA kernels bit-exact
// against the CPU ones.
#include "flashkv/ops/kv_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "flashkv/kernels/kv_convert.h"
#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/kvcache/swa_allocator.h"
#include "test_util.h"

namespace flashkv {
namespace {

using test::Rng;

// ---- helpers --------------------------------------------------------------------------------

Tensor index_tensor(const std::vector<int64_t>& values, DType dtype) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())}, dtype);
  for (size_t i = 0; i < values.size(); ++i)
    store_from_double(t.data(), dtype, static_cast<int64_t>(i), static_cast<double>(values[i]));
  return t;
}

Tensor host_copy(const TensorView& t) {
  std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
  Tensor h = Tensor::empty(shape, t.dtype);
  h.copy_from(t);
  if (t.device.is_cuda()) synchronize(t.device);
  return h;
}

// Whole-tensor byte equality (either side may be on the GPU).
::testing::AssertionResult same_bytes(const TensorView& a, const TensorView& b) {
  const Tensor ha = host_copy(a), hb = host_copy(b);
  if (ha.view().nbytes() != hb.view().nbytes())
    return ::testing::AssertionFailure() << a.str() << " vs " << b.str();
  const auto* pa = static_cast<const uint8_t*>(ha.data());
  const auto* pb = static_cast<const uint8_t*>(hb.data());
  const size_t elem = dtype_size(a.dtype);
  for (size_t i = 0; i < ha.view().nbytes(); ++i)
    if (pa[i] != pb[i])
      return ::testing::AssertionFailure()
             << "first difference at element " << i / elem << " of " << a.str();
  return ::testing::AssertionSuccess();
}

std::vector<DType> index_dtypes() { return {DType::i32, DType::i64}; }

// ---- element conversions ---------------------------------------------------------------------

// Float bit patterns covering every exponent and the upper mantissa bits, plus the low patterns
// that make exact ties and near-ties for f16 (13 dropped bits) and bf16 (16).
std::vector<uint32_t> float_patterns() {
  std::vector<uint32_t> out;
  const uint32_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x2000,
                           0x3000, 0x7fff, 0x8000, 0x8001, 0xf000, 0xffff};
  for (uint32_t hi = 0; hi < 0x10000; ++hi)
    for (uint32_t lo : lows) out.push_back(hi << 16 | lo);
  return out;
}

TEST(KVConvert, StoresEqualTheCoreConversionsBitForBit) {
  for (uint32_t u : float_patterns()) {
    const float f = bits_to_float(u);
    ASSERT_EQ(kv_convert::Store<bf16_t>::from(f).bits, to_bf16(f).bits) << std::hex << u;
    ASSERT_EQ(kv_convert::Store<f16_t>::from(f).bits, to_f16(f).bits) << std::hex << u;
    ASSERT_EQ(kv_convert::Store<fp8_e4m3_t>::from(f).bits, to_fp8_e4m3(f).bits) << std::hex << u;
    ASSERT_EQ(kv_convert::Store<fp8_e5m2_t>::from(f).bits, to_fp8_e5m2(f).bits) << std::hex << u;
  }
  EXPECT_EQ(to_float(kv_convert::Store<fp8_e4m3_t>::from(1e9f)), 448.0f);
  EXPECT_EQ(to_float(kv_convert::Store<fp8_e4m3_t>::from(-INFINITY)), -448.0f);
  EXPECT_EQ(to_float(kv_convert::Store<fp8_e5m2_t>::from(70000.0f)), 57344.0f);
  EXPECT_TRUE(std::isinf(to_float(kv_convert::Store<f16_t>::from(65520.0f))));
}

TEST(KVConvert, LoadsAreExact) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float a = kv_convert::load(f16_t{static_cast<uint16_t>(b)});
    const float e = to_float(f16_t{static_cast<uint16_t>(b)});
    if (std::isnan(e)) {
      ASSERT_TRUE(std::isnan(a)) << b;
    } else {
      ASSERT_EQ(float_to_bits(a), float_to_bits(e)) << b;
    }
    ASSERT_EQ(float_to_bits(kv_convert::load(bf16_t{static_cast<uint16_t>(b)})),
              float_to_bits(to_float(bf16_t{static_cast<uint16_t>(b)})));
  }
}

// ---- build_kv_indices ------------------------------------------------------------------------

constexpr int32_t kPoisonIndex = 0x7f7f7f7f;

struct IndicesCase {
  Tensor req_to_token;  // [max_reqs, max_context_len]
  std::vector<int64_t> rows, lens, starts;
  std::vector<int32_t> indptr;
  bool with_start = true;
  int64_t extra = 7;  // kv_indices elements past the last request (must stay untouched)

  int64_t num_indices() const { return indptr.back() + extra; }
  // The naive loop of docs/SEMANTICS.md over a poisoned output.
  std::vector<int32_t> expected() const {
    std::vector<int32_t> out(static_cast<size_t>(num_indices()), kPoisonIndex);
    const int64_t ctx = req_to_token.size(1);
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t j = 0; j < lens[i]; ++j)
        out[indptr[i] + j] = req_to_token.ptr<int32_t>()[rows[i] * ctx + starts[i] + j];
    return out;
  }
};

IndicesCase make_indices_case(Rng& rng, int64_t batch, bool with_start) {
  IndicesCase c;
  c.with_start = with_start;
  const int64_t max_reqs = batch + 13, ctx = 384;
  c.req_to_token = Tensor::empty({max_reqs, ctx}, DType::i32);
  for (int64_t i = 0; i < max_reqs * ctx; ++i)
    c.req_to_token.ptr<int32_t>()[i] = rng.uniform_int(0, 1 << 30);
  std::vector<int32_t> lens32;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t start = with_start ? rng.uniform_int(0, ctx) : 0;
    const int64_t len = rng.uniform_int(0, 9) == 0 ? 0 : rng.uniform_int(0, ctx - start);
    c.rows.push_back(rng.uniform_int(0, max_reqs - 1));
    c.starts.push_back(start);
    c.lens.push_back(len);
    lens32.push_back(static_cast<int32_t>(len));
  }
  c.lens[0] = 0;  // a zero length in every batch (batch 1 included)
  lens32[0] = 0;
  if (batch > 1) {  // and a full row
    c.starts[1] = 0;
    c.lens[1] = lens32[1] = ctx;
  }
  c.indptr = test::indptr_of(lens32);
  return c;
}

// Runs build_kv_indices for a case with the given index dtypes on `device`; returns kv_indices.
Tensor run_build_kv_indices(const IndicesCase& c, DType rows_dtype, DType lens_dtype,
                            Device device) {
  auto on = [&](const Tensor& t) { return device.is_cpu() ? t : t.to(device); };
  Tensor out = Tensor::empty({c.num_indices()}, DType::i32);
  std::fill(out.ptr<int32_t>(), out.ptr<int32_t>() + out.numel(), kPoisonIndex);
  const Tensor r2t = on(c.req_to_token), rows = on(index_tensor(c.rows, rows_dtype));
  const Tensor lens = on(index_tensor(c.lens, lens_dtype));
  const Tensor starts = c.with_start ? on(index_tensor(c.starts, lens_dtype)) : Tensor();
  const Tensor indptr = on(Tensor::from_i32(c.indptr));
  Tensor dev_out = on(out);
  build_kv_indices(r2t, rows, lens, starts.defined() ? starts.view() : TensorView(), indptr,
                   dev_out);
  return host_copy(dev_out);
}

TEST(BuildKVIndices, MatchesNaiveLoopBitForBit) {
  FLASHKV_SEEDED_RNG(rng, 401);
  for (int64_t batch : {1, 37, 1786}) {
    for (bool with_start : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch << " start " << with_start);
      const IndicesCase c = make_indices_case(rng, batch, with_start);
      const std::vector<int32_t> expected = c.expected();
      for (DType rows_dtype : index_dtypes()) {
        const DType lens_dtype = rows_dtype == DType::i32 ? DType::i64 : DType::i32;
        const Tensor out = run_build_kv_indices(c, rows_dtype, lens_dtype, Device::cpu());
        ASSERT_TRUE(std::equal(expected.begin(), expected.end(), out.ptr<int32_t>()));
      }
    }
  }
}

// Valid build_kv_indices arguments (host) that a bad-input test breaks one at a time.
struct IndicesArgs {
  Tensor req_to_token, rows, lens, starts, indptr, out;
  void call() const { build_kv_indices(req_to_token, rows, lens, starts, indptr, out); }
};

IndicesArgs valid_indices_args(Rng& rng) {
  IndicesArgs a;
  a.req_to_token = Tensor::empty({4, 10}, DType::i32);
  for (int i = 0; i < 40; ++i) a.req_to_token.ptr<int32_t>()[i] = rng.uniform_int(1, 1000);
  a.rows = index_tensor({2, 0, 3}, DType::i32);
  a.lens = index_tensor({3, 0, 10}, DType::i64);
  a.starts = index_tensor({7, 4, 0}, DType::i32);
  a.indptr = Tensor::from_i32({0, 3, 3, 13});
  a.out = Tensor::empty({13}, DType::i32);
  std::fill(a.out.ptr<int32_t>(), a.out.ptr<int32_t>() + 13, kPoisonIndex);
  return a;
}

TEST(BuildKVIndices, BadInputThrowsBeforeWriting) {
  FLASHKV_SEEDED_RNG(rng, 402);
  {
    IndicesArgs ok = valid_indices_args(rng);
    ok.call();
    EXPECT_EQ(ok.out.ptr<int32_t>()[12], ok.req_to_token.ptr<int32_t>()[39]);
  }
  // Each breaks one argument; the last request is valid and would be written first by a
  // kernel that does not validate up front.
  const std::vector<std::pair<const char*, std::function<void(IndicesArgs&)>>> cases = {
      {"row out of range", [](IndicesArgs& a) { a.rows.ptr<int32_t>()[0] = 4; }},
      {"negative row", [](IndicesArgs& a) { a.rows.ptr<int32_t>()[1] = -1; }},
      {"negative length", [](IndicesArgs& a) { a.lens.ptr<int64_t>()[1] = -1; }},
      {"negative start", [](IndicesArgs& a) { a.starts.ptr<int32_t>()[1] = -2; }},
      {"past max_context_len", [](IndicesArgs& a) { a.starts.ptr<int32_t>()[0] = 8; }},
      {"indptr != lens", [](IndicesArgs& a) { a.indptr.ptr<int32_t>()[1] = 2; }},
      {"negative indptr",
       [](IndicesArgs& a) {
         for (int i = 0; i < 4; ++i) a.indptr.ptr<int32_t>()[i] -= 1;
       }},
      {"kv_indices too small", [](IndicesArgs& a) { a.out = Tensor::empty({12}, DType::i32); }},
      {"req_to_token dtype",
       [](IndicesArgs& a) {
         a.req_to_token = Tensor::empty({4, 10}, DType::i64);
       }},
      {"req_to_token 1-D",
       [](IndicesArgs& a) { a.req_to_token = Tensor::empty({40}, DType::i32); }},
      {"lens size",
       [](IndicesArgs& a) {
         a.lens = index_tensor({3, 0}, DType::i64);
       }},
      {"lens dtype", [](IndicesArgs& a) { a.lens = Tensor::empty({3}, DType::f32); }},
      {"kv_start size",
       [](IndicesArgs& a) {
         a.starts = index_tensor({0, 0, 0, 0}, DType::i32);
       }},
      {"kv_indptr size",
       [](IndicesArgs& a) {
         a.indptr = Tensor::from_i32({0, 3, 3});
       }},
      {"kv_indptr dtype",
       [](IndicesArgs& a) {
         a.indptr = index_tensor({0, 3, 3, 13}, DType::i64);
       }},
      {"kv_indices dtype", [](IndicesArgs& a) { a.out = Tensor::empty({13}, DType::i64); }},
  };
  for (const auto& [what, mutate] : cases) {
    SCOPED_TRACE(what);
    IndicesArgs a = valid_indices_args(rng);
    mutate(a);
    const Tensor out_before = host_copy(a.out);
    EXPECT_THROW(a.call(), Error);
    EXPECT_TRUE(same_bytes(a.out, out_before));
  }
  // A CUDA-tagged view of host memory: the device check fires before any access.
  IndicesArgs a = valid_indices_args(rng);
  TensorView fake = a.out.view();
  fake.device = Device::cuda(0);
  EXPECT_THROW(build_kv_indices(a.req_to_token, a.rows, a.lens, a.starts, a.indptr, fake), Error);
  TensorView fake_rows = a.rows.view();
  fake_rows.device = Device::cuda(0);
  EXPECT_THROW(build_kv_indices(a.req_to_token, fake_rows, a.lens, a.starts, a.indptr, a.out),
               Error);
  EXPECT_EQ(a.out.ptr<int32_t>()[0], kPoisonIndex);
}

// ---- append_kv -------------------------------------------------------------------------------

// One append_kv problem on the host: inputs, slots and poisoned pools.
struct AppendCase {
  Tensor qkv;  // [T, Hkv + Hkv, D] backing store when the inputs are strided views
  TensorView k_new, v_new;
  Tensor k_own, v_own;  // contiguous inputs otherwise
  Tensor loc;
  std::vector<int64_t> slots;
  Tensor k_pool, v_pool;
  float k_scale = 1, v_scale = 1;
};

// Stores NaN in every element of a float tensor (fp8 included).
void poison_pool(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    store_from_double(t.data(), t.dtype(), i, std::numeric_limits<double>::quiet_NaN());
}

// Inputs of unit-normal values times 4, with a few large values that saturate fp8 and a few
// exact fp8 ties; tokens [T - num_pad, T) are padding rows (identical) sent to slot 0.
AppendCase make_append_case(Rng& rng, DType in, DType pool, int64_t tokens, int64_t hkv,
                            int64_t dqk, int64_t dv, bool strided, DType loc_dtype, float k_scale,
                            float v_scale) {
  AppendCase c;
  const int64_t num_slots = tokens + 29, num_pad = std::min<int64_t>(3, tokens / 4);
  if (strided) {
    EXPECT_EQ(dqk, dv);
    // A fused [T, 2 * Hkv + 1, D] buffer: K heads, then V heads, then one unrelated head.
    c.qkv = test::random_tensor(rng, {tokens, 2 * hkv + 1, dqk}, in, 4.0);
    c.k_new = c.qkv.view();
    c.k_new.shape[1] = hkv;
    c.v_new = c.k_new;
    c.v_new.data = static_cast<char*>(c.qkv.data()) + hkv * dqk * dtype_size(in);
  } else {
    c.k_own = test::random_tensor(rng, {tokens, hkv, dqk}, in, 4.0);
    c.v_own = test::random_tensor(rng, {tokens, hkv, dv}, in, 4.0);
    c.k_new = c.k_own.view();
    c.v_new = c.v_own.view();
  }
  const double specials[] = {1000.0, -1000.0, 1e5, -1e5, 1.0625, 1.1875, -0.0029296875, 3e-3};
  for (const TensorView* t : {&c.k_new, &c.v_new}) {
    for (int i = 0; i < 12 && tokens > num_pad; ++i) {
      const int64_t idx = t->offset({rng.uniform_int(0, static_cast<int>(tokens - num_pad) - 1),
                                     rng.uniform_int(0, static_cast<int>(hkv) - 1),
                                     rng.uniform_int(0, static_cast<int>(t->shape[2]) - 1)});
      store_from_double(t->data, in, idx, specials[i % 8]);
    }
    // Padding rows: copies of the first padding row.
    for (int64_t r = tokens - num_pad + 1; r < tokens; ++r)
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t d = 0; d < t->shape[2]; ++d)
          store_from_double(t->data, in, t->offset({r, h, d}),
                            load_as_double(t->data, in, t->offset({tokens - num_pad, h, d})));
  }
  std::vector<int64_t> free_slots;
  for (int64_t s = 1; s < num_slots; ++s) free_slots.push_back(s);
  std::shuffle(free_slots.begin(), free_slots.end(), rng.gen());
  for (int64_t t = 0; t < tokens; ++t) c.slots.push_back(t < tokens - num_pad ? free_slots[t] : 0);
  c.loc = index_tensor(c.slots, loc_dtype);
  c.k_pool = Tensor::empty({num_slots, hkv, dqk}, pool);
  c.v_pool = Tensor::empty({num_slots, hkv, dv}, pool);
  poison_pool(c.k_pool);
  poison_pool(c.v_pool);
  c.k_scale = k_scale;
  c.v_scale = v_scale;
  return c;
}

// The naive scatter: pool[slot, h, d] = to_<pool dtype>(float(x) / scale), on host copies.
void naive_append(const AppendCase& c, const Tensor& k_pool, const Tensor& v_pool) {
  auto scatter = [&](const TensorView& src, const Tensor& dst, float scale) {
    for (int64_t t = 0; t < src.shape[0]; ++t)
      for (int64_t h = 0; h < src.shape[1]; ++h)
        for (int64_t d = 0; d < src.shape[2]; ++d) {
          const float x =
              static_cast<float>(load_as_double(src.data, src.dtype, src.offset({t, h, d})));
          store_from_double(dst.data(), dst.dtype(), dst.view().offset({c.slots[t], h, d}),
                            static_cast<double>(x / scale));
        }
  };
  scatter(c.k_new, k_pool, c.k_scale);
  scatter(c.v_new, v_pool, c.v_scale);
}

const DType kInDtypes[] = {DType::f32, DType::f16, DType::bf16};
const DType kPoolDtypes[] = {DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3, DType::fp8_e5m2};

TEST(AppendKV, MatchesNaiveScatterIncludingFp8RoundingAndSaturation) {
  FLASHKV_SEEDED_RNG(rng, 403);
  for (DType in : kInDtypes) {
    for (DType pool : kPoolDtypes) {
      for (int variant = 0; variant < 3; ++variant) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(in) << " -> " << dtype_name(pool) << " variant " << variant);
        // 0: scales 1 (exact ties), contiguous; 1: odd scales, D_qk != D_v, i64 slots;
        // 2: strided views of a fused buffer, odd head dim.
        const bool strided = variant == 2;
        const float ks = variant == 1 ? 0.37f : 1.0f, vs = variant == 1 ? 2.5f : 1.0f;
        AppendCase c =
            make_append_case(rng, in, pool, variant == 2 ? 9 : 41, 3, variant == 2 ? 6 : 16,
                             variant == 1 ? 8 : (strided ? 6 : 16), strided,
                             variant == 1 ? DType::i64 : DType::i32, ks, vs);
        Tensor k_expected = host_copy(c.k_pool), v_expected = host_copy(c.v_pool);
        naive_append(c, k_expected, v_expected);
        append_kv(c.k_new, c.v_new, c.loc, c.k_pool, c.v_pool, c.k_scale, c.v_scale);
        ASSERT_TRUE(same_bytes(c.k_pool, k_expected));
        ASSERT_TRUE(same_bytes(c.v_pool, v_expected));
      }
    }
  }
}

TEST(AppendKV, Fp8SaturatesAfterDividingByTheScale) {
  Tensor k = Tensor::empty({1, 1, 4}, DType::f32), v = Tensor::empty({1, 1, 4}, DType::f32);
  const float values[4] = {100.0f, -100.0f, 0.5f, 1.0f};
  std::memcpy(k.data(), values, sizeof(values));
  std::memcpy(v.data(), values, sizeof(values));
  // K into e4m3 with scale 1/8, V into e5m2 with scale 1/1024: both saturate at the top.
  const float e4m3_stored[4] = {448.0f, -448.0f, 4.0f, 8.0f};           // 800 saturates
  const float e5m2_stored[4] = {57344.0f, -57344.0f, 512.0f, 1024.0f};  // 102400 saturates
  for (DType pool : {DType::fp8_e4m3, DType::fp8_e5m2}) {
    Tensor k_pool = Tensor::empty({2, 1, 4}, pool), v_pool = Tensor::empty({2, 1, 4}, pool);
    const float scale = pool == DType::fp8_e4m3 ? 0.125f : 1.0f / 1024;
    append_kv(k, v, index_tensor({1}, DType::i32), k_pool, v_pool, scale, scale);
    const float* stored = pool == DType::fp8_e4m3 ? e4m3_stored : e5m2_stored;
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(load_as_double(k_pool.data(), pool, 4 + i), stored[i]);
      EXPECT_EQ(load_as_double(v_pool.data(), pool, 4 + i), stored[i]);
    }
  }
}

// Valid append_kv arguments (host) for the bad-input test.
struct AppendArgs {
  Tensor k_new, v_new, loc, k_pool, v_pool;
  float k_scale = 0.5f, v_scale = 2.0f;
  void call() const { append_kv(k_new, v_new, loc, k_pool, v_pool, k_scale, v_scale); }
};

AppendArgs valid_append_args(Rng& rng) {
  AppendArgs a;
  a.k_new = test::random_tensor(rng, {4, 2, 8}, DType::bf16);
  a.v_new = test::random_tensor(rng, {4, 2, 4}, DType::bf16);
  a.loc = index_tensor({3, 1, 0, 5}, DType::i64);
  a.k_pool = Tensor::empty({6, 2, 8}, DType::fp8_e4m3);
  a.v_pool = Tensor::empty({6, 2, 4}, DType::fp8_e4m3);
  poison_pool(a.k_pool);
  poison_pool(a.v_pool);
  return a;
}

TEST(AppendKV, BadInputThrowsWithPoolsUnchanged) {
  FLASHKV_SEEDED_RNG(rng, 404);
  {
    AppendArgs ok = valid_append_args(rng);
    ok.call();
    EXPECT_FALSE(std::isnan(load_as_double(ok.k_pool.data(), DType::fp8_e4m3, 5 * 16)));
  }
  auto fake_cuda = [](Tensor& t) {
    TensorView v = t.view();
    v.device = Device::cuda(0);
    return v;
  };
  const std::vector<std::pair<const char*, std::function<void(AppendArgs&)>>> cases = {
      {"slot == num_slots", [](AppendArgs& a) { a.loc.ptr<int64_t>()[3] = 6; }},
      {"negative slot", [](AppendArgs& a) { a.loc.ptr<int64_t>()[3] = -1; }},
      {"loc length",
       [](AppendArgs& a) {
         a.loc = index_tensor({3, 1, 0}, DType::i64);
       }},
      {"loc dtype", [](AppendArgs& a) { a.loc = Tensor::empty({4}, DType::f32); }},
      {"loc 2-D",
       [](AppendArgs& a) {
         a.loc = Tensor::empty({4, 1}, DType::i32);
       }},
      {"v_new dtype",
       [&rng](AppendArgs& a) {
         a.v_new = test::random_tensor(rng, {4, 2, 4}, DType::f16);
       }},
      {"k_new dtype",
       [](AppendArgs& a) {
         a.k_new = Tensor::empty({4, 2, 8}, DType::fp8_e4m3);
       }},
      {"v_new tokens",
       [&rng](AppendArgs& a) {
         a.v_new = test::random_tensor(rng, {3, 2, 4}, DType::bf16);
       }},
      {"heads",
       [&rng](AppendArgs& a) {
         a.k_new = test::random_tensor(rng, {4, 1, 8}, DType::bf16);
       }},
      {"head_dim_qk",
       [&rng](AppendArgs& a) {
         a.k_new = test::random_tensor(rng, {4, 2, 4}, DType::bf16);
       }},
      {"head_dim_v",
       [&rng](AppendArgs& a) {
         a.v_new = test::random_tensor(rng, {4, 2, 8}, DType::bf16);
       }},
      {"pool dtype",
       [](AppendArgs& a) {
         a.k_pool = Tensor::empty({6, 2, 8}, DType::i32);
       }},
      {"v_pool dtype",
       [](AppendArgs& a) {
         a.v_pool = Tensor::empty({6, 2, 4}, DType::bf16);
       }},
      {"v_pool slots",
       [](AppendArgs& a) {
         a.v_pool = Tensor::empty({7, 2, 4}, DType::fp8_e4m3);
       }},
      {"k_scale 0", [](AppendArgs& a) { a.k_scale = 0; }},
      {"v_scale NaN", [](AppendArgs& a) { a.v_scale = NAN; }},
      {"k_scale negative", [](AppendArgs& a) { a.k_scale = -1; }},
      {"v_scale inf", [](AppendArgs& a) { a.v_scale = INFINITY; }},
  };
  for (const auto& [what, mutate] : cases) {
    SCOPED_TRACE(what);
    AppendArgs a = valid_append_args(rng);
    mutate(a);
    const Tensor k_before = host_copy(a.k_pool), v_before = host_copy(a.v_pool);
    EXPECT_THROW(a.call(), Error);
    EXPECT_TRUE(same_bytes(a.k_pool, k_before));
    EXPECT_TRUE(same_bytes(a.v_pool, v_before));
  }
  // Layout and device problems.
  AppendArgs a = valid_append_args(rng);
  const Tensor k_before = host_copy(a.k_pool);
  TensorView gapped = a.k_new.view();  // last dimension not unit-stride
  gapped.shape[2] = 4;
  gapped.stride[2] = 2;
  EXPECT_THROW(append_kv(gapped, a.v_new, a.loc, a.k_pool, a.v_pool), Error);
  EXPECT_THROW(append_kv(a.k_new, a.v_new, fake_cuda(a.loc), a.k_pool, a.v_pool), Error);
  EXPECT_THROW(append_kv(a.k_new, a.v_new, a.loc, fake_cuda(a.k_pool), a.v_pool), Error);
  EXPECT_THROW(append_kv(a.k_new, a.v_new, a.loc, TensorView(), a.v_pool), Error);
  EXPECT_TRUE(same_bytes(a.k_pool, k_before));
}

// ---- translate_slots -------------------------------------------------------------------------

TEST(TranslateSlots, MatchesTableLookupAndRejectsBadSlots) {
  FLASHKV_SEEDED_RNG(rng, 405);
  std::vector<int32_t> table_values(300);
  for (int32_t& v : table_values) v = rng.uniform_int(0, 1 << 20);
  const Tensor table = Tensor::from_i32(table_values);
  std::vector<int64_t> slots(517);
  for (int64_t& s : slots) s = rng.uniform_int(0, 299);
  slots[0] = 0;
  slots[1] = 299;
  for (DType dtype : index_dtypes()) {
    const Tensor full = index_tensor(slots, dtype);
    Tensor out = Tensor::empty({517}, DType::i32);
    translate_slots(full, table, out);
    for (size_t i = 0; i < slots.size(); ++i)
      ASSERT_EQ(out.ptr<int32_t>()[i], table_values[slots[i]]);
  }
  // In place on an i32 tensor.
  Tensor in_place = index_tensor(slots, DType::i32);
  translate_slots(in_place, table, in_place);
  EXPECT_EQ(in_place.ptr<int32_t>()[5], table_values[slots[5]]);

  Tensor out = Tensor::empty({517}, DType::i32);
  std::fill(out.ptr<int32_t>(), out.ptr<int32_t>() + 517, kPoisonIndex);
  const Tensor out_before = host_copy(out);
  std::vector<int64_t> bad = slots;
  bad.back() = 300;
  EXPECT_THROW(translate_slots(index_tensor(bad, DType::i32), table, out), Error);
  bad.back() = -1;
  EXPECT_THROW(translate_slots(index_tensor(bad, DType::i64), table, out), Error);
  EXPECT_TRUE(same_bytes(out, out_before));
  const Tensor full = index_tensor(slots, DType::i64);
  EXPECT_THROW(translate_slots(full, index_tensor({1, 2}, DType::i64), out), Error);
  EXPECT_THROW(translate_slots(full, table, Tensor::empty({516}, DType::i32)), Error);
  EXPECT_THROW(translate_slots(full, table, Tensor::empty({517}, DType::i64)), Error);
  TensorView alias = full.view();  // i32 output over i64 input: overlapping, not elementwise
  alias.dtype = DType::i32;
  EXPECT_THROW(translate_slots(full, table, alias), Error);
}

// ---- the pieces together, as a scheduler drives them -------------------------------------------

TEST(KVCacheEndToEnd, RowsSlotsIndicesAndAppendAgree) {
  FLASHKV_SEEDED_RNG(rng, 406);
  const int page_size = 4;
  ReqToTokenPool r2t(8, 64);
  KVPoolConfig config;
  config.num_slots = 128;
  config.page_size = page_size;
  config.num_kv_heads = 2;
  config.head_dim_qk = 8;
  config.dtype = DType::bf16;
  KVPool pool(config);
  PagedAllocator alloc(pool.num_slots(), pool.page_size());
  // Three requests prefill, then one decode step for all.
  const std::vector<int64_t> prompt = {5, 0, 11};
  std::vector<int32_t> rows = *r2t.alloc(3);
  std::vector<ExtendRequest> prefill;
  for (int64_t len : prompt) prefill.push_back({0, 0, len});
  std::vector<int32_t> loc = *alloc.alloc_extend(prefill);
  size_t at = 0;
  for (size_t i = 0; i < 3; ++i) {
    r2t.write(rows[i], 0, std::vector<int32_t>(loc.begin() + at, loc.begin() + at + prompt[i]));
    at += prompt[i];
  }
  std::vector<ExtendRequest> decode;
  for (size_t i = 0; i < 3; ++i)
    decode.push_back({prompt[i], prompt[i] ? r2t.read(rows[i], prompt[i] - 1, 1)[0] : 0, 1});
  const std::vector<int32_t> decode_loc = *alloc.alloc_extend(decode);
  for (size_t i = 0; i < 3; ++i) r2t.write(rows[i], prompt[i], {decode_loc[i]});

  // Write K/V for the decode tokens, then gather every request's slots.
  const Tensor k = test::random_tensor(rng, {3, 2, 8}, DType::f32);
  const Tensor v = test::random_tensor(rng, {3, 2, 8}, DType::f32);
  append_kv(k, v, Tensor::from_i32(decode_loc), pool.k(0), pool.v(0));
  std::vector<int32_t> lens32;
  for (int64_t len : prompt) lens32.push_back(static_cast<int32_t>(len + 1));
  const std::vector<int32_t> indptr = test::indptr_of(lens32);
  Tensor indices = Tensor::empty({indptr.back()}, DType::i32);
  build_kv_indices(r2t.req_to_token(), Tensor::from_i32(rows), Tensor::from_i32(lens32),
                   TensorView(), Tensor::from_i32(indptr), indices);
  for (size_t i = 0; i < 3; ++i) {
    const int32_t last = indices.ptr<int32_t>()[indptr[i + 1] - 1];
    EXPECT_EQ(last, decode_loc[i]);
    EXPECT_TRUE(alloc.is_live(last));
    for (int64_t d = 0; d < 8; ++d)
      EXPECT_EQ(pool.k(0).at({last, 1, d}),
                static_cast<float>(to_float(to_bf16(k.view().at({int64_t(i), 1, d})))));
    for (int32_t j = indptr[i]; j < indptr[i + 1]; ++j)
      EXPECT_EQ(indices.ptr<int32_t>()[j] % page_size, (j - indptr[i]) % page_size);
  }
  // The sliding-window view of the same slots.
  SWAAllocator swa(128, 64, page_size);
  const std::vector<int32_t> full = *swa.alloc(9);
  Tensor swa_slots = Tensor::empty({9}, DType::i32);
  translate_slots(Tensor::from_i32(full), swa.full_to_swa_table(), swa_slots);
  EXPECT_EQ(std::vector<int32_t>(swa_slots.ptr<int32_t>(), swa_slots.ptr<int32_t>() + 9),
            swa.translate_full_to_swa(full));
}

// ---- CUDA against CPU ------------------------------------------------------------------------

TEST(CudaAppendKV, MatchesCpuBitForBit) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 501);
  const Device gpu = Device::cuda(0);
  for (DType in : kInDtypes) {
    for (DType pool : kPoolDtypes) {
      for (int variant = 0; variant < 4; ++variant) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(in) << " -> " << dtype_name(pool) << " variant " << variant);
        // 0: vectorized (D 128); 1: odd scales, D_qk != D_v, i64; 2: strided, D 6 (scalar);
        // 3: many tokens (D 64).
        const bool strided = variant == 2;
        const int64_t tokens = variant == 3 ? 3000 : (variant == 2 ? 9 : 41);
        const int64_t dqk = variant == 0 ? 128 : (variant == 2 ? 6 : (variant == 3 ? 64 : 16));
        const int64_t dv = variant == 1 ? 8 : dqk;
        const float ks = variant == 1 ? 0.37f : 1.0f, vs = variant == 1 ? 2.5f : 1.0f;
        AppendCase c = make_append_case(rng, in, pool, tokens, variant == 3 ? 8 : 3, dqk, dv,
                                        strided, variant == 1 ? DType::i64 : DType::i32, ks, vs);
        Tensor k_pool = c.k_pool.to(gpu), v_pool = c.v_pool.to(gpu), loc = c.loc.to(gpu);
        // The same views over device copies of the input memory.
        const Tensor k_store = (strided ? c.qkv : c.k_own).to(gpu);
        const Tensor v_store = strided ? k_store : c.v_own.to(gpu);
        const char* k_base = static_cast<const char*>((strided ? c.qkv : c.k_own).data());
        const char* v_base = static_cast<const char*>((strided ? c.qkv : c.v_own).data());
        TensorView k_new = c.k_new, v_new = c.v_new;
        k_new.data =
            static_cast<char*>(k_store.data()) + (static_cast<char*>(c.k_new.data) - k_base);
        v_new.data =
            static_cast<char*>(v_store.data()) + (static_cast<char*>(c.v_new.data) - v_base);
        k_new.device = v_new.device = gpu;
        append_kv(k_new, v_new, loc, k_pool, v_pool, ks, vs);
        append_kv(c.k_new, c.v_new, c.loc, c.k_pool, c.v_pool, ks, vs);
        synchronize(gpu);
        ASSERT_TRUE(same_bytes(k_pool, c.k_pool));
        ASSERT_TRUE(same_bytes(v_pool, c.v_pool));
      }
    }
  }
}

TEST(CudaBuildKVIndices, MatchesCpuBitForBit) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 502);
  for (int64_t batch : {1, 37, 1786}) {
    for (bool with_start : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch << " start " << with_start);
      const IndicesCase c = make_indices_case(rng, batch, with_start);
      for (DType rows_dtype : index_dtypes()) {
        const DType lens_dtype = rows_dtype == DType::i32 ? DType::i64 : DType::i32;
        const Tensor cpu = run_build_kv_indices(c, rows_dtype, lens_dtype, Device::cpu());
        const Tensor gpu = run_build_kv_indices(c, rows_dtype, lens_dtype, Device::cuda(0));
        ASSERT_TRUE(same_bytes(gpu, cpu));
      }
    }
  }
}

TEST(CudaKVOps, KernelsSkipOutOfRangeIndices) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 503);
  const Device gpu = Device::cuda(0);
  // append_kv: tokens 1 and 3 name slots outside the pool and are skipped.
  AppendArgs a = valid_append_args(rng);
  Tensor k_pool = a.k_pool.to(gpu), v_pool = a.v_pool.to(gpu);
  append_kv(a.k_new.to(gpu), a.v_new.to(gpu), index_tensor({3, 6, 0, -1}, DType::i64).to(gpu),
            k_pool, v_pool, a.k_scale, a.v_scale);
  a.loc = index_tensor({3, 0}, DType::i64);  // the CPU run of the valid tokens 0 and 2
  TensorView k_valid = a.k_new.view(), v_valid = a.v_new.view();
  k_valid.shape[0] = v_valid.shape[0] = 2;
  k_valid.stride[0] *= 2;  // rows 0 and 2
  v_valid.stride[0] *= 2;
  append_kv(k_valid, v_valid, a.loc, a.k_pool, a.v_pool, a.k_scale, a.v_scale);
  synchronize(gpu);
  EXPECT_TRUE(same_bytes(k_pool, a.k_pool));
  EXPECT_TRUE(same_bytes(v_pool, a.v_pool));

  // build_kv_indices: request 0 names a row out of range, request 2 runs past max_context_len;
  // only request 1 is written.
  IndicesArgs b = valid_indices_args(rng);
  b.lens.ptr<int64_t>()[1] = 2;
  b.starts.ptr<int32_t>()[1] = 3;
  b.indptr = Tensor::from_i32({0, 3, 5, 15});
  b.out = Tensor::empty({15}, DType::i32);
  std::fill(b.out.ptr<int32_t>(), b.out.ptr<int32_t>() + 15, kPoisonIndex);
  Tensor rows = index_tensor({9, 0, 3}, DType::i32).to(gpu);
  Tensor starts = index_tensor({7, 3, 1}, DType::i32).to(gpu);
  Tensor out = b.out.to(gpu);
  build_kv_indices(b.req_to_token.to(gpu), rows, b.lens.to(gpu), starts, b.indptr.to(gpu), out);
  const Tensor got = host_copy(out);
  for (int i = 0; i < 15; ++i) {
    const int32_t expected =
        i == 3 || i == 4 ? b.req_to_token.ptr<int32_t>()[3 + i - 3] : kPoisonIndex;
    EXPECT_EQ(got.ptr<int32_t>()[i], expected) << i;
  }

  // translate_slots: out-of-range slots translate to the dummy slot 0.
  const Tensor table = Tensor::from_i32({0, 11, 12, 13});
  Tensor translated = Tensor::empty({4}, DType::i32, gpu);
  translate_slots(index_tensor({3, 4, -1, 1}, DType::i64).to(gpu), table.to(gpu), translated);
  const Tensor t_host = host_copy(translated);
  EXPECT_EQ(std::vector<int32_t>(t_host.ptr<int32_t>(), t_host.ptr<int32_t>() + 4),
            (std::vector<int32_t>{13, 0, 0, 11}));

  // Host-checkable problems still throw for CUDA tensors.
  EXPECT_THROW(append_kv(a.k_new.to(gpu), a.v_new.to(gpu), a.loc.to(gpu), k_pool, v_pool), Error);
  EXPECT_THROW(append_kv(a.k_new.to(gpu), a.v_new, a.loc.to(gpu), k_pool, v_pool), Error);
  EXPECT_THROW(translate_slots(index_tensor({1}, DType::i32).to(gpu), table, translated), Error);
}

TEST(CudaKVCache, DevicePoolsAndSwaTableMatchHost) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 504);
  const Device gpu = Device::cuda(0);
  ReqToTokenPool r2t(4, 32, gpu);
  const int32_t row = (*r2t.alloc(2))[1];
  r2t.write(row, 30, std::vector<int32_t>{5, 6});
  r2t.write(row, 0, Tensor::from_i32({9, 8, 7}, gpu));
  EXPECT_EQ(r2t.read(row, 0, 4), (std::vector<int32_t>{9, 8, 7, 0}));
  EXPECT_EQ(r2t.read(row, 30, 2), (std::vector<int32_t>{5, 6}));
  EXPECT_THROW(r2t.write(row, 31, std::vector<int32_t>{1, 2}), Error);

  KVPoolConfig config;
  config.num_slots = 64;
  config.num_kv_heads = 2;
  config.head_dim_qk = 16;
  config.dtype = DType::fp8_e5m2;
  config.device = gpu;
  KVPool pool(config);
  const Tensor k0 = host_copy(pool.k(0));
  for (int64_t i = 0; i < k0.numel(); ++i) ASSERT_EQ(static_cast<uint8_t*>(k0.data())[i], 0);

  for (int page_size : {1, 4}) {
    SWAAllocator swa(256, 128, page_size, gpu);
    std::vector<std::vector<int32_t>> held;
    for (int step = 0; step < 200; ++step) {
      if (held.empty() || rng.uniform_int(0, 2) != 0) {
        if (auto s = swa.alloc(rng.uniform_int(1, 9))) held.push_back(*s);
      } else {
        const size_t r = rng.uniform_int(0, static_cast<int>(held.size()) - 1);
        swa.free(held[r]);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(r));
      }
      if (step % 20 == 0) {
        const TensorView& table = swa.full_to_swa_table();
        ASSERT_TRUE(table.device.is_cuda());
        ASSERT_TRUE(same_bytes(table, swa.host_table()));
        if (!held.empty()) {
          Tensor out = Tensor::empty({static_cast<int64_t>(held.back().size())}, DType::i32, gpu);
          translate_slots(Tensor::from_i32(held.back(), gpu), table, out);
          const Tensor h = host_copy(out);
          EXPECT_EQ(std::vector<int32_t>(h.ptr<int32_t>(), h.ptr<int32_t>() + h.numel()),
                    swa.translate_full_to_swa(held.back()));
        }
      }
    }
  }
}

}  // namespace
}  // namespace flashkv
