// Randomized FlashKVBackend scenarios that `flashkv check` runs next to the operator cases: a
// small model (Model), real pools and allocator, requests prefilled through the backend, then
// the mode under test. Every layer output of every pass is compared with the float64 reference
// computed from the pool (layer_reference).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashkv/core/device.h"
#include "model.h"

namespace flashkv::app {

enum class BackendScenario {
  decode,           // prefill, then two decode passes
  extend,           // prefill of new requests (ragged only)
  extend_prefix,    // extend on top of cached prefixes, mixed with a new request (ragged + paged +
                    // merge)
  mixed,            // a MIXED pass: decode requests and an extend in one batch
  verify,           // TARGET_VERIFY over random draft trees
  draft_extend,     // DRAFT_EXTEND by random accepted lengths
  draft_steps,      // MultiStepDraftBackend: topk branches x steps of draft decode
  sliding_window,   // window and full layers: prefill, extend, decode
  cross_attention,  // encoder-decoder: extend writing the encoder KV, then decode
};
const char* scenario_name(BackendScenario s);

struct BackendCase {
  BackendScenario scenario = BackendScenario::decode;
  ModelConfig model;
  int scale = 1;  // multiplies the sequence lengths (the full grid runs longer ones)
  uint64_t seed = 1;
  std::string describe() const;
};

struct BackendResult {
  int passes = 0, checked = 0, failures = 0;
  double worst_rel = 0;
  bool nonfinite = false;  // a NaN or Inf in a layer output
  bool passed = false;
  std::string error;  // a thrown flashkv::Error, or the first failure
};

BackendResult run_backend_case(const BackendCase& c, Device device);
// Every scenario (fp8 KV cache variants of some; attention sinks in every mode but cross
// attention); quick: short sequences, one head shape.
std::vector<BackendCase> backend_case_grid(bool quick, uint64_t seed);

}  // namespace flashkv::app
