// Context parallelism in the serving simulator (docs/PARALLEL.md, "Serving"): every rank runs the
// same scheduler over the same workload and seed, so the scheduling decisions, the global slot
// ids, the prefix cache and the requests' req_to_token rows are the same on every rank, and the
// collectives of each pass line up. What is a rank's own is the KV: a RankShare maps each live
// global slot whose position the layout gives this rank to a slot of the rank's own pool (its own
// allocator), and keeps the rank's req_to_token row of each request, which lists those slots in
// increasing position (what ForwardBatch carries under context parallelism).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/parallel/context_parallel.h"
#include "invariants.h"
#include "step_batch.h"

namespace flashkv::app {

// How a run is sharded: null comm runs the one-rank path, without any of this.
struct CpConfig {
  parallel::Communicator* comm = nullptr;  // not owned
  parallel::CpOptions options;
  bool enabled() const { return comm != nullptr; }
};

class RankShare {
 public:
  // global_slots: the scheduler's pool size (this rank's pool gets as many: a bound that holds for
  // any layout); max_reqs, max_context: the scheduler's req_to_token rows.
  RankShare(const CpConfig& cp, int64_t global_slots, int64_t max_reqs, int64_t max_context,
            Device device);

  int rank() const { return rank_; }
  const parallel::CpShard& shard() const { return shard_; }
  ReqToTokenPool& req_to_token() { return *req_to_token_; }
  const TokenAllocator& allocator() const { return *allocator_; }
  int64_t slots_in_use() const { return allocator_->capacity() - allocator_->num_free(); }
  int64_t peak_slots() const { return peak_slots_; }

  // A request took req_to_token row `row` (the scheduler's): the rank's pool gives it the same
  // row; and gave it back.
  void add_request(int32_t row);
  void remove_request(int32_t row);
  // Brings the request's local row up to its global slots: each position the rank holds and has
  // not seen gets a local slot (once per global slot: shared prefix blocks share it too) and its
  // entry in the row. After rewrite_tokens, call resync instead.
  void sync(const Sequence& seq);
  void resync(const Sequence& seq);
  // The scheduler freed these global slots: the local slots of those this rank holds are freed.
  void release(const std::vector<int32_t>& global_slots);
  // Points a pass's batch at this rank's share: its req_to_token pool, and each new token's local
  // slot where the rank holds its position, else the dummy slot 0. The requests must be synced.
  // It also checks, with one small all-gather, that every rank runs the same pass (mode and
  // lengths), so that ranks whose schedules diverged stop with that error instead of running
  // mismatched collectives.
  void localize(StepBatch& step);

  // "" when this rank's share is consistent, else the first violation: every local slot in use
  // belongs to exactly one live global slot (no local slot leaked or shared by two), and each
  // running request's local row lists the local slots of the positions the rank holds.
  std::string check(const KVAllocator& global, const std::vector<RequestRow>& running) const;

 private:
  int32_t local_slot(int32_t global_slot) const;
  void note_use();

  parallel::Communicator& comm_;
  parallel::CpShard shard_;
  int rank_;
  std::unique_ptr<ReqToTokenPool> req_to_token_;
  std::unique_ptr<TokenAllocator> allocator_;
  std::vector<int32_t> local_of_;  // global slot -> local slot; -1: not on this rank
  std::vector<int32_t> synced_;    // per row: the positions [0, synced) its local row reflects
  Tensor out_cache_loc_;           // the last localized batch's
  int64_t peak_slots_ = 0;
};

}  // namespace flashkv::app
