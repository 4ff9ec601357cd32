// The process group of `flashkv serve --cp N` (and soak, and bench): with N > 1, MPI's world (the
// build must have found MPI; the run is started by mpirun -np N), initialised here and finalized
// when the session ends; with N = 1, one rank without MPI. Every rank then serves the same workload
// with its share of the KV (docs/PARALLEL.md, "Serving").
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
// --cp-exchange.
std::vector<FlagSpec> cp_flags();
// --cp N, or 0 when off (then any other --cp-* flag is refused, exit 2).
int cp_ranks_from_flags(const Args& args);
// The device with --cp: the CPU (--device auto picks it; --device cuda is refused, exit 2).
Device cp_device_from_flags(const Args& args);
// The layout and exchange; `longest`: the longest request in tokens (--cp-block auto splits it
// evenly across the ranks).
parallel::CpOptions cp_options_from_flags(const Args& args, int ranks, int64_t longest);
// For reports: "interleaved in runs of 1 tokens" / "contiguous, 512 positions a rank", and
// "all_gather" / "all_to_all".
std::string cp_layout_str(const parallel::CpOptions& o);
std::string cp_exchange_str(const parallel::CpOptions& o);

class CpSession {
 public:
  // Starts the group of `ranks` ranks; returns null and sets `error` (one line) when it cannot:
  // no MPI in this build, or mpirun started a different number of ranks. `options`: the MPI
  // communicator's (its collectives' timeout).
  static std::unique_ptr<CpSession> start(int ranks, std::string& error,
                                          const parallel::CommOptions& options = {});
  ~CpSession();
  CpSession(const CpSession&) = delete;
  CpSession& operator=(const CpSession&) = delete;

  parallel::Communicator& comm() { return *comm_; }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  // Stops every rank of the group at once (MPI_Abort), so that the others do not wait in a
  // collective for a rank that failed; with one rank, exits.
  [[noreturn]] void abort(int code);

 private:
  CpSession() = default;
  std::unique_ptr<parallel::Communicator> comm_;
  bool mpi_ = false;  // this session initialised MPI (and finalizes it)
};

}  // namespace flashkv::app
