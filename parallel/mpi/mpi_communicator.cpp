// The MPI communicator: nonblocking collectives on a private duplicate of the caller's
// communicator, polled against a deadline, through host staging buffers that are abandoned to MPI
// when a collective times out.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flashkv/core/error.h"
#include "flashkv/parallel/mpi.h"

namespace flashkv::parallel {

namespace {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return str_cat("MPI error ", code);
  return std::string(text, len);
}

// memcpy that accepts empty ranges with null pointers (a rank may send nothing).
void copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

int to_int(size_t bytes, const char* what, const char* name) {
  FLASHKV_CHECK(bytes <= static_cast<size_t>(INT_MAX), "MPI ", what, ": ", name, " = ", bytes,
                " bytes: expected at most ", INT_MAX, " (MPI counts are int)");
  return static_cast<int>(bytes);
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(int fortran_comm, const CommOptions& options) : options_(options) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    FLASHKV_CHECK(initialized, "make_mpi_communicator: MPI is not initialised (call MPI_Init)");
    MPI_Comm user = MPI_Comm_f2c(fortran_comm);
    FLASHKV_CHECK(user != MPI_COMM_NULL, "make_mpi_communicator: fortran_comm ", fortran_comm,
                  " is MPI_COMM_NULL");
    check(MPI_Comm_dup(user, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    // A broken communicator has a collective in flight, which MPI_Comm_free would wait for.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!broken_ && !finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu(); }
  std::string name() const override { return "MPI"; }

  void all_gather(const void* send, size_t bytes, void* recv, Stream) override {
    const char* what = "all_gather";
    ready(what);
    const int n = to_int(bytes, what, "bytes");
    to_int(bytes * size_, what, "the gathered size");
    char* s = stage(send_, bytes);
    char* r = stage(recv_, bytes * size_);
    copy(s, send, bytes);
    MPI_Request req;
    check(MPI_Iallgather(s, n, MPI_BYTE, r, n, MPI_BYTE, comm_, &req), "MPI_Iallgather");
    wait(req, what);
    copy(recv, r, bytes * size_);
  }

  void all_gather_v(const void* send, void* recv, const std::vector<size_t>& counts,
                    const std::vector<size_t>& displs, Stream) override {
    const char* what = "all_gather_v";
    ready(what);
    check_counts(*this, what, counts, displs, "counts", "displs");
    std::vector<int> c(size_), d(size_);
    size_t end = 0;
    for (int p = 0; p < size_; ++p) {
      c[p] = to_int(counts[p], what, "counts[p]");
      d[p] = to_int(displs[p], what, "displs[p]");
      end = std::max(end, displs[p] + counts[p]);
    }
    char* s = stage(send_, counts[rank_]);
    char* r = stage(recv_, end);
    copy(s, send, counts[rank_]);
    MPI_Request req;
    check(MPI_Iallgatherv(s, c[rank_], MPI_BYTE, r, c.data(), d.data(), MPI_BYTE, comm_, &req),
          "MPI_Iallgatherv");
    wait(req, what);
    for (int p = 0; p < size_; ++p)
      copy(static_cast<char*>(recv) + displs[p], r + displs[p], counts[p]);
  }

  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts,
                    const std::vector<size_t>& send_displs, void* recv,
                    const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                    Stream) override {
    const char* what = "all_to_all_v";
    ready(what);
    check_counts(*this, what, send_counts, send_displs, "send_counts", "send_displs");
    check_counts(*this, what, recv_counts, recv_displs, "recv_counts", "recv_displs");
    std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
    size_t send_end = 0, recv_end = 0;
    for (int p = 0; p < size_; ++p) {
      sc[p] = to_int(send_counts[p], what, "send_counts[p]");
      sd[p] = to_int(send_displs[p], what, "send_displs[p]");
      rc[p] = to_int(recv_counts[p], what, "recv_counts[p]");
      rd[p] = to_int(recv_displs[p], what, "recv_displs[p]");
      send_end = std::max(send_end, send_displs[p] + send_counts[p]);
      recv_end = std::max(recv_end, recv_displs[p] + recv_counts[p]);
    }
    char* s = stage(send_, send_end);
    char* r = stage(recv_, recv_end);
    for (int p = 0; p < size_; ++p)
      copy(s + send_displs[p], static_cast<const char*>(send) + send_displs[p], send_counts[p]);
    MPI_Request req;
    check(MPI_Ialltoallv(s, sc.data(), sd.data(), MPI_BYTE, r, rc.data(), rd.data(), MPI_BYTE,
                         comm_, &req),
          "MPI_Ialltoallv");
    wait(req, what);
    for (int p = 0; p < size_; ++p)
      copy(static_cast<char*>(recv) + recv_displs[p], r + recv_displs[p], recv_counts[p]);
  }

  void broadcast(void* data, size_t bytes, int root, Stream) override {
    const char* what = "broadcast";
    ready(what);
    FLASHKV_CHECK(root >= 0 && root < size_, "MPI broadcast: root = ", root, ": expected 0..",
                  size_ - 1);
    const int n = to_int(bytes, what, "bytes");
    char* s = stage(send_, bytes);
    if (rank_ == root) copy(s, data, bytes);
    MPI_Request req;
    check(MPI_Ibcast(s, n, MPI_BYTE, root, comm_, &req), "MPI_Ibcast");
    wait(req, what);
    if (rank_ != root) copy(data, s, bytes);
  }

  // Point to point: a synchronous send (MPI_Issend completes only once `dest` has matched it, so
  // a sender whose receiver is gone stops at the timeout too) and a receive, waited for together.
  void send_recv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                 int source, Stream) override {
    const char* what = "send_recv";
    ready(what);
    check_send_recv(*this, dest, source, send_bytes, recv_bytes);
    const int ns = to_int(send_bytes, what, "send_bytes");
    const int nr = to_int(recv_bytes, what, "recv_bytes");
    char* s = stage(send_, send_bytes);
    char* r = stage(recv_, recv_bytes);
    copy(s, send, send_bytes);
    MPI_Request reqs[2];
    check(MPI_Irecv(r, nr, MPI_BYTE, source, kSendRecvTag, comm_, &reqs[0]), "MPI_Irecv");
    check(MPI_Issend(s, ns, MPI_BYTE, dest, kSendRecvTag, comm_, &reqs[1]), "MPI_Issend");
    wait(reqs, 2, what);
    copy(recv, r, recv_bytes);
  }

  void barrier() override {
    ready("barrier");
    MPI_Request req;
    check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
    wait(req, "barrier");
  }

  void synchronize(Stream) override { ready("synchronize"); }

 private:
  void check(int code, const char* call) {
    if (code != MPI_SUCCESS) throw_error(str_cat(call, ": ", mpi_error_string(code)));
  }
  void ready(const char* what) const {
    FLASHKV_CHECK(!broken_, "MPI ", what, ": the communicator is unusable since an earlier ",
                  "collective failed (", broken_why_, ")");
  }
  static char* stage(std::unique_ptr<std::vector<char>>& buf, size_t bytes) {
    if (!buf) buf = std::make_unique<std::vector<char>>();
    if (buf->size() < bytes) buf->resize(bytes);
    return buf->data();
  }
  void wait(MPI_Request& req, const char* what) { wait(&req, 1, what); }
  // Polls the `n` requests until they all complete or the timeout passes. MPI cannot cancel a
  // collective, so on a timeout the staging buffers stay with it (never freed or reused) and the
  // communicator breaks.
  void wait(MPI_Request* reqs, int n, const char* what) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    for (int spins = 0;; ++spins) {
      int done = 0;
      const int code = MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
      if (code != MPI_SUCCESS) {
        abandon(str_cat(what, " failed: ", mpi_error_string(code)));
        throw_error(str_cat("MPI ", what, ": ", mpi_error_string(code), " (rank ", rank_, " of ",
                            size_, ")"));
      }
      if (done) return;
      if (options_.timeout_s > 0 &&
          std::chrono::duration<double>(clock::now() - start).count() > options_.timeout_s) {
        abandon(str_cat(what, " timed out"));
        throw_error(str_cat("MPI ", what, ": rank ", rank_, " of ", size_, " waited ",
                            options_.timeout_s,
                            " s for the other ranks, which did not join (a rank exited, failed "
                            "before this collective, or called a different one); the "
                            "communicator is unusable from now on"));
      }
      if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  void abandon(const std::string& why) {
    broken_ = true;
    broken_why_ = why;
    // Left to MPI, which may still read or write them: kept until the process exits.
    static std::vector<std::unique_ptr<std::vector<char>>> abandoned;
    abandoned.push_back(std::move(send_));
    abandoned.push_back(std::move(recv_));
  }

  // The tag of send_recv's messages (collectives do not match point-to-point messages).
  static constexpr int kSendRecvTag = 0x464b;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  CommOptions options_;
  bool broken_ = false;
  std::string broken_why_;
  // Staging buffers: the caller's memory is never handed to MPI.
  std::unique_ptr<std::vector<char>> send_, recv_;

 public:
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(int fortran_comm, const CommOptions& options) {
  return std::make_unique<MpiCommunicator>(fortran_comm, options);
}

}  // namespace flashkv::parallel
