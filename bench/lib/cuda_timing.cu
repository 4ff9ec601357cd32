// CUDA timing for the attention benchmark: runs captured into a CUDA graph, replays timed with
// events.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "cuda_timing.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"

namespace flashkv::bench::detail {
namespace {

void check(cudaError_t e, const char* what) {
  flashkv::detail::cuda_check(static_cast<int>(e), what);
}

// Owns the stream, events and graph of one timing session.
struct Session {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  Session() {
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~Session() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Milliseconds taken by launch() on the stream.
  template <typename Launch>
  float time_ms(const Launch& launch) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    launch();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return ms;
  }

  // Captures `calls` runs into a graph; false (with the stream usable again) when run cannot be
  // captured.
  bool capture(const std::function<void(Stream)>& run, int calls) {
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    bool ok = true;
    try {
      for (int i = 0; i < calls; ++i) run(Stream{stream});
    } catch (const Error&) {
      ok = false;
    }
    cudaGraph_t g = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream, &g);
    if (!ok || end != cudaSuccess || g == nullptr) {
      if (g) cudaGraphDestroy(g);
      cudaGetLastError();
      return false;
    }
    graph = g;
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
      cudaGetLastError();
      exec = nullptr;
      return false;
    }
    return true;
  }
};

}  // namespace

TimedRuns time_cuda(Device device, const std::function<void(Stream)>& run,
                    const BenchOptions& options) {
  flashkv::detail::cuda_set_device(device);
  Session s;
  const Stream stream{s.stream};
  for (int i = 0; i < options.warmup; ++i) run(stream);
  check(cudaStreamSynchronize(s.stream), "benchmark warm-up");
  // Runs per graph: enough for about a millisecond, from one directly timed run.
  const float one_ms = s.time_ms([&] { run(stream); });
  const int per_graph =
      std::clamp(static_cast<int>(std::ceil(1.0 / std::max(one_ms, 1e-4f))), 1, 500);

  TimedRuns t;
  t.cuda_graph = s.capture(run, per_graph);
  if (t.cuda_graph) {  // one untimed replay loads the graph
    check(cudaGraphLaunch(s.exec, s.stream), "cudaGraphLaunch");
    check(cudaStreamSynchronize(s.stream), "cudaStreamSynchronize");
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int min_samples = std::max(options.min_runs, 3);
  for (;;) {
    const float ms = s.time_ms([&] {
      if (t.cuda_graph) {
        check(cudaGraphLaunch(s.exec, s.stream), "cudaGraphLaunch");
      } else {
        for (int i = 0; i < per_graph; ++i) run(stream);
      }
    });
    t.us.push_back(1e3 * ms / per_graph);
    t.runs += per_graph;
    const double spent =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int n = static_cast<int>(t.us.size());
    if (n >= min_samples && (spent >= options.min_seconds || n >= options.max_runs)) break;
  }
  return t;
}

}  // namespace flashkv::bench::detail
