// Internal: timing on a CUDA device (cuda_timing.cu, built only with CUDA): CUDA-event timers,
// and the timing of a run for the attention benchmark. The standalone benchmarks
// (bench/cuda_*_bench.cu) use the event timer too.
#pragma once

#include <functional>
#include <vector>

#include "attention_bench.h"
#include "flashkv/core/device.h"

namespace flashkv::bench::detail {

struct TimedRuns {
  std::vector<double> us;  // one sample per timed replay: its time divided by the runs it holds
  int runs = 0;            // runs timed in total
  bool cuda_graph = false;
};

#if FLASHKV_WITH_CUDA
// Two CUDA events recorded on `stream` around what a callable enqueues there. Errors throw
// flashkv::Error (detail::cuda_check).
class EventTimer {
 public:
  explicit EventTimer(Stream stream);
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  // Milliseconds the device takes for what launch() enqueues on the stream (waits for it).
  float time_ms(const std::function<void()>& launch);
  // The median of `reps` (>= 1) such timings, one after the other.
  float median_ms(int reps, const std::function<void()>& launch);

 private:
  void* stream_;
  void* start_ = nullptr;
  void* stop_ = nullptr;
};

// Times run(stream) on `device`: options.warmup direct calls, then enough calls to last about a
// millisecond captured into one CUDA graph whose replays are timed with events, so launch
// overhead is out. When run cannot be captured (it synchronizes or allocates), times direct
// calls with events instead (cuda_graph = false).
TimedRuns time_cuda(Device device, const std::function<void(Stream)>& run,
                    const BenchOptions& options);
#endif

}  // namespace flashkv::bench::detail
