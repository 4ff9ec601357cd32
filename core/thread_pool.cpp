#include "flashkv/core/thread_pool.h"

#include "flashkv/core/options.h"

namespace flashkv {
namespace {
thread_local bool t_in_worker = false;
}

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) {
    num_threads = env_num_threads();
    if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
    if (num_threads <= 0) num_threads = 1;
  }
  num_threads_ = num_threads;
  for (int w = 1; w < num_threads_; ++w) threads_.emplace_back([this, w] { worker_loop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool;
  return pool;
}

void ThreadPool::run_chunk(int worker) {
  const bool was_in_worker = t_in_worker;
  t_in_worker = true;
  for (;;) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= job_n_) break;
    try {
      (*job_)(i, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(job_n_, std::memory_order_relaxed);  // stop handing out work
    }
  }
  t_in_worker = was_in_worker;
}

void ThreadPool::worker_loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_chunk(worker);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  if (t_in_worker || num_threads_ == 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  // One job at a time: concurrent callers from different host threads take turns.
  static std::mutex job_mu;
  std::lock_guard<std::mutex> job_lock(job_mu);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    next_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    active_ = num_threads_ - 1;
    ++generation_;
  }
  wake_.notify_all();
  run_chunk(0);
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return active_ == 0; });
    job_ = nullptr;
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace flashkv
