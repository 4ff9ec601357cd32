// Context parallelism on one rank (the path every build has): the shard layout and the zigzag
// split, the one-rank communicator, sharded decode and extend against the float64 reference,
// argument errors; and, on a GPU with NCCL, the NCCL communicator with one rank.
#include <gtest/gtest.h>

#include <numeric>
#include <set>

#include "flashkv/parallel/communicator.h"
#include "flashkv/parallel/context_parallel.h"
#include "parallel_cases.h"
#include "test_util.h"

#if FLASHKV_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include "flashkv/parallel/nccl.h"
#endif

namespace flashkv::test {
namespace {

using parallel::CpExchange;
using parallel::CpLayout;
using parallel::CpOptions;
using parallel::CpShard;

// owner / local_len / local_index / global_pos agree with a direct count, for both layouts.
TEST(CpShard, LayoutsAgreeWithCounting) {
  for (CpLayout layout : {CpLayout::interleaved, CpLayout::contiguous}) {
    for (int world = 1; world <= 4; ++world) {
      for (int64_t block : {1, 3, 16}) {
        const CpShard shard(CpOptions{layout, block, CpExchange::all_gather}, world);
        SCOPED_TRACE(str_cat(static_cast<int>(layout), " world ", world, " block ", block));
        std::vector<int64_t> count(world, 0);
        for (int64_t t = 0; t < 200; ++t) {
          const int r = shard.owner(t);
          ASSERT_GE(r, 0);
          ASSERT_LT(r, world);
          for (int s = 0; s < world; ++s) ASSERT_EQ(shard.local_len(s, t), count[s]) << t;
          ASSERT_EQ(shard.local_index(t), count[r]);
          ASSERT_EQ(shard.global_pos(r, count[r]), t);
          ++count[r];
        }
        if (layout == CpLayout::interleaved) {
          EXPECT_EQ(shard.owner(block * world), 0);
          EXPECT_EQ(shard.owner(block), world > 1 ? 1 : 0);
        } else {
          EXPECT_EQ(shard.owner(1000000), world - 1);  // the last rank takes the rest
        }
      }
    }
  }
}

TEST(CpShard, BadOptions) {
  EXPECT_NE(error_of([] {
              CpShard(CpOptions{CpLayout::interleaved, 0, {}}, 2);
            }).find("CpOptions::block = 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { CpShard(CpOptions{}, 0); }).find("world size 0"), std::string::npos);
}

// The zigzag chunks of all ranks cover [0, n) once, and each rank's two chunks differ in length
// by at most one (balanced causal work: chunk r and chunk 2P-1-r).
TEST(CpShard, ZigzagCoversOnce) {
  for (int world = 1; world <= 4; ++world) {
    for (int64_t n : {0, 1, 2, 5, 7, 8, 33, 100}) {
      std::vector<int> seen(n, 0);
      int64_t total = 0;
      for (int r = 0; r < world; ++r) {
        const parallel::ZigzagRows z = parallel::zigzag_rows(n, world, r);
        for (int k = 0; k < 2; ++k)
          for (int64_t t = z.begin[k]; t < z.begin[k] + z.len[k]; ++t) ++seen[t];
        EXPECT_LE(std::abs(z.len[0] - z.len[1]), 1);
        total += z.total();
      }
      EXPECT_EQ(total, n);
      for (int64_t t = 0; t < n; ++t) EXPECT_EQ(seen[t], 1) << "n " << n << " t " << t;
    }
  }
}

TEST(CpOneRank, Collectives) {
  parallel::OneRankCommunicator comm;
  EXPECT_EQ(comm.size(), 1);
  const char src[4] = {1, 2, 3, 4};
  char dst[8] = {0};
  comm.all_gather(src, 4, dst, {});
  EXPECT_EQ(std::memcmp(dst, src, 4), 0);
  comm.all_gather_v(src, dst, {3}, {4}, {});
  EXPECT_EQ(std::memcmp(dst + 4, src, 3), 0);
  char a2a[2] = {0, 0};
  comm.all_to_all_v(src, {2}, {2}, a2a, {2}, {0}, {});
  EXPECT_EQ(a2a[0], 3);
  EXPECT_EQ(a2a[1], 4);
  EXPECT_NE(error_of([&] {
              comm.all_to_all_v(src, {2}, {0}, a2a, {1}, {0}, {});
            }).find("recv_counts[0] = 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              comm.all_gather_v(src, dst, {1, 1}, {0, 1}, {});
            }).find("counts: expected 1 entries"),
            std::string::npos);
  EXPECT_NE(error_of([&] { comm.broadcast(dst, 1, 1, {}); }).find("root = 1"), std::string::npos);
  char ring[3] = {0, 0, 0};
  comm.send_recv(src + 1, 3, 0, ring, 3, 0, {});
  EXPECT_EQ(std::memcmp(ring, src + 1, 3), 0);
  EXPECT_NE(error_of([&] { comm.send_recv(src, 1, 1, ring, 1, 0, {}); }).find("dest = 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              comm.send_recv(src, 2, 0, ring, 1, 0, {});
            }).find("recv_bytes = 1: expected send_bytes = 2"),
            std::string::npos);
}

TEST(CpOneRank, DecodeMatchesReference) {
  parallel::OneRankCommunicator comm;
  uint64_t seed = 1;
  for (const CpOptions& o :
       {CpOptions{}, CpOptions{CpLayout::contiguous, 37, CpExchange::all_to_all}}) {
    for (int page : {1, 16}) {
      CpDecodeCase c;
      c.kv_len = {0, 1, 37, 130};
      c.page_size = page;
      c.seed = ++seed;
      check_cp_decode(comm, o, c);
      c.dtype = DType::bf16;
      c.sinks = true;
      c.seed = ++seed;
      check_cp_decode(comm, o, c);
      c.window_left = 20;
      c.seed = ++seed;
      check_cp_decode(comm, o, c);
    }
  }
}

// Both passings of the new tokens' K/V: on one rank the ring is its step over the rank's own
// block, planned as on more ranks (chunks, masks over global positions).
TEST(CpOneRank, ExtendMatchesReference) {
  parallel::OneRankCommunicator comm;
  uint64_t seed = 50;
  for (parallel::CpKvPass pass : {parallel::CpKvPass::all_gather, parallel::CpKvPass::ring}) {
    CpOptions o;
    o.kv_pass = pass;
    for (int page : {1, 16}) {
      CpExtendCase c;
      c.prefix_len = {0, 40, 17};
      c.extend_len = {5, 33, 0};
      c.page_size = page;
      c.seed = ++seed;
      check_cp_extend(comm, o, c);
      c.dtype = DType::bf16;
      c.sinks = true;
      c.window_left = 20;
      c.seed = ++seed;
      check_cp_extend(comm, o, c);
      c.tree_mask = true;
      c.extend_len = {4, 6, 1};
      c.seed = ++seed;
      check_cp_extend(comm, o, c);
      c.tree_mask = false;
      c.causal = false;
      c.window_left = page == 1 ? -1 : 7;
      c.seed = ++seed;
      check_cp_extend(comm, o, c);
      c.causal = true;
      c.extend_len = {50, 70, 9};
      c.fixed_split_size = 16;
      c.seed = ++seed;
      check_cp_extend(comm, o, c);
    }
  }
}

TEST(CpOneRank, BadArguments) {
  parallel::OneRankCommunicator comm;
  parallel::CpDecode cp(comm, CpOptions{});
  Tensor q = Tensor::empty({1, 4, 64}, DType::f32);
  Tensor k = Tensor::empty({8, 2, 64}, DType::f32), v = Tensor::empty({8, 2, 64}, DType::f32);
  Tensor indptr = Tensor::from_i32({0, 8}), idx = Tensor::from_i32({0, 1, 2, 3, 4, 5, 6, 7});
  PagedKV kv{k, v, indptr, idx, TensorView(), 1};
  Tensor out = Tensor::empty({1, 4, 64}, DType::f32);
  EXPECT_NE(error_of([&] { cp.run(q, kv, {}, out, {}); }).find("call plan first"),
            std::string::npos);
  parallel::CpDecodeShape shape;
  shape.kv_len = {9};
  shape.num_qo_heads = 4;
  shape.num_kv_heads = 2;
  shape.head_dim_qk = shape.head_dim_v = 64;
  shape.dtype = DType::f32;
  cp.plan(shape);
  EXPECT_NE(error_of([&] {
              cp.run(q, kv, {}, out, {});
            }).find("kv: request 0 holds 8 tokens on rank 0: expected 9"),
            std::string::npos);
  shape.kv_len = {8};
  cp.plan(shape);
  AttentionOptions windowed;
  windowed.window_left = 4;
  EXPECT_NE(error_of([&] {
              cp.run(q, kv, windowed, out, {});
            }).find("opt.window_left = 4: expected the plan's -1"),
            std::string::npos);
  Tensor bad_out = Tensor::empty({1, 4, 64}, DType::bf16);
  EXPECT_NE(error_of([&] { cp.run(q, kv, {}, bad_out, {}); }).find("out: expected dtype f32"),
            std::string::npos);
  shape.kv_len = {-1};
  EXPECT_NE(error_of([&] { cp.plan(shape); }).find("kv_len[0] = -1"), std::string::npos);

  CpOptions bad_pass;
  bad_pass.kv_pass = static_cast<parallel::CpKvPass>(7);
  EXPECT_NE(error_of([&] {
              parallel::CpExtend bad(comm, bad_pass);
            }).find("CpOptions::kv_pass: expected all_gather or ring, got 7"),
            std::string::npos);
  parallel::CpExtend ext(comm, CpOptions{});
  parallel::CpExtendShape es;
  es.prefix_len = {4, 4};
  es.extend_len = {1};
  EXPECT_NE(error_of([&] { ext.plan(es); }).find("extend_len: expected 2 entries"),
            std::string::npos);
  es.prefix_len = {8};
  es.num_qo_heads = 4;
  es.num_kv_heads = 2;
  es.head_dim_qk = es.head_dim_v = 64;
  es.dtype = DType::f32;
  ext.plan(es);
  Tensor kn = Tensor::empty({1, 2, 64}, DType::f32), vn = Tensor::empty({1, 2, 64}, DType::f32);
  EXPECT_NE(error_of([&] {
              ext.append_local_kv(kn, vn, Tensor::from_i32({1}), k, v);
            }).find("call run first"),
            std::string::npos);
  AttentionOptions non_causal;
  non_causal.causal = false;
  EXPECT_NE(error_of([&] {
              ext.run(q, kn, vn, kv, non_causal, out, {});
            }).find("opt.causal = 0: expected the plan's 1"),
            std::string::npos);
  Tensor short_q = Tensor::empty({2, 4, 64}, DType::f32);
  EXPECT_NE(error_of([&] { ext.run(short_q, kn, vn, kv, {}, out, {}); }).find("q:"),
            std::string::npos);
}

#if FLASHKV_WITH_NCCL
// The NCCL communicator with one rank: its collectives, and a sharded decode on the GPU against
// the float64 reference.
TEST(CpNccl, OneRank) {
  FLASHKV_REQUIRE_GPU();
  ncclComm_t nc = nullptr;
  int dev0 = 0;
  ASSERT_EQ(ncclCommInitAll(&nc, 1, &dev0), ncclSuccess);
  {
    auto comm = parallel::make_nccl_communicator(nc, Device::cuda(0));
    EXPECT_EQ(comm->size(), 1);
    EXPECT_EQ(comm->name(), "NCCL");
    Tensor host = Tensor::from_i32({1, 2, 3, 4});
    Tensor src = host.to(Device::cuda(0));
    Tensor dst = Tensor::from_i32({0, 0, 0, 0, 0, 0, 0, 0}).to(Device::cuda(0));
    comm->all_gather(src.data(), 16, dst.data(), {});
    comm->all_gather_v(src.data(), static_cast<char*>(dst.data()) + 16, {8}, {0}, {});
    comm->all_to_all_v(src.data(), {8}, {8}, static_cast<char*>(dst.data()) + 24, {8}, {0}, {});
    comm->synchronize({});
    Tensor back = dst.to(Device::cpu());
    const std::vector<int32_t> want = {1, 2, 3, 4, 1, 2, 3, 4};
    for (int i = 0; i < 8; ++i) EXPECT_EQ(back.ptr<int32_t>()[i], want[i]) << i;
    // send_recv to itself: a copy on the stream.
    comm->send_recv(static_cast<char*>(src.data()) + 4, 8, 0, dst.data(), 8, 0, {});
    comm->synchronize({});
    back = dst.to(Device::cpu());
    EXPECT_EQ(back.ptr<int32_t>()[0], 2);
    EXPECT_EQ(back.ptr<int32_t>()[1], 3);

    // Decode on the GPU through the NCCL communicator.
    Rng rng(test_seed(2901));
    const int b = 2, hq = 8, hkv = 2, d = 128;
    const std::vector<int32_t> lens = {70, 300};
    Tensor q = random_tensor(rng, {b, hq, d}, DType::bf16);
    Tensor k = random_tensor(rng, {370, hkv, d}, DType::bf16);
    Tensor v = random_tensor(rng, {370, hkv, d}, DType::bf16);
    std::vector<int32_t> idx(370);
    std::iota(idx.begin(), idx.end(), 0);
    Tensor indptr = Tensor::from_i32({0, 70, 370}), indices = Tensor::from_i32(idx);
    PagedKV host_kv{k, v, indptr, indices, TensorView(), 1};
    const reference::Result ref = reference::paged_attention(q, TensorView(), host_kv, {});
    const Device g = Device::cuda(0);
    Tensor qg = q.to(g), kg = k.to(g), vg = v.to(g), ig = indptr.to(g), xg = indices.to(g);
    PagedKV kv{kg, vg, ig, xg, TensorView(), 1};
    parallel::CpDecodeShape shape;
    shape.kv_len = lens;
    shape.num_qo_heads = hq;
    shape.num_kv_heads = hkv;
    shape.head_dim_qk = shape.head_dim_v = d;
    shape.dtype = DType::bf16;
    parallel::CpDecode cp(*comm, CpOptions{});
    cp.plan(shape);
    Tensor out = Tensor::empty({b, hq, d}, DType::bf16, g);
    Tensor lse = Tensor::empty({b, hq}, DType::f32, g);
    cp.run(qg, kv, {}, out, lse);
    comm->synchronize({});
    expect_close(out.to(Device::cpu()), lse.to(Device::cpu()), ref, DType::bf16);
  }
  ncclCommDestroy(nc);
}
#endif

}  // namespace
}  // namespace flashkv::test
