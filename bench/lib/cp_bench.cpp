// Context-parallel benchmark (flashkv bench --cp N): one long request's KV sharded across the
// ranks of a communicator, timed with CpDecode / CpExtend against the same case on rank 0 alone,
// with each call's time split into local attention, communication and merge (parallel::CpTiming).
// The case runs where the communicator's buffers live: the CPU (MPI, one rank) or a GPU (NCCL).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "attention_bench.h"
#include "flashkv/core/error.h"
#include "flashkv/ops/attention.h"
#include "flashkv/parallel/host_collectives.h"

namespace flashkv::bench {
namespace {

using parallel::CpTiming;

// One rank's share of the case: the paged pool of its positions of every request (`local_len`
// tokens each), its query rows and their output.
struct Share {
  Tensor q, k, v, out, sinks;
  Tensor pool_k, pool_v, kv_indptr, kv_indices, last_page_len;
  PagedKV paged;
};

// Drawn on the host, then copied to `device`.
Tensor random_tensor(std::initializer_list<int64_t> shape, DType dtype, uint64_t seed,
                     Device device) {
  Tensor t = Tensor::empty(shape, dtype);
  fill_random(t, seed);
  return device.is_cpu() ? t : t.to(device);
}

// Pages in order or shuffled, as the one-device benchmark lays them out. At least one page and
// one index are allocated, so that a rank holding none of the positions still has valid tensors.
void make_pool(const BenchCase& c, int64_t local_len, uint64_t seed, Share& s) {
  const int64_t p = c.page_size;
  const int64_t pages_per_request = (local_len + p - 1) / p;
  const int64_t num_pages = c.batch * pages_per_request;
  const int64_t rows = std::max<int64_t>(num_pages, 1) * p;
  s.pool_k = random_tensor({rows, c.num_kv_heads, c.head_dim}, c.kv_dtype, seed, c.device);
  s.pool_v = random_tensor({rows, c.num_kv_heads, c.head_dim}, c.kv_dtype, seed + 1, c.device);
  std::vector<int32_t> order(std::max<int64_t>(num_pages, 1)), indptr(c.batch + 1), last(c.batch);
  std::iota(order.begin(), order.end(), 0);
  if (c.kv_layout == KvLayout::shuffled) {
    std::mt19937_64 gen(seed);
    std::shuffle(order.begin(), order.end(), gen);
  }
  for (int i = 0; i <= c.batch; ++i) indptr[i] = static_cast<int32_t>(i * pages_per_request);
  for (int i = 0; i < c.batch; ++i)
    last[i] = static_cast<int32_t>(local_len == 0 ? 0 : local_len - (pages_per_request - 1) * p);
  s.kv_indptr = Tensor::from_i32(indptr, c.device);
  s.kv_indices = Tensor::from_i32(order, c.device);
  s.last_page_len = Tensor::from_i32(last, c.device);
  s.paged = PagedKV{s.pool_k,
                    s.pool_v,
                    s.kv_indptr,
                    s.kv_indices,
                    p > 1 ? s.last_page_len.view() : TensorView(),
                    static_cast<int32_t>(p)};
}

// Phase times and wall time of every timed call on this rank.
struct Calls {
  std::vector<double> us, local, comm, merge;
  int runs = 0;
};

// Warm-up calls, then timed calls in lockstep: before each, every rank learns rank 0's decision
// to go on from one all-gather of a byte, which also starts the ranks together. Rank 0 goes on
// until it has timed min_runs calls and spent min_seconds (or timed max_runs). On a GPU a call's
// time runs until its stream's work has completed (comm.synchronize).
Calls time_lockstep(parallel::Communicator& comm, const std::function<void()>& call,
                    CpTiming& timing, const BenchOptions& o) {
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < o.warmup; ++i) {
    call();
    comm.synchronize(Stream{});
  }
  Calls t;
  std::vector<uint8_t> go(comm.size());
  const Clock::time_point start = Clock::now();
  for (;;) {
    const double spent = std::chrono::duration<double>(Clock::now() - start).count();
    const uint8_t mine = t.runs < o.min_runs || (spent < o.min_seconds && t.runs < o.max_runs);
    parallel::all_gather_host(comm, &mine, 1, go.data());
    if (go[0] == 0) break;
    timing = CpTiming{};
    const Clock::time_point t0 = Clock::now();
    call();
    comm.synchronize(Stream{});
    const Clock::time_point t1 = Clock::now();
    t.us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    t.local.push_back(timing.local_us);
    t.comm.push_back(timing.comm_us);
    t.merge.push_back(timing.merge_us);
    t.runs++;
  }
  return t;
}

// A rank's median call (of an even count, the faster of the middle two): its time and its
// phases, which add up to it but for the clock reads (the medians of each phase taken apart would
// not: one rank's slow local pass is another rank's long wait in the collective).
struct MedianCall {
  double us = 0;
  CpTiming phases;
};

MedianCall median_call(const Calls& t) {
  MedianCall m;
  if (t.runs == 0) return m;
  std::vector<int> order(t.runs);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return t.us[a] < t.us[b]; });
  const int i = order[(t.runs - 1) / 2];
  m.us = t.us[i];
  m.phases = CpTiming{t.local[i], t.comm[i], t.merge[i]};
  return m;
}

// Plans the case on `comm`, builds this rank's share and times it.
Calls time_case(const BenchCase& c, parallel::Communicator& comm,
                const parallel::CpOptions& options, const BenchOptions& o) {
  const int rank = comm.rank();
  Share s;
  CpTiming timing;
  AttentionOptions opt;
  opt.logits_soft_cap = c.logit_cap;
  opt.causal = c.causal;
  if (c.sinks) {
    s.sinks = random_tensor({c.num_qo_heads}, DType::f32, o.seed + 7, c.device);
    opt.sinks = s.sinks;
  }
  if (c.op == BenchOp::decode) {
    parallel::CpDecodeShape shape;
    shape.kv_len.assign(c.batch, c.kv_len);
    shape.num_qo_heads = c.num_qo_heads;
    shape.num_kv_heads = c.num_kv_heads;
    shape.head_dim_qk = shape.head_dim_v = c.head_dim;
    shape.page_size = c.page_size;
    shape.dtype = c.dtype;
    parallel::CpDecode decode(comm, options);
    decode.plan(shape);
    decode.set_timing(&timing);
    // Every rank holds the same queries; the KV of its positions differs from rank to rank.
    make_pool(c, decode.local_kv_len().empty() ? 0 : decode.local_kv_len()[0],
              o.seed + 100 * (rank + 1), s);
    s.q = random_tensor({c.batch, c.num_qo_heads, c.head_dim}, c.dtype, o.seed, c.device);
    s.out = Tensor::empty({c.batch, c.num_qo_heads, c.head_dim}, c.dtype, c.device);
    return time_lockstep(
        comm, [&] { decode.run(s.q, s.paged, opt, s.out, TensorView()); }, timing, o);
  }
  parallel::CpExtendShape shape;
  shape.prefix_len.assign(c.batch, c.prefix_len());
  shape.extend_len.assign(c.batch, c.qo_len);
  shape.num_qo_heads = c.num_qo_heads;
  shape.num_kv_heads = c.num_kv_heads;
  shape.head_dim_qk = shape.head_dim_v = c.head_dim;
  shape.page_size = c.page_size;
  shape.dtype = c.dtype;
  shape.causal = c.causal;
  parallel::CpExtend extend(comm, options);
  extend.plan(shape);
  extend.set_timing(&timing);
  make_pool(c, extend.local_prefix_len().empty() ? 0 : extend.local_prefix_len()[0],
            o.seed + 100 * (rank + 1), s);
  // This rank's new tokens (its zigzag rows of every request).
  const int64_t own = extend.num_own_rows();
  const uint64_t seed = o.seed + 1000 * (rank + 1);
  s.q = random_tensor({own, c.num_qo_heads, c.head_dim}, c.dtype, seed, c.device);
  s.k = random_tensor({own, c.num_kv_heads, c.head_dim}, c.dtype, seed + 1, c.device);
  s.v = random_tensor({own, c.num_kv_heads, c.head_dim}, c.dtype, seed + 2, c.device);
  s.out = Tensor::empty({own, c.num_qo_heads, c.head_dim}, c.dtype, c.device);
  return time_lockstep(
      comm, [&] { extend.run(s.q, s.k, s.v, s.paged, opt, s.out, TensorView()); }, timing, o);
}

}  // namespace

std::vector<BenchCase> cp_grid(const std::string& name, Device device) {
  if (name == "quick") return {decode_case(1, 16384, device), extend_case(1, 16384, 16, device)};
  FLASHKV_CHECK(name == "full", "grid: expected quick or full, got '", name, "'");
  return {decode_case(1, 262144, device), decode_case(1, 1048576, device),
          extend_case(1, 262144, 1024, device)};
}

CpCaseResult run_cp_case(const BenchCase& c, parallel::Communicator& comm,
                         const parallel::CpOptions& options, const Roofline& machine,
                         const BenchOptions& o) {
  validate_case(c);
  FLASHKV_CHECK(c.op == BenchOp::decode || c.op == BenchOp::extend,
                "op: the context-parallel cases are decode and extend, got ", op_name(c.op));
  FLASHKV_CHECK(c.window_left < 0, "window_left: the context-parallel cases take no window, got ",
                c.window_left);
  FLASHKV_CHECK(comm.device() == c.device && machine.device == c.device,
                "device: a context-parallel case runs where the communicator's buffers live, "
                "with the roofline measured there; got the case on ",
                c.device.str(), ", the communicator on ", comm.device().str(), ", the roofline on ",
                machine.device.str());
  FLASHKV_CHECK(o.min_runs >= 1 && o.max_runs >= o.min_runs && o.warmup >= 0,
                "BenchOptions: expected warmup >= 0 and 1 <= min_runs <= max_runs, got ", o.warmup,
                ", ", o.min_runs, ", ", o.max_runs);
  const int world = comm.size();
  CpCaseResult r;
  r.options = options;
  // Rank 0 alone first (the others wait at the barrier), then every rank: the two never share
  // the machine, and the one-rank share is freed before the sharded ones are built.
  MedianCall one;
  if (comm.rank() == 0) {
    parallel::OneRankCommunicator alone(c.device);
    const Calls t = time_case(c, alone, options, o);
    one = median_call(t);
    r.one_rank.runs = t.runs;
  }
  comm.barrier();
  const Calls t = time_case(c, comm, options, o);
  const MedianCall mine = median_call(t);
  // Every rank's median call (and rank 0's one-rank one) to every rank.
  constexpr int kFields = 9;
  const double send[kFields] = {mine.us,
                                mine.phases.local_us,
                                mine.phases.comm_us,
                                mine.phases.merge_us,
                                one.us,
                                one.phases.local_us,
                                one.phases.comm_us,
                                one.phases.merge_us,
                                double(r.one_rank.runs)};
  std::vector<double> all(size_t(kFields) * world);
  parallel::all_gather_host(comm, send, sizeof send, all.data());
  r.one_rank.c = c;
  r.one_rank.us = all[4];
  r.one_rank.runs = static_cast<int>(all[8]);
  r.one_rank_phases = {CpTiming{all[5], all[6], all[7]}};
  set_rates(r.one_rank, machine);
  r.sharded.c = c;
  r.sharded.runs = t.runs;
  for (int s = 0; s < world; ++s) {
    const double* f = all.data() + size_t(kFields) * s;
    r.sharded.us = std::max(r.sharded.us, f[0]);
    r.sharded_phases.push_back(CpTiming{f[1], f[2], f[3]});
  }
  set_rates(r.sharded, machine, world);
  r.speedup = r.sharded.us > 0 ? r.one_rank.us / r.sharded.us : 0;
  return r;
}

}  // namespace flashkv::bench
