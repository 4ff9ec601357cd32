// Device-agnostic benchmark of the attention operators: random inputs in a paged pool (pages in
// order, or a shuffled permutation of the pool), plan -> upload -> warm up -> timed runs (CPU: wall
// clock; CUDA: CUDA-graph replays timed with events), reported against the roofline measured in the
// same run.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/core/device.h"
#include "flashkv/core/dtype.h"
#include "flashkv/parallel/context_parallel.h"
#include "plan_timing.h"
#include "roofline.h"

namespace flashkv::bench {

// decode: paged_decode, one query per request over its paged KV.
// prefill: ragged_prefill, new tokens only (no cached prefix); causal unless BenchCase::causal
//   is false.
// extend: ragged causal prefill over the new tokens + non-causal paged_prefill over the cached
//   prefix + merge_state (docs/SEMANTICS.md); with no prefix, the ragged kernel alone.
// verify: SGLang's TARGET_VERIFY (EAGLE) as the backend runs it: one paged_prefill over each
//   request's prefix and its qo_len draft tokens (whose K/V are already in the pool) with a tree
//   custom mask: every draft token sees the whole prefix and, among the drafts, itself and its
//   ancestors in the draft tree (verify_tree_parent).
enum class BenchOp { decode, prefill, extend, verify };
const char* op_name(BenchOp op);
BenchOp parse_op(const std::string& name);  // "decode" | "prefill" | "extend" | "verify"

// Where a request's pages lie in the paged pool. in_order: request r holds pages
// [r * pages_per_request, (r + 1) * pages_per_request) in order, as an allocator hands out a fresh
// pool; shuffled: the batch's pages are a random permutation of the pool, as after churn.
enum class KvLayout { shuffled, in_order };
const char* kv_layout_name(KvLayout layout);  // "shuffled" | "in_order"

// One benchmark shape. Every request of the batch has the same lengths.
struct BenchCase {
  BenchOp op = BenchOp::decode;
  int batch = 1;
  int qo_len = 1;  // new query tokens per request (decode: 1; prefill: == kv_len)
  int kv_len = 1;  // KV tokens each request attends to in total (extend: cached prefix + qo_len)
  int num_qo_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;
  int page_size = 1;                        // of the paged KV (decode, the prefix of extend)
  KvLayout kv_layout = KvLayout::shuffled;  // of the paged KV's pages in the pool
  DType dtype = DType::bf16;                // Q, O and the new tokens' K/V
  DType kv_dtype = DType::bf16;             // the paged KV pool (may be fp8)
  Device device;
  // A sliding-window layer's case (model_grid): window_left of the decode and of the new
  // tokens' causal pass (-1: none). The paged KV is then what the backend hands the kernel for
  // such a layer: decode's last w + 1 tokens, extend's prefix's last w.
  int window_left = -1;
  float logit_cap = 0;  // logits soft cap of every pass (0: none)
  // Attention sinks (random f32 [num_qo_heads] logits), added where the backend adds them: the
  // decode, the prefill, or an extend's prefix pass (the one that writes the merged rows).
  bool sinks = false;
  // Timed in alternating rounds with the case before it in a grid (its twin with one thing
  // changed, e.g. sinks added), so a drift of the machine during the run (clocks, heat, other
  // load) falls on both alike; the result then carries the time ratio to that twin.
  bool paired = false;
  // "NAME=VALUE": an environment switch (a variable of kEnvSwitches, core/options.h) set while
  // this case is prepared and timed, and put back after (bench --ab, switch_twins); empty: none.
  std::string env;
  // prefill and extend: whether the new tokens attend to each other causally (false: each new
  // token sees all of them, as an encoder's prefill). Decode and verify ignore it.
  bool causal = true;
  // extend: one causal paged pass over a pool that holds each request's prefix and new tokens
  // (the new tokens' K/V written there first; the backend's ExtendPath::one_paged_pass) instead
  // of the ragged pass over the new tokens and the prefix pass that merges into it. One plan,
  // one launch; the new tokens' K/V are read back from the pool.
  bool one_paged_pass = false;

  int prefix_len() const { return kv_len - qo_len; }
  // Decode, verify, extend with a cached prefix and extend in one paged pass read a paged pool;
  // prefill does not.
  bool reads_pool() const {
    return op == BenchOp::decode || op == BenchOp::verify ||
           (op == BenchOp::extend && (prefix_len() > 0 || one_paged_pass));
  }
  // kv_layout_name(kv_layout), or "none" when the case reads no paged pool.
  const char* layout_name() const;
  // The mask among the query rows' own tokens: "causal", "non-causal" (prefill / extend with
  // causal false), "tree" (verify) or "none" (decode: one row, the last position).
  const char* mask_name() const;
  // e.g. "decode B=16 qo=1 kv=4096 32/8/128 P=1 shuffled bf16/bf16 cpu"; an extend in one paged
  // pass adds " one-pass", a non-causal case ends in " non-causal", a verify case in
  // " tree-mask", a case with a switch in " NAME=VALUE".
  std::string str() const;
};

// Convenience constructors (heads/dims default to the Llama-3-8B shape 32/8/128, bf16).
BenchCase decode_case(int batch, int kv_len, Device device, int hq = 32, int hkv = 8, int d = 128,
                      DType kv_dtype = DType::bf16, KvLayout layout = KvLayout::shuffled);
BenchCase prefill_case(int batch, int len, Device device, int hq = 32, int hkv = 8, int d = 128);
BenchCase extend_case(int batch, int prefix_len, int new_len, Device device, int hq = 32,
                      int hkv = 8, int d = 128);
// `batch` requests of `drafts` draft tokens over a `prefix_len`-token prefix (op verify).
BenchCase verify_case(int batch, int prefix_len, int drafts, Device device, int hq = 32,
                      int hkv = 8, int d = 128);

// The verify case's draft tree: a complete binary tree in breadth-first order (EAGLE's tree
// with top-k 2), draft t's parent is (t - 1) / 2, draft 0 (the root) has none (-1).
int verify_tree_parent(int t);
// One request's tree mask of a verify case: u8 [qo_len, kv_len] row-major (the layout of
// AttentionOptions::custom_mask), every request of the case has the same one.
std::vector<uint8_t> verify_tree_mask(const BenchCase& c);

// Work of a case. FLOPs are 4 * Hq * D per (query row, visible key) pair (QK^T and PV), summed
// over the pairs the case's mask allows: decode kv_len per request; prefill and extend
// new * prefix + new * (new + 1) / 2 (causal; a window caps each row at window_left + 1 new
// keys) or new * prefix + new * new (non-causal); verify the ones of its tree mask. Bytes are
// the minimum traffic: Q and O once, every K/V entry once (at its dtype), verify's mask once.
double case_flops(const BenchCase& c);
double case_bytes(const BenchCase& c);
// Throws flashkv::Error naming the first field a case gets wrong (run_case checks this first).
void validate_case(const BenchCase& c);

struct CaseResult {
  BenchCase c;
  double us = 0;      // median time of one run (all kernels of the op)
  double gbps = 0;    // case_bytes / time
  double tflops = 0;  // case_flops / time
  // Against the bound that applies: decode gbps / read_gbps; prefill and extend
  // matmul rate / matmul_gflops; verify (a few query rows per request over a long paged KV,
  // which may sit on either side of the ridge) the roofline at its arithmetic intensity, i.e.
  // the larger of the two fractions.
  double roofline_fraction = 0;
  // The same bound with the GEMM timed back to back (Roofline::matmul_sustained_gflops) in place
  // of the single one, for prefill, extend and verify: the bench times each case for as long, so
  // both run at the clock the card's power limit leaves them. 0 where no sustained rate is
  // measured (a CPU) and for decode (a bandwidth bound).
  double sustained_fraction = 0;
  int runs = 0;             // timed runs (CUDA: total runs over all graph replays)
  bool cuda_graph = false;  // CUDA: timed as CUDA-graph replays
  // A paired case (BenchCase::paired): its time over its twin's, the median of the rounds'
  // ratios (each round's medians), and the smallest and largest round's ratio: the spread.
  double vs_twin = 0, vs_twin_min = 0, vs_twin_max = 0;
  int rounds = 0;  // alternating rounds timed (paired cases and their twins)
};

// The planner's host time for one PlanCase (run_plan_grid).
struct PlanResult {
  PlanCase c;
  PlanTiming t;
};

// A context-parallel case (flashkv bench --cp N, run_cp_case): the same case on rank 0 alone (a
// one-rank communicator) and sharded across the N ranks of the group, in the same run.
struct CpCaseResult {
  // Rank 0 alone: us the time of its median call, the fraction of the machine's roofline.
  CaseResult one_rank;
  // The group: us the slowest rank's median call (a call is done when every rank has its
  // output), GB/s and TFLOP/s of the whole case in that time, the fraction of ranks x the
  // machine's roofline (the group's bound when every rank has a machine like rank 0's).
  CaseResult sharded;
  // The phases (parallel::CpTiming) of each rank's median call, which add up to its time (of an
  // even count of calls, the faster of the middle two): one entry for the one-rank run, one a
  // rank for the sharded run.
  std::vector<parallel::CpTiming> one_rank_phases, sharded_phases;
  parallel::CpOptions options;  // the sharding and exchange of this case
  double speedup = 0;           // one_rank.us / sharded.us
};

// How a --cp run was set up: the group and its communicator.
struct CpRun {
  int ranks = 0;  // 0: not a --cp run
  std::string communicator;
  std::vector<CpCaseResult> cases;
};

struct BenchReport {
  Roofline machine;
  std::vector<CaseResult> cases;
  std::vector<PlanResult> plans;  // run_plan_grid's, when the run timed the planner
  CpRun cp;                       // flashkv bench --cp's cases
};

struct BenchOptions {
  int warmup = 2;             // untimed runs before timing
  int min_runs = 5;           // timed runs: at least this many ...
  int max_runs = 100;         // ... at most this many ...
  double min_seconds = 0.25;  // ... and until this much time was spent timing
  uint64_t seed = 1;          // of the random inputs
};

// Fills a contiguous host tensor of a float dtype with random values of unit variance; the values
// depend only on (seed, index).
void fill_random(const Tensor& t, uint64_t seed);

// A result's GB/s, TFLOP/s and roofline fraction from its time (r.c and r.us set), against
// `scale` machines like `machine` (the ranks of a --cp run; 1 otherwise).
void set_rates(CaseResult& r, const Roofline& machine, double scale = 1);

// bench --ab: each case, then its twin with the switch `env` ("NAME=VALUE", NAME a variable of
// kEnvSwitches) set, timed in alternating rounds with it (paired), so that the twin's ratio and
// its spread compare the two in one run. Twins the cases already had (a model's sinks) become
// cases of their own, each with its twin. Throws flashkv::Error when NAME is not a switch or is
// set in the environment (the cases would not run the default).
std::vector<BenchCase> switch_twins(const std::vector<BenchCase>& cases, const std::string& env);

// Runs one case on its device (must be machine.device) and reports its figures.
CaseResult run_case(const BenchCase& c, const Roofline& machine, const BenchOptions& options = {});
// Runs every case in order; on_result (if set) sees each result as it is made.
BenchReport run_cases(const std::vector<BenchCase>& cases, const Roofline& machine,
                      const BenchOptions& options = {},
                      const std::function<void(const CaseResult&)>& on_result = {});

// A model's cases (`flashkv bench --model`): decode and extend at the grid's sizes ("quick":
// seconds on a CPU; "full": the sizes of the full grid) for each kind of layer the model has:
// its full-attention layers (when any) and its windowed ones (window_left >= 0, when any), with
// its heads, head dim and soft cap.
struct ModelShape {
  int num_qo_heads = 32, num_kv_heads = 8, head_dim = 128;
  int window_left = -1;     // >= 0: the windowed layers' window
  bool has_full = true;     // has full-attention layers
  bool has_window = false;  // has windowed layers
  float logit_cap = 0;
  bool sinks = false;  // the model has attention sinks: each case with and without them
};
std::vector<BenchCase> model_grid(const std::string& name, Device device, const ModelShape& m);

// Named grids: "quick" (tiny shapes, seconds on a 2-core CPU: for CI and smoke runs) and "full"
// (the shapes of the performance issues for the device's kind: CPU issue 5; CUDA issues 6, 7,
// 28).
std::vector<BenchCase> bench_grid(const std::string& name, Device device);

// The context-parallel grid (flashkv bench --cp): one long request, Llama-3-8B's attention shape
// (32/8/128, bf16). "quick": decode at 1 x 16384 and extend of 16 tokens on a 16384-token prefix
// (seconds on a 2-core CPU at --cp 2, for CI); "full": decode at 1 x 262144 and 1 x 1048576 and
// extend of 1024 tokens on a 262144-token prefix (issue 29's sizes).
std::vector<BenchCase> cp_grid(const std::string& name, Device device);
// Times a decode or extend case (batch requests, every one sharded by `options`) on rank 0 alone,
// then on every rank of `comm`, in lockstep (rank 0 decides how many calls are timed). Every rank
// of the group calls it with the same arguments; the result is complete on every rank. machine:
// rank 0's roofline, on comm.device().
CpCaseResult run_cp_case(const BenchCase& c, parallel::Communicator& comm,
                         const parallel::CpOptions& options, const Roofline& machine,
                         const BenchOptions& bench_options = {});

// The planner's host time next to a grid: bench_plan_grid (prefill and extend batches of 256
// requests) with the device's own DeviceInfo, its median and minimum over 15 rounds of 2000
// planning steps ("full") or 5 rounds of 200 ("quick"). `kinds` (when not empty) keeps the cases
// of those kinds only; on_result (if set) sees each result as it is made.
std::vector<PlanResult> run_plan_grid(const std::string& name, Device device,
                                      const std::vector<PlanKind>& kinds = {},
                                      const std::function<void(const PlanResult&)>& on_result = {});

}  // namespace flashkv::bench
