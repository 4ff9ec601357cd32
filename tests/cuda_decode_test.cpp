// CUDA paged decode and merge_state(s) against the float64 reference. Inputs are built on the
// host (pools with shuffled pages, unused slots NaN), copied to the GPU, run, copied back and
// compared. Every test skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "flashkv/ops/attention.h"
#include "flashkv/reference/reference.h"
#include "test_util.h"

#if FLASHKV_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda_capture.h"
#endif

namespace flashkv {
namespace {

using test::Rng;

struct DecodeCase {
  int hq = 8, hkv = 2, d = 128;
  DType q_dtype = DType::bf16, kv_dtype = DType::bf16;
  int page_size = 1;
  std::vector<int32_t> kv_lens;
  float k_scale = 1.0f, v_scale = 1.0f;
  double q_scale = 1.0;
  AttentionOptions opt;
  bool want_lse = true;
  int fixed_split_size = 0;
  bool plan_sees_window = true;  // pass window_left to the planner (it then trims KV ranges)
  bool sinks = false;            // random per-query-head attention sinks
  bool f32_out = false;          // out in f32 instead of q's dtype
};

// A batch on the host: q [B, Hq, D], pools [slots, Hkv, D] with the requests' pages shuffled
// and every slot no request owns set to NaN, and the paged indices.
struct HostBatch {
  Tensor q, k, v, indptr, indices, last_page_len;
  std::vector<int32_t> kv_lens;
  PagedKV kv() const {
    PagedKV kv{k, v, indptr, indices, last_page_len, page_size, k_scale, v_scale};
    return kv;
  }
  int page_size = 1;
  float k_scale = 1.0f, v_scale = 1.0f;
  Tensor sinks;  // f32 [Hq] when the case has sinks
};

HostBatch make_batch(Rng& rng, const DecodeCase& c, int64_t extra_pages = 5) {
  HostBatch b;
  b.kv_lens = c.kv_lens;
  b.page_size = c.page_size;
  b.k_scale = c.k_scale;
  b.v_scale = c.v_scale;
  const int64_t batch = static_cast<int64_t>(c.kv_lens.size());
  std::vector<int32_t> pages_of(batch);
  int64_t total_pages = 0;
  for (int64_t i = 0; i < batch; ++i) {
    pages_of[i] = (c.kv_lens[i] + c.page_size - 1) / c.page_size;
    total_pages += pages_of[i];
  }
  const int64_t pool_pages = total_pages + extra_pages;
  const int64_t slots = pool_pages * c.page_size;
  b.k = test::random_tensor(rng, {slots, c.hkv, c.d}, c.kv_dtype);
  b.v = test::random_tensor(rng, {slots, c.hkv, c.d}, c.kv_dtype);
  b.q = test::random_tensor(rng, {batch, c.hq, c.d}, c.q_dtype, c.q_scale);
  std::vector<int32_t> perm(pool_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.gen());
  std::vector<int32_t> indices(perm.begin(), perm.begin() + total_pages);
  std::vector<int32_t> last(batch, 1);
  std::vector<char> used(slots, 0);
  int64_t e = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const int32_t len = c.kv_lens[i];
    if (pages_of[i] > 0) last[i] = len - (pages_of[i] - 1) * c.page_size;
    for (int32_t t = 0; t < len; ++t)
      used[int64_t{indices[e + t / c.page_size]} * c.page_size + t % c.page_size] = 1;
    e += pages_of[i];
  }
  // NaN in every slot no request owns (also the tails of partly filled pages).
  const int64_t row = int64_t{c.hkv} * c.d;
  for (int64_t s = 0; s < slots; ++s) {
    if (used[s]) continue;
    for (int64_t x = 0; x < row; ++x) {
      store_from_double(b.k.data(), c.kv_dtype, s * row + x, std::nan(""));
      store_from_double(b.v.data(), c.kv_dtype, s * row + x, std::nan(""));
    }
  }
  b.indptr = Tensor::from_i32(test::indptr_of(pages_of));
  b.indices = Tensor::from_i32(indices);
  b.last_page_len = Tensor::from_i32(last);
  if (c.sinks) b.sinks = test::random_tensor(rng, {c.hq}, DType::f32, 3.0);
  return b;
}

BatchShape shape_of(const DecodeCase& c, const std::vector<int32_t>& kv_lens) {
  BatchShape bs;
  bs.batch_size = static_cast<int32_t>(kv_lens.size());
  bs.kv_len = kv_lens.data();
  bs.num_qo_heads = c.hq;
  bs.num_kv_heads = c.hkv;
  bs.head_dim_qk = bs.head_dim_v = c.d;
  bs.page_size = c.page_size;
  bs.causal = c.opt.causal;
  bs.window_left = c.plan_sees_window ? c.opt.window_left : -1;
  return bs;
}

// The batch's tensors on the GPU.
struct DeviceBatch {
  Tensor q, k, v, indptr, indices, last_page_len;
  PagedKV kv(const HostBatch& h) const {
    return PagedKV{k, v, indptr, indices, last_page_len, h.page_size, h.k_scale, h.v_scale};
  }
};
DeviceBatch to_device(const HostBatch& h) {
  const Device gpu = Device::cuda();
  return {h.q.to(gpu),      h.k.to(gpu),       h.v.to(gpu),
          h.indptr.to(gpu), h.indices.to(gpu), h.last_page_len.to(gpu)};
}

// Runs `plan` on the GPU for batch h (already on the device as dv), checks the result against
// the reference, and returns the output (host copy; the LSE too when lse_out is given).
Tensor run_plan(const HostBatch& h, const DeviceBatch& dv, const DecodeCase& c,
                const DecodePlan& plan, Tensor* lse_out = nullptr) {
  const int64_t batch = static_cast<int64_t>(c.kv_lens.size());
  Workspace ws(std::max<size_t>(plan.layout.total_bytes, 256), Device::cuda());
  ws.upload(plan);
  Tensor out = Tensor::empty({batch, c.hq, c.d}, c.f32_out ? DType::f32 : c.q_dtype);
  Tensor lse = Tensor::empty({batch, c.hq}, DType::f32);
  test::poison(out);
  test::poison(lse);
  Tensor out_d = out.to(Device::cuda()), lse_d = lse.to(Device::cuda());
  AttentionOptions opt = c.opt, ref_opt = c.opt;
  Tensor sinks;
  if (h.sinks.defined()) {
    sinks = h.sinks.to(Device::cuda());
    opt.sinks = sinks;
    ref_opt.sinks = h.sinks;
  }
  paged_decode(plan, dv.q, dv.kv(h), opt, out_d, c.want_lse ? lse_d.view() : TensorView(), ws);
  synchronize(Device::cuda());
  Tensor out_h = out_d.to(Device::cpu()), lse_h = lse_d.to(Device::cpu());
  const auto ref = reference::paged_attention(h.q, TensorView(), h.kv(), ref_opt);
  test::expect_close(out_h, c.want_lse ? lse_h.view() : TensorView(), ref, c.q_dtype,
                     is_fp8(c.kv_dtype));
  if (lse_out) *lse_out = lse_h;
  return out_h;
}

DecodePlan plan_case(const DecodeCase& c, int plan_sms = 0) {
  PlanOptions po;
  po.fixed_split_size = c.fixed_split_size;
  DeviceInfo info = device_info(Device::cuda());
  if (plan_sms > 0) info.num_sms = plan_sms;
  return plan_decode(shape_of(c, c.kv_lens), info, po);
}

// Plans, runs on the GPU and checks against the reference. Returns the plan's merge count.
// plan_sms > 0 plans for that many SMs (few workers, so each runs many items in a row).
size_t run_case(Rng& rng, const DecodeCase& c, int plan_sms = 0) {
  const HostBatch h = make_batch(rng, c);
  const DecodePlan plan = plan_case(c, plan_sms);
  run_plan(h, to_device(h), c, plan);
  return plan.merges.size();
}

// Awkward lengths: empty, one token, not a multiple of any tile, longer than a tile.
const std::vector<int32_t> kAwkwardLens = {0, 1, 17, 300, 1003, 77, 16, 129};

TEST(CudaDecode, MatchesReferenceAcrossGroupsHeadDimsAndPages) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 601);
  int n = 0;
  for (int group : {1, 4, 8})
    for (int d : {64, 128, 256})
      for (int page : {1, 16}) {
        DecodeCase c;
        c.hkv = 2;
        c.hq = 2 * group;
        c.d = d;
        c.page_size = page;
        c.q_dtype = c.kv_dtype = (n++ % 2) ? DType::f16 : DType::bf16;
        c.kv_lens = kAwkwardLens;
        SCOPED_TRACE(testing::Message() << "G=" << group << " D=" << d << " page=" << page
                                        << " dtype=" << dtype_name(c.q_dtype));
        run_case(rng, c);
      }
}

TEST(CudaDecode, LargeAndOddGroups) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 602);
  // 5 and 12 pad the mma's head tile; 16 fills two; 32 and 40 run as several CTAs per KV head.
  for (auto [hq, hkv] : {std::pair{10, 2}, {12, 1}, {32, 2}, {32, 1}, {40, 1}}) {
    DecodeCase c;
    c.hq = hq;
    c.hkv = hkv;
    c.kv_lens = {300, 0, 45, 1100};
    SCOPED_TRACE(testing::Message() << "Hq=" << hq << " Hkv=" << hkv);
    run_case(rng, c);
  }
}

TEST(CudaDecode, Fp8KvWithScales) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 603);
  for (DType kv : {DType::fp8_e4m3, DType::fp8_e5m2})
    for (DType q : {DType::bf16, DType::f16})
      for (int d : {64, 128, 256})
        for (int page : {1, 16}) {
          if (d != 128 && (q != DType::bf16 || page != 1)) continue;
          DecodeCase c;
          c.q_dtype = q;
          c.kv_dtype = kv;
          c.d = d;
          c.page_size = page;
          c.hq = 8;
          c.hkv = 2;
          c.k_scale = 0.75f;
          c.v_scale = 1.5f;
          c.kv_lens = kAwkwardLens;
          SCOPED_TRACE(testing::Message() << "kv=" << dtype_name(kv) << " q=" << dtype_name(q)
                                          << " D=" << d << " page=" << page);
          run_case(rng, c);
        }
}

TEST(CudaDecode, SoftCapWindowAndNoLse) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 604);
  DecodeCase c;
  c.kv_lens = kAwkwardLens;
  c.q_scale = 3.0;  // large logits, so the cap matters
  c.opt.logits_soft_cap = 2.5f;
  run_case(rng, c);
  for (bool plan_sees : {true, false})
    for (int window : {0, 5, 100}) {
      DecodeCase w;
      w.kv_lens = kAwkwardLens;
      w.opt.window_left = window;
      w.plan_sees_window = plan_sees;
      w.page_size = window == 5 ? 16 : 1;
      SCOPED_TRACE(testing::Message() << "window=" << window << " planned=" << plan_sees);
      run_case(rng, w);
    }
  DecodeCase n;
  n.kv_lens = kAwkwardLens;
  n.want_lse = false;
  n.fixed_split_size = 64;
  run_case(rng, n);
}

TEST(CudaDecode, ForcedAndAutomaticSplits) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 605);
  for (int split : {16, 64, 256}) {
    DecodeCase c;
    c.kv_lens = kAwkwardLens;
    c.fixed_split_size = split;
    c.page_size = split == 64 ? 16 : 1;
    SCOPED_TRACE(testing::Message() << "split=" << split);
    EXPECT_GT(run_case(rng, c), 0u);
  }
  // A small batch with long KV: the planner splits on its own to fill the GPU.
  DecodeCase a;
  a.hq = 32;
  a.hkv = 8;
  a.kv_lens = {9000, 4100};
  a.opt.logits_soft_cap = 30.0f;
  EXPECT_GT(run_case(rng, a), 0u);
}

// Attention sinks (SEMANTICS.md) on every decode path: each group and head dim (heads padded to
// the mma's tile: the pad rows read no sink), page sizes 1 and 16, empty requests (O = 0, LSE =
// the sink), unsplit rows (the sink folded in the warps' merge), forced and automatic splits
// (folded once, after the chunks, by the CTA that completes a tile; with chunks emptied by a
// window the planner does not see, and with one request cut into many chunks), soft cap and
// window, fp8 KV, no LSE.
TEST(CudaDecode, SinksOnEveryPath) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 620);
  for (int group : {1, 4, 8})
    for (int d : {64, 128, 256})
      for (int split : {0, 64}) {
        DecodeCase c;
        c.sinks = true;
        c.hkv = 2;
        c.hq = 2 * group;
        c.d = d;
        c.page_size = split ? 16 : 1;
        c.fixed_split_size = split;
        c.kv_lens = kAwkwardLens;
        SCOPED_TRACE(testing::Message() << "G=" << group << " D=" << d << " split=" << split);
        run_case(rng, c);
      }
  for (auto [hq, hkv] : {std::pair{12, 1}, {40, 1}}) {
    DecodeCase c;
    c.sinks = true;
    c.hq = hq;
    c.hkv = hkv;
    c.kv_lens = {300, 0, 45, 1100};
    SCOPED_TRACE(testing::Message() << "Hq=" << hq << " Hkv=" << hkv);
    run_case(rng, c);
    c.fixed_split_size = 32;
    run_case(rng, c);
  }
  DecodeCase w;  // chunks emptied by the window, soft cap, no LSE
  w.sinks = true;
  w.kv_lens = kAwkwardLens;
  w.q_scale = 3.0;
  w.opt.logits_soft_cap = 2.5f;
  w.opt.window_left = 40;
  w.plan_sees_window = false;
  w.fixed_split_size = 32;
  EXPECT_GT(run_case(rng, w), 0u);
  w.want_lse = false;
  run_case(rng, w);
  DecodeCase m;  // many chunks per tile (the wide merge), then an automatic split
  m.sinks = true;
  m.hq = 32;
  m.hkv = 8;
  m.kv_lens = {20000, 3, 5000};
  m.fixed_split_size = 16;
  EXPECT_GT(run_case(rng, m), 0u);
  m.fixed_split_size = 0;
  m.kv_lens = {70000};
  EXPECT_GT(run_case(rng, m), 0u);
  for (DType kv : {DType::fp8_e4m3, DType::fp8_e5m2}) {
    DecodeCase f;
    f.sinks = true;
    f.kv_dtype = kv;
    f.k_scale = 0.75f;
    f.v_scale = 1.5f;
    f.kv_lens = kAwkwardLens;
    SCOPED_TRACE(testing::Message() << "kv=" << dtype_name(kv));
    run_case(rng, f);
    f.fixed_split_size = 64;
    run_case(rng, f);
  }
}

// Outputs in f32 (FlashInfer's o_data_type) on every store of the decode kernel: the warps'
// merge of unsplit rows and the in-kernel merge of split ones (narrow and wide), with sinks and
// fp8 KV too. Within the tolerance, and the same values as the 16-bit output before rounding.
TEST(CudaDecode, F32OutputOnEveryPath) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 630);
  auto check = [&](DecodeCase c) {
    const HostBatch h = make_batch(rng, c);
    const DeviceBatch dv = to_device(h);
    const DecodePlan plan = plan_case(c);
    const Tensor out16 = run_plan(h, dv, c, plan);
    c.f32_out = true;
    const Tensor out32 = run_plan(h, dv, c, plan);
    test::expect_unrounded_f32(out32, out16);
    return plan.merges.size();
  };
  for (int group : {1, 8})
    for (int d : {64, 128, 256})
      for (int split : {0, 64}) {
        DecodeCase c;
        c.hkv = 2;
        c.hq = 2 * group;
        c.d = d;
        c.page_size = split ? 16 : 1;
        c.fixed_split_size = split;
        c.kv_lens = kAwkwardLens;
        c.sinks = d == 128;
        c.q_dtype = c.kv_dtype = d == 64 ? DType::f16 : DType::bf16;
        SCOPED_TRACE(testing::Message() << "G=" << group << " D=" << d << " split=" << split);
        const size_t merges = check(c);  // without a forced split the planner may split too
        if (split) EXPECT_GT(merges, 0u);
      }
  DecodeCase m;  // many chunks per tile: the wide merge
  m.hq = 32;
  m.hkv = 8;
  m.kv_lens = {20000, 3, 5000};
  m.fixed_split_size = 16;
  EXPECT_GT(check(m), 0u);
  DecodeCase f;
  f.kv_dtype = DType::fp8_e4m3;
  f.k_scale = 0.75f;
  f.v_scale = 1.5f;
  f.kv_lens = kAwkwardLens;
  check(f);
}

// Split requests are merged inside the decode kernel by the CTA whose chunk arrives last.
// Windows the planner does not see leave whole chunks empty in the kernel (they must still be
// counted), and a long request cut into many small chunks makes many CTAs race for the count.
TEST(CudaDecode, InKernelMergeOfEmptyAndManyChunks) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 611);
  DecodeCase w;
  w.kv_lens = kAwkwardLens;
  w.opt.window_left = 40;
  w.plan_sees_window = false;
  w.fixed_split_size = 32;
  EXPECT_GT(run_case(rng, w), 0u);
  DecodeCase m;
  m.hq = 32;
  m.hkv = 8;
  m.kv_lens = {20000, 3, 5000};
  m.fixed_split_size = 16;  // 1250 chunks of the first request, each its own item
  EXPECT_GT(run_case(rng, m), 0u);
  m.fixed_split_size = 0;  // automatic split of a small batch
  m.kv_lens = {70000};
  EXPECT_GT(run_case(rng, m), 0u);
}

// Deterministic mode (a fixed split): the chunks of a request do not depend on the plan's
// workers, and the in-kernel merge folds them in chunk order whatever order they arrive in, so
// plans for different SM counts (other workers, other arrival orders) and repeated runs give
// the same bits.
TEST(CudaDecode, FixedSplitResultsAreBitStable) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 612);
  // Kernel instantiations of 4 and 8 warps, one and two head tiles, head dims 64 to 256: with
  // tiles of a block count that is no multiple of the warps (fp8 with two head tiles, head dim
  // 256), the warps' rotation over the blocks starts afresh with every item, or a CTA's earlier
  // items would change the sums. Per plan, the merging CTAs fold one or several tiles at a time
  // (the merge's two unit layouts).
  struct Shape {
    int hq, hkv, d;
    DType q, kv;
  };
  for (const Shape& sh :
       {Shape{32, 8, 128, DType::bf16, DType::bf16},
        Shape{32, 8, 128, DType::bf16, DType::fp8_e4m3}, Shape{16, 8, 256, DType::f16, DType::f16},
        Shape{64, 4, 128, DType::f16, DType::fp8_e5m2},
        Shape{16, 2, 64, DType::bf16, DType::fp8_e4m3}}) {
    SCOPED_TRACE(testing::Message()
                 << sh.hq << "/" << sh.hkv << "/" << sh.d << " kv " << dtype_name(sh.kv));
    DecodeCase c;
    c.hq = sh.hq;
    c.hkv = sh.hkv;
    c.d = sh.d;
    c.q_dtype = sh.q;
    c.kv_dtype = sh.kv;
    c.kv_lens = {3000, 17, 4097, 0, 900, 2500};
    c.fixed_split_size = 256;
    const HostBatch h = make_batch(rng, c);
    const DeviceBatch dv = to_device(h);
    const Tensor first = run_plan(h, dv, c, plan_case(c));
    for (int sms : {0, 1, 3, 17, 132}) {
      SCOPED_TRACE(testing::Message() << "plan SMs " << sms);
      const DecodePlan plan = plan_case(c, sms);
      EXPECT_GT(plan.merges.size(), 0u);
      for (int repeat = 0; repeat < 2; ++repeat) {
        const Tensor out = run_plan(h, dv, c, plan);
        EXPECT_EQ(0, std::memcmp(first.data(), out.data(), out.view().nbytes()));
      }
    }
  }
}

// NaN in request 0's first K row (element 0) or V row (dims 0 and 1), KV head 0: through the
// warps' softmax, the finalize over the warps (a warp whose only token is the NaN one) and the
// split merge it reaches exactly the query heads and dims that use it, as in the reference.
TEST(CudaDecode, NaNInKvReachesTheOutput) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 614);
  for (DType kv : {DType::bf16, DType::fp8_e4m3})
    for (int group : {1, 4, 8})
      for (int first : {1, 90, 3000})  // 1: the NaN key is all the request has
        for (int split : {0, 32})
          for (bool nan_k : {true, false}) {
            DecodeCase c;
            c.hkv = 2;
            c.hq = 2 * group;
            c.d = group == 4 ? 256 : group == 8 ? 64 : 128;
            c.kv_dtype = kv;
            c.kv_lens = {first, 40, 0, 7};
            c.fixed_split_size = split;
            c.opt.logits_soft_cap = group == 4 ? 30.0f : 0.0f;
            SCOPED_TRACE(testing::Message()
                         << dtype_name(kv) << " G=" << group << " D=" << c.d << " first=" << first
                         << " split=" << split << (nan_k ? " K" : " V"));
            HostBatch h = make_batch(rng, c);  // page size 1: entry 0 is the first slot
            test::put_nan_in_kv_row(h.k, h.v, h.indices.ptr<int32_t>()[0], nan_k);
            Tensor lse;
            const Tensor out = run_plan(h, to_device(h), c, plan_case(c), &lse);
            test::expect_nan_from_first_kv_row(out, lse, 1, group, nan_k);
          }
}

// Two workers run a long list of items each: empty ones, one-token ones and split chunks of
// one tile, so the copy pipeline runs across many item boundaries.
TEST(CudaDecode, ManyItemsPerWorker) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 610);
  DecodeCase c;
  c.hq = 8;
  c.hkv = 2;
  c.kv_lens = {0, 33, 1, 0, 70, 16, 5, 0, 200, 2};
  c.fixed_split_size = 32;
  EXPECT_GT(run_case(rng, c, /*plan_sms=*/2), 0u);
  c.kv_dtype = DType::fp8_e5m2;
  c.fixed_split_size = 0;
  run_case(rng, c, /*plan_sms=*/1);
  // One worker with more items than a CTA keeps in shared memory (32; the rest are read from the
  // plan as the walks reach them), and more than 32 split tiles for its end-of-run merge rounds.
  c.kv_lens.clear();
  for (int i = 0; i < 60; ++i) c.kv_lens.push_back(std::vector<int32_t>{0, 33, 1, 70, 65}[i % 5]);
  c.fixed_split_size = 32;
  for (DType kv : {DType::bf16, DType::fp8_e4m3}) {
    c.kv_dtype = kv;
    EXPECT_GT(run_case(rng, c, /*plan_sms=*/1), 32u);
  }
}

// Plans in equal runs (plan.cpp, wrap_tiles; planned for few SMs, so that a small batch takes
// them): tiles cut where the runs end, so that a worker starts with the tail of one request and
// ends with the head of the next, some pieces one alignment unit long, an empty request in the
// middle of a run; groups of 4 and 8, bf16 and fp8 KV, page sizes 1 and 16, graph-mode plans.
TEST(CudaDecode, EqualRunsMatchReference) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 614);
  struct Shape {
    int hq, hkv, sms;
  };
  for (const Shape& sh : {Shape{32, 8, 33}, Shape{16, 2, 9}}) {
    for (DType kv : {DType::bf16, DType::fp8_e4m3}) {
      for (int page : {1, 16}) {
        for (bool graph : {false, true}) {
          SCOPED_TRACE(testing::Message()
                       << sh.hq << "/" << sh.hkv << " on " << sh.sms << " SMs, kv "
                       << dtype_name(kv) << ", page " << page << (graph ? ", graph" : ""));
          DecodeCase c;
          c.hq = sh.hq;
          c.hkv = sh.hkv;
          c.kv_dtype = kv;
          c.page_size = page;
          c.kv_lens = {1000, 1003, 999, 1017, 0, 1000, 998, 1001, 1000, 1500, 7};
          PlanOptions po;
          po.cuda_graph = graph;
          po.max_batch_size = 16;
          DeviceInfo info = device_info(Device::cuda());
          info.num_sms = sh.sms;
          const DecodePlan plan = plan_decode(shape_of(c, c.kv_lens), info, po);
          ASSERT_TRUE(plan.equal_runs);
          ASSERT_GT(plan.merges.size(), 5u);
          const HostBatch h = make_batch(rng, c);
          run_plan(h, to_device(h), c, plan);
        }
      }
    }
  }
}

// AttentionOptions::layout_ready: the item views and the first tiles' indices are read before
// the kernel waits for its predecessor. The indices here were copied before the call, as the
// option asks; results must match the reference as without it (empty, one-token and split items,
// more items than the CTA keeps views of, page sizes 1 and 16, windows the plan does not see).
TEST(CudaDecode, LayoutReadyMatchesReference) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 613);
  DecodeCase c;
  c.opt.layout_ready = true;
  c.kv_lens = kAwkwardLens;
  EXPECT_GT(run_case(rng, c), 0u);
  c.page_size = 16;
  c.fixed_split_size = 64;
  c.opt.window_left = 40;
  c.plan_sees_window = false;
  EXPECT_GT(run_case(rng, c), 0u);
  c.page_size = 1;
  c.opt.window_left = -1;
  c.kv_lens.clear();
  for (int i = 0; i < 60; ++i) c.kv_lens.push_back(std::vector<int32_t>{0, 33, 1, 70, 65}[i % 5]);
  c.fixed_split_size = 32;
  EXPECT_GT(run_case(rng, c, /*plan_sms=*/1), 32u);
}

TEST(CudaDecode, LongContexts) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 606);
  DecodeCase c;
  c.kv_lens = {65536, 1, 40000};
  run_case(rng, c);
  DecodeCase p = c;
  p.page_size = 16;
  p.kv_lens = {65536 - 5};
  p.kv_dtype = DType::fp8_e4m3;
  run_case(rng, p);
}

TEST(CudaDecode, LargeBatch) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 607);
  DecodeCase c;
  c.hq = 16;
  c.hkv = 4;
  c.d = 64;
  for (int i = 0; i < 512; ++i) c.kv_lens.push_back(rng.uniform_int(0, 300));
  run_case(rng, c);
}

TEST(CudaDecode, UnsupportedInputsThrow) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 608);
  auto expect_throw = [&](DecodeCase c, const char* what, bool with_mask = false,
                          int64_t k_token_stride = 0) {
    SCOPED_TRACE(what);
    c.kv_lens = {5, 9};
    const HostBatch h = make_batch(rng, c);
    const DeviceBatch dv = to_device(h);
    const DecodePlan plan =
        plan_decode(shape_of(c, c.kv_lens), device_info(Device::cuda()), PlanOptions());
    Workspace ws(std::max<size_t>(plan.layout.total_bytes, 256), Device::cuda());
    ws.upload(plan);
    Tensor out = Tensor::empty({2, c.hq, c.d}, c.q_dtype, Device::cuda());
    Tensor mask = Tensor::from_i32({1, 1, 1, 1}, Device::cuda());
    Tensor mask_indptr = Tensor::from_i32({0, 5, 14}, Device::cuda());
    AttentionOptions opt = c.opt;
    if (with_mask) {
      TensorView m = mask;
      m.dtype = DType::u8;
      m.shape[0] = 16;
      m.stride[0] = 1;
      opt.custom_mask = m;
      opt.mask_indptr = mask_indptr;
    }
    PagedKV kv = dv.kv(h);
    // Only the launcher's checks run (no kernel is launched), so the stride need not be real.
    if (k_token_stride > 0) kv.k.stride[0] = k_token_stride;
    try {
      paged_decode(plan, dv.q, kv, opt, out, TensorView(), ws);
      ADD_FAILURE() << "expected flashkv::Error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
    }
  };
  DecodeCase f32;
  f32.q_dtype = f32.kv_dtype = DType::f32;
  expect_throw(f32, "f32 q");
  DecodeCase d96;
  d96.d = 96;
  expect_throw(d96, "head dim 96");
  expect_throw(DecodeCase(), "custom mask", /*with_mask=*/true);
  // A token row more than 4 GiB apart: the kernel's row addresses are 32-bit multiply-adds.
  expect_throw(DecodeCase(), "k token stride over 4 GiB", false, int64_t{1} << 31);
}

#if FLASHKV_WITH_CUDA
// Captures paged_decode into a CUDA graph for one batch, then re-plans and re-uploads a
// different batch of the same size into the same workspace and buffers and replays: the first
// batch needs no split, the second does (so the replay also exercises the in-kernel merge).
TEST(CudaDecode, GraphReplayWithANewBatch) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 609);
  DecodeCase c;
  c.hq = 16;
  c.hkv = 4;
  c.page_size = 16;
  // (No request of the first batch is longer than 64 tokens, the planner's shortest automatic
  // split part.)
  const std::vector<std::vector<int32_t>> batches = {{50, 0, 37, 64}, {5000, 1, 2100, 640}};
  // One pool big enough for both; each batch gets its own indices into it.
  c.kv_lens = {7008, 3008, 1008, 1008};  // whole pages: no NaN tail a later batch could reuse
  HostBatch pool = make_batch(rng, c);
  const Device gpu = Device::cuda();
  DeviceBatch dv = to_device(pool);
  const int64_t batch = 4;
  Tensor out_d = Tensor::empty({batch, c.hq, c.d}, c.q_dtype, gpu);
  Tensor lse_d = Tensor::empty({batch, c.hq}, DType::f32, gpu);
  Tensor indptr_d = Tensor::empty({batch + 1}, DType::i32, gpu);
  Tensor last_d = Tensor::empty({batch}, DType::i32, gpu);
  const int64_t max_pages = pool.indices.numel();
  Tensor indices_d = Tensor::empty({max_pages}, DType::i32, gpu);
  PlanOptions po;
  po.cuda_graph = true;
  po.max_batch_size = static_cast<int32_t>(batch);
  Workspace ws;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  size_t layout_bytes = 0;
  for (size_t round = 0; round < batches.size(); ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    const std::vector<int32_t>& lens = batches[round];
    // The batch's pages: a random subset of the pool's pages, shuffled.
    std::vector<int32_t> pages(pool.indices.ptr<int32_t>(),
                               pool.indices.ptr<int32_t>() + max_pages);
    std::shuffle(pages.begin(), pages.end(), rng.gen());
    std::vector<int32_t> n_pages(batch), last(batch, 1);
    for (int64_t i = 0; i < batch; ++i) {
      n_pages[i] = (lens[i] + c.page_size - 1) / c.page_size;
      if (n_pages[i] > 0) last[i] = lens[i] - (n_pages[i] - 1) * c.page_size;
    }
    HostBatch h = pool;
    h.q = test::random_tensor(rng, {batch, c.hq, c.d}, c.q_dtype);
    h.indptr = Tensor::from_i32(test::indptr_of(n_pages));
    h.indices = Tensor::from_i32(pages);
    h.last_page_len = Tensor::from_i32(last);
    dv.q.copy_from(h.q);
    indptr_d.copy_from(h.indptr);
    indices_d.copy_from(h.indices);
    last_d.copy_from(h.last_page_len);
    Tensor poison_out = Tensor::empty({batch, c.hq, c.d}, c.q_dtype);
    Tensor poison_lse = Tensor::empty({batch, c.hq}, DType::f32);
    test::poison(poison_out);
    test::poison(poison_lse);
    out_d.copy_from(poison_out);
    lse_d.copy_from(poison_lse);
    const DecodePlan plan = plan_decode(shape_of(c, lens), device_info(gpu), po);
    EXPECT_EQ(plan.merges.empty(), round == 0);
    if (round == 0) {
      layout_bytes = plan.layout.total_bytes;
      ws.reserve(layout_bytes, gpu);
    }
    ASSERT_EQ(plan.layout.total_bytes, layout_bytes) << "graph plans share one layout";
    ws.upload(plan, Stream{stream});
    PagedKV kv{dv.k, dv.v, indptr_d, indices_d, last_d, c.page_size};
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the copies above ran on another stream
    if (round == 0) {
      cudaGraph_t graph = test::capture_graph(
          stream, [&] { paged_decode(plan, dv.q, kv, c.opt, out_d, lse_d, ws, Stream{stream}); });
      ASSERT_NE(graph, nullptr);
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      cudaGraphDestroy(graph);
    }
    // The split batch is replayed three times with no upload in between (new queries each
    // time): the in-kernel merge must leave its arrival counters at zero after every run.
    for (int replay = 0; replay < (round == 0 ? 1 : 3); ++replay) {
      SCOPED_TRACE(testing::Message() << "replay " << replay);
      if (replay > 0) {
        h.q = test::random_tensor(rng, {batch, c.hq, c.d}, c.q_dtype);
        dv.q.copy_from(h.q);
        out_d.copy_from(poison_out);
        lse_d.copy_from(poison_lse);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      }
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const Tensor out_h = out_d.to(Device::cpu()), lse_h = lse_d.to(Device::cpu());
      const auto ref = reference::paged_attention(h.q, TensorView(), h.kv(), c.opt);
      test::expect_close(out_h, lse_h, ref, c.q_dtype);
    }
  }
  cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
}
#endif

// ---- merge_state / merge_states -----------------------------------------------------------------

reference::Result result_of(const Tensor& o, const Tensor& lse) {
  reference::Result r;
  r.rows = o.size(0);
  r.heads = static_cast<int>(o.size(1));
  r.head_dim = static_cast<int>(o.size(2));
  for (int64_t i = 0; i < o.numel(); ++i) r.o.push_back(load_as_double(o.data(), o.dtype(), i));
  for (int64_t i = 0; i < lse.numel(); ++i)
    r.lse.push_back(load_as_double(lse.data(), DType::f32, i));
  return r;
}

// Random LSEs with some -inf (an empty state), a few NaN (a state that saw NaN in the KV: the
// merge is NaN, also next to empty states only) and some rows where every state is empty.
Tensor random_lse(Rng& rng, std::initializer_list<int64_t> shape, int64_t all_empty_row,
                  int64_t row_stride) {
  Tensor t = test::random_tensor(rng, shape, DType::f32, 4.0);
  float* x = t.ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double u = rng.uniform();
    if (u < 0.15 || i / row_stride == all_empty_row) {
      x[i] = -INFINITY;
    } else if (u < 0.2) {
      x[i] = NAN;
    }
  }
  return t;
}

TEST(CudaMerge, MergeStateMatchesReference) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 620);
  const Device gpu = Device::cuda();
  // Head dims: 16-byte vectors with lanes left over (80), one element per access (36 bf16 /
  // f16: no whole vectors), and more vectors than a warp's lanes (320 f32).
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t dim : {80, 36, 320})
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << dtype_name(dt) << " dim=" << dim << (in_place ? " in place" : ""));
        const int64_t rows = 37, heads = 5;
        Tensor oa = test::random_tensor(rng, {rows, heads, dim}, dt);
        Tensor ob = test::random_tensor(rng, {rows, heads, dim}, dt);
        Tensor la = random_lse(rng, {rows, heads}, 3, heads);
        Tensor lb = random_lse(rng, {rows, heads}, 3, heads);
        const auto ref = reference::merge_states({result_of(oa, la), result_of(ob, lb)});
        Tensor oa_d = oa.to(gpu), ob_d = ob.to(gpu), la_d = la.to(gpu), lb_d = lb.to(gpu);
        Tensor o = Tensor::empty({rows, heads, dim}, dt),
               l = Tensor::empty({rows, heads}, DType::f32);
        test::poison(o);
        test::poison(l);
        Tensor o_d = in_place ? oa_d : o.to(gpu), l_d = in_place ? la_d : l.to(gpu);
        merge_state(oa_d, la_d, ob_d, lb_d, o_d, l_d);
        test::expect_close(o_d.to(Device::cpu()), l_d.to(Device::cpu()), ref, dt);
      }
}

TEST(CudaMerge, MergeStatesMatchesReference) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 621);
  const Device gpu = Device::cuda();
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t n : {1, 3, 7}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " states=" << n);
      const int64_t rows = 19, heads = 4, dim = 128;
      Tensor states = test::random_tensor(rng, {rows, n, heads, dim}, dt);
      Tensor lse = random_lse(rng, {rows, n, heads}, 2, n * heads);
      std::vector<reference::Result> parts;
      for (int64_t s = 0; s < n; ++s) {
        Tensor o = Tensor::empty({rows, heads, dim}, dt),
               l = Tensor::empty({rows, heads}, DType::f32);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t h = 0; h < heads; ++h) {
            for (int64_t d = 0; d < dim; ++d)
              store_from_double(
                  o.data(), dt, (r * heads + h) * dim + d,
                  load_as_double(states.data(), dt, ((r * n + s) * heads + h) * dim + d));
            l.ptr<float>()[r * heads + h] = lse.ptr<float>()[(r * n + s) * heads + h];
          }
        parts.push_back(result_of(o, l));
      }
      const auto ref = reference::merge_states(parts);
      Tensor o = Tensor::empty({rows, heads, dim}, dt),
             l = Tensor::empty({rows, heads}, DType::f32);
      test::poison(o);
      test::poison(l);
      Tensor o_d = o.to(gpu), l_d = l.to(gpu);
      merge_states(states.to(gpu), lse.to(gpu), o_d, l_d);
      test::expect_close(o_d.to(Device::cpu()), l_d.to(Device::cpu()), ref, dt);
    }
}

}  // namespace
}  // namespace flashkv
