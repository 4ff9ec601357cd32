// Stream capture for the GPU tests: what a function enqueues, as a CUDA graph, with the capture
// ended on every path out. Include only where FLASHKV_WITH_CUDA is set.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <functional>

namespace flashkv::test {

// Captures (thread-local mode) what `fn` enqueues on `stream`; returns the graph, or null after
// a failure that it reports. When `fn` throws, the capture is ended and its partial graph
// destroyed before the exception goes on: a capture left open would make the thread's later
// synchronizing calls (every test after this one) fail with cudaErrorStreamCaptureUnsupported.
inline cudaGraph_t capture_graph(cudaStream_t stream, const std::function<void()>& fn) {
  const cudaError_t begin = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  if (begin != cudaSuccess) {
    ADD_FAILURE() << "cudaStreamBeginCapture: " << cudaGetErrorString(begin);
    return nullptr;
  }
  struct EndOnUnwind {
    cudaStream_t stream;
    bool ended = false;
    ~EndOnUnwind() {
      if (ended) return;
      cudaGraph_t partial = nullptr;
      if (cudaStreamEndCapture(stream, &partial) == cudaSuccess && partial != nullptr)
        cudaGraphDestroy(partial);
      (void)cudaGetLastError();
    }
  } guard{stream};
  fn();
  guard.ended = true;
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  if (end != cudaSuccess) {
    ADD_FAILURE() << "cudaStreamEndCapture: " << cudaGetErrorString(end);
    return nullptr;
  }
  return graph;
}

}  // namespace flashkv::test
