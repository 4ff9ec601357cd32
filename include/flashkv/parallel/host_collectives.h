// Collectives over host memory through any communicator, for the small host-side exchanges around
// the sharded attention (a scheduler's pass digests, a checker's gathered K/V and output rows, a
// benchmark's lockstep): the caller's buffers live on the host whatever the device. With a
// communicator whose buffers live on a GPU (NCCL), the bytes are staged through device buffers;
// each call returns once the collective has completed (comm.synchronize(stream)), bounded by the
// communicator's timeout. The arguments are those of the Communicator method of the same name.
#pragma once

#include <cstddef>
#include <vector>

#include "flashkv/parallel/communicator.h"

namespace flashkv::parallel {

void all_gather_host(Communicator& comm, const void* send, size_t bytes, void* recv,
                     Stream stream = {});
void all_gather_v_host(Communicator& comm, const void* send, void* recv,
                       const std::vector<size_t>& counts, const std::vector<size_t>& displs,
                       Stream stream = {});

}  // namespace flashkv::parallel
