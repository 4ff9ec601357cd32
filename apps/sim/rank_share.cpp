#include "rank_share.h"

#include <algorithm>

#include "flashkv/core/error.h"
#include "flashkv/parallel/host_collectives.h"

namespace flashkv::app {

RankShare::RankShare(const CpConfig& cp, int64_t global_slots, int64_t max_reqs,
                     int64_t max_context, Device device)
    : comm_(*cp.comm), shard_(cp.options, cp.comm->size()), rank_(cp.comm->rank()) {
  // The longest local row: local_len grows with the length, so the longest request's share.
  const int64_t local_context = std::max<int64_t>(shard_.local_len(rank_, max_context), 1);
  req_to_token_ = std::make_unique<ReqToTokenPool>(max_reqs, local_context, device);
  allocator_ = std::make_unique<TokenAllocator>(global_slots);
  // Global slots are 1..global_slots (slot 0 is the dummy), as the scheduler's TokenAllocator.
  local_of_.assign(static_cast<size_t>(global_slots) + 1, -1);
  synced_.assign(static_cast<size_t>(max_reqs), 0);
}

int32_t RankShare::local_slot(int32_t global_slot) const {
  FLASHKV_CHECK(global_slot > 0 && global_slot < static_cast<int64_t>(local_of_.size()),
                "RankShare: global slot ", global_slot, " outside the pool's slots 1..",
                local_of_.size() - 1);
  return local_of_[global_slot];
}

void RankShare::note_use() { peak_slots_ = std::max(peak_slots_, slots_in_use()); }

void RankShare::add_request(int32_t row) {
  const auto local = req_to_token_->alloc(1);
  FLASHKV_CHECK(local.has_value() && (*local)[0] == row, "RankShare: rank ", rank_,
                " took req_to_token row ", local ? (*local)[0] : -1, ", the scheduler's is ", row,
                " (the ranks' schedules differ)");
  synced_[row] = 0;
}

void RankShare::remove_request(int32_t row) {
  req_to_token_->free({row});
  synced_[row] = 0;
}

void RankShare::sync(const Sequence& seq) {
  FLASHKV_CHECK(seq.encoder_len == 0, "RankShare: encoder tokens are not supported");
  const int32_t from = synced_[seq.row], to = seq.seq_len();
  // The positions of [from, to) this rank holds have consecutive local indices.
  std::vector<int32_t> fresh;  // global slots without a local one yet
  for (int32_t p = from; p < to; ++p)
    if (shard_.owner(p) == rank_ && local_slot(seq.slots[p]) < 0) fresh.push_back(seq.slots[p]);
  if (!fresh.empty()) {
    const auto got = allocator_->alloc(static_cast<int64_t>(fresh.size()));
    // The rank's pool has as many slots as the global one, so it fits whatever the layout.
    FLASHKV_CHECK(got.has_value(), "RankShare: rank ", rank_, " is out of KV slots");
    for (size_t i = 0; i < fresh.size(); ++i) local_of_[fresh[i]] = (*got)[i];
    note_use();
  }
  std::vector<int32_t> row;
  int64_t first = -1;
  for (int32_t p = from; p < to; ++p) {
    if (shard_.owner(p) != rank_) continue;
    if (first < 0) first = shard_.local_index(p);
    row.push_back(local_of_[seq.slots[p]]);
  }
  if (!row.empty()) req_to_token_->write(seq.row, first, row);
  synced_[seq.row] = to;
}

void RankShare::resync(const Sequence& seq) {
  synced_[seq.row] = 0;
  sync(seq);
}

void RankShare::release(const std::vector<int32_t>& global_slots) {
  std::vector<int32_t> freed;
  for (const int32_t g : global_slots) {
    const int32_t l = local_slot(g);
    if (l < 0) continue;
    freed.push_back(l);
    local_of_[g] = -1;
  }
  allocator_->free(freed);
}

void RankShare::localize(StepBatch& step) {
  ForwardBatch& b = step.batch();
  // A digest of the pass (FNV-1a over its mode and lengths), the same on every rank.
  uint64_t digest = 0xcbf29ce484222325ull;
  auto mix = [&digest](int64_t v) {
    for (int i = 0; i < 8; ++i)
      digest = (digest ^ ((static_cast<uint64_t>(v) >> (8 * i)) & 0xFF)) * 0x100000001b3ull;
  };
  mix(static_cast<int64_t>(b.mode));
  for (const BatchEntry& e : step.entries()) {
    mix(e.seq_len);
    mix(e.num_new);
  }
  std::vector<uint64_t> digests(static_cast<size_t>(comm_.size()));
  parallel::all_gather_host(comm_, &digest, sizeof digest, digests.data());
  for (int r = 0; r < comm_.size(); ++r)
    FLASHKV_CHECK(digests[r] == digests[0], "context parallelism: rank ", r, "'s ",
                  mode_name(b.mode),
                  " pass differs from rank 0's (the ranks' schedules "
                  "diverged: run every rank with the same options and workload)");
  std::vector<int32_t> loc;
  loc.reserve(static_cast<size_t>(step.num_tokens()));
  for (const BatchEntry& e : step.entries()) {
    FLASHKV_CHECK(synced_[e.seq->row] >= e.seq_len, "RankShare::localize: request row ", e.seq->row,
                  " is synced to ", synced_[e.seq->row], " of its ", e.seq_len, " positions");
    for (int32_t p = e.seq_len - e.num_new; p < e.seq_len; ++p)
      loc.push_back(shard_.owner(p) == rank_ ? local_of_[e.seq->slots[p]] : 0);
  }
  out_cache_loc_ =
      Tensor::from_i32(loc.empty() ? std::vector<int32_t>{0} : loc, b.req_pool_indices.device);
  b.out_cache_loc = out_cache_loc_.view().rows(0, static_cast<int64_t>(loc.size()));
  b.req_to_token_pool = req_to_token_.get();
}

std::string RankShare::check(const KVAllocator& global,
                             const std::vector<RequestRow>& running) const {
  SlotOwner mapped{str_cat("rank ", rank_, "'s share of the live slots"), {}};
  for (size_t g = 1; g < local_of_.size(); ++g) {
    if (local_of_[g] < 0) continue;
    if (!global.is_live(static_cast<int32_t>(g)))
      return str_cat("rank ", rank_, " still holds local slot ", local_of_[g], " of global slot ",
                     g, ", which the scheduler freed");
    mapped.slots.push_back(local_of_[g]);
  }
  std::string bad = check_slot_ownership(*allocator_, {mapped});
  if (!bad.empty()) return str_cat("rank ", rank_, ": ", bad);
  // The local rows, as the global ones say they should be.
  std::vector<std::vector<int32_t>> expected(running.size());
  std::vector<RequestRow> rows;
  for (size_t i = 0; i < running.size(); ++i) {
    const std::vector<int32_t>& slots = *running[i].slots;
    for (size_t p = 0; p < slots.size(); ++p) {
      if (shard_.owner(static_cast<int64_t>(p)) != rank_) continue;
      const int32_t l = local_slot(slots[p]);
      if (l < 0)
        return str_cat("rank ", rank_, ": ", running[i].name, " position ", p, " (global slot ",
                       slots[p], ") has no local slot");
      expected[i].push_back(l);
    }
    rows.push_back({running[i].name, running[i].row, &expected[i]});
  }
  bad = check_request_rows(*req_to_token_, rows);
  return bad.empty() ? "" : str_cat("rank ", rank_, ": ", bad);
}

}  // namespace flashkv::app
