// The process group of `flashkv serve --cp N`: with N > 1, MPI's world (the build must have found
// MPI; the run is started by mpirun -np N), initialised here and finalized when the session ends;
// with N = 1, one rank without MPI. Every rank then serves the same workload with its share of
// the KV (docs/PARALLEL.md, "Serving").
#pragma once

#include <memory>
#include <string>

#include "flashkv/parallel/communicator.h"

namespace flashkv::app {

class CpSession {
 public:
  // Starts the group of `ranks` ranks; returns null and sets `error` (one line) when it cannot:
  // no MPI in this build, or mpirun started a different number of ranks.
  static std::unique_ptr<CpSession> start(int ranks, std::string& error);
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
