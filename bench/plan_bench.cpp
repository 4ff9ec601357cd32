// Host time of plan_decode / plan_prefill in the steady state (the `Plan* out` form, reusing the
// previous plan's vectors), on an H100-like CUDA DeviceInfo (132 SMs) and on a 64-thread CPU.
// The target: plan_decode for 256 requests and plan_prefill for 64 requests under 5 us. The
// batches, the runner and the timing loop are bench/lib/plan_timing.h's, shared with
// `flashkv bench` (whose plan lines are the last cases here). Built with Google Benchmark when
// it is installed; otherwise a plain timing loop prints the median and the minimum of 15 repeats
// of 2000 calls. Results and method: docs/perf/planner.md, section "Planner".
#include <cstdio>
#include <string>
#include <vector>

#include "flashkv/plan/plan.h"
#include "lib/plan_timing.h"

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

using bench::PlanCase;
using bench::PlanKind;

std::vector<PlanCase> cases() {
  std::vector<PlanCase> c;
  PlanOptions dflt;
  PlanOptions graph;
  graph.cuda_graph = true;
  graph.max_batch_size = 256;
  graph.max_num_tokens = 64 * 512;
  PlanOptions fixed;
  fixed.fixed_split_size = 2048;
  const DeviceInfo gpu = cuda_like(), cpu = cpu_like();
  const PlanKind decode = PlanKind::decode, prefill = PlanKind::prefill;
  c.push_back({"decode/b256/kv8k/cuda", decode, 256, 8192, 1, gpu, dflt});
  c.push_back({"decode/b256/kv8k/cuda/hkv1", decode, 256, 8192, 1, gpu, dflt, 1});
  c.push_back({"decode/b256/kv8k/cuda/graph", decode, 256, 8192, 1, gpu, graph});
  c.push_back({"decode/b256/kv8k/cuda/fixed2048", decode, 256, 8192, 1, gpu, fixed});
  c.push_back({"decode/b256/kv8k/cpu", decode, 256, 8192, 1, cpu, dflt});
  c.push_back({"decode/b8/kv32k/cuda (split)", decode, 8, 32768, 1, gpu, dflt});
  // 64 requests sharing SGLang's default chunked-prefill budget of 8192 tokens (128 on average),
  // then a heavier batch of up to 512 new tokens each (16k in all).
  c.push_back({"prefill/b64/q256/kv4k/cuda", prefill, 64, 4096, 255, gpu, dflt});
  c.push_back({"prefill/b64/q256/kv4k/cpu", prefill, 64, 4096, 255, cpu, dflt});
  c.push_back({"prefill/b64/q512/kv4k/cuda", prefill, 64, 4096, 512, gpu, dflt});
  c.push_back({"prefill/b64/q512/kv4k/cuda/graph", prefill, 64, 4096, 512, gpu, graph});
  c.push_back({"prefill/b64/q512/kv4k/cpu", prefill, 64, 4096, 512, cpu, dflt});
  c.push_back({"prefill/b4/q64/kv32k/cuda (split)", prefill, 4, 32768, 64, gpu, dflt});
  // 256 requests (the batch of the decode target) sharing about 8192 new tokens, the sizes of
  // `flashkv bench`'s plan lines (bench_plan_grid): new tokens only, then an extend on cached
  // prefixes, as one plan and as the ragged path's two.
  for (PlanCase p : bench::bench_plan_grid(gpu)) {
    p.name += "/cuda";
    c.push_back(p);
  }
  return c;
}

}  // namespace
}  // namespace flashkv

#if FLASHKV_PLAN_BENCH_GBENCH

int main(int argc, char** argv) {
  for (const flashkv::bench::PlanCase& c : flashkv::cases()) {
    benchmark::RegisterBenchmark(c.name.c_str(), [c](benchmark::State& state) {
      flashkv::bench::PlanRunner r(c);
      for (auto _ : state) {
        r.step();
        benchmark::ClobberMemory();
      }
      state.SetLabel(flashkv::bench::plan_counts(r).summary());
    });
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

#else

int main() {
  std::printf("%-36s %10s %10s  %s\n", "case", "median us", "min us", "plan");
  for (const flashkv::bench::PlanCase& c : flashkv::cases()) {
    const flashkv::bench::PlanTiming t = flashkv::bench::time_plan(c, 2000, 15);
    std::printf("%-36s %10.2f %10.2f  %s\n", c.name.c_str(), t.median_us, t.min_us,
                t.summary().c_str());
  }
  return 0;
}

#endif
