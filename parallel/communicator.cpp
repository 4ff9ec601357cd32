#include "flashkv/parallel/communicator.h"

#include "flashkv/core/error.h"

namespace flashkv::parallel {

void check_counts(const Communicator& comm, const char* what, const std::vector<size_t>& counts,
                  const std::vector<size_t>& displs, const char* counts_name,
                  const char* displs_name) {
  const size_t n = static_cast<size_t>(comm.size());
  FLASHKV_CHECK(counts.size() == n, what, ": ", counts_name, ": expected ", n,
                " entries (one a rank), got ", counts.size());
  FLASHKV_CHECK(displs.size() == n, what, ": ", displs_name, ": expected ", n,
                " entries (one a rank), got ", displs.size());
}

void check_send_recv(const Communicator& comm, int dest, int source, size_t send_bytes,
                     size_t recv_bytes) {
  const int n = comm.size();
  FLASHKV_CHECK(dest >= 0 && dest < n, comm.name(), " send_recv: dest = ", dest, ": expected 0..",
                n - 1);
  FLASHKV_CHECK(source >= 0 && source < n, comm.name(), " send_recv: source = ", source,
                ": expected 0..", n - 1);
  FLASHKV_CHECK((dest == comm.rank()) == (source == comm.rank()), comm.name(),
                " send_recv: dest = ", dest, ", source = ", source, " on rank ", comm.rank(),
                ": a rank sends to itself exactly when it receives from itself");
  FLASHKV_CHECK(dest != comm.rank() || send_bytes == recv_bytes, comm.name(),
                " send_recv: recv_bytes = ", recv_bytes, ": expected send_bytes = ", send_bytes,
                " (this rank sends to itself)");
}

void Communicator::send_recv(const void* send, size_t send_bytes, int dest, void* recv,
                             size_t recv_bytes, int source, Stream stream) {
  check_send_recv(*this, dest, source, send_bytes, recv_bytes);
  const size_t n = static_cast<size_t>(size());
  std::vector<size_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  sc[dest] = send_bytes;
  rc[source] = recv_bytes;
  all_to_all_v(send, sc, sd, recv, rc, rd, stream);
}

void OneRankCommunicator::all_gather(const void* send, size_t bytes, void* recv, Stream stream) {
  copy_bytes(recv, device_, send, device_, bytes, stream);
}

void OneRankCommunicator::all_gather_v(const void* send, void* recv,
                                       const std::vector<size_t>& counts,
                                       const std::vector<size_t>& displs, Stream stream) {
  check_counts(*this, "all_gather_v", counts, displs, "counts", "displs");
  copy_bytes(static_cast<char*>(recv) + displs[0], device_, send, device_, counts[0], stream);
}

void OneRankCommunicator::all_to_all_v(const void* send, const std::vector<size_t>& send_counts,
                                       const std::vector<size_t>& send_displs, void* recv,
                                       const std::vector<size_t>& recv_counts,
                                       const std::vector<size_t>& recv_displs, Stream stream) {
  check_counts(*this, "all_to_all_v", send_counts, send_displs, "send_counts", "send_displs");
  check_counts(*this, "all_to_all_v", recv_counts, recv_displs, "recv_counts", "recv_displs");
  FLASHKV_CHECK(send_counts[0] == recv_counts[0], "all_to_all_v: recv_counts[0] = ", recv_counts[0],
                ": expected send_counts[0] = ", send_counts[0], " (this rank sends to itself)");
  copy_bytes(static_cast<char*>(recv) + recv_displs[0], device_,
             static_cast<const char*>(send) + send_displs[0], device_, send_counts[0], stream);
}

void OneRankCommunicator::broadcast(void*, size_t, int root, Stream) {
  FLASHKV_CHECK(root == 0, "broadcast: root = ", root, ": expected 0 (the only rank)");
}

void OneRankCommunicator::send_recv(const void* send, size_t send_bytes, int dest, void* recv,
                                    size_t recv_bytes, int source, Stream stream) {
  check_send_recv(*this, dest, source, send_bytes, recv_bytes);
  copy_bytes(recv, device_, send, device_, send_bytes, stream);
}

void OneRankCommunicator::synchronize(Stream stream) { flashkv::synchronize(device_, stream); }

}  // namespace flashkv::parallel
