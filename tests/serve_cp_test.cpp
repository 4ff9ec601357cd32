// Context parallelism in the backend and the serving simulator, on one rank (every build): the
// backend's sharded path (BackendOptions::cp_comm) against the float64 reference through the
// scheduler, what it refuses, the batch it expects, and `flashkv serve --cp 1`. The same paths on
// two and three ranks run under mpirun (CTest: flashkv_serve_cp_*, where MPI is found).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "cp_session.h"
#include "flashkv/backend/multi_step_draft.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/reference/compare.h"
#include "json.h"
#include "scheduler.h"
#include "test_util.h"
#include "workload.h"

namespace flashkv::app {
namespace {

using test::error_of;

SchedulerOptions cp_options(parallel::Communicator& comm, parallel::CpLayout layout) {
  SchedulerOptions o;
  o.kv_slots = 1024;
  o.max_running = 6;
  o.token_budget = 256;
  o.check.enabled = true;
  o.check.layers = 2;
  o.cp.comm = &comm;
  o.cp.options.layout = layout;
  o.cp.options.block = layout == parallel::CpLayout::interleaved ? 1 : 64;
  return o;
}

// The sharded path on one rank: every pass matches the reference (sliding-window, soft-capped and
// sink layers included), the invariants (the rank's share among them) hold after every step, and
// the rank's pool is empty once the prefix cache is flushed.
TEST(ServeCp, OneRankServesCleanOnBothLayouts) {
  for (const parallel::CpLayout layout :
       {parallel::CpLayout::interleaved, parallel::CpLayout::contiguous}) {
    SCOPED_TRACE(layout == parallel::CpLayout::interleaved ? "interleaved" : "contiguous");
    parallel::OneRankCommunicator comm;
    const Workload w = builtin_workload("chat", 10, false, 5);
    ModelConfig m;
    m.num_layers = 2;
    m.sliding_window = 24;
    m.logit_cap = 30;
    m.sinks = true;
    Scheduler s(w, m, Device::cpu(), cp_options(comm, layout));
    ASSERT_NE(s.rank_share(), nullptr);
    int64_t steps = 0;
    while (s.step()) {
      ++steps;
      ASSERT_EQ(s.check_step_invariants(), "") << "step " << steps;
    }
    const ServeStats& st = s.stats();
    EXPECT_EQ(st.requests_done, 10);
    EXPECT_GT(st.checked, 0);
    EXPECT_EQ(st.check_failures, 0) << st.first_failure;
    EXPECT_EQ(st.nonfinite_passes, 0) << st.first_nonfinite;
    EXPECT_GT(st.cached_prompt_tokens, 0);  // prefix blocks shared, so shared local slots too
    EXPECT_EQ(s.rank_share()->slots_in_use(), s.kv_in_use());
    s.flush_prefix_cache();
    EXPECT_EQ(s.kv_in_use(), 0);
    EXPECT_EQ(s.rank_share()->slots_in_use(), 0);
    EXPECT_EQ(s.check_step_invariants(), "");
  }
}

// The end-of-run invariants of a run with context parallelism include the rank's pool.
TEST(ServeCp, RunChecksTheRanksPoolAtTheEnd) {
  parallel::OneRankCommunicator comm;
  const Workload w = builtin_workload("chat", 6, false, 7);
  ModelConfig m;
  m.num_layers = 1;
  Scheduler s(w, m, Device::cpu(), cp_options(comm, parallel::CpLayout::interleaved));
  const ServeStats st = s.run();
  EXPECT_TRUE(st.invariant_failures.empty()) << st.invariant_failures[0];
  EXPECT_EQ(st.check_failures, 0) << st.first_failure;
  EXPECT_GT(s.rank_share()->peak_slots(), 0);
  EXPECT_EQ(s.rank_share()->slots_in_use(), 0);  // the run flushed the cache to check it
}

TEST(ServeCp, RefusesWhatItDoesNotSupport) {
  parallel::OneRankCommunicator comm;
  SchedulerOptions o = cp_options(comm, parallel::CpLayout::interleaved);
  EXPECT_NE(error_of([&] {
              Scheduler(builtin_workload("spec", 3, false, 4), ModelConfig(), Device::cpu(), o);
            }).find("speculative decoding is not supported with context parallelism"),
            std::string::npos);
  BackendOptions b;
  b.device = Device::cpu();
  b.num_qo_heads = 4;
  b.num_kv_heads = 2;
  b.head_dim_qk = 64;
  b.cp_comm = &comm;
  {
    BackendOptions e = b;
    e.is_encoder_decoder = true;
    EXPECT_NE(error_of([&] { FlashKVBackend x(e); }).find("does not support cross attention"),
              std::string::npos);
  }
  {
    // The communicator's buffers must live where the backend runs (here, a GPU's for a CPU
    // backend: refused before anything touches a GPU).
    parallel::OneRankCommunicator gpu_comm(Device::cuda(0));
    BackendOptions e = b;
    e.cp_comm = &gpu_comm;
    EXPECT_NE(error_of([&] {
                FlashKVBackend x(e);
              }).find("needs a communicator on cpu, got one on cuda:0"),
              std::string::npos);
  }
  FlashKVBackend backend(b);
  EXPECT_NE(error_of([&] {
              backend.init_cuda_graph_state(4, 4);
            }).find("CUDA graphs are not supported with context parallelism"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              MultiStepDraftBackend x(b, 2, 2);
            }).find("context parallelism (BackendOptions::cp_comm) is not supported"),
            std::string::npos);
}

// The batch carries the rank's share: each new token this rank holds needs a slot of its pool
// (with one rank, every token), and the rank's req_to_token rows must hold its positions.
TEST(ServeCp, BatchSlotsAreTheRanks) {
  parallel::OneRankCommunicator comm;
  BackendOptions b;
  b.device = Device::cpu();
  b.num_qo_heads = 4;
  b.num_kv_heads = 2;
  b.head_dim_qk = 64;
  b.cp_comm = &comm;
  FlashKVBackend backend(b);
  KVPoolConfig pc;
  pc.num_slots = 64;
  pc.num_kv_heads = 2;
  pc.head_dim_qk = 64;
  KVPool pool(pc);
  ReqToTokenPool r2t(2, 8);
  const int32_t row = (*r2t.alloc(1))[0];
  r2t.write(row, 0, std::vector<int32_t>{1, 2, 3});
  const Tensor rows = Tensor::from_i32({row});
  Tensor loc = Tensor::from_i32({0});
  ForwardBatch fb;
  fb.mode = ForwardMode::DECODE;
  fb.batch_size = 1;
  fb.req_pool_indices = rows;
  fb.seq_lens_cpu = {3};
  fb.out_cache_loc = loc;
  fb.req_to_token_pool = &r2t;
  fb.token_to_kv_pool = &pool;
  EXPECT_NE(error_of([&] {
              backend.init_forward_metadata(fb);
            }).find("batch.out_cache_loc[0] = 0: this rank holds position 2 of request 0"),
            std::string::npos);
  fb.seq_lens_cpu = {9};  // more positions than a row of the rank's req_to_token pool
  loc = Tensor::from_i32({3});
  fb.out_cache_loc = loc;
  EXPECT_NE(error_of([&] {
              backend.init_forward_metadata(fb);
            }).find("more than a row of its req_to_token pool"),
            std::string::npos);
  fb.seq_lens_cpu = {3};
  backend.init_forward_metadata(fb);
  EXPECT_EQ(backend.cp_query_rows(), 1);
}

// The bytes of a tensor on any device, on the host.
std::vector<char> host_bytes(const TensorView& t) {
  std::vector<char> out(t.nbytes());
  copy_bytes(out.data(), Device::cpu(), t.data, t.device, t.nbytes());
  return out;
}

double load_at(const std::vector<char>& bytes, DType dtype, int64_t e) {
  return load_as_double(bytes.data(), dtype, e);
}

// Every forward mode through the backend's context-parallel path (one rank, `comm`, on `dev`)
// against its ordinary path over the same pool contents: the same outputs within the bf16
// tolerance, and the same K/V appended. Layer 0 is windowed, layer 1 full; the verify pass has a
// tree mask. On a GPU the batch (its slots, rows and tree mask) lives on the GPU.
void expect_backend_modes_match(Device dev, parallel::Communicator& comm) {
  FLASHKV_SEEDED_RNG(rng, 2901);
  constexpr int kHq = 4, kHkv = 2, kD = 64, kLayers = 2;
  BackendOptions o;
  o.device = dev;
  o.num_qo_heads = kHq;
  o.num_kv_heads = kHkv;
  o.head_dim_qk = kD;
  o.sliding_window_size = 5;
  FlashKVBackend plain(o);
  o.cp_comm = &comm;
  FlashKVBackend sharded(o);
  KVPoolConfig pc;
  pc.num_slots = 128;
  pc.num_layers = kLayers;
  pc.num_kv_heads = kHkv;
  pc.head_dim_qk = kD;
  KVPool host_pool(pc);
  pc.device = dev;
  KVPool pool_a(pc), pool_b(pc);
  for (int l = 0; l < kLayers; ++l) {
    fill_normal(host_pool.k(l), 11 + l);
    fill_normal(host_pool.v(l), 21 + l);
    for (const KVPool* p : {&pool_a, &pool_b}) {
      copy_bytes(p->k(l).data, dev, host_pool.k(l).data, Device::cpu(), p->k(l).nbytes());
      copy_bytes(p->v(l).data, dev, host_pool.v(l).data, Device::cpu(), p->v(l).nbytes());
    }
  }
  ReqToTokenPool r2t(4, 64, dev);
  std::vector<int32_t> free_slots;
  for (int32_t s = 1; s <= 120; ++s) free_slots.push_back(s);
  std::shuffle(free_slots.begin(), free_slots.end(), rng.gen());
  Sequence seqs[2];
  const int32_t lens[2] = {37, 20};
  for (int i = 0; i < 2; ++i) {
    seqs[i].row = (*r2t.alloc(1))[0];
    append_tokens(
        seqs[i],
        std::vector<int32_t>(free_slots.begin() + 60 * i, free_slots.begin() + 60 * i + lens[i]),
        r2t);
  }
  const std::vector<int32_t> tree = {-1, 0, 0, 1};
  struct Case {
    ForwardMode mode;
    int32_t num_new[2];
  };
  for (const Case& c :
       {Case{ForwardMode::EXTEND, {9, 20}}, Case{ForwardMode::DECODE, {1, 1}},
        Case{ForwardMode::TARGET_VERIFY, {4, 4}}, Case{ForwardMode::DRAFT_EXTEND, {3, 2}},
        Case{ForwardMode::MIXED, {5, 1}}}) {
    SCOPED_TRACE(mode_name(c.mode));
    std::vector<BatchEntry> entries;
    for (int i = 0; i < 2; ++i)
      entries.push_back({&seqs[i], lens[i], c.num_new[i],
                         c.mode == ForwardMode::TARGET_VERIFY ? tree : std::vector<int32_t>()});
    StepBatch step(c.mode, entries, r2t, dev);
    ForwardBatch& b = step.batch();
    ASSERT_EQ(b.out_cache_loc.device, dev);
    const int64_t T = step.num_tokens();
    b.token_to_kv_pool = &pool_a;
    plain.init_forward_metadata(b);
    b.token_to_kv_pool = &pool_b;
    sharded.init_forward_metadata(b);
    ASSERT_EQ(sharded.cp_query_rows(), T);
    for (int l = 0; l < kLayers; ++l) {
      LayerSpec layer;
      layer.layer_id = l;
      layer.num_qo_heads = kHq;
      layer.num_kv_heads = kHkv;
      layer.head_dim_qk = kD;
      if (l == 0) layer.sliding_window_size = 5;
      const Tensor q = test::random_tensor(rng, {T, kHq, kD}, DType::bf16).to(dev);
      const Tensor k = test::random_tensor(rng, {T, kHkv, kD}, DType::bf16).to(dev);
      const Tensor v = test::random_tensor(rng, {T, kHkv, kD}, DType::bf16).to(dev);
      Tensor out_a = Tensor::empty({T, kHq * kD}, DType::bf16, dev);
      Tensor out_b = Tensor::empty({T, kHq * kD}, DType::bf16, dev);
      b.token_to_kv_pool = &pool_a;
      plain.forward(q, k, v, layer, b, true, out_a);
      b.token_to_kv_pool = &pool_b;
      sharded.forward(q, k, v, layer, b, true, out_b);
      const std::vector<char> a = host_bytes(out_a), o_b = host_bytes(out_b);
      double diff = 0, norm = 0;
      for (int64_t e = 0; e < out_a.numel(); ++e) {
        const double x = load_at(a, DType::bf16, e), y = load_at(o_b, DType::bf16, e);
        diff += (x - y) * (x - y);
        norm += x * x;
      }
      EXPECT_GT(norm, 0) << "layer " << l;
      EXPECT_LT(std::sqrt(diff / std::max(norm, 1e-30)), 1e-2) << "layer " << l;
      EXPECT_TRUE(host_bytes(pool_a.k(l)) == host_bytes(pool_b.k(l))) << "layer " << l;
      EXPECT_TRUE(host_bytes(pool_a.v(l)) == host_bytes(pool_b.v(l))) << "layer " << l;
    }
  }
}

TEST(ServeCp, BackendModesMatchTheOrdinaryPath) {
  parallel::OneRankCommunicator comm;
  expect_backend_modes_match(Device::cpu(), comm);
}

// ---- on a GPU (skipped without one) ---------------------------------------------------------

// The GPU's communicators of one rank: the command line's (CpSession: NCCL where the build has
// it, else the one-rank communicator on the GPU) and the one-rank communicator on the GPU.
TEST(ServeCpCuda, BackendModesMatchTheOrdinaryPath) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  std::string error;
  const std::unique_ptr<CpSession> session = CpSession::start(1, Device::cuda(0), error);
  ASSERT_NE(session, nullptr) << error;
  EXPECT_EQ(session->device(), Device::cuda(0));
#if FLASHKV_WITH_NCCL
  EXPECT_EQ(session->comm().name(), "NCCL");
#endif
  {
    SCOPED_TRACE(session->comm().name());
    expect_backend_modes_match(Device::cuda(0), session->comm());
  }
  parallel::OneRankCommunicator one(Device::cuda(0));
  SCOPED_TRACE("one rank on the GPU");
  expect_backend_modes_match(Device::cuda(0), one);
}

// The scheduler's context-parallel path on the GPU (the batches, the rank's share, the checks'
// gathers through the communicator's device buffers) against the float64 reference, with the
// invariants after every step, through the command line's one-rank session.
TEST(ServeCpCuda, OneRankServesClean) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  std::string error;
  const std::unique_ptr<CpSession> session = CpSession::start(1, Device::cuda(0), error);
  ASSERT_NE(session, nullptr) << error;
  for (const parallel::CpLayout layout :
       {parallel::CpLayout::interleaved, parallel::CpLayout::contiguous}) {
    SCOPED_TRACE(layout == parallel::CpLayout::interleaved ? "interleaved" : "contiguous");
    const Workload w = builtin_workload("chat", 10, false, 5);
    ModelConfig m;
    m.num_layers = 2;
    m.sliding_window = 24;
    m.sinks = true;
    Scheduler s(w, m, Device::cuda(0), cp_options(session->comm(), layout));
    int64_t steps = 0;
    while (s.step()) {
      ++steps;
      ASSERT_EQ(s.check_step_invariants(), "") << "step " << steps;
    }
    const ServeStats& st = s.stats();
    EXPECT_EQ(st.requests_done, 10);
    EXPECT_GT(st.checked, 0);
    EXPECT_EQ(st.check_failures, 0) << st.first_failure;
    EXPECT_EQ(st.nonfinite_passes, 0) << st.first_nonfinite;
    s.flush_prefix_cache();
    EXPECT_EQ(s.rank_share()->slots_in_use(), 0);
  }
}

// ---- the command line ----------------------------------------------------------------------

struct CliRun {
  int code = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

CliRun flashkv(const std::string& args) {
  const std::string out = test::temp_file("cp_stdout");
  const std::string err = test::temp_file("cp_stderr");
  const std::string cmd =
      std::string("'") + FLASHKV_CLI_PATH + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

TEST(ServeCp, CommandLineOneRank) {
  const std::string json = test::temp_file("cp_serve.json");
  const CliRun r = flashkv(
      "serve --cp 1 --cp-layout contiguous --requests 6 --layers 2 --check "
      "--quiet --json " +
      json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("context par  1 rank, KV contiguous"), std::string::npos) << r.out;
  const JsonValue j = parse_json(slurp(json));
  const JsonValue* cp = j.find("context_parallel");
  ASSERT_TRUE(cp != nullptr && cp->find("ranks") != nullptr);
  EXPECT_EQ(cp->find("ranks")->number(), 1);
  EXPECT_EQ(j.find("check_failures")->number(), 0);
  EXPECT_TRUE(j.find("invariants_ok")->boolean());
}

// The new tokens' K/V passed round a ring (on one rank, its own block): checked clean, and named
// in the report and the JSON.
TEST(ServeCp, CommandLineOneRankRing) {
  const std::string json = test::temp_file("cp_serve_ring.json");
  const CliRun r = flashkv(
      "serve --cp 1 --cp-kv-pass ring --window 24 --requests 6 --layers 2 --check --quiet "
      "--json " +
      json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("states by all_gather, new K/V by ring"), std::string::npos) << r.out;
  const JsonValue j = parse_json(slurp(json));
  const JsonValue* cp = j.find("context_parallel");
  ASSERT_TRUE(cp != nullptr && cp->find("kv_pass") != nullptr);
  EXPECT_EQ(cp->find("kv_pass")->string(), "ring");
  EXPECT_EQ(j.find("check_failures")->number(), 0);
  EXPECT_TRUE(j.find("invariants_ok")->boolean());
  const CliRun soak = flashkv("soak --cp 1 --cp-kv-pass ring --steps 100 --quiet");
  ASSERT_EQ(soak.code, 0) << soak.out << soak.err;
  EXPECT_NE(soak.out.find("new K/V by ring"), std::string::npos) << soak.out;
}

// soak --cp 1: the invariants after every step, the rank's share among them; speculative
// decoding is off by default with --cp.
TEST(ServeCp, SoakOneRank) {
  const CliRun r = flashkv("soak --cp 1 --steps 150 --quiet");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("context par  1 rank, KV interleaved"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("speculative"), std::string::npos) << r.out;
}

// Each mistake is one line and exit code 2.
TEST(ServeCp, CommandLineRefusals) {
  const std::pair<const char*, const char*> cases[] = {
      {"serve --cp-layout contiguous", "--cp-layout needs --cp N"},
      {"serve --cp 1 --cp-layout rows", "--cp-layout rows: expected interleaved or contiguous"},
      {"serve --cp 1 --cp-block 8", "--cp-block is for --cp-layout contiguous"},
      {"serve --cp 1 --cp-exchange ring", "--cp-exchange ring: expected all_gather or all_to_all"},
      {"serve --cp 1 --cp-kv-pass tree", "--cp-kv-pass tree: expected all_gather or ring"},
      {"serve --cp-kv-pass ring", "--cp-kv-pass needs --cp N"},
      {"serve --cp 1 --workload spec", "speculative decoding is not supported with --cp"},
      {"serve --cp 1 --model t5-base", "models with cross attention"},
      {"serve --cp 0", "--cp"},
      {"soak --cp 1 --speculative on", "speculative decoding is not supported with --cp"},
      {"soak --cp-exchange all_to_all", "--cp-exchange needs --cp N"},
  };
  for (const auto& [args, message] : cases) {
    SCOPED_TRACE(args);
    const CliRun r = flashkv(std::string(args) + " --quiet");
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// bench --cp 1: the context-parallel grid on one rank (no MPI), its breakdown in the table and
// in the JSON.
TEST(ServeCp, BenchOneRank) {
  const std::string json = test::temp_file("cp_bench.json");
  const CliRun r = flashkv(
      "bench --cp 1 --grid quick --op decode --min-seconds 0 --roofline-mb 8 --json " + json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("context parallelism: 1 rank (one rank)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("    sharded: rank 0: local "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("extend "), std::string::npos) << r.out;
  const JsonValue j = parse_json(slurp(json));
  const JsonValue* cp = j.find("cp");
  ASSERT_TRUE(cp != nullptr && cp->find("cases") != nullptr);
  ASSERT_EQ(cp->find("cases")->items().size(), 1u);
  const JsonValue& c = cp->find("cases")->items()[0];
  EXPECT_EQ(c.find("kv_len")->number(), 16384);
  EXPECT_GT(c.find("speedup")->number(), 0);
  EXPECT_EQ(c.find("sharded")->find("phases")->items().size(), 1u);
}

// serve / soak / bench --cp 1 --device cuda on the GPU: the one-rank session's communicator (NCCL
// where the build has it) serves the workload clean against the reference, soaks with the
// invariants after every step, and times the quick grid.
// Without a GPU, --device cuda is refused with one line.
TEST(ServeCpCuda, CommandLineOneRank) {
  if (!cuda_available()) {
    for (const char* cmd : {"serve --cp 1 --device cuda --quiet", "bench --cp 1 --device cuda"}) {
      SCOPED_TRACE(cmd);
      const CliRun r = flashkv(cmd);
      EXPECT_EQ(r.code, 2) << r.err;
      EXPECT_NE(r.err.find("--device cuda: "), std::string::npos) << r.err;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    }
    GTEST_SKIP() << "no GPU";
  }
  const std::string json = test::temp_file("cp_serve_cuda.json");
  CliRun r =
      flashkv("serve --cp 1 --device cuda --requests 8 --layers 4 --check --quiet --json " + json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("context par  1 rank, KV interleaved"), std::string::npos) << r.out;
  JsonValue j = parse_json(slurp(json));
  EXPECT_EQ(j.find("device")->string(), "cuda:0");
  EXPECT_EQ(j.find("context_parallel")->find("ranks")->number(), 1);
  EXPECT_GT(j.find("checked")->number(), 0);
  EXPECT_EQ(j.find("check_failures")->number(), 0);
  EXPECT_TRUE(j.find("invariants_ok")->boolean());

  r = flashkv("soak --cp 1 --device cuda --steps 100 --quiet");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("context par  1 rank, KV interleaved"), std::string::npos) << r.out;

  const std::string bench_json = test::temp_file("cp_bench_cuda.json");
  r = flashkv("bench --cp 1 --device cuda --grid quick --min-seconds 0 --json " + bench_json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
#if FLASHKV_WITH_NCCL
  EXPECT_NE(r.out.find("context parallelism: 1 rank (NCCL)"), std::string::npos) << r.out;
#endif
  EXPECT_NE(r.out.find("    sharded: rank 0: local "), std::string::npos) << r.out;
  j = parse_json(slurp(bench_json));
  const JsonValue* cases = j.find("cp")->find("cases");
  ASSERT_EQ(cases->items().size(), 2u);
  for (const JsonValue& c : cases->items()) {
    EXPECT_GT(c.find("speedup")->number(), 0);
    EXPECT_EQ(c.find("sharded")->find("phases")->items().size(), 1u);
  }
}

// bench --cp's mistakes: one line each, exit code 2.
TEST(ServeCp, BenchCommandLineRefusals) {
  const std::pair<const char*, const char*> cases[] = {
      {"bench --cp-layout contiguous", "--cp-layout needs --cp N"},
      {"bench --cp 1 --op prefill", "--cp times decode and extend"},
      {"bench --cp 1 --op verify", "--cp times decode and extend"},
      {"bench --cp 1 --model llama-3.1-8b", "--model is not supported with --cp"},
      {"bench --cp 1 --csv x.csv", "--csv is not supported with --cp"},
      {"bench --cp 1 --plot x.svg", "--plot is not supported with --cp"},
      {"bench --cp 1 --cp-exchange ring", "--cp-exchange ring: expected all_gather or all_to_all"},
      {"bench --cp 1 --cp-interleave 4 --cp-layout contiguous",
       "--cp-interleave is for --cp-layout interleaved"},
      {"bench --cp 0", "--cp"},
  };
  for (const auto& [args, message] : cases) {
    SCOPED_TRACE(args);
    const CliRun r = flashkv(args);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
}  // namespace flashkv::app
