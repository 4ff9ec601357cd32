#include "flashkv/parallel/host_collectives.h"

#include <algorithm>

#include "flashkv/core/buffer.h"

namespace flashkv::parallel {

namespace {

// The device buffers of one staged collective: `send_bytes` of the host's send copied in, room for
// `recv_bytes` (never a null buffer).
struct Staged {
  Buffer send, recv;
  Staged(const Communicator& comm, const void* host_send, size_t send_bytes, size_t recv_bytes,
         Stream stream)
      : send(std::max<size_t>(send_bytes, 1), comm.device()),
        recv(std::max<size_t>(recv_bytes, 1), comm.device()) {
    copy_bytes(send.data(), comm.device(), host_send, Device::cpu(), send_bytes, stream);
  }
  // Waits for the collective, then copies the received bytes to the host.
  void finish(Communicator& comm, void* host_recv, size_t recv_bytes, Stream stream) {
    comm.synchronize(stream);
    copy_bytes(host_recv, Device::cpu(), recv.data(), comm.device(), recv_bytes, stream);
  }
};

}  // namespace

void all_gather_host(Communicator& comm, const void* send, size_t bytes, void* recv,
                     Stream stream) {
  const size_t total = bytes * static_cast<size_t>(comm.size());
  if (comm.device().is_cpu()) {
    comm.all_gather(send, bytes, recv, stream);
    return;
  }
  Staged s(comm, send, bytes, total, stream);
  comm.all_gather(s.send.data(), bytes, s.recv.data(), stream);
  s.finish(comm, recv, total, stream);
}

void all_gather_v_host(Communicator& comm, const void* send, void* recv,
                       const std::vector<size_t>& counts, const std::vector<size_t>& displs,
                       Stream stream) {
  if (comm.device().is_cpu()) {
    comm.all_gather_v(send, recv, counts, displs, stream);
    return;
  }
  check_counts(comm, "all_gather_v_host", counts, displs, "counts", "displs");
  size_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) total = std::max(total, displs[r] + counts[r]);
  Staged s(comm, send, counts[static_cast<size_t>(comm.rank())], total, stream);
  comm.all_gather_v(s.send.data(), s.recv.data(), counts, displs, stream);
  s.finish(comm, recv, total, stream);
}

}  // namespace flashkv::parallel
