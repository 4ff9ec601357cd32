#include "scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "flashkv/core/error.h"
#include "invariants.h"

namespace flashkv::app {

double ServeStats::pass_ms_percentile(double p) const {
  if (pass_ms.empty()) return 0;
  std::vector<double> s = pass_ms;
  std::sort(s.begin(), s.end());
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(s.size())));
  return s[std::min(s.size() - 1, rank > 0 ? rank - 1 : 0)];
}

// A request from admission to its end.
struct Scheduler::Active {
  int64_t id = 0;
  RequestSpec request;
  Sequence seq;
  std::vector<int32_t> chain;  // prefix-cache nodes it references: its leading prompt blocks
  int32_t generated = 0;       // output tokens so far (the prefill makes the first)

  // The slots the request holds itself: its encoder tokens' and its decoder tokens' after the
  // shared prefix blocks (those are the prefix cache's).
  std::vector<int32_t> own_slots(int block_size) const {
    const size_t enc = static_cast<size_t>(seq.encoder_len);
    const size_t shared = chain.size() * static_cast<size_t>(block_size);
    std::vector<int32_t> own(seq.slots.begin(), seq.slots.begin() + enc);
    own.insert(own.end(), seq.slots.begin() + enc + shared, seq.slots.end());
    return own;
  }
};

namespace {
// A one-layer draft model of the target's shape (EAGLE-style).
ModelConfig draft_config(const ModelConfig& target) {
  ModelConfig d = target;
  d.num_layers = 1;
  d.sliding_window = -1;
  d.encoder_decoder = false;
  return d;
}
}  // namespace

int64_t Scheduler::slots_needed(const RequestSpec& r, const SpeculativeConfig& spec) {
  return int64_t{r.encoder_len} + static_cast<int64_t>(r.prompt.size()) + r.output_len +
         (spec.enabled ? spec.draft_tokens() : 0);
}

Scheduler::Scheduler(const Workload& workload, const ModelConfig& model, Device device,
                     const SchedulerOptions& options)
    : spec_(workload.spec),
      options_(options),
      device_(device),
      cache_(options.block_size),
      rng_(options.seed * 0x2545F4914F6CDD1Dull + 17) {
  FLASHKV_CHECK(options.token_budget >= 1, "token budget: expected >= 1, got ",
                options.token_budget);
  FLASHKV_CHECK(options.max_running >= 1, "max running requests: expected >= 1, got ",
                options.max_running);
  FLASHKV_CHECK(options.check_every >= 1, "check every: expected >= 1 steps, got ",
                options.check_every);
  FLASHKV_CHECK(options.max_context >= 0, "max context: expected >= 0 (0: the workload's), got ",
                options.max_context);
  FLASHKV_CHECK(!workload.requests.empty() || options.max_context > 0, "workload ", workload.name,
                ": no requests");
  // The draft model is a decoder-only layer (and multi-step drafting plans no cross attention),
  // as SGLang runs speculative decoding for decoder-only models alone.
  FLASHKV_CHECK(!(workload.spec.enabled && model.encoder_decoder), "workload ", workload.name,
                ": speculative decoding needs a decoder-only model; this one has cross attention");
  int64_t max_context = std::max<int64_t>(options.max_context, 1);
  if (options.max_context == 0)
    for (const RequestSpec& r : workload.requests)
      max_context = std::max(max_context, slots_needed(r, workload.spec));
  options_.max_context = max_context;
  for (size_t i = 0; i < workload.requests.size(); ++i) {
    const int64_t need = slots_needed(workload.requests[i], workload.spec);
    FLASHKV_CHECK(need <= options.kv_slots, "workload request ", i, " needs ", need,
                  " KV slots (prompt + output", workload.spec.enabled ? " + draft tree" : "",
                  "), more than the pool's ", options.kv_slots, " (--kv-slots)");
    FLASHKV_CHECK(need <= max_context, "workload request ", i, " needs ", need,
                  " tokens, more than the max context of ", max_context);
  }
  req_to_token_ = std::make_unique<ReqToTokenPool>(options.max_running, max_context, device);
  allocator_ = std::make_unique<TokenAllocator>(options.kv_slots);
  if (options.cp.enabled()) {
    FLASHKV_CHECK(!workload.spec.enabled, "workload ", workload.name,
                  ": speculative decoding is not supported with context parallelism");
    FLASHKV_CHECK(!model.encoder_decoder,
                  "context parallelism: models with cross attention are not supported");
    share_ = std::make_unique<RankShare>(options.cp, options.kv_slots, options.max_running,
                                         max_context, device);
  }
  model_ = std::make_unique<Model>(model, device, options.kv_slots, options.seed, options.cp);
  if (workload.spec.enabled) {
    draft_ =
        std::make_unique<Model>(draft_config(model), device, options.kv_slots, options.seed + 1);
    draft_->enable_multi_step_draft(workload.spec.topk, workload.spec.num_steps);
  }
  stats_.kv_slots = options.kv_slots;
  for (const RequestSpec& r : workload.requests) submit(r);
}

Scheduler::~Scheduler() = default;

int64_t Scheduler::reserve_of(const Active& a) const {
  // Slots the request may still take: one per output token to come, plus a draft tree's worth
  // during a speculative step.
  return (a.request.output_len - a.generated) + (spec_.enabled ? spec_.draft_tokens() : 0);
}

void Scheduler::note_kv_use() {
  const int64_t used = allocator_->capacity() - allocator_->num_free();
  stats_.peak_kv_slots = std::max(stats_.peak_kv_slots, used);
  // Unreferenced prefix-cache blocks could be evicted at once: not part of the working set.
  stats_.peak_working_kv_slots =
      std::max(stats_.peak_working_kv_slots, used - cache_.evictable_slots());
}

std::vector<int32_t> Scheduler::alloc_slots(int64_t n) {
  auto slots = allocator_->alloc(n);
  if (!slots) {
    free_slots(cache_.evict(n - allocator_->num_free()));
    slots = allocator_->alloc(n);
  }
  // Admission reserved room for every running request, so this cannot fail.
  FLASHKV_CHECK(slots.has_value(), "scheduler: out of KV slots (", n, " wanted, ",
                allocator_->num_free(), " free) despite the reservation");
  note_kv_use();
  return *slots;
}

void Scheduler::free_slots(const std::vector<int32_t>& slots) {
  allocator_->free(slots);
  if (share_) share_->release(slots);
}

void Scheduler::record(const char* what, const PassResult& r) {
  stats_.pass_ms.push_back(r.ms);
  stats_.check_s += r.check_ms / 1000.0;
  ServeStats::ModeStats& m = stats_.by_mode[what];
  ++m.passes;
  m.ms += r.ms;
  stats_.checked += r.checked;
  stats_.check_failures += r.failures;
  stats_.worst_rel_error = std::max(stats_.worst_rel_error, r.worst_rel);
  if (r.failures > 0 && stats_.first_failure.empty())
    stats_.first_failure = std::string(what) + ": " + r.failure;
  if (r.nonfinite && stats_.nonfinite_passes++ == 0)
    stats_.first_nonfinite = std::string(what) + ": " + r.nonfinite_where;
}

std::vector<Scheduler::Active*> Scheduler::admit() {
  std::vector<Active*> admitted;
  int64_t reserved = 0;
  for (const Active* a : running_) reserved += reserve_of(*a);
  int64_t batch_tokens = 0;
  const int B = cache_.block_size();
  while (!waiting_.empty() &&
         static_cast<int>(running_.size() + admitted.size()) < options_.max_running) {
    const RequestSpec& spec = waiting_.front().request;
    const int32_t prompt_len = static_cast<int32_t>(spec.prompt.size());
    // A request with an encoder input shares no prompt blocks: its decoder tokens' K/V depend on
    // its encoder input (SGLang's radix cache keys such a request by its encoder tokens first),
    // and its encoder K/V are its own, freed with it.
    const bool cacheable = spec.encoder_len == 0;
    std::vector<int32_t> chain = cacheable ? cache_.match(spec.prompt) : std::vector<int32_t>();
    // At least one prompt token is computed (its output is the first generated token).
    if (static_cast<int64_t>(chain.size()) * B >= prompt_len) chain.resize((prompt_len - 1) / B);
    const int32_t matched = static_cast<int32_t>(chain.size()) * B;
    const int32_t new_tokens = prompt_len - matched;
    // The admitting pass also writes the encoder tokens' K/V: they count against the budget.
    const int64_t pass_tokens = int64_t{new_tokens} + spec.encoder_len;
    if (!admitted.empty() && batch_tokens + pass_tokens > options_.token_budget) break;
    cache_.acquire(chain);  // before counting: its blocks are no longer evictable
    const int64_t future = (spec.output_len - 1) + (spec_.enabled ? spec_.draft_tokens() : 0);
    if (allocator_->num_free() + cache_.evictable_slots() < reserved + pass_tokens + future) {
      cache_.release(chain);
      ++stats_.admission_waits;
      break;
    }
    auto a = std::make_unique<Active>();
    auto row = req_to_token_->alloc(1);
    FLASHKV_CHECK(row.has_value(), "scheduler: no free req_to_token row");
    a->seq.row = (*row)[0];
    if (share_) share_->add_request(a->seq.row);
    if (spec.encoder_len > 0)
      set_encoder_tokens(a->seq, alloc_slots(spec.encoder_len), *req_to_token_);
    std::vector<int32_t> prefix;
    for (int32_t node : chain)
      prefix.insert(prefix.end(), cache_.slots(node).begin(), cache_.slots(node).end());
    a->chain = std::move(chain);
    append_tokens(a->seq, prefix, *req_to_token_);
    append_tokens(a->seq, alloc_slots(new_tokens), *req_to_token_);
    if (share_) share_->sync(a->seq);
    stats_.prompt_tokens += prompt_len;
    stats_.cached_prompt_tokens += matched;
    stats_.encoder_tokens += spec.encoder_len;
    reserved += pass_tokens + future;
    batch_tokens += pass_tokens;
    a->id = waiting_.front().id;
    a->request = std::move(waiting_.front().request);  // `spec` is gone from here on
    waiting_.pop_front();
    admitted.push_back(a.get());
    active_.push_back(std::move(a));
  }
  return admitted;
}

void Scheduler::finish(Active* a) {
  cache_.release(a->chain);
  free_slots(a->own_slots(cache_.block_size()));
  req_to_token_->free({a->seq.row});
  if (share_) share_->remove_request(a->seq.row);
  running_.erase(std::find(running_.begin(), running_.end(), a));
  ++stats_.requests_done;
  // Last use of `a`: a long run keeps only the requests in flight.
  active_.erase(std::find_if(active_.begin(), active_.end(),
                             [a](const std::unique_ptr<Active>& p) { return p.get() == a; }));
}

void Scheduler::run_extend(const std::vector<Active*>& admitted) {
  std::vector<BatchEntry> entries;
  for (Active* a : admitted) {
    BatchEntry e;
    e.seq = &a->seq;
    e.seq_len = a->seq.seq_len();
    e.num_new = e.seq_len - static_cast<int32_t>(a->chain.size()) * cache_.block_size();
    entries.push_back(e);
  }
  // The admitting pass is the one that writes the requests' encoder K/V (cross-attention layers
  // get them as their k / v); later passes read them from the pool.
  StepBatch step(ForwardMode::EXTEND, entries, *req_to_token_, device_,
                 /*write_encoder_kv=*/model_->config().encoder_decoder);
  if (share_) share_->localize(step);
  record("EXTEND", model_->forward(step, step_check_));
  if (draft_) record("draft EXTEND", draft_->forward(step, step_check_));
  for (Active* a : admitted) {
    // Cache the prompt's whole blocks; blocks another request cached meanwhile are shared.
    if (a->request.encoder_len == 0) {
      std::vector<int32_t> prompt_slots(a->seq.slots.begin(),
                                        a->seq.slots.begin() + a->request.prompt.size());
      std::vector<int32_t> released;
      cache_.insert(a->request.prompt, prompt_slots, a->chain, released);
      if (!released.empty()) {
        rewrite_tokens(a->seq, 0, prompt_slots, *req_to_token_);
        if (share_) share_->resync(a->seq);
        free_slots(released);
      }
    }
    a->generated = 1;
    ++stats_.generated_tokens;
    running_.push_back(a);
    if (a->generated >= a->request.output_len) finish(a);
  }
}

void Scheduler::run_decode() {
  const std::vector<int32_t> slots = alloc_slots(static_cast<int64_t>(running_.size()));
  std::vector<BatchEntry> entries;
  for (size_t i = 0; i < running_.size(); ++i) {
    Active* a = running_[i];
    append_tokens(a->seq, {slots[i]}, *req_to_token_);
    if (share_) share_->sync(a->seq);
    entries.push_back({&a->seq, a->seq.seq_len(), 1, {}});
  }
  StepBatch step(ForwardMode::DECODE, entries, *req_to_token_, device_);
  if (share_) share_->localize(step);
  record("DECODE", model_->forward(step, step_check_));
  const std::vector<Active*> batch = running_;
  for (Active* a : batch) {
    ++a->generated;
    ++stats_.generated_tokens;
    if (a->generated >= a->request.output_len) finish(a);
  }
}

void Scheduler::run_speculative() {
  const SpeculativeConfig& sc = spec_;
  const int K = sc.topk, S = sc.num_steps, D = sc.draft_tokens();
  const std::vector<Active*> batch = running_;
  const size_t R = batch.size();
  // The tree's D slots per request, in node order: the root (the last generated token, in
  // neither pool yet), then branch b's draft token i as node 1 + b * S + i.
  const std::vector<int32_t> slots = alloc_slots(static_cast<int64_t>(R) * D);
  std::vector<int32_t> base(R), root_seq_lens(R), draft_slots;
  std::vector<Sequence*> seqs;
  for (size_t i = 0; i < R; ++i) {
    base[i] = batch[i]->seq.seq_len();
    root_seq_lens[i] = base[i] + 1;
    append_tokens(batch[i]->seq,
                  std::vector<int32_t>(slots.begin() + i * D, slots.begin() + (i + 1) * D),
                  *req_to_token_);
    draft_slots.insert(draft_slots.end(), slots.begin() + i * D + 1, slots.begin() + (i + 1) * D);
    seqs.push_back(&batch[i]->seq);
  }
  // Draft: the draft model takes in the root (a decode pass), then drafts topk branches of
  // num_steps tokens after it (multi-step draft decode, all steps planned at once).
  {
    std::vector<BatchEntry> entries;
    for (size_t i = 0; i < R; ++i) entries.push_back({seqs[i], root_seq_lens[i], 1, {}});
    StepBatch root(ForwardMode::DECODE, entries, *req_to_token_, device_);
    record("draft DECODE", draft_->forward(root, step_check_));
  }
  record("draft multi-step", draft_->forward_draft_steps(seqs, root_seq_lens, draft_slots,
                                                         *req_to_token_, step_check_));
  // Verify the tree with the target model: each branch is a chain hanging off the root.
  std::vector<BatchEntry> entries;
  std::vector<std::vector<int32_t>> parents(R);
  for (size_t i = 0; i < R; ++i) {
    parents[i].assign(D, -1);
    for (int b = 0; b < K; ++b)
      for (int j = 0; j < S; ++j) parents[i][1 + b * S + j] = j == 0 ? 0 : b * S + j;
    entries.push_back({seqs[i], base[i] + D, D, parents[i]});
  }
  {
    StepBatch verify(ForwardMode::TARGET_VERIFY, entries, *req_to_token_, device_);
    record("TARGET_VERIFY", model_->forward(verify, step_check_));
  }
  // Accept a root-to-node path: from each node the walk continues to a random child with
  // probability accept_rate. The accepted tokens move to the positions after the prefix; the
  // other tree slots are freed.
  std::bernoulli_distribution go_on(sc.accept_rate);
  std::vector<BatchEntry> accepted_entries;
  std::vector<int32_t> freed;
  for (size_t i = 0; i < R; ++i) {
    Active* a = batch[i];
    std::vector<int32_t> path = {0};
    for (;;) {
      std::vector<int32_t> children;
      for (int j = 1; j < D; ++j)
        if (parents[i][j] == path.back()) children.push_back(j);
      if (children.empty() || !go_on(rng_)) break;
      path.push_back(children[std::uniform_int_distribution<size_t>(0, children.size() - 1)(rng_)]);
    }
    const int32_t remaining = a->request.output_len - a->generated;
    if (static_cast<int32_t>(path.size()) > remaining) path.resize(remaining);
    const int32_t first = a->seq.encoder_len + base[i];
    const std::vector<int32_t> tree(a->seq.slots.begin() + first, a->seq.slots.begin() + first + D);
    std::vector<int32_t> kept;
    std::vector<bool> on_path(D, false);
    for (int32_t node : path) {
      kept.push_back(tree[node]);
      on_path[node] = true;
    }
    for (int j = 0; j < D; ++j)
      if (!on_path[j]) freed.push_back(tree[j]);
    rewrite_tokens(a->seq, base[i], kept, *req_to_token_);
    a->seq.slots.resize(first + kept.size());
    accepted_entries.push_back({&a->seq, a->seq.seq_len(), static_cast<int32_t>(kept.size()), {}});
    stats_.accepted_tokens += static_cast<int64_t>(kept.size());
  }
  free_slots(freed);
  {
    StepBatch extend(ForwardMode::DRAFT_EXTEND, accepted_entries, *req_to_token_, device_);
    record("DRAFT_EXTEND", draft_->forward(extend, step_check_));
  }
  ++stats_.spec_steps;
  stats_.spec_request_steps += static_cast<int64_t>(R);
  for (size_t i = 0; i < R; ++i) {
    Active* a = batch[i];
    a->generated += accepted_entries[i].num_new;
    stats_.generated_tokens += accepted_entries[i].num_new;
    if (a->generated >= a->request.output_len) finish(a);
  }
}

void Scheduler::submit(const RequestSpec& r) {
  const int64_t need = slots_needed(r, spec_);
  FLASHKV_CHECK(!r.prompt.empty() && r.output_len >= 1, "request ", stats_.requests,
                ": expected a prompt of >= 1 tokens and output >= 1, got ", r.prompt.size(),
                " and ", r.output_len);
  if (model_->config().encoder_decoder)
    FLASHKV_CHECK(r.encoder_len >= 1, "request ", stats_.requests,
                  ": encoder_len: expected >= 1 for a model with cross attention, got ",
                  r.encoder_len);
  else
    FLASHKV_CHECK(r.encoder_len == 0, "request ", stats_.requests,
                  ": encoder_len: expected 0 for a model without cross attention, got ",
                  r.encoder_len);
  FLASHKV_CHECK(need <= options_.kv_slots, "request ", stats_.requests, " needs ", need,
                " KV slots, more than the pool's ", options_.kv_slots);
  FLASHKV_CHECK(need <= options_.max_context, "request ", stats_.requests, " needs ", need,
                " tokens, more than the max context of ", options_.max_context);
  const int64_t last = pending_.empty() ? 0 : pending_.back().request.arrival;
  FLASHKV_CHECK(r.arrival >= last, "request ", stats_.requests, ": arrival ", r.arrival,
                " before the previous request's ", last);
  pending_.push_back({stats_.requests++, r});
}

bool Scheduler::step() {
  auto arrive = [this] {
    while (!pending_.empty() && pending_.front().request.arrival <= clock_) {
      waiting_.push_back(std::move(pending_.front()));
      pending_.pop_front();
    }
  };
  arrive();
  if (idle()) {
    if (pending_.empty()) return false;
    clock_ = pending_.front().request.arrival;  // nothing to run until the next arrival
    arrive();
  }
  step_check_ = options_.check;
  step_check_.enabled = options_.check.enabled && stats_.steps % options_.check_every == 0;
  const std::vector<Active*> admitted = admit();
  if (!admitted.empty()) {
    run_extend(admitted);
  } else if (!running_.empty()) {
    if (draft_)
      run_speculative();
    else
      run_decode();
  } else {
    // Cannot happen: with nothing running every cached block is evictable and each request
    // fits the pool alone (checked by submit).
    throw Error(str_cat("scheduler: request ", waiting_.front().id,
                        " cannot be admitted into an idle pool"));
  }
  ++stats_.steps;
  ++clock_;
  stats_.evicted_blocks = cache_.evicted_nodes();
  return true;
}

int64_t Scheduler::flush_prefix_cache() {
  const std::vector<int32_t> freed = cache_.evict(std::numeric_limits<int64_t>::max());
  free_slots(freed);
  stats_.evicted_blocks = cache_.evicted_nodes();
  return static_cast<int64_t>(freed.size());
}

std::string Scheduler::check_step_invariants() const {
  const int B = cache_.block_size();
  std::vector<SlotOwner> owners;
  owners.push_back({"the prefix cache", cache_.all_slots()});
  for (const Active* a : running_) {
    // The request's first chain blocks' slots (after its encoder tokens') are the cache's; the
    // rest, its encoder tokens' included, are its own.
    const size_t enc = static_cast<size_t>(a->seq.encoder_len);
    const size_t shared = a->chain.size() * static_cast<size_t>(B);
    if (enc != static_cast<size_t>(a->request.encoder_len))
      return str_cat("request ", a->id, " holds ", enc,
                     " encoder tokens, but its encoder input has ", a->request.encoder_len);
    if (a->seq.slots.size() < enc + shared)
      return str_cat("request ", a->id, " holds ", a->seq.slots.size(), " slots, fewer than its ",
                     enc, " encoder tokens and ", a->chain.size(), " prefix blocks");
    for (size_t b = 0; b < a->chain.size(); ++b) {
      const std::vector<int32_t>& block = cache_.slots(a->chain[b]);
      if (!std::equal(block.begin(), block.end(), a->seq.slots.begin() + enc + b * B))
        return str_cat("request ", a->id, ": its prefix block ", b,
                       " does not list the prefix cache's slots of that block");
    }
    owners.push_back({str_cat("request ", a->id), a->own_slots(B)});
  }
  std::string bad = check_slot_ownership(*allocator_, owners);
  if (!bad.empty()) return "slot ownership: " + bad;

  std::vector<RequestRow> rows;
  for (const Active* a : running_)
    rows.push_back({str_cat("request ", a->id), a->seq.row, &a->seq.slots});
  bad = check_request_rows(*req_to_token_, rows);
  if (!bad.empty()) return "request rows: " + bad;

  try {
    cache_.check_invariants();
  } catch (const Error& e) {
    return std::string("prefix cache: ") + e.what();
  }
  if (share_) {
    bad = share_->check(*allocator_, rows);
    if (!bad.empty()) return "rank share: " + bad;
  }
  return "";
}

void Scheduler::check_end_invariants() {
  auto fail = [&](const std::string& what) { stats_.invariant_failures.push_back(what); };
  if (stats_.requests_done != stats_.requests)
    fail(str_cat(stats_.requests_done, " of ", stats_.requests, " requests finished"));
  if (!running_.empty() || !waiting_.empty())
    fail(str_cat(running_.size(), " requests still running, ", waiting_.size(), " waiting"));
  // With nothing running, ownership says: every allocated slot is the prefix cache's.
  const std::string bad = check_step_invariants();
  if (!bad.empty()) fail(bad);
  if (stats_.nonfinite_passes > 0)
    fail(str_cat(stats_.nonfinite_passes,
                 " passes produced NaN or Inf outputs (first: ", stats_.first_nonfinite, ")"));
  if (share_ && bad.empty() && idle()) {
    // No slot leaked on this rank: with the prefix cache flushed, the rank's pool is empty too.
    const int64_t evicted = stats_.evicted_blocks;
    flush_prefix_cache();
    stats_.evicted_blocks = evicted;
    if (kv_in_use() != 0 || share_->slots_in_use() != 0)
      fail(str_cat("rank ", share_->rank(), ": after the prefix cache was flushed, ", kv_in_use(),
                   " KV slots are in use and ", share_->slots_in_use(), " of the rank's own"));
  }
}

Progress Scheduler::progress() const {
  Progress p;
  p.done = stats_.requests_done;
  p.total = stats_.requests;
  p.generated_tokens = stats_.generated_tokens;
  p.kv_used = kv_in_use();
  p.kv_slots = allocator_->capacity();
  p.running = static_cast<int64_t>(running_.size());
  p.waiting = static_cast<int64_t>(waiting_.size());
  return p;
}

ServeStats Scheduler::run(const std::function<void(const Progress&)>& on_progress) {
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  while (step()) {
    if (on_progress) {
      Progress p = progress();
      p.serve_s = elapsed() - stats_.check_s;
      on_progress(p);
    }
  }
  // Reference checks and NaN scans are verification, not serving: their time is left out.
  stats_.serve_s = elapsed() - stats_.check_s;
  stats_.evicted_blocks = cache_.evicted_nodes();
  stats_.cached_blocks_end = cache_.num_nodes();
  stats_.cached_slots_end = cache_.cached_slots();
  check_end_invariants();
  return stats_;
}

}  // namespace flashkv::app
