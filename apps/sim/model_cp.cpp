// The Model's context-parallel pieces: which rows of a pass a rank gives the backend, and the
// gathers that let every rank check its outputs against the float64 reference (which needs every
// rank's K/V and, in an extend, every rank's output rows).
#include <algorithm>
#include <cstring>

#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/parallel/host_collectives.h"
#include "model.h"

namespace flashkv::app {

namespace {

size_t row_bytes_of(const TensorView& t) {
  return t.shape[0] > 0 ? t.nbytes() / static_cast<size_t>(t.shape[0]) : 0;
}

// Byte offsets of `counts`, one after the other.
std::vector<size_t> offsets_of(const std::vector<size_t>& counts) {
  std::vector<size_t> displs(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + counts[r - 1];
  return displs;
}

// Appends the rows `slots` of a pool tensor [num_rows, ...] (on the host or a GPU) to `dst`, in
// runs of consecutive slots, so that a device pool costs a few copies rather than one per row.
void append_pool_rows(std::vector<char>& dst, const TensorView& pool,
                      const std::vector<int32_t>& slots) {
  const size_t bytes = row_bytes_of(pool);
  size_t at = dst.size();
  dst.resize(at + slots.size() * bytes);
  for (size_t j = 0; j < slots.size();) {
    size_t run = 1;
    while (j + run < slots.size() && slots[j + run] == slots[j] + static_cast<int32_t>(run)) ++run;
    copy_bytes(dst.data() + at, Device::cpu(),
               static_cast<const char*>(pool.data) + static_cast<size_t>(slots[j]) * bytes,
               pool.device, run * bytes);
    at += run * bytes;
    j += run;
  }
}

}  // namespace

Model::RowRuns Model::cp_rows(const StepBatch& step, int rank) const {
  RowRuns runs;
  if (step.batch().mode == ForwardMode::DECODE) {
    if (step.num_tokens() > 0) runs.emplace_back(0, step.num_tokens());
    return runs;
  }
  for (size_t i = 0; i < step.entries().size(); ++i) {
    const parallel::ZigzagRows z =
        parallel::zigzag_rows(step.entries()[i].num_new, cp_.comm->size(), rank);
    for (int c = 0; c < 2; ++c)
      if (z.len[c] > 0) runs.emplace_back(step.qo_begin(i) + z.begin[c], z.len[c]);
  }
  return runs;
}

void Model::gather_runs(const TensorView& src, const RowRuns& runs, const Tensor& dst) {
  FLASHKV_CHECK(src.is_contiguous(), "gather_runs: expected contiguous rows, got ", src.str());
  const size_t row = row_bytes_of(src);
  int64_t at = 0;
  for (const auto& [first, n] : runs) {
    copy_bytes(static_cast<char*>(dst.data()) + at * row, dst.device(),
               static_cast<const char*>(src.data) + first * row, src.device,
               static_cast<size_t>(n) * row);
    at += n;
  }
}

Tensor Model::cp_all_outputs(const StepBatch& step, const TensorView& own_out) {
  parallel::Communicator& comm = *cp_.comm;
  const int world = comm.size();
  const size_t row = row_bytes_of(own_out);
  std::vector<RowRuns> runs(static_cast<size_t>(world));
  std::vector<size_t> counts(static_cast<size_t>(world), 0);
  for (int r = 0; r < world; ++r) {
    runs[r] = cp_rows(step, r);
    for (const auto& run : runs[r]) counts[r] += static_cast<size_t>(run.second) * row;
  }
  const std::vector<size_t> displs = offsets_of(counts);
  // This rank's rows on the host (the exchange is of host buffers, staged through the
  // communicator's device where that is a GPU); never a null buffer, even when no rank has a row.
  std::vector<char> mine(std::max<size_t>(counts[comm.rank()], 1));
  copy_bytes(mine.data(), Device::cpu(), own_out.data, own_out.device, counts[comm.rank()]);
  std::vector<char> recv(std::max<size_t>(displs.back() + counts.back(), 1));
  parallel::all_gather_v_host(comm, mine.data(), recv.data(), counts, displs);
  Tensor all = Tensor::empty({std::max<int64_t>(step.num_tokens(), 1), own_out.shape[1]},
                             own_out.dtype, own_out.device);
  for (int r = 0; r < world; ++r) {
    size_t at = displs[r];
    for (const auto& [first, n] : runs[r]) {
      copy_bytes(static_cast<char*>(all.data()) + first * row, all.device(), recv.data() + at,
                 Device::cpu(), static_cast<size_t>(n) * row);
      at += static_cast<size_t>(n) * row;
    }
  }
  return all;
}

std::unique_ptr<KVPool> Model::cp_gather_kv(int layer, const StepBatch& step,
                                            const std::vector<size_t>& entries,
                                            std::vector<std::vector<int32_t>>& slots) {
  parallel::Communicator& comm = *cp_.comm;
  const parallel::CpShard shard(cp_.options, comm.size());
  const int world = comm.size(), me = comm.rank();
  const TensorView& k_pool = pool_->k(layer);
  const TensorView& v_pool = pool_->v(layer);
  const size_t kb = row_bytes_of(k_pool), vb = row_bytes_of(v_pool);
  const ForwardBatch& b = step.batch();  // localized: its req_to_token rows are this rank's
  // This rank's K rows, then V rows, of each checked request, in local (position) order.
  std::vector<char> send;
  for (const size_t i : entries) {
    const BatchEntry& e = step.entries()[i];
    const int64_t n = shard.local_len(me, e.seq_len);
    const std::vector<int32_t> local = b.req_to_token_pool->read(e.seq->row, 0, n);
    append_pool_rows(send, k_pool, local);
    append_pool_rows(send, v_pool, local);
  }
  std::vector<size_t> counts(static_cast<size_t>(world), 0);
  int64_t total = 0;
  for (const size_t i : entries) {
    const int32_t seq = step.entries()[i].seq_len;
    total += seq;
    for (int r = 0; r < world; ++r)
      counts[r] += static_cast<size_t>(shard.local_len(r, seq)) * (kb + vb);
  }
  const std::vector<size_t> displs = offsets_of(counts);
  std::vector<char> recv(std::max<size_t>(displs.back() + counts.back(), 1));
  if (send.empty()) send.resize(1);  // never a null buffer
  parallel::all_gather_v_host(comm, send.data(), recv.data(), counts, displs);

  // A one-layer host pool: request j's positions at slots base_j + 1 + position.
  KVPoolConfig pc;
  pc.num_slots = std::max<int64_t>(total, 1);
  pc.num_layers = 1;
  pc.num_kv_heads = config_.num_kv_heads;
  pc.head_dim_qk = config_.head_dim;
  pc.dtype = config_.kv_dtype;
  auto gathered = std::make_unique<KVPool>(pc);
  gathered->set_scales(0, pool_->k_scale(layer), pool_->v_scale(layer));
  slots.assign(entries.size(), {});
  std::vector<int32_t> base(entries.size(), 1);
  for (size_t j = 0; j < entries.size(); ++j) {
    const int32_t seq = step.entries()[entries[j]].seq_len;
    if (j + 1 < entries.size()) base[j + 1] = base[j] + seq;
    for (int32_t p = 0; p < seq; ++p) slots[j].push_back(base[j] + p);
  }
  char* k_dst = static_cast<char*>(gathered->k(0).data);
  char* v_dst = static_cast<char*>(gathered->v(0).data);
  for (int r = 0; r < world; ++r) {
    const char* at = recv.data() + displs[r];
    for (size_t j = 0; j < entries.size(); ++j) {
      const int64_t n = shard.local_len(r, step.entries()[entries[j]].seq_len);
      for (const auto& [dst, bytes] : {std::make_pair(k_dst, kb), std::make_pair(v_dst, vb)})
        for (int64_t l = 0; l < n; ++l, at += bytes) {
          const int64_t slot = base[j] + shard.global_pos(r, l);
          std::memcpy(dst + static_cast<size_t>(slot) * bytes, at, bytes);
        }
    }
  }
  return gathered;
}

}  // namespace flashkv::app
