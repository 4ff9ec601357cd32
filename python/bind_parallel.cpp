// Context parallelism for Python: the Communicator (over a table of Python callables, which
// flashkv/parallel.py fills from a torch.distributed process group, or the raw MPI and NCCL
// communicators where the build has them), CpOptions, CpShard, zigzag_rows, and the sharded
// operators CpDecode and CpExtend (docs/PARALLEL.md, "Python").
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bind.h"
#include "flashkv/parallel/communicator.h"
#include "flashkv/parallel/context_parallel.h"
#if FLASHKV_WITH_MPI
#include "flashkv/parallel/mpi.h"
#endif
#if FLASHKV_WITH_NCCL
#include "flashkv/parallel/nccl.h"
#endif

namespace flashkv::py {
namespace {

using parallel::Communicator;
using parallel::CpDecode;
using parallel::CpExtend;
using parallel::CpOptions;

// A communicator whose collectives call methods of a Python object, the transport. Each buffer
// reaches it as a 1-D uint8 DLPack array over exactly the bytes the collective reads or writes
// (on device()), the byte counts as lists and the stream as an int handle:
//   all_gather(send, recv, stream)
//   all_gather_v(send, recv, counts, displs, stream)
//   all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, stream)
//   broadcast(data, root, stream), send_recv(send, dest, recv, source, stream), barrier(),
//   synchronize(stream)
// An exception a method raises (the process group's timeout, a peer that failed) becomes
// flashkv::Error naming the collective, and breaks the communicator: the group's state is unknown
// after a failed collective, so every later call throws at once, as communicator.h requires.
class CallbackCommunicator final : public Communicator {
 public:
  CallbackCommunicator(nb::object transport, int rank, int size, Device device, std::string name)
      : transport_(std::move(transport)),
        rank_(rank),
        size_(size),
        device_(device),
        name_(std::move(name)) {
    FLASHKV_CHECK(size >= 1, "size: expected >= 1, got ", size);
    FLASHKV_CHECK(rank >= 0 && rank < size, "rank: expected 0 <= rank < size = ", size, ", got ",
                  rank);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  std::string name() const override { return name_; }
  bool broken() const { return broken_; }

  void all_gather(const void* send, size_t bytes, void* recv, Stream stream) override {
    call("all_gather", [&] {
      transport_.attr("all_gather")(array(send, bytes), array(recv, bytes * size_), handle(stream));
    });
  }
  void all_gather_v(const void* send, void* recv, const std::vector<size_t>& counts,
                    const std::vector<size_t>& displs, Stream stream) override {
    parallel::check_counts(*this, "all_gather_v", counts, displs, "counts", "displs");
    call("all_gather_v", [&] {
      transport_.attr("all_gather_v")(array(send, counts[rank_]),
                                      array(recv, extent(counts, displs)), counts, displs,
                                      handle(stream));
    });
  }
  void all_to_all_v(const void* send, const std::vector<size_t>& send_counts,
                    const std::vector<size_t>& send_displs, void* recv,
                    const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                    Stream stream) override {
    parallel::check_counts(*this, "all_to_all_v", send_counts, send_displs, "send_counts",
                           "send_displs");
    parallel::check_counts(*this, "all_to_all_v", recv_counts, recv_displs, "recv_counts",
                           "recv_displs");
    call("all_to_all_v", [&] {
      transport_.attr("all_to_all_v")(array(send, extent(send_counts, send_displs)), send_counts,
                                      send_displs, array(recv, extent(recv_counts, recv_displs)),
                                      recv_counts, recv_displs, handle(stream));
    });
  }
  void broadcast(void* data, size_t bytes, int root, Stream stream) override {
    FLASHKV_CHECK(root >= 0 && root < size_, "broadcast: root = ", root, ": expected 0 <= root < ",
                  size_);
    call("broadcast",
         [&] { transport_.attr("broadcast")(array(data, bytes), root, handle(stream)); });
  }
  void send_recv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                 int source, Stream stream) override {
    parallel::check_send_recv(*this, dest, source, send_bytes, recv_bytes);
    call("send_recv", [&] {
      transport_.attr("send_recv")(array(send, send_bytes), dest, array(recv, recv_bytes), source,
                                   handle(stream));
    });
  }
  void barrier() override {
    call("barrier", [&] { transport_.attr("barrier")(); });
  }
  void synchronize(Stream stream) override {
    call("synchronize", [&] { transport_.attr("synchronize")(handle(stream)); });
  }

 private:
  // Runs f with the GIL (the operators release it while they run), turning a Python exception
  // into flashkv::Error and breaking the communicator.
  template <class F>
  void call(const char* what, F&& f) {
    FLASHKV_CHECK(!broken_, name_, " ", what, ": the communicator is unusable after an earlier ",
                  "failure (", failure_, ")");
    nb::gil_scoped_acquire gil;
    try {
      f();
    } catch (nb::python_error& e) {
      broken_ = true;
      failure_ = str_cat(nb::type_name(e.value().type()).c_str(), ": ", nb::str(e.value()).c_str());
      throw_error(str_cat(name_, " ", what, ": rank ", rank_, " of ", size_, " failed: ", failure_,
                          "; the communicator is unusable from now on"));
    }
  }
  // A uint8 [bytes] array over p, valid for the call (owned by None: nanobind would otherwise
  // copy it; a byte of our own when empty, since DLPack importers may refuse a null pointer).
  nb::object array(const void* p, size_t bytes) {
    static unsigned char empty_byte = 0;
    TensorView t;
    t.data = bytes == 0 ? &empty_byte : const_cast<void*>(p);  // NOLINT: the view is read-only
    t.dtype = DType::u8;
    t.device = bytes == 0 ? Device::cpu() : device_;
    t.ndim = 1;
    t.shape[0] = static_cast<int64_t>(bytes);
    t.stride[0] = 1;
    return nb::cast(export_view(t, nb::none()));
  }
  static uintptr_t handle(Stream stream) { return reinterpret_cast<uintptr_t>(stream.handle); }
  static size_t extent(const std::vector<size_t>& counts, const std::vector<size_t>& displs) {
    size_t end = 0;
    for (size_t r = 0; r < counts.size(); ++r) end = std::max(end, displs[r] + counts[r]);
    return end;
  }

  nb::object transport_;
  int rank_, size_;
  Device device_;
  std::string name_;
  bool broken_ = false;
  std::string failure_;
};

// The byte view of an array given to one of the communicator's collectives from Python.
TensorView comm_buffer(const Communicator& comm, const Array& a, const char* name) {
  const TensorView t = view_of(a, name);
  Expect(t, name).device(comm.device()).contiguous();
  return t;
}

// Checks that every region (counts[r] bytes at displs[r]) lies inside `bytes`.
void check_regions(const std::vector<size_t>& counts, const std::vector<size_t>& displs,
                   size_t bytes, const char* buffer) {
  for (size_t r = 0; r < counts.size() && r < displs.size(); ++r)
    FLASHKV_CHECK(displs[r] + counts[r] <= bytes, buffer, ": rank ", r, "'s ", counts[r],
                  " bytes at ", displs[r], " end past its ", bytes, " bytes");
}

void bind_communicator(nb::module_& m) {
  nb::class_<Communicator>(
      m, "Communicator",
      "The group a sharded operator exchanges its states over (C++ parallel::Communicator). "
      "Build one with flashkv.parallel: from a torch.distributed process group, an mpi4py "
      "communicator or an NCCL communicator. Its collectives move bytes between contiguous "
      "arrays on `device` and must be called by every rank in the same order.")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size)
      .def_prop_ro("device", [](const Communicator& c) { return c.device().str(); })
      .def_prop_ro("name", &Communicator::name)
      .def(
          "all_gather",
          [](Communicator& c, const Array& send, const Array& recv, uintptr_t stream) {
            const TensorView s = comm_buffer(c, send, "send"), r = comm_buffer(c, recv, "recv");
            FLASHKV_CHECK(r.nbytes() == s.nbytes() * static_cast<size_t>(c.size()),
                          "recv: expected size x send's bytes = ", s.nbytes() * c.size(),
                          " bytes, got ", r.nbytes());
            nb::gil_scoped_release release;
            c.all_gather(s.data, s.nbytes(), r.data, stream_of(stream));
          },
          nb::arg("send"), nb::arg("recv"), nb::arg("stream") = 0,
          "Rank r's send bytes land at byte r * len(send) of recv on every rank.")
      .def(
          "all_gather_v",
          [](Communicator& c, const Array& send, const Array& recv,
             const std::vector<size_t>& counts, const std::vector<size_t>& displs,
             uintptr_t stream) {
            const TensorView s = comm_buffer(c, send, "send"), r = comm_buffer(c, recv, "recv");
            parallel::check_counts(c, "all_gather_v", counts, displs, "counts", "displs");
            FLASHKV_CHECK(s.nbytes() == counts[c.rank()], "send: expected counts[", c.rank(),
                          "] = ", counts[c.rank()], " bytes, got ", s.nbytes());
            check_regions(counts, displs, r.nbytes(), "recv");
            nb::gil_scoped_release release;
            c.all_gather_v(s.data, r.data, counts, displs, stream_of(stream));
          },
          nb::arg("send"), nb::arg("recv"), nb::arg("counts"), nb::arg("displs"),
          nb::arg("stream") = 0,
          "Uneven all-gather: rank r's counts[r] bytes land at byte displs[r] of recv (counts and "
          "displs in bytes, the same on every rank).")
      .def(
          "all_to_all_v",
          [](Communicator& c, const Array& send, const std::vector<size_t>& send_counts,
             const std::vector<size_t>& send_displs, const Array& recv,
             const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
             uintptr_t stream) {
            const TensorView s = comm_buffer(c, send, "send"), r = comm_buffer(c, recv, "recv");
            parallel::check_counts(c, "all_to_all_v", send_counts, send_displs, "send_counts",
                                   "send_displs");
            parallel::check_counts(c, "all_to_all_v", recv_counts, recv_displs, "recv_counts",
                                   "recv_displs");
            check_regions(send_counts, send_displs, s.nbytes(), "send");
            check_regions(recv_counts, recv_displs, r.nbytes(), "recv");
            nb::gil_scoped_release release;
            c.all_to_all_v(s.data, send_counts, send_displs, r.data, recv_counts, recv_displs,
                           stream_of(stream));
          },
          nb::arg("send"), nb::arg("send_counts"), nb::arg("send_displs"), nb::arg("recv"),
          nb::arg("recv_counts"), nb::arg("recv_displs"), nb::arg("stream") = 0,
          "Rank r gets send_counts[r] bytes from byte send_displs[r] of send; rank r's bytes land "
          "at byte recv_displs[r] of recv (recv_counts[r] of them).")
      .def(
          "broadcast",
          [](Communicator& c, const Array& data, int root, uintptr_t stream) {
            const TensorView d = comm_buffer(c, data, "data");
            nb::gil_scoped_release release;
            c.broadcast(d.data, d.nbytes(), root, stream_of(stream));
          },
          nb::arg("data"), nb::arg("root"), nb::arg("stream") = 0,
          "Copies root's data into data on every rank.")
      .def(
          "send_recv",
          [](Communicator& c, const Array& send, int dest, const Array& recv, int source,
             uintptr_t stream) {
            const TensorView s = comm_buffer(c, send, "send"), r = comm_buffer(c, recv, "recv");
            nb::gil_scoped_release release;
            c.send_recv(s.data, s.nbytes(), dest, r.data, r.nbytes(), source, stream_of(stream));
          },
          nb::arg("send"), nb::arg("dest"), nb::arg("recv"), nb::arg("source"),
          nb::arg("stream") = 0,
          "One ring step, called by every rank at once: send goes to rank dest, recv gets what "
          "rank source sends this rank (its whole size).")
      .def(
          "barrier",
          [](Communicator& c) {
            nb::gil_scoped_release release;
            c.barrier();
          },
          "Returns once every rank has called it.")
      .def(
          "synchronize",
          [](Communicator& c, uintptr_t stream) {
            nb::gil_scoped_release release;
            c.synchronize(stream_of(stream));
          },
          nb::arg("stream") = 0, "Waits for the collectives enqueued on `stream`.");

  nb::class_<parallel::OneRankCommunicator, Communicator>(
      m, "OneRankCommunicator", "The group of one: every collective is a copy.")
      .def(
          "__init__",
          [](parallel::OneRankCommunicator* self, const std::string& device) {
            new (self) parallel::OneRankCommunicator(parse_device(device));
          },
          nb::arg("device") = "cpu");

  nb::class_<CallbackCommunicator, Communicator>(
      m, "CallbackCommunicator",
      "A communicator whose collectives call the methods of `transport` (flashkv.parallel "
      "builds one over a torch.distributed process group). A method that raises breaks it.")
      .def(
          "__init__",
          [](CallbackCommunicator* self, nb::object transport, int rank, int size,
             const std::string& device, const std::string& name) {
            new (self)
                CallbackCommunicator(std::move(transport), rank, size, parse_device(device), name);
          },
          nb::arg("transport"), nb::arg("rank"), nb::arg("size"), nb::arg("device"),
          nb::arg("name"))
      .def_prop_ro("broken", &CallbackCommunicator::broken,
                   "Whether a collective failed (every later call then raises at once).");

  m.def(
      "built_with_mpi", [] { return FLASHKV_WITH_MPI != 0; },
      "Whether this build has the MPI communicator (mpi_communicator).");
  m.def(
      "built_with_nccl", [] { return FLASHKV_WITH_NCCL != 0; },
      "Whether this build has the NCCL communicator (nccl_communicator).");
  m.def(
      "mpi_communicator",
      [](int fortran_comm, double timeout_s) -> std::unique_ptr<Communicator> {
#if FLASHKV_WITH_MPI
        parallel::CommOptions o;
        o.timeout_s = timeout_s;
        return parallel::make_mpi_communicator(fortran_comm, o);
#else
        throw_error(str_cat("mpi_communicator: this flashkv was built without MPI (fortran_comm ",
                            fortran_comm, ", timeout_s ", timeout_s, ")"));
#endif
      },
      nb::arg("fortran_comm"), nb::arg("timeout_s") = parallel::CommOptions().timeout_s,
      "The MPI communicator (host memory) over a duplicate of the communicator with this "
      "Fortran handle (mpi4py: comm.py2f()); collective.");
  m.def(
      "nccl_communicator",
      [](uintptr_t comm, const std::string& device,
         double timeout_s) -> std::unique_ptr<Communicator> {
        const Device dev = parse_device(device);
#if FLASHKV_WITH_NCCL
        FLASHKV_CHECK(comm != 0, "comm: expected an ncclComm_t as an int, got 0");
        parallel::CommOptions o;
        o.timeout_s = timeout_s;
        return parallel::make_nccl_communicator(
            reinterpret_cast<ncclComm*>(comm),  // NOLINT(performance-no-int-to-ptr): see above
            dev, o);
#else
        throw_error(
            str_cat("nccl_communicator: this flashkv module was built without NCCL (comm ", comm,
                    " on ", dev.str(), ", timeout_s ", timeout_s,
                    "; configure with -DFLASHKV_PYTHON_NCCL=ON, or pass a torch.distributed "
                    "NCCL group to from_process_group, which needs no NCCL here)"));
#endif
      },
      nb::arg("comm"), nb::arg("device"), nb::arg("timeout_s") = parallel::CommOptions().timeout_s,
      "The NCCL communicator (GPU memory) over an ncclComm_t given as an int (not owned: it must "
      "outlive this communicator) on `device` ('cuda:N').");
}

parallel::CpLayout parse_layout(const std::string& s) {
  if (s == "interleaved") return parallel::CpLayout::interleaved;
  if (s == "contiguous") return parallel::CpLayout::contiguous;
  throw_error(str_cat("layout: expected 'interleaved' or 'contiguous', got '", s, "'"));
}
parallel::CpExchange parse_exchange(const std::string& s) {
  if (s == "all_gather") return parallel::CpExchange::all_gather;
  if (s == "all_to_all") return parallel::CpExchange::all_to_all;
  throw_error(str_cat("exchange: expected 'all_gather' or 'all_to_all', got '", s, "'"));
}
parallel::CpKvPass parse_kv_pass(const std::string& s) {
  if (s == "all_gather") return parallel::CpKvPass::all_gather;
  if (s == "ring") return parallel::CpKvPass::ring;
  throw_error(str_cat("kv_pass: expected 'all_gather' or 'ring', got '", s, "'"));
}
const char* layout_name(parallel::CpLayout l) {
  return l == parallel::CpLayout::interleaved ? "interleaved" : "contiguous";
}
const char* exchange_name(parallel::CpExchange e) {
  return e == parallel::CpExchange::all_gather ? "all_gather" : "all_to_all";
}
const char* kv_pass_name(parallel::CpKvPass p) {
  return p == parallel::CpKvPass::all_gather ? "all_gather" : "ring";
}

void bind_sharding(nb::module_& m) {
  nb::class_<CpOptions>(m, "CpOptions",
                        "How a request's KV is sharded and how the states are exchanged "
                        "(C++ parallel::CpOptions).")
      .def(
          "__init__",
          [](CpOptions* self, const std::string& layout, int64_t block, const std::string& exchange,
             const std::string& kv_pass) {
            CpOptions o;
            o.layout = parse_layout(layout);
            o.block = block;
            o.exchange = parse_exchange(exchange);
            o.kv_pass = parse_kv_pass(kv_pass);
            parallel::CpShard(o, 1);  // validates the block
            new (self) CpOptions(o);
          },
          nb::kw_only(), nb::arg("layout") = "interleaved", nb::arg("block") = 1,
          nb::arg("exchange") = "all_gather", nb::arg("kv_pass") = "all_gather",
          "layout 'interleaved' (runs of `block` tokens round robin: position t on rank (t // "
          "block) % P) or 'contiguous' (rank r holds [r * block, (r + 1) * block), the last rank "
          "everything after); exchange 'all_gather' or 'all_to_all'; kv_pass: how an extend's new "
          "tokens' K/V reach the ranks, 'all_gather' or 'ring' (passed from rank to rank, each "
          "block attended as it passes).")
      .def_prop_ro("layout", [](const CpOptions& o) { return layout_name(o.layout); })
      .def_ro("block", &CpOptions::block)
      .def_prop_ro("exchange", [](const CpOptions& o) { return exchange_name(o.exchange); })
      .def_prop_ro("kv_pass", [](const CpOptions& o) { return kv_pass_name(o.kv_pass); })
      .def("__repr__", [](const CpOptions& o) {
        return str_cat("CpOptions(layout='", layout_name(o.layout), "', block=", o.block,
                       ", exchange='", exchange_name(o.exchange), "', kv_pass='",
                       kv_pass_name(o.kv_pass), "')");
      });

  nb::class_<parallel::CpShard>(m, "CpShard", "Where a request's positions live.")
      .def(nb::init<const CpOptions&, int>(), nb::arg("options"), nb::arg("world"))
      .def_prop_ro("world", &parallel::CpShard::world)
      .def("owner", &parallel::CpShard::owner, nb::arg("pos"), "The rank holding position pos.")
      .def("local_len", &parallel::CpShard::local_len, nb::arg("rank"), nb::arg("len"),
           "How many of the positions [0, len) rank `rank` holds.")
      .def("local_index", &parallel::CpShard::local_index, nb::arg("pos"),
           "The index of position pos among its owner's positions.")
      .def("global_pos", &parallel::CpShard::global_pos, nb::arg("rank"), nb::arg("local"),
           "The position of rank `rank`'s local entry `local`.")
      .def(
          "positions",
          [](const parallel::CpShard& s, int rank, int64_t len) {
            FLASHKV_CHECK(rank >= 0 && rank < s.world(), "rank: expected 0 <= rank < ", s.world(),
                          ", got ", rank);
            std::vector<int64_t> pos(static_cast<size_t>(s.local_len(rank, len)));
            for (size_t k = 0; k < pos.size(); ++k)
              pos[k] = s.global_pos(rank, static_cast<int64_t>(k));
            return pos;
          },
          nb::arg("rank"), nb::arg("len"),
          "The positions of [0, len) rank `rank` holds, in increasing order (its local entries).");

  m.def(
      "zigzag_rows",
      [](int64_t n, int world, int rank) {
        FLASHKV_CHECK(world >= 1 && rank >= 0 && rank < world, "rank: expected 0 <= rank < world ",
                      "= ", world, ", got ", rank);
        const parallel::ZigzagRows z = parallel::zigzag_rows(n, world, rank);
        return std::make_pair(std::make_pair(z.begin[0], z.len[0]),
                              std::make_pair(z.begin[1], z.len[1]));
      },
      nb::arg("n"), nb::arg("world"), nb::arg("rank"),
      "The new tokens rank `rank` owns of a request's n: ((begin, len), (begin, len)), chunks r "
      "and 2 * world - 1 - r of 2 * world.");
}

AttentionOptions run_options(float sm_scale, float logits_soft_cap, bool causal, int window_left,
                             const TensorView& sinks) {
  AttentionOptions opt;
  opt.sm_scale = sm_scale;
  opt.logits_soft_cap = logits_soft_cap;
  opt.causal = causal;
  opt.window_left = window_left;
  opt.sinks = sinks;
  return opt;
}

void bind_operators(nb::module_& m) {
  nb::class_<CpDecode>(m, "CpDecode",
                       "Sharded decode (C++ parallel::CpDecode): every rank holds the batch's "
                       "queries and its shard of each request's KV, and gets the whole output.")
      .def(nb::init<Communicator&, const CpOptions&>(), nb::arg("comm"), nb::arg("options"),
           nb::keep_alive<1, 2>())
      .def(
          "plan",
          [](CpDecode& d, std::vector<int32_t> kv_len, int32_t num_qo_heads, int32_t num_kv_heads,
             int32_t head_dim_qk, int32_t head_dim_v, int32_t page_size, const std::string& dtype,
             int32_t window_left, const PlanOptions& plan_options, uintptr_t stream) {
            parallel::CpDecodeShape s;
            s.kv_len = std::move(kv_len);
            s.num_qo_heads = num_qo_heads;
            s.num_kv_heads = num_kv_heads;
            s.head_dim_qk = head_dim_qk;
            s.head_dim_v = head_dim_v;
            s.page_size = page_size;
            s.dtype = parse_dtype(dtype.c_str());
            s.window_left = window_left;
            d.plan(s, plan_options, stream_of(stream));
          },
          nb::kw_only(), nb::arg("kv_len"), nb::arg("num_qo_heads"), nb::arg("num_kv_heads"),
          nb::arg("head_dim_qk"), nb::arg("head_dim_v"), nb::arg("page_size"), nb::arg("dtype"),
          nb::arg("window_left"), nb::arg("plan_options"), nb::arg("stream"))
      .def_prop_ro("local_kv_len", &CpDecode::local_kv_len)
      .def(
          "run",
          [](CpDecode& d, const Array& q, const Array& k_cache, const Array& v_cache,
             const Array& indptr, const Array& indices, const OptArray& last_page_len,
             int page_size, float k_scale, float v_scale, const std::string& kv_dtype,
             float sm_scale, float logits_soft_cap, int window_left, const OptArray& sinks,
             const Array& out, const OptArray& lse, uintptr_t stream) {
            const PagedKV kv = paged_kv_of(k_cache, v_cache, indptr, indices, last_page_len,
                                           page_size, k_scale, v_scale, kv_dtype);
            const AttentionOptions opt =
                run_options(sm_scale, logits_soft_cap, false, window_left, view_of(sinks, "sinks"));
            const TensorView qv = view_of(q, "q"), ov = view_of(out, "out"),
                             lv = view_of(lse, "lse");
            nb::gil_scoped_release release;
            d.run(qv, kv, opt, ov, lv, stream_of(stream));
          },
          nb::kw_only(), nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"),
          nb::arg("paged_kv_indptr"), nb::arg("paged_kv_indices"),
          nb::arg("paged_kv_last_page_len").none(), nb::arg("page_size"), nb::arg("k_scale"),
          nb::arg("v_scale"), nb::arg("kv_dtype"), nb::arg("sm_scale"), nb::arg("logits_soft_cap"),
          nb::arg("window_left"), nb::arg("sinks").none(), nb::arg("out"), nb::arg("lse").none(),
          nb::arg("stream"));

  nb::class_<CpExtend>(m, "CpExtend",
                       "Sharded extend (C++ parallel::CpExtend): a sharded cached prefix and new "
                       "tokens split zigzag; each rank gives and gets its own new tokens' rows.")
      .def(nb::init<Communicator&, const CpOptions&>(), nb::arg("comm"), nb::arg("options"),
           nb::keep_alive<1, 2>())
      .def(
          "plan",
          [](CpExtend& e, std::vector<int32_t> prefix_len, std::vector<int32_t> extend_len,
             int32_t num_qo_heads, int32_t num_kv_heads, int32_t head_dim_qk, int32_t head_dim_v,
             int32_t page_size, const std::string& dtype, bool causal, int32_t window_left,
             const OptArray& custom_mask, const OptArray& mask_indptr,
             const PlanOptions& plan_options, uintptr_t stream) {
            parallel::CpExtendShape s;
            s.prefix_len = std::move(prefix_len);
            s.extend_len = std::move(extend_len);
            s.num_qo_heads = num_qo_heads;
            s.num_kv_heads = num_kv_heads;
            s.head_dim_qk = head_dim_qk;
            s.head_dim_v = head_dim_v;
            s.page_size = page_size;
            s.dtype = parse_dtype(dtype.c_str());
            s.causal = causal;
            s.window_left = window_left;
            s.custom_mask = view_of(custom_mask, "custom_mask");
            s.mask_indptr = view_of(mask_indptr, "mask_indptr");
            e.plan(s, plan_options, stream_of(stream));
          },
          nb::kw_only(), nb::arg("prefix_len"), nb::arg("extend_len"), nb::arg("num_qo_heads"),
          nb::arg("num_kv_heads"), nb::arg("head_dim_qk"), nb::arg("head_dim_v"),
          nb::arg("page_size"), nb::arg("dtype"), nb::arg("causal"), nb::arg("window_left"),
          nb::arg("custom_mask").none(), nb::arg("mask_indptr").none(), nb::arg("plan_options"),
          nb::arg("stream"))
      .def_prop_ro("local_prefix_len", &CpExtend::local_prefix_len)
      .def_prop_ro("num_own_rows", &CpExtend::num_own_rows)
      .def_prop_ro("num_local_new", &CpExtend::num_local_new)
      .def(
          "run",
          [](CpExtend& e, const Array& q, const Array& k, const Array& v, const Array& k_cache,
             const Array& v_cache, const Array& indptr, const Array& indices,
             const OptArray& last_page_len, int page_size, float k_scale, float v_scale,
             const std::string& kv_dtype, float sm_scale, float logits_soft_cap, bool causal,
             int window_left, const OptArray& sinks, const Array& out, const OptArray& lse,
             uintptr_t stream) {
            const PagedKV prefix = paged_kv_of(k_cache, v_cache, indptr, indices, last_page_len,
                                               page_size, k_scale, v_scale, kv_dtype);
            const AttentionOptions opt = run_options(sm_scale, logits_soft_cap, causal, window_left,
                                                     view_of(sinks, "sinks"));
            const TensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
            const TensorView ov = view_of(out, "out"), lv = view_of(lse, "lse");
            nb::gil_scoped_release release;
            e.run(qv, kv, vv, prefix, opt, ov, lv, stream_of(stream));
          },
          nb::kw_only(), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("k_cache"),
          nb::arg("v_cache"), nb::arg("paged_kv_indptr"), nb::arg("paged_kv_indices"),
          nb::arg("paged_kv_last_page_len").none(), nb::arg("page_size"), nb::arg("k_scale"),
          nb::arg("v_scale"), nb::arg("kv_dtype"), nb::arg("sm_scale"), nb::arg("logits_soft_cap"),
          nb::arg("causal"), nb::arg("window_left"), nb::arg("sinks").none(), nb::arg("out"),
          nb::arg("lse").none(), nb::arg("stream"))
      .def(
          "append_local_kv",
          [](CpExtend& e, const Array& k, const Array& v, const Array& out_cache_loc,
             const Array& k_pool, const Array& v_pool, float k_scale, float v_scale,
             const std::string& kv_dtype, uintptr_t stream) {
            const TensorView kv = view_of(k, "k"), vv = view_of(v, "v");
            const TensorView loc = view_of(out_cache_loc, "out_cache_loc");
            const TensorView kp = kv_view_of(k_pool, "k_pool", kv_dtype, 0);
            const TensorView vp = kv_view_of(v_pool, "v_pool", kv_dtype, 0);
            nb::gil_scoped_release release;
            e.append_local_kv(kv, vv, loc, kp, vp, k_scale, v_scale, stream_of(stream));
          },
          nb::kw_only(), nb::arg("k"), nb::arg("v"), nb::arg("out_cache_loc"), nb::arg("k_pool"),
          nb::arg("v_pool"), nb::arg("k_scale"), nb::arg("v_scale"), nb::arg("kv_dtype"),
          nb::arg("stream"));
}

}  // namespace

void bind_parallel(nb::module_& m) {
  bind_communicator(m);
  bind_sharding(m);
  bind_operators(m);
}

}  // namespace flashkv::py
