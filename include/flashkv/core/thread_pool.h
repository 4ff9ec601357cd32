// A fixed pool of worker threads for the CPU kernels.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace flashkv {

class ThreadPool {
 public:
  // num_threads <= 0: FLASHKV_NUM_THREADS if set, else the hardware thread count.
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }

  // Calls fn(i, worker) for every i in [0, n), handing indices out dynamically to the workers
  // (the calling thread is worker 0); returns when all are done. The first exception thrown by
  // fn is rethrown here. A call from inside a worker runs serially on that worker.
  void parallel_for(int64_t n, const std::function<void(int64_t i, int worker)>& fn);

  // The process-wide pool the CPU kernels use.
  static ThreadPool& global();

 private:
  void worker_loop(int worker);
  void run_chunk(int worker);

  int num_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0;
  std::atomic<int64_t> next_{0};  // next index to hand out
  uint64_t generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace flashkv
