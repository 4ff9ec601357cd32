// Workspace with an external scratch buffer (the partial states of split work in caller memory,
// shared between workspaces as the Python wrappers share FlashInfer's float workspace).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "flashkv/ops/attention.h"
#include "flashkv/reference/reference.h"
#include "test_util.h"

namespace flashkv {
namespace {

struct SplitDecodeCase {
  std::vector<int32_t> kv_lens = {700, 3, 0, 260};
  int hq = 4, hkv = 2, d = 32, slots = 1200;
  Tensor kc, vc, q, indptr, idx;
  BatchShape shape;
  DecodePlan plan;

  explicit SplitDecodeCase(test::Rng& rng) {
    std::vector<int32_t> perm(slots);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.gen());
    const int32_t total = std::accumulate(kv_lens.begin(), kv_lens.end(), 0);
    kc = test::random_tensor(rng, {slots, hkv, d}, DType::f32);
    vc = test::random_tensor(rng, {slots, hkv, d}, DType::f32);
    q = test::random_tensor(rng, {4, hq, d}, DType::f32);
    indptr = Tensor::from_i32(test::indptr_of(kv_lens));
    idx = Tensor::from_i32(std::vector<int32_t>(perm.begin(), perm.begin() + total));
    shape.batch_size = 4;
    shape.kv_len = kv_lens.data();
    shape.num_qo_heads = hq;
    shape.num_kv_heads = hkv;
    shape.head_dim_qk = shape.head_dim_v = d;
    PlanOptions po;
    po.fixed_split_size = 64;  // force splits, so the scratch is used
    plan = plan_decode(shape, device_info(Device::cpu()), po);
  }
  PagedKV kv() const { return PagedKV{kc, vc, indptr, idx, TensorView(), 1}; }
};

TEST(WorkspaceScratch, SharedExternalScratchMatchesReference) {
  FLASHKV_SEEDED_RNG(rng, 41);
  SplitDecodeCase c(rng);
  ASSERT_FALSE(c.plan.merges.empty());
  const size_t scratch_bytes = c.plan.layout.total_bytes - c.plan.layout.plan_bytes;
  // An unaligned start: the workspace aligns it and needs the padding on top.
  Buffer scratch(scratch_bytes + 512, Device::cpu());
  Workspace a, b;
  for (Workspace* ws : {&a, &b}) {
    ws->set_external_scratch(static_cast<unsigned char*>(scratch.data()) + 8, scratch_bytes + 504);
    EXPECT_EQ(ws->bytes_needed(c.plan), c.plan.layout.plan_bytes);
    ws->reserve(ws->bytes_needed(c.plan), Device::cpu());
    ws->upload(c.plan);
  }
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.scratch(c.plan)) % 256, 0u);
  const auto ref = reference::paged_attention(c.q, TensorView(), c.kv(), AttentionOptions());
  for (Workspace* ws : {&a, &b}) {
    Tensor out = Tensor::empty({4, c.hq, c.d}, DType::f32);
    Tensor lse = Tensor::empty({4, c.hq}, DType::f32);
    test::poison(out);
    test::poison(lse);
    paged_decode(c.plan, c.q, c.kv(), AttentionOptions(), out, lse, *ws);
    test::expect_close(out, lse, ref, DType::f32);
  }
}

TEST(WorkspaceScratch, TooSmallScratchIsRejected) {
  FLASHKV_SEEDED_RNG(rng, 42);
  SplitDecodeCase c(rng);
  const size_t scratch_bytes = c.plan.layout.total_bytes - c.plan.layout.plan_bytes;
  ASSERT_GT(scratch_bytes, 256u);
  Buffer scratch(scratch_bytes, Device::cpu());
  Workspace ws;
  ws.set_external_scratch(scratch.data(), scratch_bytes - 256);
  ws.reserve(ws.bytes_needed(c.plan), Device::cpu());
  ws.upload(c.plan);
  Tensor out = Tensor::empty({4, c.hq, c.d}, DType::f32);
  try {
    paged_decode(c.plan, c.q, c.kv(), AttentionOptions(), out, TensorView(), ws);
    FAIL() << "expected flashkv::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace scratch"), std::string::npos) << e.what();
  }
  // Back to its own memory: now the workspace itself is too small for the partial states.
  ws.set_external_scratch(nullptr, 0);
  EXPECT_EQ(ws.bytes_needed(c.plan), c.plan.layout.total_bytes);
  EXPECT_THROW(paged_decode(c.plan, c.q, c.kv(), AttentionOptions(), out, TensorView(), ws), Error);
}

}  // namespace
}  // namespace flashkv
