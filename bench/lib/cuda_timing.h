// Internal: timing of a run on a CUDA device (cuda_timing.cu, built only with CUDA).
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
// Times run(stream) on `device`: options.warmup direct calls, then enough calls to last about a
// millisecond captured into one CUDA graph whose replays are timed with events, so launch
// overhead is out. When run cannot be captured (it synchronizes or allocates), times direct
// calls with events instead (cuda_graph = false).
TimedRuns time_cuda(Device device, const std::function<void(Stream)>& run,
                    const BenchOptions& options);
#endif

}  // namespace flashkv::bench::detail
