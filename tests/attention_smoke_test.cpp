// End-to-end smoke checks of plan -> upload -> run against the reference on the CPU. The full
// grids live in the per-operator tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "flashkv/ops/attention.h"
#include "flashkv/reference/reference.h"
#include "test_util.h"

namespace flashkv {
namespace {

using test::Rng;

TEST(AttentionSmoke, RaggedCausalMatchesReference) {
  FLASHKV_SEEDED_RNG(rng, 1);
  const int hq = 8, hkv = 2, d = 64;
  const std::vector<int32_t> q_lens = {5, 0, 33, 17}, kv_lens = {5, 3, 70, 17};
  auto qo = test::indptr_of(q_lens), kvp = test::indptr_of(kv_lens);
  Tensor q = test::random_tensor(rng, {qo.back(), hq, d}, DType::f32);
  Tensor k = test::random_tensor(rng, {kvp.back(), hkv, d}, DType::f32);
  Tensor v = test::random_tensor(rng, {kvp.back(), hkv, d}, DType::f32);
  Tensor out = Tensor::empty({qo.back(), hq, d}, DType::f32);
  Tensor lse = Tensor::empty({qo.back(), hq}, DType::f32);
  test::poison(out);
  test::poison(lse);
  BatchShape bs;
  bs.batch_size = 4;
  bs.qo_indptr = qo.data();
  bs.kv_len = kv_lens.data();
  bs.num_qo_heads = hq;
  bs.num_kv_heads = hkv;
  bs.head_dim_qk = bs.head_dim_v = d;
  bs.causal = true;
  PlanOptions po;
  po.q_tile = 8;
  PrefillPlan plan = plan_prefill(bs, device_info(Device::cpu()), po);
  Workspace ws(plan.layout.total_bytes, Device::cpu());
  ws.upload(plan);
  AttentionOptions opt;
  Tensor qo_t = Tensor::from_i32(qo), kv_t = Tensor::from_i32(kvp);
  ragged_prefill(plan, q, k, v, qo_t, kv_t, opt, out, lse, ws);
  auto ref = reference::ragged_attention(q, k, v, qo_t, kv_t, opt);
  test::expect_close(out, lse, ref, DType::f32);
}

TEST(AttentionSmoke, PagedDecodeWithSplitMatchesReference) {
  FLASHKV_SEEDED_RNG(rng, 2);
  const int hq = 4, hkv = 4, d = 32, slots = 3000;
  const std::vector<int32_t> kv_lens = {1000, 1, 0, 513};
  std::vector<int32_t> perm(slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.gen());
  std::vector<int32_t> indices(perm.begin(), perm.begin() + 1514);
  Tensor kc = test::random_tensor(rng, {slots, hkv, d}, DType::bf16);
  Tensor vc = test::random_tensor(rng, {slots, hkv, d}, DType::bf16);
  Tensor q = test::random_tensor(rng, {4, hq, d}, DType::bf16);
  Tensor out = Tensor::empty({4, hq, d}, DType::bf16);
  Tensor lse = Tensor::empty({4, hq}, DType::f32);
  test::poison(out);
  test::poison(lse);
  Tensor indptr = Tensor::from_i32(test::indptr_of(kv_lens)), idx = Tensor::from_i32(indices);
  PagedKV kv{kc, vc, indptr, idx, TensorView(), 1};
  BatchShape bs;
  bs.batch_size = 4;
  bs.kv_len = kv_lens.data();
  bs.num_qo_heads = hq;
  bs.num_kv_heads = hkv;
  bs.head_dim_qk = bs.head_dim_v = d;
  PlanOptions po;
  po.fixed_split_size = 128;  // force splits and merges
  DecodePlan plan = plan_decode(bs, device_info(Device::cpu()), po);
  ASSERT_FALSE(plan.merges.empty());
  Workspace ws(plan.layout.total_bytes, Device::cpu());
  ws.upload(plan);
  AttentionOptions opt;
  paged_decode(plan, q, kv, opt, out, lse, ws);
  auto ref = reference::paged_attention(q, TensorView(), kv, opt);
  test::expect_close(out, lse, ref, DType::bf16);
}

}  // namespace
}  // namespace flashkv
