// Scheduler: continuous batching of a workload over a Model (and, for speculative decoding, a
// one-layer draft Model sharing its req_to_token rows and slot ids).
//
// Each scheduler step runs one of:
//   EXTEND  the waiting requests that fit (in arrival order, under the token budget, the
//           running-request cap and the KV reservation), each on top of the longest prefix of its
//           prompt the prefix cache holds; afterwards its prompt blocks are cached;
//   DECODE  one token for every running request, when nothing could be admitted; or with
//           speculative decoding, a speculative step instead: draft-model DECODE passes that
//           draft a chain, a TARGET_VERIFY pass over a random draft tree, an accepted path, and a
//           DRAFT_EXTEND pass of the draft model over the accepted tokens.
// A request is admitted only when the free slots plus the prefix cache's unreferenced slots
// cover what every admitted request may still need (its remaining output, plus a draft tree), so
// a running request never waits for KV; when allocation finds the pool short it evicts
// unreferenced prefix-cache blocks, least recently used first. A finished request returns its
// slots except the prompt blocks the cache holds, which stay until evicted.
// Steps with nothing to run skip ahead to the next arrival.
//
// Encoder-decoder models (cross attention on odd layers): each request carries an encoder input
// (RequestSpec::encoder_len tokens). Admission allocates their slots as the first entries of the
// request's req_to_token row; the EXTEND pass that admits it writes their K/V (the cross-attention
// layers' k / v) and every later pass reads them; they are freed with the request. Such requests
// neither reuse nor cache prompt blocks, and speculative decoding is refused.
//
// Context parallelism (SchedulerOptions::cp): every rank runs the same scheduler, so its
// decisions, global slot ids, prefix cache and req_to_token rows are the same everywhere; a
// RankShare keeps the rank's own KV pool, allocator and req_to_token rows, each pass's batch
// carries that share, and the invariants also check it on every rank.
//
// run() serves a whole workload. A long-running driver (the soak test) instead calls submit()
// and step() itself and checks the per-step invariants (check_step_invariants) in between.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "model.h"
#include "prefix_cache.h"
#include "rank_share.h"
#include "workload.h"

namespace flashkv::app {

struct SchedulerOptions {
  int64_t kv_slots = 4096;  // usable slots of the KV pool
  // New prompt tokens (and encoder tokens) per EXTEND pass; a longer request runs alone.
  int token_budget = 512;
  int max_running = 16;  // requests in flight
  int block_size = 16;   // prefix-cache granularity in tokens
  // Longest request (encoder input + prompt + output + draft tree) in tokens: the width of the
  // req_to_token rows. 0: the longest request of the constructor's workload.
  int64_t max_context = 0;
  CheckOptions check;
  int check_every = 1;  // with check.enabled: check the passes of every check_every-th step
  uint64_t seed = 1;
  // Context parallelism (rank_share.h): every rank runs this scheduler with the same options and
  // workload; each holds its share of the KV. Decoder-only models without speculative decoding.
  CpConfig cp;
};

// Figures of a run (what the report and `serve --json` show).
struct ServeStats {
  int64_t requests = 0, requests_done = 0;
  int64_t prompt_tokens = 0;         // all prompt tokens of the admitted requests
  int64_t cached_prompt_tokens = 0;  // of which served from the prefix cache
  int64_t encoder_tokens = 0;        // encoder tokens of the admitted requests
  int64_t generated_tokens = 0;
  double serve_s = 0;           // wall time of the run, reference checks and NaN scans excluded
  double check_s = 0;           // time spent in those
  std::vector<double> pass_ms;  // every forward pass (all layers of its model)
  struct ModeStats {
    int64_t passes = 0;
    double ms = 0;
  };
  std::map<std::string, ModeStats> by_mode;  // "EXTEND", "DECODE", "draft DECODE", ...
  int64_t steps = 0;
  int64_t kv_slots = 0;
  int64_t peak_kv_slots = 0;          // allocated slots, prefix-cache holdings included
  int64_t peak_working_kv_slots = 0;  // ... less the unreferenced (evictable) cache blocks
  int64_t admission_waits = 0;        // steps where the head of the queue waited for KV space
  int64_t evicted_blocks = 0, cached_blocks_end = 0, cached_slots_end = 0;
  int64_t spec_steps = 0, spec_request_steps = 0, accepted_tokens = 0;
  int64_t checked = 0, check_failures = 0;
  double worst_rel_error = 0;
  std::string first_failure;
  int64_t nonfinite_passes = 0;                 // passes with a NaN or Inf in a scanned output
  std::string first_nonfinite;                  // the first such pass, described
  std::vector<std::string> invariant_failures;  // empty: every end-of-run invariant holds

  double tokens_per_s() const { return serve_s > 0 ? generated_tokens / serve_s : 0; }
  double prefix_hit_rate() const {
    return prompt_tokens > 0 ? double(cached_prompt_tokens) / double(prompt_tokens) : 0;
  }
  double pass_ms_percentile(double p) const;  // nearest rank; 0 without passes
};

// What the progress line shows, after every step.
struct Progress {
  int64_t step = 0, steps = 0;  // the soak test: step of steps (0 of 0 for serve)
  int64_t done = 0, total = 0;
  int64_t generated_tokens = 0;
  double serve_s = 0;
  int64_t kv_used = 0, kv_slots = 0;
  int64_t running = 0, waiting = 0;
};

class Scheduler {
 public:
  // Takes the workload's requests (it may be empty when options.max_context is set: submit()
  // adds requests later) and its speculative setting. Throws flashkv::Error when a request can
  // never fit the pool (it needs more than kv_slots).
  Scheduler(const Workload& workload, const ModelConfig& model, Device device,
            const SchedulerOptions& options);
  ~Scheduler();

  // Steps until every request finished, then checks the end-of-run invariants (into
  // ServeStats::invariant_failures).
  ServeStats run(const std::function<void(const Progress&)>& on_progress = {});

  // Slots one request needs at its end (encoder input, prompt, output and a draft tree): the pool
  // must hold it.
  static int64_t slots_needed(const RequestSpec& r, const SpeculativeConfig& spec);

  // --- driving the scheduler step by step ---
  // Queues a request arriving at r.arrival (arrivals must not decrease). Throws flashkv::Error
  // when it can never fit the pool or the req_to_token rows, or when it has an encoder input
  // (encoder_len >= 1) exactly when the model has no cross attention.
  void submit(const RequestSpec& r);
  // Runs one step (one EXTEND, DECODE or speculative step), first skipping ahead to the next
  // arrival when nothing is waiting or running. Returns false, doing nothing, when no request
  // is left at all.
  bool step();
  // Every request submitted so far has finished.
  bool idle() const { return running_.empty() && waiting_.empty(); }
  int64_t clock() const { return clock_; }  // the current step's time (arrivals count in it)
  int64_t num_pending() const { return static_cast<int64_t>(pending_.size()); }
  int64_t kv_in_use() const { return allocator_->capacity() - allocator_->num_free(); }
  int64_t prefix_cache_slots() const { return cache_.cached_slots(); }
  // Evicts every unreferenced prefix-cache block, handing its slots back to the allocator;
  // returns how many slots that freed. With nothing running, the pool is then empty.
  int64_t flush_prefix_cache();
  // The invariants that hold between any two steps; "" when they do, else the first violation:
  //   slot ownership   every allocated KV slot is held by exactly one owner: a running request
  //                    (its encoder tokens' slots and those after its shared prefix blocks) or
  //                    the prefix cache, and every slot an owner holds is allocated
  //                    (check_slot_ownership);
  //   request rows     each running request's req_to_token row lists its slots (its encoder
  //                    tokens', then its prefix blocks'), and no other row is in use;
  //   prefix cache     the cache's own bookkeeping (PrefixCache::check_invariants);
  //   rank share       with context parallelism, RankShare::check on this rank.
  std::string check_step_invariants() const;
  // Context parallelism: this rank's share (null without).
  const RankShare* rank_share() const { return share_.get(); }
  // Figures so far (run() returns the final ones).
  const ServeStats& stats() const { return stats_; }
  // The progress line's figures now (serve_s, step and steps are the caller's to fill).
  Progress progress() const;
  // The allocator, the req_to_token rows and the target model, for tools and tests that inspect
  // (or deliberately break) the state the invariants watch.
  TokenAllocator& allocator() { return *allocator_; }
  const ReqToTokenPool& req_to_token() const { return *req_to_token_; }
  Model& model() { return *model_; }

 private:
  struct Active;
  struct Pending {
    int64_t id;  // submission order
    RequestSpec request;
  };
  std::vector<Active*> admit();
  void run_extend(const std::vector<Active*>& admitted);
  void run_decode();
  void run_speculative();
  void finish(Active* a);
  std::vector<int32_t> alloc_slots(int64_t n);         // evicting cached prefixes when short
  void free_slots(const std::vector<int32_t>& slots);  // and their local slots (RankShare)
  int64_t reserve_of(const Active& a) const;
  void record(const char* what, const PassResult& r);
  void note_kv_use();
  void check_end_invariants();

  SpeculativeConfig spec_;
  SchedulerOptions options_;
  Device device_;
  std::unique_ptr<ReqToTokenPool> req_to_token_;
  std::unique_ptr<TokenAllocator> allocator_;
  std::unique_ptr<RankShare> share_;  // context parallelism
  std::unique_ptr<Model> model_, draft_;
  PrefixCache cache_;
  std::vector<std::unique_ptr<Active>> active_;  // admitted and not finished
  std::deque<Pending> pending_;                  // not arrived yet, by arrival
  std::deque<Pending> waiting_;                  // arrived, not admitted
  std::vector<Active*> running_;
  int64_t clock_ = 0;
  CheckOptions step_check_;  // options.check, enabled on every check_every-th step
  ServeStats stats_;
  std::mt19937_64 rng_;  // draft trees and accepted paths
};

}  // namespace flashkv::app
