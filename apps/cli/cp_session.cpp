#include "cp_session.h"

#include <algorithm>
#include <cstdlib>

#include "flashkv/core/error.h"

#if FLASHKV_WITH_MPI
#include <mpi.h>

#include "flashkv/parallel/mpi.h"
#endif

namespace flashkv::app {

std::vector<FlagSpec> cp_flags() {
  return {{"--cp", "N",
           "context parallelism: shard each request's KV across N ranks (run under mpirun -np N; "
           "CPU; N = 1 runs the sharded path on one rank without MPI)",
           "off"},
          {"--cp-layout", "interleaved|contiguous", "--cp: how positions go to the ranks",
           "interleaved"},
          {"--cp-interleave", "K",
           "--cp-layout interleaved: positions t with (t / K) % N == r live on rank r", "1"},
          {"--cp-block", "N",
           "--cp-layout contiguous: positions per rank, the last takes the rest (auto: the "
           "longest request split evenly)",
           "auto"},
          {"--cp-exchange", "all_gather|all_to_all",
           "--cp: how the ranks exchange partial attention states", "all_gather"}};
}

int cp_ranks_from_flags(const Args& args) {
  const int ranks = args.get("--cp") == "off" ? 0 : args.get_int("--cp", 1, 1 << 16, 0);
  for (const char* f : {"--cp-layout", "--cp-interleave", "--cp-block", "--cp-exchange"})
    if (ranks == 0 && args.given(f)) args.fail(str_cat(f, " needs --cp N"));
  return ranks;
}

Device cp_device_from_flags(const Args& args) {
  // Context parallelism runs on the CPU: --device auto picks it.
  const Device device = args.given("--device") ? args.device() : Device::cpu();
  if (device.is_cuda())
    args.fail(
        "--cp: context parallelism runs on the CPU only for now (--device cpu); the GPU "
        "path (NCCL bootstrapped through MPI) is not done");
  return device;
}

parallel::CpOptions cp_options_from_flags(const Args& args, int ranks, int64_t longest) {
  parallel::CpOptions o;
  const std::string& layout = args.get("--cp-layout");
  if (layout == "interleaved") {
    o.layout = parallel::CpLayout::interleaved;
    o.block = args.get_int("--cp-interleave", 1, 1 << 30, 1);
    if (args.given("--cp-block")) args.fail("--cp-block is for --cp-layout contiguous");
  } else if (layout == "contiguous") {
    o.layout = parallel::CpLayout::contiguous;
    if (args.given("--cp-interleave")) args.fail("--cp-interleave is for --cp-layout interleaved");
    const int64_t even = (std::max<int64_t>(longest, 1) + ranks - 1) / ranks;
    o.block =
        args.get_int("--cp-block", 1, 1 << 30, static_cast<int>(std::min<int64_t>(even, 1 << 30)));
  } else {
    args.fail(str_cat("--cp-layout ", layout, ": expected interleaved or contiguous"));
  }
  const std::string& exchange = args.get("--cp-exchange");
  if (exchange == "all_gather")
    o.exchange = parallel::CpExchange::all_gather;
  else if (exchange == "all_to_all")
    o.exchange = parallel::CpExchange::all_to_all;
  else
    args.fail(str_cat("--cp-exchange ", exchange, ": expected all_gather or all_to_all"));
  return o;
}

std::string cp_layout_str(const parallel::CpOptions& o) {
  return o.layout == parallel::CpLayout::interleaved
             ? str_cat("interleaved in runs of ", o.block, " tokens")
             : str_cat("contiguous, ", o.block, " positions a rank");
}

std::string cp_exchange_str(const parallel::CpOptions& o) {
  return o.exchange == parallel::CpExchange::all_gather ? "all_gather" : "all_to_all";
}

std::unique_ptr<CpSession> CpSession::start(int ranks, std::string& error,
                                            const parallel::CommOptions& options) {
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
  s->comm_ = parallel::make_mpi_communicator(MPI_Comm_c2f(MPI_COMM_WORLD), options);
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
