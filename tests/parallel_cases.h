// Context-parallel test cases shared by the one-rank tests (flashkv_tests) and the sharded ones
// under mpirun (tests/parallel_mpi/): every rank builds the same global batch from the seed, its
// own shard of it, runs the sharded operator, and checks its result against the float64
// reference and against the one-rank result.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashkv/parallel/context_parallel.h"

namespace flashkv::test {

struct CpDecodeCase {
  std::vector<int32_t> kv_len;
  int hq = 8, hkv = 2, head_dim = 64, page_size = 1;
  DType dtype = DType::f32;
  bool sinks = false;
  float soft_cap = 0;
  int window_left = -1;
  uint64_t seed = 1;
  std::string str() const;
};

struct CpExtendCase {
  std::vector<int32_t> prefix_len, extend_len;
  int hq = 8, hkv = 2, head_dim = 64, page_size = 1;
  DType dtype = DType::f32;
  bool causal = true;
  int window_left = -1;
  // A speculative tree mask over prefix + new tokens (each new token sees its ancestors and
  // itself, and most of the prefix).
  bool tree_mask = false;
  bool sinks = false;
  // PlanOptions::fixed_split_size of every pass's plan (0: the planner's choice): > 0 cuts the KV
  // into chunks whose partial states the kernels merge (the ring's steps share their memory).
  int32_t fixed_split_size = 0;
  uint64_t seed = 1;
  std::string str() const;
};

std::string str(const parallel::CpOptions& o);

// Runs the case on every rank of `comm` (each rank calls it with the same arguments) and checks
// this rank's output (gtest EXPECTs).
void check_cp_decode(parallel::Communicator& comm, const parallel::CpOptions& options,
                     const CpDecodeCase& c);
void check_cp_extend(parallel::Communicator& comm, const parallel::CpOptions& options,
                     const CpExtendCase& c);

// The layouts and exchanges the sharded tests sweep, with the given passing of the new tokens'
// K/V; for extend, both passings.
std::vector<parallel::CpOptions> cp_option_sweep(
    parallel::CpKvPass kv_pass = parallel::CpKvPass::all_gather);
std::vector<parallel::CpOptions> cp_extend_option_sweep();

}  // namespace flashkv::test
