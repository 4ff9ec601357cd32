// The NCCL communicator (GPU memory): built only with CUDA and where CMake finds NCCL (the target
// flashkv_parallel_nccl). Every collective is enqueued on the caller's stream and nothing else
// happens on the host, so the collectives can be captured in a CUDA graph. synchronize(stream)
// waits for them, polling the stream and NCCL's asynchronous error state; past the timeout (a
// rank that exited or never joined) it aborts the NCCL communicator and throws flashkv::Error,
// and the communicator is broken from then on.
#pragma once

#include <memory>

#include "flashkv/parallel/communicator.h"

struct ncclComm;  // ncclComm_t is `struct ncclComm*`

namespace flashkv::parallel {

// Wraps the caller's communicator (not owned: the caller destroys it, unless synchronize() had to
// abort it) on GPU `device` (the device the NCCL communicator was created on).
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm* comm, Device device,
                                                     const CommOptions& options = {});

}  // namespace flashkv::parallel
