#include "cp_session.h"

#include <cstdlib>

#include "flashkv/core/error.h"

#if FLASHKV_WITH_MPI
#include <mpi.h>

#include "flashkv/parallel/mpi.h"
#endif

namespace flashkv::app {

std::unique_ptr<CpSession> CpSession::start(int ranks, std::string& error) {
  std::unique_ptr<CpSession> s(new CpSession());
  if (ranks == 1) {
    s->comm_ = std::make_unique<parallel::OneRankCommunicator>();
    return s;
  }
#if FLASHKV_WITH_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized == 0) {
    MPI_Init(nullptr, nullptr);
    s->mpi_ = true;
  }
  int size = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (size != ranks) {
    error = str_cat("--cp ", ranks, ": run it under mpirun -np ", ranks, " (this process is rank ",
                    rank, " of ", size, ")");
    return nullptr;  // the destructor of `s` finalizes MPI on every rank
  }
  s->comm_ = parallel::make_mpi_communicator(MPI_Comm_c2f(MPI_COMM_WORLD));
  return s;
#else
  error =
      str_cat("--cp ", ranks, ": this build has no MPI (CMake found none), which more than one ",
              "rank needs; --cp 1 runs the sharded path on one rank");
  return nullptr;
#endif
}

CpSession::~CpSession() {
  comm_.reset();  // frees its duplicate of the MPI communicator before MPI_Finalize
#if FLASHKV_WITH_MPI
  if (mpi_) MPI_Finalize();
#endif
}

void CpSession::abort(int code) {
#if FLASHKV_WITH_MPI
  if (mpi_) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::exit(code);
}

}  // namespace flashkv::app
