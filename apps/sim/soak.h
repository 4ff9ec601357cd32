// The soak test behind `flashkv soak`: a long random serving workload through the scheduler
// (arrivals in bursts and quiet spells, short and long prompts, shared and nested prefixes,
// repeated prompts, prefixes that go out of use, outputs of 1 to 64 tokens, speculative steps;
// with an encoder-decoder model, an encoder input per request instead of speculative steps),
// with the serving invariants checked after EVERY step:
//   slot ownership     no KV slot leaked or live twice (Scheduler::check_step_invariants);
//   request rows       every running request's req_to_token row lists its slots;
//   prefix cache       the cache's own bookkeeping;
//   finite outputs     no NaN or Inf in any layer's output of any pass;
//   reference          sampled layer outputs (every check_every-th step) match the float64
//                      reference within the tolerances of docs/SEMANTICS.md;
//   pool at idle       whenever every request has finished, the pool holds exactly the prefix
//                      cache's slots, and after every flush_every-th such point the cache is
//                      flushed and the pool must be empty.
// After `steps` steps no request arrives any more; the run drains (every request finishes), then
// the cache is flushed and the pool must be empty. The first violation stops the run.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "model.h"
#include "scheduler.h"
#include "workload.h"

namespace flashkv::app {

// The random request stream of a soak run (seeded: the same seed gives the same stream).
class SoakWorkload {
 public:
  explicit SoakWorkload(uint64_t seed);
  RequestSpec next();  // arrivals never decrease
  // The longest prompt + output next() returns.
  static constexpr int32_t kMaxPrompt = 224, kMaxOutput = 64;

 private:
  std::vector<int32_t> tokens(int n);
  std::vector<int32_t> new_prefix();

  std::mt19937_64 gen_;
  std::vector<std::vector<int32_t>> prefixes_;
  std::vector<std::vector<int32_t>> recent_;  // the last few prompts, for verbatim repeats
  double clock_ = 0;
  int64_t burst_left_ = 0;  // requests until the current burst ends
  int64_t count_ = 0;
};

struct SoakOptions {
  int64_t steps = 10000;  // steps with arrivals (then the run drains)
  uint64_t seed = 1;
  bool speculative = true;
  int check_every = 4;  // reference checks on every check_every-th step; 0: none
  int flush_every = 4;  // flush the prefix cache at every flush_every-th idle point
  ModelConfig model;
  // A model with cross attention: each request's encoder input has (encoder_len + 1) / 2 ..
  // encoder_len tokens (draw_encoder_lens' rule, seeded); 0 for a model without. Speculative
  // decoding needs a decoder-only model.
  int32_t encoder_len = 0;
  Device device = Device::cpu();
  SchedulerOptions scheduler;  // kv_slots, token_budget, max_running (the rest is set here)
};

struct SoakResult {
  int64_t steps = 0, drain_steps = 0;  // steps with arrivals, then to finish every request
  double seconds = 0;                  // wall time, checks included
  std::string failure;                 // "": every invariant held; else "step N: what: detail"
  int64_t failed_step = 0;             // the step (1-based) after which a check failed
  int64_t idle_points = 0, flushes = 0;
  ServeStats stats;  // the scheduler's figures at the end (or at the failure)
};

// What the driver reports after each step.
using SoakProgress = std::function<void(const Progress&)>;
// Called after each step with the scheduler and the step number (1-based), before the checks:
// tests use it to break the state on purpose and see the checks fail.
using SoakHook = std::function<void(Scheduler&, int64_t step)>;

SoakResult run_soak(const SoakOptions& options, const SoakProgress& on_progress = {},
                    const SoakHook& after_step = {});

}  // namespace flashkv::app
