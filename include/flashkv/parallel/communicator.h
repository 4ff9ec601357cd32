// The communicator seam of context parallelism: the few collectives the sharded attention needs,
// behind an interface the caller supplies (the serving engine owns its communicator). flashkv
// has no transport of its own: the implementations wrap an existing library (MPI for host
// memory, NCCL for GPU memory, see mpi.h and nccl.h in this folder) or, for one rank, none.
//
// Every collective moves bytes between buffers on device(). Every rank of the group calls the
// same collectives in the same order with matching sizes. A collective that waits longer than
// the communicator's timeout for the other ranks (one exited, or failed before joining) throws
// flashkv::Error naming the collective; the communicator is then broken, and every later call
// throws at once.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "flashkv/core/device.h"

namespace flashkv::parallel {

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where the buffers of its collectives live (host memory for MPI, the GPU for NCCL).
  virtual Device device() const = 0;
  // "one rank", "MPI", "NCCL": used in error messages.
  virtual std::string name() const = 0;

  // Rank r's `bytes` bytes from `send` land at recv + r * bytes on every rank (recv holds
  // size() * bytes). `send` may not overlap `recv`.
  virtual void all_gather(const void* send, size_t bytes, void* recv, Stream stream) = 0;
  // Uneven all-gather: rank r sends counts[r] bytes, which land at recv + displs[r] on every
  // rank. counts and displs (size() entries) are the same on every rank.
  virtual void all_gather_v(const void* send, void* recv, const std::vector<size_t>& counts,
                            const std::vector<size_t>& displs, Stream stream) = 0;
  // Rank r gets send_counts[r] bytes from send + send_displs[r]; the bytes from rank r land at
  // recv + recv_displs[r] (recv_counts[r] bytes, which equal what rank r sends this rank).
  virtual void all_to_all_v(const void* send, const std::vector<size_t>& send_counts,
                            const std::vector<size_t>& send_displs, void* recv,
                            const std::vector<size_t>& recv_counts,
                            const std::vector<size_t>& recv_displs, Stream stream) = 0;
  // `bytes` bytes of `data` on rank `root` are copied into `data` on every rank.
  virtual void broadcast(void* data, size_t bytes, int root, Stream stream) = 0;
  // One step of a ring (or any permutation): every rank calls it at once, sending `send_bytes`
  // bytes of `send` to rank `dest` and receiving `recv_bytes` bytes from rank `source` into
  // `recv`, which equal what `source` sends it (a ring step: dest = rank + 1, source = rank - 1,
  // modulo size()). `send` may not overlap `recv`. A rank that is its own dest and source copies.
  // The default is all_to_all_v with one non-empty count each way; the MPI and NCCL communicators
  // send and receive point to point.
  virtual void send_recv(const void* send, size_t send_bytes, int dest, void* recv,
                         size_t recv_bytes, int source, Stream stream);
  // Returns once every rank has called it (host side; bounded by the timeout).
  virtual void barrier() = 0;
  // Waits until the collectives enqueued on `stream` have completed, bounded by the timeout.
  // MPI and one rank complete each collective inside the call, so this returns at once; NCCL
  // enqueues on the stream (so that the collectives can be captured in a CUDA graph) and this
  // polls the stream.
  virtual void synchronize(Stream stream) = 0;
};

// Checks the size vectors of an all_gather_v / all_to_all_v call against the communicator's size
// (`what` names the call in the message).
void check_counts(const Communicator& comm, const char* what, const std::vector<size_t>& counts,
                  const std::vector<size_t>& displs, const char* counts_name,
                  const char* displs_name);

// Checks send_recv's ranks and sizes against the communicator (named by its name() in the
// message): dest and source in range, and a rank that sends to itself receiving from itself, what
// it sends.
void check_send_recv(const Communicator& comm, int dest, int source, size_t send_bytes,
                     size_t recv_bytes);

// The group of one: every collective is a copy from send to recv on `device` (on `stream`
// when the device is a GPU). The default communicator of the one-rank path.
class OneRankCommunicator final : public Communicator {
 public:
  explicit OneRankCommunicator(Device device = Device::cpu()) : device_(device) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return device_; }
  std::string name() const override { return "one rank"; }
  void all_gather(const void* send, size_t bytes, void* recv, Stream stream) override;
  void all_gather_v(const void* send, void* recv, const std::vector<size_t>& counts,
                    const std::vector<size_t>& displs, Stream stream) override;
  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts,
                    const std::vector<size_t>& send_displs, void* recv,
                    const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                    Stream stream) override;
  void broadcast(void* data, size_t bytes, int root, Stream stream) override;
  void send_recv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                 int source, Stream stream) override;
  void barrier() override {}
  void synchronize(Stream stream) override;

 private:
  Device device_;
};

// Options of the library-backed communicators.
struct CommOptions {
  // How long a collective (MPI) or synchronize() (NCCL) waits for the other ranks before it
  // throws; <= 0 waits forever.
  double timeout_s = 300.0;
};

}  // namespace flashkv::parallel
