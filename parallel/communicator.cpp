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

void OneRankCommunicator::synchronize(Stream stream) { flashkv::synchronize(device_, stream); }

}  // namespace flashkv::parallel
