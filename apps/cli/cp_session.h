// The process group of `flashkv serve --cp N` (and soak, and bench): with N > 1, MPI's world (the
// build must have found MPI; the run is started by mpirun -np N), initialised here and finalized
// when the session ends; with N = 1, one rank without MPI. On the CPU the ranks exchange through
// MPI (one rank: no communication at all); on GPUs through NCCL, each rank on a GPU of its own
// (the one of its local rank on its host), the NCCL communicator bootstrapped through MPI (rank 0
// makes its unique id and broadcasts it); one rank on a GPU gets a one-rank NCCL communicator
// without MPI. Every rank then serves the same workload with its share of the KV
// (docs/PARALLEL.md, "Serving").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "args.h"
#include "flashkv/core/device.h"
#include "flashkv/parallel/context_parallel.h"

namespace flashkv::app {

// The --cp flags of serve, soak and bench: --cp N, --cp-layout, --cp-interleave, --cp-block,
// --cp-exchange, --cp-kv-pass.
std::vector<FlagSpec> cp_flags();
// --cp N, or 0 when off (then any other --cp-* flag is refused, exit 2).
int cp_ranks_from_flags(const Args& args);
// The device with --cp N: --device auto picks the CPU; --device cuda runs each rank on a GPU. With
// N > 1 the session picks each rank's GPU, so --device cuda:K is refused (exit 2).
Device cp_device_from_flags(const Args& args, int ranks);
// The layout, exchange and passing of the new tokens' K/V; `longest`: the longest request in tokens
// (--cp-block auto splits it evenly across the ranks).
parallel::CpOptions cp_options_from_flags(const Args& args, int ranks, int64_t longest);
// For reports: "interleaved in runs of 1 tokens" / "contiguous, 512 positions a rank",
// "all_gather" / "all_to_all", and "all_gather" / "ring".
std::string cp_layout_str(const parallel::CpOptions& o);
std::string cp_exchange_str(const parallel::CpOptions& o);
std::string cp_kv_pass_str(const parallel::CpOptions& o);

class CpSession {
 public:
  // Starts the group of `ranks` ranks on `device` (the CPU, or a GPU: with one rank that GPU, with
  // more each rank's local GPU); returns null and sets `error` (one line) when it cannot: no MPI
  // (or, on GPUs, no NCCL) in this build, mpirun started a different number of ranks, or more
  // ranks share a host than it has GPUs. `options`: the communicator's (its timeout).
  static std::unique_ptr<CpSession> start(int ranks, Device device, std::string& error,
                                          const parallel::CommOptions& options = {});
  ~CpSession();
  CpSession(const CpSession&) = delete;
  CpSession& operator=(const CpSession&) = delete;

  parallel::Communicator& comm() { return *comm_; }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  // Where this rank runs: the CPU, or its GPU.
  Device device() const { return comm_->device(); }
  // Stops every rank of the group at once (MPI_Abort), so that the others do not wait in a
  // collective for a rank that failed; with one rank, exits.
  [[noreturn]] void abort(int code);

 private:
  CpSession() = default;
  std::unique_ptr<parallel::Communicator> comm_;
  bool mpi_ = false;      // this session initialised MPI (and finalizes it)
  void* nccl_ = nullptr;  // the NCCL communicator this session created (ncclComm_t), or null
};

}  // namespace flashkv::app
