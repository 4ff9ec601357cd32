// CUDA timing for the attention benchmark: runs captured into a CUDA graph, replays timed with
// events.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <vector>

#include "cuda_timing.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"

namespace flashkv::bench::detail {
namespace {

using flashkv::detail::cuda_check;

// Owns the stream, events and graph of one timing session.
struct Session {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::optional<EventTimer> timer;
  Session() {
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    timer.emplace(Stream{stream});
  }
  ~Session() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    timer.reset();
    cudaStreamDestroy(stream);
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Milliseconds taken by launch() on the stream.
  float time_ms(const std::function<void()>& launch) { return timer->time_ms(launch); }

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

EventTimer::EventTimer(Stream stream) : stream_(stream.handle) {
  cudaEvent_t start, stop;
  cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  start_ = start;
  cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  stop_ = stop;
}

EventTimer::~EventTimer() {
  cudaEventDestroy(static_cast<cudaEvent_t>(start_));
  if (stop_) cudaEventDestroy(static_cast<cudaEvent_t>(stop_));
}

float EventTimer::time_ms(const std::function<void()>& launch) {
  const auto stream = static_cast<cudaStream_t>(stream_);
  const auto start = static_cast<cudaEvent_t>(start_), stop = static_cast<cudaEvent_t>(stop_);
  cuda_check(cudaEventRecord(start, stream), "cudaEventRecord");
  launch();
  cuda_check(cudaEventRecord(stop, stream), "cudaEventRecord");
  cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  return ms;
}

float EventTimer::median_ms(int reps, const std::function<void()>& launch) {
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) t.push_back(time_ms(launch));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

TimedRuns time_cuda(Device device, const std::function<void(Stream)>& run,
                    const BenchOptions& options) {
  flashkv::detail::cuda_set_device(device);
  Session s;
  const Stream stream{s.stream};
  for (int i = 0; i < options.warmup; ++i) run(stream);
  cuda_check(cudaStreamSynchronize(s.stream), "benchmark warm-up");
  // Runs per graph: enough for about a millisecond, from one directly timed run.
  const float one_ms = s.time_ms([&] { run(stream); });
  const int per_graph =
      std::clamp(static_cast<int>(std::ceil(1.0 / std::max(one_ms, 1e-4f))), 1, 500);

  TimedRuns t;
  t.cuda_graph = s.capture(run, per_graph);
  if (t.cuda_graph) {  // one untimed replay loads the graph
    cuda_check(cudaGraphLaunch(s.exec, s.stream), "cudaGraphLaunch");
    cuda_check(cudaStreamSynchronize(s.stream), "cudaStreamSynchronize");
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int min_samples = std::max(options.min_runs, 3);
  for (;;) {
    const float ms = s.time_ms([&] {
      if (t.cuda_graph) {
        cuda_check(cudaGraphLaunch(s.exec, s.stream), "cudaGraphLaunch");
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
