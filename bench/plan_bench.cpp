// Host time of plan_decode / plan_prefill in the steady state (the `Plan* out` form, reusing the
// previous plan's vectors), on an H100-like CUDA DeviceInfo (132 SMs) and on a 64-thread CPU.
// The target: plan_decode for 256 requests and plan_prefill for 64 requests under 5 us.
// Built with Google Benchmark when it is installed; otherwise a plain timing loop prints the
// median and the minimum of 15 repeats of 2000 calls. Results and method: docs/perf/planner.md,
// section "Planner".
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "flashkv/plan/plan.h"

#if FLASHKV_PLAN_BENCH_GBENCH
#include <benchmark/benchmark.h>
#endif

namespace flashkv {
namespace {

DeviceInfo cuda_like() {
  DeviceInfo d;
  d.device = Device::cuda(0);
  d.name = "cuda-like (132 SMs)";
  d.num_sms = 132;
  return d;
}

DeviceInfo cpu_like() {
  DeviceInfo d;
  d.device = Device::cpu();
  d.name = "cpu (64 threads)";
  d.num_threads = 64;
  return d;
}

// A serving-like batch: KV lengths spread over [1, max_kv], `q_max` new tokens at most (decode:
// none), Llama-3-8B heads (Hq 32, Hkv 8, D 128).
struct BenchBatch {
  std::vector<int32_t> qo_indptr, kv_len;
  BatchShape shape;
};

BenchBatch make_batch(int batch, int max_kv, int q_max, bool decode, uint64_t seed) {
  std::mt19937_64 gen(seed);
  BenchBatch b;
  b.qo_indptr.assign(1, 0);
  for (int i = 0; i < batch; ++i) {
    const int q = decode ? 1 : std::uniform_int_distribution<int>(1, q_max)(gen);
    const int prefix = std::uniform_int_distribution<int>(0, max_kv)(gen);
    b.qo_indptr.push_back(b.qo_indptr.back() + q);
    b.kv_len.push_back(decode ? prefix + 1 : prefix + q);
  }
  BatchShape& s = b.shape;
  s.batch_size = batch;
  s.qo_indptr = decode ? nullptr : b.qo_indptr.data();
  s.kv_len = b.kv_len.data();
  s.num_qo_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim_qk = s.head_dim_v = 128;
  s.causal = !decode;
  return b;
}

struct Case {
  std::string name;
  bool decode;
  int batch, max_kv, q_max;
  DeviceInfo device;
  PlanOptions options;
  int num_kv_heads = 8;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  PlanOptions dflt;
  PlanOptions graph;
  graph.cuda_graph = true;
  graph.max_batch_size = 256;
  graph.max_num_tokens = 64 * 512;
  PlanOptions fixed;
  fixed.fixed_split_size = 2048;
  const DeviceInfo gpu = cuda_like(), cpu = cpu_like();
  c.push_back({"decode/b256/kv8k/cuda", true, 256, 8192, 1, gpu, dflt});
  c.push_back({"decode/b256/kv8k/cuda/hkv1", true, 256, 8192, 1, gpu, dflt, 1});
  c.push_back({"decode/b256/kv8k/cuda/graph", true, 256, 8192, 1, gpu, graph});
  c.push_back({"decode/b256/kv8k/cuda/fixed2048", true, 256, 8192, 1, gpu, fixed});
  c.push_back({"decode/b256/kv8k/cpu", true, 256, 8192, 1, cpu, dflt});
  c.push_back({"decode/b8/kv32k/cuda (split)", true, 8, 32768, 1, gpu, dflt});
  // 64 requests sharing SGLang's default chunked-prefill budget of 8192 tokens (128 on average),
  // then a heavier batch of up to 512 new tokens each (16k in all).
  c.push_back({"prefill/b64/q256/kv4k/cuda", false, 64, 4096, 255, gpu, dflt});
  c.push_back({"prefill/b64/q256/kv4k/cpu", false, 64, 4096, 255, cpu, dflt});
  c.push_back({"prefill/b64/q512/kv4k/cuda", false, 64, 4096, 512, gpu, dflt});
  c.push_back({"prefill/b64/q512/kv4k/cuda/graph", false, 64, 4096, 512, gpu, graph});
  c.push_back({"prefill/b64/q512/kv4k/cpu", false, 64, 4096, 512, cpu, dflt});
  c.push_back({"prefill/b4/q64/kv32k/cuda (split)", false, 4, 32768, 64, gpu, dflt});
  return c;
}

// Plans `c` once per call of `step`, alternating between two batches so that nothing is cached.
struct Runner {
  explicit Runner(const Case& c)
      : c_(c),
        batches_{make_batch(c.batch, c.max_kv, c.q_max, c.decode, 1),
                 make_batch(c.batch, c.max_kv, c.q_max, c.decode, 2)} {
    for (BenchBatch& b : batches_) b.shape.num_kv_heads = c.num_kv_heads;
  }
  void step() {
    const BatchShape& s = batches_[next_ ^= 1].shape;
    if (c_.decode)
      plan_decode(s, c_.device, c_.options, &decode_);
    else
      plan_prefill(s, c_.device, c_.options, &prefill_);
  }
  const Plan& last() const { return c_.decode ? static_cast<const Plan&>(decode_) : prefill_; }

  Case c_;
  BenchBatch batches_[2];
  int next_ = 0;
  DecodePlan decode_;
  PrefillPlan prefill_;
};

std::string summary(const Plan& p) {
  return std::to_string(p.items.size()) + " items, " + std::to_string(p.merges.size()) +
         " merges, " + std::to_string(p.num_workers) + " workers";
}

}  // namespace
}  // namespace flashkv

#if FLASHKV_PLAN_BENCH_GBENCH

int main(int argc, char** argv) {
  for (const flashkv::Case& c : flashkv::cases()) {
    benchmark::RegisterBenchmark(c.name.c_str(), [c](benchmark::State& state) {
      flashkv::Runner r(c);
      for (auto _ : state) {
        r.step();
        benchmark::ClobberMemory();
      }
      state.SetLabel(flashkv::summary(r.last()));
    });
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

#else

int main() {
  using Clock = std::chrono::steady_clock;
  std::printf("%-36s %10s %10s  %s\n", "case", "median us", "min us", "plan");
  for (const flashkv::Case& c : flashkv::cases()) {
    flashkv::Runner r(c);
    constexpr int kCalls = 2000, kRepeats = 15;
    std::vector<double> us;
    for (int rep = 0; rep < kRepeats; ++rep) {
      const auto t0 = Clock::now();
      for (int i = 0; i < kCalls; ++i) r.step();
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / kCalls);
    }
    std::sort(us.begin(), us.end());
    std::printf("%-36s %10.2f %10.2f  %s\n", c.name.c_str(), us[kRepeats / 2], us[0],
                flashkv::summary(r.last()).c_str());
  }
  return 0;
}

#endif
