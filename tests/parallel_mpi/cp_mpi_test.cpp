// Sharded decode and extend across the MPI ranks of the run, every layout and exchange, against
// the float64 reference and the one-rank result; collectives; a failing rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <numeric>

#include "flashkv/parallel/mpi.h"
#include "parallel_cases.h"
#include "test_util.h"

namespace flashkv::test {
namespace {

using parallel::Communicator;
using parallel::CpOptions;

std::unique_ptr<Communicator> world_comm(double timeout_s = 120) {
  parallel::CommOptions o;
  o.timeout_s = timeout_s;
  return parallel::make_mpi_communicator(MPI_Comm_c2f(MPI_COMM_WORLD), o);
}

TEST(CpMpi, Collectives) {
  auto comm = world_comm();
  const int p = comm->size(), r = comm->rank();
  ASSERT_GE(p, 1);
  // all_gather: rank r sends 3 bytes r, r+1, r+2.
  std::vector<unsigned char> mine = {static_cast<unsigned char>(r),
                                     static_cast<unsigned char>(r + 1),
                                     static_cast<unsigned char>(r + 2)};
  std::vector<unsigned char> all(3 * p, 0xff);
  comm->all_gather(mine.data(), 3, all.data(), {});
  for (int s = 0; s < p; ++s)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(all[3 * s + j], s + j);
  // all_gather_v: rank s sends s + 1 bytes of value 10 + s, laid out back to back.
  std::vector<size_t> counts(p), displs(p);
  for (int s = 0; s < p; ++s) {
    counts[s] = s + 1;
    displs[s] = s == 0 ? 0 : displs[s - 1] + counts[s - 1];
  }
  std::vector<unsigned char> send_v(r + 1, static_cast<unsigned char>(10 + r));
  std::vector<unsigned char> recv_v(displs[p - 1] + counts[p - 1], 0);
  comm->all_gather_v(send_v.data(), recv_v.data(), counts, displs, {});
  for (int s = 0; s < p; ++s)
    for (size_t j = 0; j < counts[s]; ++j) EXPECT_EQ(recv_v[displs[s] + j], 10 + s);
  // all_to_all_v: rank r sends (s + 1) bytes of value 16 r + s to rank s.
  std::vector<size_t> sc(p), sd(p), rc(p), rd(p);
  std::vector<unsigned char> send_a;
  for (int s = 0; s < p; ++s) {
    sd[s] = send_a.size();
    sc[s] = s + 1;
    send_a.insert(send_a.end(), s + 1, static_cast<unsigned char>(16 * r + s));
    rc[s] = r + 1;
    rd[s] = s * (r + 1);
  }
  std::vector<unsigned char> recv_a(p * (r + 1), 0);
  comm->all_to_all_v(send_a.data(), sc, sd, recv_a.data(), rc, rd, {});
  for (int s = 0; s < p; ++s)
    for (int j = 0; j <= r; ++j) EXPECT_EQ(recv_a[rd[s] + j], 16 * s + r);
  // broadcast from the last rank.
  int value = r == p - 1 ? 4242 : -1;
  comm->broadcast(&value, sizeof(value), p - 1, {});
  EXPECT_EQ(value, 4242);
  comm->barrier();
  // Wrong-sized count vectors are refused before anything is sent.
  EXPECT_NE(error_of([&] {
              comm->all_gather_v(send_v.data(), recv_v.data(), {1}, {0, 0}, {});
            }),
            "");
}

TEST(CpMpi, Decode) {
  auto comm = world_comm();
  const std::vector<std::vector<int32_t>> lens = {
      {1}, {0, 1, 2}, {37, 100, 5}, {257}, {16, 33, 0, 64}};
  uint64_t seed = 100;
  for (const CpOptions& o : cp_option_sweep()) {
    for (const auto& l : lens) {
      for (int page : {1, 16}) {
        CpDecodeCase c;
        c.kv_len = l;
        c.page_size = page;
        c.seed = ++seed;
        check_cp_decode(*comm, o, c);
      }
    }
  }
  // bf16, MHA and MQA, sinks and a soft cap.
  for (const CpOptions& o : cp_option_sweep()) {
    CpDecodeCase c;
    c.kv_len = {300, 7, 64};
    c.dtype = DType::bf16;
    c.sinks = true;
    c.seed = ++seed;
    check_cp_decode(*comm, o, c);
    c.hq = c.hkv = 4;
    c.soft_cap = 30;
    c.page_size = 16;
    c.seed = ++seed;
    check_cp_decode(*comm, o, c);
    c.hq = 6;
    c.hkv = 1;
    c.seed = ++seed;
    check_cp_decode(*comm, o, c);
    // Fewer query heads than ranks at three: a rank merges no head slice.
    c.hq = 2;
    c.seed = ++seed;
    check_cp_decode(*comm, o, c);
  }
  // Sliding windows: shorter and longer than some requests, on both page sizes.
  for (const CpOptions& o : cp_option_sweep()) {
    for (int window : {0, 5, 50}) {
      for (int page : {1, 16}) {
        CpDecodeCase c;
        c.kv_len = {1, 40, 130, 17};
        c.window_left = window;
        c.page_size = page;
        c.sinks = window == 5;
        c.seed = ++seed;
        check_cp_decode(*comm, o, c);
      }
    }
  }
}

TEST(CpMpi, Extend) {
  auto comm = world_comm();
  struct Lens {
    std::vector<int32_t> prefix, extend;
  };
  const std::vector<Lens> lens = {
      {{0}, {1}},                  // one token, no prefix
      {{0, 5}, {17, 3}},           // no prefix; fewer new tokens than chunks
      {{100, 0, 33}, {40, 9, 0}},  // a request with no new tokens
      {{257, 16}, {64, 100}},      // long prefix, page-size multiples
  };
  uint64_t seed = 500;
  for (const CpOptions& o : cp_option_sweep()) {
    for (const Lens& l : lens) {
      for (int page : {1, 16}) {
        CpExtendCase c;
        c.prefix_len = l.prefix;
        c.extend_len = l.extend;
        c.page_size = page;
        c.seed = ++seed;
        check_cp_extend(*comm, o, c);
      }
    }
  }
  for (const CpOptions& o : cp_option_sweep()) {
    // bf16 with sinks; a sliding window (global positions in the sharded prefix).
    CpExtendCase c;
    c.prefix_len = {150, 31};
    c.extend_len = {45, 20};
    c.dtype = DType::bf16;
    c.sinks = true;
    c.seed = ++seed;
    check_cp_extend(*comm, o, c);
    c.dtype = DType::f32;
    c.sinks = false;
    c.window_left = 40;
    c.page_size = 16;
    c.seed = ++seed;
    check_cp_extend(*comm, o, c);
    // Non-causal (every new token sees all of them) with a window.
    c.causal = false;
    c.seed = ++seed;
    check_cp_extend(*comm, o, c);
  }
}

// Target verify (a draft tree's tokens with a tree mask) and draft-extend shapes (a few accepted
// tokens for each of many requests).
TEST(CpMpi, VerifyAndDraftExtend) {
  auto comm = world_comm();
  uint64_t seed = 900;
  for (const CpOptions& o : cp_option_sweep()) {
    CpExtendCase verify;
    verify.prefix_len = {120, 47, 1};
    verify.extend_len = {7, 5, 9};
    verify.tree_mask = true;
    verify.page_size = 16;
    verify.seed = ++seed;
    check_cp_extend(*comm, o, verify);
    verify.sinks = true;
    verify.window_left = 60;
    verify.page_size = 1;
    verify.seed = ++seed;
    check_cp_extend(*comm, o, verify);

    CpExtendCase draft;
    draft.prefix_len = {33, 80, 16, 5, 200, 64};
    draft.extend_len = {1, 3, 2, 4, 1, 2};
    draft.dtype = DType::bf16;
    draft.seed = ++seed;
    check_cp_extend(*comm, o, draft);
  }
}

// A rank that fails on a bad input before its first collective: it throws its own error, and the
// other ranks, waiting in the collective, stop at the timeout with an error rather than hang.
TEST(CpMpi, ZFailingRankTimesOut) {
  auto comm = world_comm(/*timeout_s=*/2.0);
  if (comm->size() < 2) GTEST_SKIP() << "needs two ranks";
  CpDecodeCase c;
  c.kv_len = {40};
  parallel::CpDecode cp(*comm, CpOptions{});
  parallel::CpDecodeShape shape;
  shape.kv_len = c.kv_len;
  shape.num_qo_heads = c.hq;
  shape.num_kv_heads = c.hkv;
  shape.head_dim_qk = shape.head_dim_v = c.head_dim;
  shape.dtype = DType::f32;
  cp.plan(shape);
  const int64_t local = cp.local_kv_len()[0];
  Rng rng(7);
  Tensor q = random_tensor(rng, {1, c.hq, c.head_dim}, DType::f32);
  Tensor kc = random_tensor(rng, {std::max<int64_t>(local, 1), c.hkv, c.head_dim}, DType::f32);
  Tensor vc = random_tensor(rng, {std::max<int64_t>(local, 1), c.hkv, c.head_dim}, DType::f32);
  std::vector<int32_t> idx(std::max<int64_t>(local, 1));
  std::iota(idx.begin(), idx.end(), 0);
  Tensor indptr = Tensor::from_i32({0, static_cast<int32_t>(local)});
  Tensor indices = Tensor::from_i32(idx);
  PagedKV kv{kc, vc, indptr, indices, TensorView(), 1};
  Tensor out = Tensor::empty({1, c.hq, c.head_dim}, DType::f32);
  if (comm->rank() == 1) {
    Tensor bad_q = Tensor::empty({1, c.hq, c.head_dim}, DType::bf16);
    const std::string e = error_of([&] { cp.run(bad_q, kv, AttentionOptions(), out, {}); });
    EXPECT_NE(e.find("q: expected dtype f32"), std::string::npos) << e;
  } else {
    const std::string e = error_of([&] { cp.run(q, kv, AttentionOptions(), out, {}); });
    EXPECT_NE(e.find("waited 2 s for the other ranks"), std::string::npos) << e;
    // The communicator stays unusable.
    const std::string again = error_of([&] { comm->barrier(); });
    EXPECT_NE(again.find("unusable"), std::string::npos) << again;
  }
}

}  // namespace
}  // namespace flashkv::test
