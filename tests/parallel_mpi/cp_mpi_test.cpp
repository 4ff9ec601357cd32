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
  // send_recv round a ring, point to point and through the default (all_to_all_v): rank r sends
  // r + 1 bytes of value 32 + r to rank r + 1 and receives rank r - 1's.
  const int next = (r + 1) % p, prev = (r - 1 + p) % p;
  std::vector<unsigned char> ring_send(r + 1, static_cast<unsigned char>(32 + r));
  for (int way = 0; way < 2; ++way) {
    std::vector<unsigned char> ring_recv(prev + 1, 0);
    if (way == 0)
      comm->send_recv(ring_send.data(), r + 1, next, ring_recv.data(), prev + 1, prev, {});
    else
      comm->Communicator::send_recv(ring_send.data(), r + 1, next, ring_recv.data(), prev + 1, prev,
                                    {});
    for (int j = 0; j <= prev; ++j) EXPECT_EQ(ring_recv[j], 32 + prev) << "way " << way;
  }
  EXPECT_NE(error_of([&] {
              comm->send_recv(ring_send.data(), 1, p, ring_send.data(), 1, prev, {});
            }).find("send_recv: dest = "),
            std::string::npos);
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
  for (const CpOptions& o : cp_extend_option_sweep()) {
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
  for (const CpOptions& o : cp_extend_option_sweep()) {
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
    // Every pass's KV split into 16-token chunks, merged in the kernels.
    c.causal = true;
    c.window_left = -1;
    c.prefix_len = {90, 0};
    c.extend_len = {150, 77};
    c.fixed_split_size = 16;
    c.seed = ++seed;
    check_cp_extend(*comm, o, c);
  }
}

// Target verify (a draft tree's tokens with a tree mask) and draft-extend shapes (a few accepted
// tokens for each of many requests).
TEST(CpMpi, VerifyAndDraftExtend) {
  auto comm = world_comm();
  uint64_t seed = 900;
  for (const CpOptions& o : cp_extend_option_sweep()) {
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

// Forwards to another communicator, but its send_recv throws at the `fail_at`-th call on rank
// `failing`: a rank that fails in the middle of a ring.
class FailingRing final : public Communicator {
 public:
  FailingRing(Communicator& inner, int failing, int fail_at)
      : inner_(inner), failing_(failing), fail_at_(fail_at) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Device device() const override { return inner_.device(); }
  std::string name() const override { return inner_.name(); }
  void all_gather(const void* send, size_t bytes, void* recv, Stream stream) override {
    inner_.all_gather(send, bytes, recv, stream);
  }
  void all_gather_v(const void* send, void* recv, const std::vector<size_t>& counts,
                    const std::vector<size_t>& displs, Stream stream) override {
    inner_.all_gather_v(send, recv, counts, displs, stream);
  }
  void all_to_all_v(const void* send, const std::vector<size_t>& sc, const std::vector<size_t>& sd,
                    void* recv, const std::vector<size_t>& rc, const std::vector<size_t>& rd,
                    Stream stream) override {
    inner_.all_to_all_v(send, sc, sd, recv, rc, rd, stream);
  }
  void broadcast(void* data, size_t bytes, int root, Stream stream) override {
    inner_.broadcast(data, bytes, root, stream);
  }
  void send_recv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                 int source, Stream stream) override {
    if (rank() == failing_ && ++calls_ == fail_at_) throw_error("rank failed mid-ring");
    inner_.send_recv(send, send_bytes, dest, recv, recv_bytes, source, stream);
  }
  void barrier() override { inner_.barrier(); }
  void synchronize(Stream stream) override { inner_.synchronize(stream); }

 private:
  Communicator& inner_;
  int failing_, fail_at_, calls_ = 0;
};

// A rank that fails on a bad input before its first collective, or in the middle of the ring of
// a sharded extend: it throws its own error, and the other ranks, waiting in the collective or
// the ring step, stop at the timeout with an error rather than hang.
TEST(CpMpi, ZFailingRankTimesOut) {
  auto comm = world_comm(/*timeout_s=*/2.0);
  if (comm->size() < 2) GTEST_SKIP() << "needs two ranks";
  // Both duplicated while every rank is healthy: the ring's case runs on ring_comm, then the
  // decode's on comm.
  auto ring_comm = world_comm(/*timeout_s=*/2.0);
  const CpDecodeCase c;
  Rng rng(7);
  // The ring: rank 1 fails at the last ring step (the second of two with three ranks), after the
  // collectives before the ring; its neighbours, one sending to it and one receiving from it,
  // stop at the timeout in that step.
  const int p = comm->size();
  FailingRing failing(*ring_comm, /*failing=*/1, /*fail_at=*/p - 1);
  CpOptions ring;
  ring.kv_pass = parallel::CpKvPass::ring;
  parallel::CpExtend ext(failing, ring);
  parallel::CpExtendShape es;
  es.prefix_len = {3 * p};
  es.extend_len = {4 * p};
  es.num_qo_heads = c.hq;
  es.num_kv_heads = c.hkv;
  es.head_dim_qk = es.head_dim_v = c.head_dim;
  es.dtype = DType::f32;
  ext.plan(es);
  const int64_t own = ext.num_own_rows(), pre = ext.local_prefix_len()[0];
  Tensor eq = random_tensor(rng, {own, c.hq, c.head_dim}, DType::f32);
  Tensor ek = random_tensor(rng, {own, c.hkv, c.head_dim}, DType::f32);
  Tensor ev = random_tensor(rng, {own, c.hkv, c.head_dim}, DType::f32);
  Tensor pk = random_tensor(rng, {pre, c.hkv, c.head_dim}, DType::f32);
  Tensor pv = random_tensor(rng, {pre, c.hkv, c.head_dim}, DType::f32);
  std::vector<int32_t> pidx(pre);
  std::iota(pidx.begin(), pidx.end(), 0);
  Tensor pindptr = Tensor::from_i32({0, static_cast<int32_t>(pre)});
  Tensor pindices = Tensor::from_i32(pidx);
  PagedKV prefix{pk, pv, pindptr, pindices, TensorView(), 1};
  Tensor eout = Tensor::empty({own, c.hq, c.head_dim}, DType::f32);
  const std::string ring_error =
      error_of([&] { ext.run(eq, ek, ev, prefix, AttentionOptions(), eout, {}); });
  if (comm->rank() == 1) {
    EXPECT_NE(ring_error.find("rank failed mid-ring"), std::string::npos) << ring_error;
  } else if (comm->rank() == 0 || comm->rank() == 2) {  // rank 1's neighbours
    EXPECT_NE(ring_error.find("MPI send_recv: rank"), std::string::npos) << ring_error;
    EXPECT_NE(ring_error.find("waited 2 s for the other ranks"), std::string::npos) << ring_error;
  }

  // A bad argument on rank 1 before the decode's first collective.
  parallel::CpDecode cp(*comm, CpOptions{});
  parallel::CpDecodeShape shape;
  shape.kv_len = {40};
  shape.num_qo_heads = c.hq;
  shape.num_kv_heads = c.hkv;
  shape.head_dim_qk = shape.head_dim_v = c.head_dim;
  shape.dtype = DType::f32;
  cp.plan(shape);
  const int64_t local = cp.local_kv_len()[0];
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
