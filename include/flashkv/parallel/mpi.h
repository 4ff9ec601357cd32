// The MPI communicator (host memory): built only where CMake finds MPI (the target
// flashkv_parallel_mpi; FLASHKV_WITH_MPI is then 1). Takes the communicator by its Fortran handle
// (MPI_Comm_c2f(comm) in C and C++, comm.py2f() in mpi4py), so that this header does not need
// <mpi.h>, whose location and MPI_Comm type differ between MPI installations.
//
// Collectives run as nonblocking MPI collectives on a private duplicate of the communicator,
// polled until they complete or the timeout passes. On a timeout the call throws flashkv::Error
// ("MPI all_gather: rank 0 of 2 waited 5 s for the other ranks ...") and the communicator is
// broken: the collective cannot be cancelled, so its staging buffers are left to MPI and never
// reused, and every later call throws at once. The caller's own buffers are never handed to MPI,
// so a late rank cannot write into them.
#pragma once

#include <memory>

#include "flashkv/parallel/communicator.h"

namespace flashkv::parallel {

// MPI must be initialised (MPI_Init or MPI_Init_thread) before, and finalized after, the
// communicator's lifetime. Collective over `fortran_comm` (it duplicates it).
std::unique_ptr<Communicator> make_mpi_communicator(int fortran_comm,
                                                    const CommOptions& options = {});

}  // namespace flashkv::parallel
