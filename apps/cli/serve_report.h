// What `flashkv serve` shows: a progress line while it runs (refreshed in place on a terminal,
// a plain line every few seconds otherwise), the final report, and the JSON of `--json FILE`
// whose field names are the stable output contract (README, "Output contract").
#pragma once

#include <chrono>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "model.h"
#include "scheduler.h"
#include "workload.h"

namespace flashkv::app {

class ProgressLine {
 public:
  // Writes to `out`; `in_place`: a terminal (carriage return + clear line).
  ProgressLine(FILE* out, bool in_place, bool enabled = true);
  void update(const Progress& p);  // rate-limited
  void finish();                   // ends the in-place line
  static std::string format(const Progress& p);

 private:
  FILE* out_;
  bool in_place_, enabled_, started_ = false, shown_ = false;
  std::chrono::steady_clock::time_point last_{};
};

// What the run was: printed in the report's header and written to the JSON.
struct ServeSetup {
  std::string workload;
  std::string device;
  int threads_or_sms = 0;
  ModelConfig model;
  SchedulerOptions scheduler;
  SpeculativeConfig spec;
  int64_t prompt_tokens = 0, output_tokens = 0;
  int num_prefixes = 0;
  // Encoder-decoder models: the longest encoder input (--encoder-len) and their total.
  int32_t encoder_len = 0;
  int64_t encoder_tokens = 0;
  // Context parallelism (--cp): ranks (0: off), how positions and states are placed and the new
  // tokens' K/V passed, and each rank's checked outputs and peak use of its own KV pool.
  struct CpReport {
    int ranks = 0;
    std::string layout, exchange, kv_pass;
    std::vector<int64_t> checked, peak_slots;
  } cp;
};

void print_serve_report(std::ostream& os, const ServeSetup& setup, const ServeStats& stats);
// {"tokens_per_s", "requests", "attention_ms_p50", "attention_ms_p99", "prefix_hit_rate",
//  "peak_kv_slots", "checked", "check_failures", ... and descriptive extras}
std::string serve_json(const ServeSetup& setup, const ServeStats& stats);

}  // namespace flashkv::app
