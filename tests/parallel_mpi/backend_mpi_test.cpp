// FlashKVBackend's context-parallel path across the MPI ranks of the run: every forward mode
// (extend on a prefix, decode, target verify with a tree mask, draft extend), windowed and full
// layers, every layout and exchange, the new tokens' K/V all-gathered or passed round a ring.
// Each rank builds the same global state from the seed, runs the ordinary backend over all of it,
// and its sharded backend over its own share (its req_to_token rows list only its positions;
// out_cache_loc names its slots or the dummy slot 0); its rows must match the ordinary ones, and
// its pool must hold exactly the K/V of its positions.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "flashkv/backend/flashkv_backend.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/parallel/mpi.h"
#include "flashkv/reference/compare.h"
#include "parallel_cases.h"
#include "step_batch.h"
#include "test_util.h"

namespace flashkv::test {
namespace {

using app::BatchEntry;
using app::Sequence;
using app::StepBatch;

constexpr int kHq = 4, kHkv = 2, kD = 64, kLayers = 2, kWindow = 7;

LayerSpec layer_of(int l) {
  LayerSpec layer;
  layer.layer_id = l;
  layer.num_qo_heads = kHq;
  layer.num_kv_heads = kHkv;
  layer.head_dim_qk = kD;
  if (l == 0) layer.sliding_window_size = kWindow;
  return layer;
}

// Rows [first, first + n) of a contiguous [T, ...] host tensor, one run after another.
Tensor pick_rows(const Tensor& t, const std::vector<std::pair<int64_t, int64_t>>& runs,
                 int64_t rows) {
  std::vector<int64_t> shape(t.view().shape, t.view().shape + t.view().ndim);
  shape[0] = std::max<int64_t>(rows, 1);
  Tensor out = Tensor::empty(shape, t.dtype());
  const size_t row = t.view().nbytes() / static_cast<size_t>(t.size(0));
  size_t at = 0;
  for (const auto& [first, n] : runs) {
    if (n == 0) continue;
    std::memcpy(static_cast<char*>(out.data()) + at,
                static_cast<const char*>(t.data()) + first * row, static_cast<size_t>(n) * row);
    at += static_cast<size_t>(n) * row;
  }
  return out;
}

TEST(CpBackendMpi, EveryModeMatchesTheOrdinaryPath) {
  parallel::CommOptions co;
  co.timeout_s = 120;
  auto comm = parallel::make_mpi_communicator(MPI_Comm_c2f(MPI_COMM_WORLD), co);
  const int P = comm->size(), me = comm->rank();
  uint64_t seed = 4200;
  for (const parallel::CpOptions& cp : cp_extend_option_sweep()) {
    SCOPED_TRACE(str(cp));
    Rng rng(++seed);  // the same on every rank
    const parallel::CpShard shard(cp, P);
    BackendOptions o;
    o.device = Device::cpu();
    o.num_qo_heads = kHq;
    o.num_kv_heads = kHkv;
    o.head_dim_qk = kD;
    o.sliding_window_size = kWindow;
    FlashKVBackend plain(o);
    o.cp_comm = comm.get();
    o.cp = cp;
    FlashKVBackend sharded(o);
    // Pool A: everything (the ordinary path); pool B: this rank's, the same slot ids, zero where
    // another rank holds the position.
    KVPoolConfig pc;
    pc.num_slots = 256;
    pc.num_layers = kLayers;
    pc.num_kv_heads = kHkv;
    pc.head_dim_qk = kD;
    KVPool pool_a(pc), pool_b(pc);
    for (int l = 0; l < kLayers; ++l) {
      fill_normal(pool_a.k(l), seed * 10 + l);
      fill_normal(pool_a.v(l), seed * 10 + 5 + l);
    }
    ReqToTokenPool r2t_a(4, 128), r2t_b(4, 128);
    std::vector<int32_t> slots(250);
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i) + 1;
    std::shuffle(slots.begin(), slots.end(), rng.gen());
    const std::vector<int32_t> lens = {61, 20, 9};
    Sequence seqs[3];
    const size_t row_bytes[2] = {pool_a.k(0).nbytes() / static_cast<size_t>(pool_a.num_rows()),
                                 pool_a.v(0).nbytes() / static_cast<size_t>(pool_a.num_rows())};
    for (int i = 0; i < 3; ++i) {
      seqs[i].row = (*r2t_a.alloc(1))[0];
      ASSERT_EQ((*r2t_b.alloc(1))[0], seqs[i].row);
      app::append_tokens(
          seqs[i], std::vector<int32_t>(slots.begin() + 80 * i, slots.begin() + 80 * i + lens[i]),
          r2t_a);
      std::vector<int32_t> local;
      for (int32_t p = 0; p < lens[i]; ++p) {
        if (shard.owner(p) != me) continue;
        const int32_t s = seqs[i].slots[p];
        local.push_back(s);
        for (int l = 0; l < kLayers; ++l)
          for (int kv = 0; kv < 2; ++kv) {
            const TensorView& a = kv == 0 ? pool_a.k(l) : pool_a.v(l);
            const TensorView& b = kv == 0 ? pool_b.k(l) : pool_b.v(l);
            std::memcpy(static_cast<char*>(b.data) + s * row_bytes[kv],
                        static_cast<const char*>(a.data) + s * row_bytes[kv], row_bytes[kv]);
          }
      }
      r2t_b.write(seqs[i].row, 0, local);
    }
    const std::vector<int32_t> tree = {-1, 0, 0, 1, 3};
    struct Case {
      ForwardMode mode;
      std::vector<int32_t> num_new;
    };
    for (const Case& c :
         {Case{ForwardMode::EXTEND, {29, 20, 2}}, Case{ForwardMode::DECODE, {1, 1, 1}},
          Case{ForwardMode::TARGET_VERIFY, {5, 5, 5}},
          Case{ForwardMode::DRAFT_EXTEND, {3, 1, 2}}}) {
      SCOPED_TRACE(mode_name(c.mode));
      std::vector<BatchEntry> entries;
      for (int i = 0; i < 3; ++i)
        entries.push_back({&seqs[i], lens[i], c.num_new[i],
                           c.mode == ForwardMode::TARGET_VERIFY ? tree : std::vector<int32_t>()});
      StepBatch step(c.mode, entries, r2t_a, Device::cpu());
      ForwardBatch& a = step.batch();
      a.token_to_kv_pool = &pool_a;
      // This rank's share of the batch.
      ForwardBatch b = a;
      b.req_to_token_pool = &r2t_b;
      b.token_to_kv_pool = &pool_b;
      std::vector<int32_t> loc;
      std::vector<std::pair<int64_t, int64_t>> own;
      for (int i = 0; i < 3; ++i) {
        const int32_t first = lens[i] - c.num_new[i];
        for (int32_t p = first; p < lens[i]; ++p)
          loc.push_back(shard.owner(p) == me ? seqs[i].slots[p] : 0);
        if (c.mode == ForwardMode::DECODE) continue;
        const parallel::ZigzagRows z = parallel::zigzag_rows(c.num_new[i], P, me);
        for (int h = 0; h < 2; ++h) own.emplace_back(step.qo_begin(i) + z.begin[h], z.len[h]);
      }
      const int64_t T = step.num_tokens();
      if (c.mode == ForwardMode::DECODE) own.emplace_back(0, T);
      int64_t rows = 0;
      for (const auto& run : own) rows += run.second;
      const Tensor loc_t = Tensor::from_i32(loc);
      b.out_cache_loc = loc_t;
      plain.init_forward_metadata(a);
      sharded.init_forward_metadata(b);
      ASSERT_EQ(sharded.cp_query_rows(), rows);
      for (int l = 0; l < kLayers; ++l) {
        SCOPED_TRACE(l == 0 ? "windowed layer" : "full layer");
        const Tensor q = random_tensor(rng, {T, kHq, kD}, DType::bf16);
        const Tensor k = random_tensor(rng, {T, kHkv, kD}, DType::bf16);
        const Tensor v = random_tensor(rng, {T, kHkv, kD}, DType::bf16);
        Tensor out_a = Tensor::empty({T, kHq * kD}, DType::bf16);
        Tensor out_b = Tensor::empty({std::max<int64_t>(rows, 1), kHq * kD}, DType::bf16);
        plain.forward(q, k, v, layer_of(l), a, true, out_a);
        sharded.forward(pick_rows(q, own, rows).view().rows(0, rows),
                        pick_rows(k, own, rows).view().rows(0, rows),
                        pick_rows(v, own, rows).view().rows(0, rows), layer_of(l), b, true,
                        out_b.view().rows(0, rows));
        const Tensor want = pick_rows(out_a, own, rows);
        double diff = 0, norm = 0;
        for (int64_t e = 0; e < rows * kHq * kD; ++e) {
          const double x = load_as_double(want.data(), DType::bf16, e);
          const double y = load_as_double(out_b.data(), DType::bf16, e);
          diff += (x - y) * (x - y);
          norm += x * x;
        }
        EXPECT_LT(std::sqrt(diff / std::max(norm, 1e-30)), 1e-2) << "rank " << me;
        // The rank's pool holds the K/V of its positions, and nothing of the others'.
        for (int i = 0; i < 3; ++i)
          for (int32_t p = 0; p < lens[i]; ++p) {
            const int32_t s = seqs[i].slots[p];
            for (int kv = 0; kv < 2; ++kv) {
              const char* pa = static_cast<const char*>((kv == 0 ? pool_a.k(l) : pool_a.v(l)).data);
              const char* pb = static_cast<const char*>((kv == 0 ? pool_b.k(l) : pool_b.v(l)).data);
              const std::vector<char> zero(row_bytes[kv], 0);
              const char* expect = shard.owner(p) == me ? pa + s * row_bytes[kv] : zero.data();
              ASSERT_EQ(std::memcmp(pb + s * row_bytes[kv], expect, row_bytes[kv]), 0)
                  << "rank " << me << ", request " << i << ", position " << p << (kv ? " V" : " K");
            }
          }
      }
    }
  }
}

}  // namespace
}  // namespace flashkv::test
