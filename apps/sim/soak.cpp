#include "soak.h"

#include <algorithm>
#include <chrono>

#include "flashkv/core/error.h"

namespace flashkv::app {

namespace {
constexpr int kNumPrefixes = 6;
constexpr int32_t kMaxPrefix = 160, kMaxSuffix = SoakWorkload::kMaxPrompt - kMaxPrefix;
constexpr int32_t kMaxUnshared = 200;
constexpr int kRecent = 8;
static_assert(kMaxUnshared <= SoakWorkload::kMaxPrompt, "an unshared prompt fits kMaxPrompt");
}  // namespace

SoakWorkload::SoakWorkload(uint64_t seed) : gen_(seed * 0x9E3779B97F4A7C15ull + 0x50A4) {
  for (int i = 0; i < kNumPrefixes; ++i) prefixes_.push_back(new_prefix());
}

std::vector<int32_t> SoakWorkload::tokens(int n) {
  std::uniform_int_distribution<int32_t> id(3, 31999);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = id(gen_);
  return t;
}

std::vector<int32_t> SoakWorkload::new_prefix() {
  auto uniform = [this](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(gen_);
  };
  std::vector<int32_t> p;
  if (!prefixes_.empty() && uniform(0, 9) < 4) {
    // A prefix that extends another one (a system prompt, then a document): cache blocks
    // shared along a longer chain, and a tree once several extend the same one.
    p = prefixes_[uniform(0, static_cast<int>(prefixes_.size()) - 1)];
    const std::vector<int32_t> more = tokens(uniform(1, 64));
    p.insert(p.end(), more.begin(), more.end());
    p.resize(std::min<size_t>(p.size(), kMaxPrefix));
  } else {
    p = tokens(uniform(1, kMaxPrefix));
  }
  // A third end on a block boundary: a prompt equal to one is then cached whole, and the
  // scheduler must still compute its last token.
  if (uniform(0, 2) == 0 && p.size() >= 16) p.resize(p.size() / 16 * 16);
  return p;
}

RequestSpec SoakWorkload::next() {
  auto uniform = [this](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(gen_);
  };
  ++count_;
  // Now and then a prefix goes out of use: its cached blocks become evictable and age out.
  if (count_ % 97 == 0) prefixes_[uniform(0, kNumPrefixes - 1)] = new_prefix();
  // Arrivals come in bursts (about one request a step, more than the server keeps up with),
  // half of them after a quiet spell long enough for the server to drain.
  if (burst_left_ == 0) {
    burst_left_ = uniform(10, 150);
    if (uniform(0, 1) == 0) clock_ += uniform(0, 400);
  }
  --burst_left_;
  clock_ += std::exponential_distribution<double>(1.0 / 1.5)(gen_);
  RequestSpec r;
  r.arrival = static_cast<int64_t>(clock_);
  const int kind = uniform(0, 99);
  if (kind < 50) {  // a shared prefix and a turn of its own
    r.prompt = prefixes_[uniform(0, kNumPrefixes - 1)];
    r.prefix_len = static_cast<int32_t>(r.prompt.size());
    const std::vector<int32_t> own = tokens(uniform(1, kMaxSuffix));
    r.prompt.insert(r.prompt.end(), own.begin(), own.end());
  } else if (kind < 60) {  // exactly a shared prefix
    r.prompt = prefixes_[uniform(0, kNumPrefixes - 1)];
    r.prefix_len = static_cast<int32_t>(r.prompt.size());
  } else if (kind < 72 && !recent_.empty()) {  // a recent prompt again, often while it runs
    r.prompt = recent_[uniform(0, static_cast<int>(recent_.size()) - 1)];
  } else {
    r.prompt = tokens(uniform(1, kMaxUnshared));
  }
  // Outputs of 1 token (done after the prefill) to 64, mostly short.
  r.output_len =
      uniform(0, 9) == 0
          ? 1
          : std::min<int32_t>(
                kMaxOutput,
                2 + static_cast<int32_t>(std::exponential_distribution<double>(1.0 / 14)(gen_)));
  recent_.push_back(r.prompt);
  if (static_cast<int>(recent_.size()) > kRecent) recent_.erase(recent_.begin());
  return r;
}

SoakResult run_soak(const SoakOptions& o, const SoakProgress& on_progress,
                    const SoakHook& after_step) {
  FLASHKV_CHECK(o.steps >= 0, "soak steps: expected >= 0, got ", o.steps);
  FLASHKV_CHECK(o.check_every >= 0, "soak check_every: expected >= 0, got ", o.check_every);
  FLASHKV_CHECK(o.flush_every >= 1, "soak flush_every: expected >= 1, got ", o.flush_every);
  if (o.model.encoder_decoder) {
    FLASHKV_CHECK(o.encoder_len >= 1 && o.encoder_len <= kMaxEncoderTokens,
                  "soak encoder_len: expected 1..", kMaxEncoderTokens,
                  " for a model with cross attention, got ", o.encoder_len);
    FLASHKV_CHECK(!o.speculative,
                  "soak speculative: speculative decoding needs a decoder-only model; this one has "
                  "cross attention");
  } else {
    FLASHKV_CHECK(o.encoder_len == 0, "soak encoder_len: expected 0 for a model without cross ",
                  "attention, got ", o.encoder_len);
  }
  Workload w;
  w.name = "soak";
  w.spec.enabled = o.speculative;
  SchedulerOptions so = o.scheduler;
  so.seed = o.seed;
  so.max_context = int64_t{o.encoder_len} + SoakWorkload::kMaxPrompt + SoakWorkload::kMaxOutput +
                   (o.speculative ? w.spec.draft_tokens() : 0);
  FLASHKV_CHECK(so.kv_slots >= so.max_context, "soak kv_slots: expected >= ", so.max_context,
                " (the longest soak request), got ", so.kv_slots);
  so.check.enabled = o.check_every > 0;
  so.check_every = std::max(o.check_every, 1);
  so.check.scan_every_layer = true;
  Scheduler s(w, o.model, o.device, so);
  SoakWorkload gen(o.seed);
  // Encoder inputs come from a stream of their own, so the requests are the same with or
  // without them.
  std::mt19937_64 encoder_gen(o.seed * 0x9E3779B97F4A7C15ull + 0xE2C0DE);
  auto next_request = [&] {
    RequestSpec r = gen.next();
    if (o.encoder_len > 0) r.encoder_len = random_encoder_len(encoder_gen, o.encoder_len);
    return r;
  };
  RequestSpec next = next_request();

  SoakResult res;
  const auto t0 = std::chrono::steady_clock::now();
  int64_t step = 0;
  std::string bad;
  for (;;) {
    const bool arriving = step < o.steps;
    // Everything that has arrived by now, and one request beyond: an idle scheduler skips ahead
    // to it instead of running out of work.
    while (arriving && (next.arrival <= s.clock() || s.num_pending() == 0)) {
      s.submit(next);
      next = next_request();
    }
    if (!s.step()) break;
    ++step;
    ++(arriving ? res.steps : res.drain_steps);
    if (after_step) after_step(s, step);
    const ServeStats& st = s.stats();
    bad = s.check_step_invariants();
    if (bad.empty() && st.nonfinite_passes > 0) bad = "finite outputs: " + st.first_nonfinite;
    if (bad.empty() && st.check_failures > 0) bad = "reference: " + st.first_failure;
    if (bad.empty() && s.idle()) {
      ++res.idle_points;
      if (s.kv_in_use() != s.prefix_cache_slots()) {
        bad = str_cat("pool at idle: every request finished, but ", s.kv_in_use(),
                      " KV slots are in use and the prefix cache holds ", s.prefix_cache_slots());
      } else if (res.idle_points % o.flush_every == 0) {
        s.flush_prefix_cache();
        ++res.flushes;
        if (s.kv_in_use() != 0)
          bad = str_cat("pool at idle: ", s.kv_in_use(),
                        " KV slots still in use after flushing the prefix cache");
      }
    }
    if (!bad.empty()) break;
    if (on_progress) {
      Progress p = s.progress();
      p.step = step;
      p.steps = o.steps;
      p.serve_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      on_progress(p);
    }
  }
  if (bad.empty()) {
    // Drained: every request finished; with the cache flushed the pool is empty.
    const ServeStats& st = s.stats();
    if (!s.idle() || st.requests_done != st.requests) {
      bad = str_cat("drain: ", st.requests_done, " of ", st.requests, " requests finished");
    } else {
      s.flush_prefix_cache();
      ++res.flushes;
      if (s.kv_in_use() != 0)
        bad = str_cat("pool at the end: ", s.kv_in_use(),
                      " KV slots in use after every request finished and the cache was flushed");
      else
        bad = s.check_step_invariants();
    }
  }
  if (!bad.empty()) {
    res.failed_step = step;
    res.failure = str_cat("step ", step, ": ", bad);
  }
  res.stats = s.stats();
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace flashkv::app
