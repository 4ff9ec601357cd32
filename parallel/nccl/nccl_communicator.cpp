// The NCCL communicator: every collective is only enqueued on the caller's stream (so a CUDA
// graph can capture it); synchronize() waits for the stream against a deadline.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <thread>

#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"
#include "flashkv/parallel/nccl.h"

namespace flashkv::parallel {

namespace {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, Device device, const CommOptions& options)
      : comm_(comm), device_(device), options_(options) {
    FLASHKV_CHECK(comm != nullptr, "make_nccl_communicator: comm is null");
    FLASHKV_CHECK(device.is_cuda(), "make_nccl_communicator: device ", device.str(),
                  ": expected a CUDA device");
    check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check(ncclCommCount(comm_, &size_), "ncclCommCount");
    int comm_device = -1;
    check(ncclCommCuDevice(comm_, &comm_device), "ncclCommCuDevice");
    FLASHKV_CHECK(comm_device == device.index, "make_nccl_communicator: device ", device.str(),
                  ": the NCCL communicator was created on cuda:", comm_device);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  std::string name() const override { return "NCCL"; }

  void all_gather(const void* send, size_t bytes, void* recv, Stream stream) override {
    ready("all_gather");
    flashkv::detail::cuda_set_device(device_);
    check(ncclAllGather(send, recv, bytes, ncclUint8, comm_, cuda_stream(stream)), "ncclAllGather");
  }

  // Uneven sizes: point-to-point sends and receives, grouped into one collective.
  void all_gather_v(const void* send, void* recv, const std::vector<size_t>& counts,
                    const std::vector<size_t>& displs, Stream stream) override {
    ready("all_gather_v");
    check_counts(*this, "all_gather_v", counts, displs, "counts", "displs");
    flashkv::detail::cuda_set_device(device_);
    const cudaStream_t s = cuda_stream(stream);
    copy_to_self(static_cast<char*>(recv) + displs[rank_], send, counts[rank_], s);
    check(ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      if (counts[rank_] > 0)
        check(ncclSend(send, counts[rank_], ncclUint8, p, comm_, s), "ncclSend");
      if (counts[p] > 0)
        check(ncclRecv(static_cast<char*>(recv) + displs[p], counts[p], ncclUint8, p, comm_, s),
              "ncclRecv");
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
  }

  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts,
                    const std::vector<size_t>& send_displs, void* recv,
                    const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                    Stream stream) override {
    ready("all_to_all_v");
    check_counts(*this, "all_to_all_v", send_counts, send_displs, "send_counts", "send_displs");
    check_counts(*this, "all_to_all_v", recv_counts, recv_displs, "recv_counts", "recv_displs");
    FLASHKV_CHECK(send_counts[rank_] == recv_counts[rank_], "NCCL all_to_all_v: recv_counts[",
                  rank_, "] = ", recv_counts[rank_], ": expected send_counts[", rank_,
                  "] = ", send_counts[rank_], " (this rank sends to itself)");
    flashkv::detail::cuda_set_device(device_);
    const cudaStream_t s = cuda_stream(stream);
    copy_to_self(static_cast<char*>(recv) + recv_displs[rank_],
                 static_cast<const char*>(send) + send_displs[rank_], send_counts[rank_], s);
    check(ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      if (send_counts[p] > 0)
        check(ncclSend(static_cast<const char*>(send) + send_displs[p], send_counts[p], ncclUint8,
                       p, comm_, s),
              "ncclSend");
      if (recv_counts[p] > 0)
        check(ncclRecv(static_cast<char*>(recv) + recv_displs[p], recv_counts[p], ncclUint8, p,
                       comm_, s),
              "ncclRecv");
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
  }

  void broadcast(void* data, size_t bytes, int root, Stream stream) override {
    ready("broadcast");
    FLASHKV_CHECK(root >= 0 && root < size_, "NCCL broadcast: root = ", root, ": expected 0..",
                  size_ - 1);
    flashkv::detail::cuda_set_device(device_);
    check(ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, cuda_stream(stream)),
          "ncclBroadcast");
  }

  // Point to point, grouped so that the ring's sends and receives cannot deadlock; a rank that is
  // its own dest copies on the stream.
  void send_recv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                 int source, Stream stream) override {
    ready("send_recv");
    check_send_recv(*this, dest, source, send_bytes, recv_bytes);
    flashkv::detail::cuda_set_device(device_);
    const cudaStream_t s = cuda_stream(stream);
    if (dest == rank_) {
      copy_to_self(recv, send, send_bytes, s);
      return;
    }
    check(ncclGroupStart(), "ncclGroupStart");
    if (send_bytes > 0) check(ncclSend(send, send_bytes, ncclUint8, dest, comm_, s), "ncclSend");
    if (recv_bytes > 0) check(ncclRecv(recv, recv_bytes, ncclUint8, source, comm_, s), "ncclRecv");
    check(ncclGroupEnd(), "ncclGroupEnd");
  }

  // An all-reduce of nothing would not synchronize the hosts: this is a one-byte all-gather on a
  // private stream, waited for with the timeout.
  void barrier() override {
    ready("barrier");
    flashkv::detail::cuda_set_device(device_);
    if (!barrier_stream_) {
      flashkv::detail::cuda_check(
          cudaStreamCreateWithFlags(&barrier_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
      barrier_buf_ = flashkv::detail::cuda_malloc(static_cast<size_t>(size_) + 1, device_);
    }
    check(ncclAllGather(static_cast<char*>(barrier_buf_) + size_, barrier_buf_, 1, ncclUint8, comm_,
                        barrier_stream_),
          "ncclAllGather (barrier)");
    wait(barrier_stream_, "barrier");
  }

  void synchronize(Stream stream) override {
    ready("synchronize");
    flashkv::detail::cuda_set_device(device_);
    wait(cuda_stream(stream), "synchronize");
  }

  ~NcclCommunicator() override {
    if (barrier_stream_) cudaStreamDestroy(barrier_stream_);
    if (barrier_buf_) flashkv::detail::cuda_free(barrier_buf_, device_);
  }

 private:
  static cudaStream_t cuda_stream(Stream s) { return static_cast<cudaStream_t>(s.handle); }
  void check(ncclResult_t r, const char* call) const {
    if (r == ncclSuccess || r == ncclInProgress) return;
    throw_error(str_cat(call, ": NCCL error ", static_cast<int>(r), " (", ncclGetErrorString(r),
                        ") on rank ", rank_, " of ", size_));
  }
  void copy_to_self(void* dst, const void* src, size_t bytes, cudaStream_t s) const {
    if (bytes == 0 || dst == src) return;
    flashkv::detail::cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s),
                                "cudaMemcpyAsync (NCCL communicator, this rank's part)");
  }
  void ready(const char* what) const {
    FLASHKV_CHECK(!broken_, "NCCL ", what, ": the communicator is unusable since an earlier ",
                  "wait failed (", broken_why_, ")");
  }
  // Polls the stream and NCCL's asynchronous error until the stream is idle or the timeout
  // passes; then aborts the NCCL communicator (which ends its kernels) and throws.
  void wait(cudaStream_t s, const char* what) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) flashkv::detail::cuda_check(q, "cudaStreamQuery");
      ncclResult_t async = ncclSuccess;
      check(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
      if (async != ncclSuccess && async != ncclInProgress) {
        fail(what, str_cat("NCCL reported ", ncclGetErrorString(async)));
      }
      if (options_.timeout_s > 0 &&
          std::chrono::duration<double>(clock::now() - start).count() > options_.timeout_s) {
        fail(what, str_cat("rank ", rank_, " of ", size_, " waited ", options_.timeout_s,
                           " s for the other ranks, which did not join (a rank exited, failed "
                           "before this collective, or called a different one)"));
      }
      if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  [[noreturn]] void fail(const char* what, const std::string& why) {
    broken_ = true;
    broken_why_ = why;
    ncclCommAbort(comm_);
    throw_error(str_cat("NCCL ", what, ": ", why, "; the communicator was aborted"));
  }

  ncclComm_t comm_;
  Device device_;
  CommOptions options_;
  int rank_ = 0, size_ = 1;
  bool broken_ = false;
  std::string broken_why_;
  cudaStream_t barrier_stream_ = nullptr;
  void* barrier_buf_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm* comm, Device device,
                                                     const CommOptions& options) {
  return std::make_unique<NcclCommunicator>(comm, device, options);
}

}  // namespace flashkv::parallel
