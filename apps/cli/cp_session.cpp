#include "cp_session.h"

#include <algorithm>
#include <cstdlib>
#include <exception>

#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"

#if FLASHKV_WITH_MPI
#include <mpi.h>

#include "flashkv/parallel/mpi.h"
#endif
#if FLASHKV_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>

#include "flashkv/parallel/nccl.h"
#endif

namespace flashkv::app {

std::vector<FlagSpec> cp_flags() {
  return {{"--cp", "N",
           "context parallelism: shard each request's KV across N ranks (run under mpirun -np N; "
           "on GPUs one GPU a rank, through NCCL; N = 1 runs the sharded path on one rank "
           "without MPI)",
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
           "--cp: how the ranks exchange partial attention states", "all_gather"},
          {"--cp-kv-pass", "all_gather|ring",
           "--cp: how an extend's new tokens' K/V reach the ranks (all-gathered, or passed round "
           "a ring so that no rank holds them all)",
           "all_gather"}};
}

int cp_ranks_from_flags(const Args& args) {
  const int ranks = args.get("--cp") == "off" ? 0 : args.get_int("--cp", 1, 1 << 16, 0);
  for (const char* f :
       {"--cp-layout", "--cp-interleave", "--cp-block", "--cp-exchange", "--cp-kv-pass"})
    if (ranks == 0 && args.given(f)) args.fail(str_cat(f, " needs --cp N"));
  return ranks;
}

Device cp_device_from_flags(const Args& args, int ranks) {
  // --device auto picks the CPU: a GPU run is asked for, as it needs a GPU per rank.
  const Device device = args.given("--device") ? args.device() : Device::cpu();
  if (device.is_cuda() && ranks > 1 && args.get("--device").find(':') != std::string::npos)
    args.fail(str_cat("--device ", args.get("--device"), ": with --cp ", ranks,
                      " each rank runs on the GPU of its local rank; pass --device cuda"));
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
  const std::string& kv_pass = args.get("--cp-kv-pass");
  if (kv_pass == "all_gather")
    o.kv_pass = parallel::CpKvPass::all_gather;
  else if (kv_pass == "ring")
    o.kv_pass = parallel::CpKvPass::ring;
  else
    args.fail(str_cat("--cp-kv-pass ", kv_pass, ": expected all_gather or ring"));
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

std::string cp_kv_pass_str(const parallel::CpOptions& o) {
  return o.kv_pass == parallel::CpKvPass::ring ? "ring" : "all_gather";
}

namespace {

#if FLASHKV_WITH_NCCL
// Throws flashkv::Error naming the call when an NCCL call failed.
void nccl_check(ncclResult_t r, const char* call) {
  FLASHKV_CHECK(r == ncclSuccess, call, ": NCCL error ", static_cast<int>(r), " (",
                ncclGetErrorString(r), ")");
}
#endif

}  // namespace

std::unique_ptr<CpSession> CpSession::start(int ranks, Device device, std::string& error,
                                            const parallel::CommOptions& options) {
  std::unique_ptr<CpSession> s(new CpSession());
  if (ranks == 1) {
#if FLASHKV_WITH_NCCL
    if (device.is_cuda()) {
      // One rank on one GPU: a one-rank NCCL communicator, so that the GPU run takes the same
      // communicator as a group's.
      ncclComm_t comm = nullptr;
      int index = device.index;
      nccl_check(ncclCommInitAll(&comm, 1, &index), "ncclCommInitAll");
      s->nccl_ = comm;
      s->comm_ = parallel::make_nccl_communicator(comm, device, options);
      return s;
    }
#endif
    // The CPU (or a GPU in a build without NCCL): the one-rank communicator, on that device.
    s->comm_ = std::make_unique<parallel::OneRankCommunicator>(device);
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
  if (device.is_cpu()) {
    s->comm_ = parallel::make_mpi_communicator(MPI_Comm_c2f(MPI_COMM_WORLD), options);
    return s;
  }
#if FLASHKV_WITH_NCCL
  // Rank r of its host takes GPU r % (the GPUs it sees). NCCL does not allow two ranks of a
  // communicator on one GPU, so the ranks of each host compare their GPUs' PCI bus ids (a launcher
  // may show each rank a different GPU under the same index), and every rank refuses, before any
  // NCCL call, when a host has two ranks on one GPU.
  MPI_Comm host;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host);
  int local_rank = 0, local_size = 0;
  MPI_Comm_rank(host, &local_rank);
  MPI_Comm_size(host, &local_size);
  const int gpus = cuda_device_count();
  constexpr int kBusIdBytes = 32;
  char bus[kBusIdBytes] = {};
  if (gpus > 0)
    flashkv::detail::cuda_check(cudaDeviceGetPCIBusId(bus, kBusIdBytes, local_rank % gpus),
                                "cudaDeviceGetPCIBusId");
  std::vector<char> buses(static_cast<size_t>(kBusIdBytes) * local_size);
  MPI_Allgather(bus, kBusIdBytes, MPI_CHAR, buses.data(), kBusIdBytes, MPI_CHAR, host);
  MPI_Comm_free(&host);
  int shared_here = gpus == 0 ? 1 : 0;
  for (int a = 0; a < local_size; ++a)
    for (int b = a + 1; b < local_size; ++b)
      if (std::strncmp(&buses[static_cast<size_t>(a) * kBusIdBytes],
                       &buses[static_cast<size_t>(b) * kBusIdBytes], kBusIdBytes) == 0)
        shared_here = 1;
  int shared_anywhere = 0;
  MPI_Allreduce(&shared_here, &shared_anywhere, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (shared_anywhere != 0) {
    const int distinct = std::min(gpus, local_size);
    error = shared_here != 0
                ? str_cat("--cp ", ranks, " --device cuda: ", local_size,
                          " ranks run on this host, which has ", distinct, " GPU",
                          distinct == 1 ? "" : "s", " for them; NCCL needs a GPU for each rank ",
                          "(run at most ", distinct, " rank", distinct == 1 ? "" : "s",
                          " a host, or --device cpu)")
                : str_cat("--cp ", ranks, " --device cuda: another host runs more ranks than it ",
                          "has GPUs; NCCL needs a GPU for each rank");
    return nullptr;
  }
  const Device gpu = Device::cuda(local_rank % gpus);
  flashkv::detail::cuda_set_device(gpu);
  ncclUniqueId id;
  if (rank == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t comm = nullptr;
  nccl_check(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank");
  s->nccl_ = comm;
  s->comm_ = parallel::make_nccl_communicator(comm, gpu, options);
  return s;
#else
  error = str_cat("--cp ", ranks, " --device cuda: this build has no NCCL (CMake found none), ",
                  "which ranks on GPUs exchange through; --device cpu runs the ranks over MPI");
  return nullptr;
#endif
#else
  error =
      str_cat("--cp ", ranks, ": this build has no MPI (CMake found none), which more than one ",
              "rank needs; --cp 1 runs the sharded path on one rank");
  return nullptr;
#endif
}

CpSession::~CpSession() {
  comm_.reset();  // frees its duplicate of the MPI communicator before MPI_Finalize
#if FLASHKV_WITH_NCCL
  // An exception on its way out may come from a synchronize() that timed out and aborted the
  // NCCL communicator (which frees it): then it is left alone.
  if (nccl_ != nullptr && std::uncaught_exceptions() == 0)
    ncclCommDestroy(static_cast<ncclComm_t>(nccl_));
#endif
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
