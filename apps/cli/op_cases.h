// Randomized operator cases checked against the float64 reference: `flashkv check` runs them on
// a device. Each case builds its inputs on the host, runs the operator on the device, copies the
// result back and compares.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashkv/core/device.h"
#include "flashkv/core/dtype.h"
#include "flashkv/reference/compare.h"

namespace flashkv::app {

enum class OpKind { decode, ragged_prefill, paged_prefill, extend, merge_states };
const char* op_name(OpKind op);

struct OpCase {
  OpKind op = OpKind::decode;
  std::vector<int32_t> qo_lens;  // per request (decode: ignored, 1 each)
  std::vector<int32_t> kv_lens;  // per request: KV entries (extend: the cached prefix)
  int hq = 8, hkv = 2, head_dim = 64, head_dim_v = 64, page_size = 1;
  DType dtype = DType::bf16, kv_dtype = DType::bf16;
  bool causal = true;
  int window_left = -1;
  float soft_cap = 0;
  bool custom_mask = false;
  int fixed_split = 0;  // > 0: deterministic split size (forces split + merge)
  // Attention sinks: per-head logits drawn from the seed (normal, std 2, one head -inf), given to
  // the operator and the reference alike. Extend passes them to the prefix pass, which merges the
  // new tokens' state (merge_o) and adds the sink once.
  bool sinks = false;
  uint64_t seed = 1;
  std::string describe() const;
};

struct OpResult {
  Errors errors;
  Tolerance tolerance;
  bool passed = false;
  std::string error;  // a thrown flashkv::Error, if any
};

OpResult run_op_case(const OpCase& c, Device device);
// The grid `flashkv check` runs; quick = a small subset for CI.
std::vector<OpCase> op_case_grid(bool quick, uint64_t seed);

}  // namespace flashkv::app
