// Host time of the planner (plan_decode / plan_prefill) on serving-like batches, in the steady
// state (the `Plan* out` form, reusing the previous plan's vectors). Shared by the standalone
// planner benchmark (bench/plan_bench.cpp, which includes it by its relative path) and by
// `flashkv bench` (its "plan (host)" lines); header-only, so the standalone benchmark needs
// nothing but the library.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flashkv/plan/plan.h"

namespace flashkv::bench {

// What one planning step plans. decode: plan_decode. prefill: one causal plan_prefill over each
// request's whole KV (its prefix and its new tokens: a paged pass without the ragged path; with
// max_kv 0, the ragged plan of a prefill of new tokens only). extend: what the backend plans for
// an extend batch with a 16-bit pool, the same one causal plan over prefix and new tokens.
// extend_ragged: what it plans on the ragged path (an fp8 pool, or `extend_path` ragged), a causal
// plan_prefill over the new tokens and a non-causal one over the cached prefix.
enum class PlanKind { decode, prefill, extend, extend_ragged };

inline const char* plan_kind_name(PlanKind k) {
  switch (k) {
    case PlanKind::decode:
      return "decode";
    case PlanKind::prefill:
      return "prefill";
    case PlanKind::extend:
      return "extend";
    case PlanKind::extend_ragged:
      return "extend_ragged";
  }
  return "?";
}

// A serving-like batch of `batch` requests: cached prefixes of [0, max_kv] tokens and [1, q_max]
// new tokens each (decode: one), drawn from a fixed seed; heads and head dim as given (default
// Llama-3-8B: 32/8/128).
struct PlanCase {
  std::string name;
  PlanKind kind = PlanKind::prefill;
  int batch = 1;
  int max_kv = 0;
  int q_max = 1;
  DeviceInfo device;
  PlanOptions options;
  int num_kv_heads = 8;
  int num_qo_heads = 32;
  int head_dim = 128;
};

// Plans a case once per step(), alternating between two batches (seeds 1 and 2) so that
// nothing carries over from the same batch.
class PlanRunner {
 public:
  explicit PlanRunner(const PlanCase& c) : c_(c) {
    for (int i = 0; i < 2; ++i) fill(&batches_[i], uint64_t(i) + 1);
  }
  PlanRunner(const PlanRunner&) = delete;  // the shapes point into this runner's vectors
  PlanRunner& operator=(const PlanRunner&) = delete;

  void step() {
    const Batch& b = batches_[next_ ^= 1];
    switch (c_.kind) {
      case PlanKind::decode:
        plan_decode(b.whole, c_.device, c_.options, &decode_);
        return;
      case PlanKind::prefill:
      case PlanKind::extend:
        plan_prefill(b.whole, c_.device, c_.options, &prefill_);
        return;
      case PlanKind::extend_ragged:
        plan_prefill(b.ragged, c_.device, c_.options, &ragged_);
        plan_prefill(b.prefix, c_.device, c_.options, &prefill_);
        return;
    }
  }

  // The plans of the last step.
  std::vector<const Plan*> last() const {
    if (c_.kind == PlanKind::decode) return {&decode_};
    if (c_.kind == PlanKind::extend_ragged) return {&ragged_, &prefill_};
    return {&prefill_};
  }

 private:
  struct Batch {
    std::vector<int32_t> qo_indptr, kv_len, new_len, prefix_len;
    BatchShape whole, ragged, prefix;
  };

  void fill(Batch* b, uint64_t seed) const {
    const bool decode = c_.kind == PlanKind::decode;
    std::mt19937_64 gen(seed);
    b->qo_indptr.assign(1, 0);
    for (int i = 0; i < c_.batch; ++i) {
      const int q = decode ? 1 : std::uniform_int_distribution<int>(1, c_.q_max)(gen);
      const int prefix = std::uniform_int_distribution<int>(0, c_.max_kv)(gen);
      b->qo_indptr.push_back(b->qo_indptr.back() + q);
      b->kv_len.push_back(decode ? prefix + 1 : prefix + q);
      b->new_len.push_back(q);
      b->prefix_len.push_back(prefix);
    }
    BatchShape s;
    s.batch_size = c_.batch;
    s.qo_indptr = decode ? nullptr : b->qo_indptr.data();
    s.num_qo_heads = c_.num_qo_heads;
    s.num_kv_heads = c_.num_kv_heads;
    s.head_dim_qk = s.head_dim_v = c_.head_dim;
    b->whole = b->ragged = b->prefix = s;
    b->whole.kv_len = b->kv_len.data();
    b->whole.causal = !decode;
    b->ragged.kv_len = b->new_len.data();
    b->ragged.causal = true;
    b->prefix.kv_len = b->prefix_len.data();
    b->prefix.causal = false;
  }

  PlanCase c_;
  Batch batches_[2];
  int next_ = 0;
  DecodePlan decode_;
  PrefillPlan prefill_, ragged_;
};

// Host time of one planning step: the median and the minimum over `repeats` rounds of `calls`
// steps each (per step, in microseconds), and what the last step planned (summed over its
// plans: 2 for extend_ragged).
struct PlanTiming {
  double median_us = 0, min_us = 0;
  int plans = 0;
  int64_t items = 0, merges = 0;
  int workers = 0;  // of the last plan
  std::string summary() const {
    return std::to_string(items) + " items, " + std::to_string(merges) + " merges, " +
           std::to_string(workers) + " workers";
  }
};

// What the runner's last step planned (the counts of a PlanTiming; no times).
inline PlanTiming plan_counts(const PlanRunner& r) {
  PlanTiming t;
  for (const Plan* p : r.last()) {
    t.plans++;
    t.items += int64_t(p->items.size());
    t.merges += int64_t(p->merges.size());
    t.workers = p->num_workers;
  }
  return t;
}

inline PlanTiming time_plan(const PlanCase& c, int calls = 2000, int repeats = 15) {
  using Clock = std::chrono::steady_clock;
  PlanRunner r(c);
  std::vector<double> us;
  for (int rep = 0; rep < repeats; ++rep) {
    const auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) r.step();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / calls);
  }
  std::sort(us.begin(), us.end());
  PlanTiming t = plan_counts(r);
  t.median_us = us[us.size() / 2];
  t.min_us = us.front();
  return t;
}

// The planner cases of `flashkv bench` (its "plan (host)" lines, also in flashkv_plan_bench):
// 256 requests of 1..64 new tokens each (about 8192 in all, SGLang's default chunked-prefill
// budget), Llama-3-8B heads, default plan options: a prefill of new tokens only (the ragged
// plan), then an extend on cached prefixes of 0..4096 tokens as the backend plans it with a
// 16-bit pool (one plan) and on its ragged path (the ragged and the prefix plan).
inline std::vector<PlanCase> bench_plan_grid(const DeviceInfo& device) {
  return {{"prefill/b256/q64", PlanKind::prefill, 256, 0, 64, device, PlanOptions()},
          {"extend/b256/q64/kv4k", PlanKind::extend, 256, 4096, 64, device, PlanOptions()},
          {"extend_ragged/b256/q64/kv4k", PlanKind::extend_ragged, 256, 4096, 64, device,
           PlanOptions()}};
}

}  // namespace flashkv::bench
