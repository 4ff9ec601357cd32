// Strided byte copies on one device, ordered on the stream for a GPU (graph-capturable: they
// only enqueue), the grow-only buffers of the sharded operators, and the clock of their phases.
#pragma once

#include <chrono>
#include <cstddef>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/parallel/communicator.h"
#include "flashkv/parallel/context_parallel.h"

namespace flashkv::parallel::detail {

// `height` rows of `width` bytes: row r from src + r * spitch to dst + r * dpitch.
void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
             Device device, Stream stream);

// Makes bufs[i] at least `bytes` long on `device` (contents lost when it grows) and returns its
// memory.
void* reserve(std::vector<Buffer>& bufs, size_t i, size_t bytes, Device device);

// A contiguous view over `data`.
TensorView view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device);

// The phase clock of a run() given a CpTiming: each call ends a phase (after the stream's work
// completes) and adds the time since the previous one, or since construction, to its field.
// Without a CpTiming every call returns at once.
class PhaseClock {
 public:
  PhaseClock(CpTiming* timing, Communicator& comm, Stream stream)
      : timing_(timing), comm_(comm), stream_(stream) {
    if (timing_) last_ = Clock::now();
  }
  void local() { end(&CpTiming::local_us); }
  void comm() { end(&CpTiming::comm_us); }
  void merge() { end(&CpTiming::merge_us); }

 private:
  using Clock = std::chrono::steady_clock;
  void end(double CpTiming::*field) {
    if (!timing_) return;
    comm_.synchronize(stream_);
    const Clock::time_point now = Clock::now();
    timing_->*field += std::chrono::duration<double, std::micro>(now - last_).count();
    last_ = now;
  }
  CpTiming* timing_;
  Communicator& comm_;
  Stream stream_;
  Clock::time_point last_;
};

}  // namespace flashkv::parallel::detail
