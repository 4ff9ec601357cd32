// Output of a benchmark run: a table for people, JSON and CSV for tools. The JSON schema is the
// output contract of `flashkv bench --json` (documented in the README):
//   {"machine": {"device", "name", "cores", "sms", "read_gbps", "copy_gbps", "matmul_gflops",
//                "matmul_kind", "matmul_sustained_gflops", "buffer_bytes"},
//    "cases": [{"op", "device", "batch", "qo_len", "kv_len", "prefix_len", "num_qo_heads",
//               "num_kv_heads", "head_dim", "page_size", "kv_layout", "dtype", "kv_dtype", "us",
//               "gbps", "tflops", "roofline_fraction", "sustained_fraction", "runs", "cuda_graph",
//               "window_left", "logit_cap", "sinks", "mask"}],
//    "plans": [{"kind", "device", "batch", "max_new", "max_prefix", "median_us", "min_us",
//               "plans", "items", "merges", "workers"}],
//    "cp": {"ranks", "communicator",                                  (bench --cp only)
//           "cases": [{"op", "device", "batch", "qo_len", "kv_len", "prefix_len", "num_qo_heads",
//                      "num_kv_heads", "head_dim", "page_size", "kv_layout", "dtype", "kv_dtype",
//                      "mask", "layout", "block", "exchange", "kv_pass", "speedup",
//                      "one_rank": {"us", "gbps", "tflops", "roofline_fraction",
//                                   "sustained_fraction", "runs",
//                                   "phases": [{"rank", "local_us", "comm_us", "merge_us"}]},
//                      "sharded": {... the same, "phases" with one entry a rank}}]}}
// kv_len is the KV each query row attends to in total, prefix_len = kv_len - qo_len; kv_layout is
// "in_order" (a fresh pool), "shuffled" (pages after churn) or "none" (no paged KV); us is the
// median time of one run; gbps is 1e9 bytes/s, tflops 1e12 FLOP/s; "cores" is the CPU threads
// used (0 on a GPU), "sms" the GPU's multiprocessors (0 on a CPU); window_left (-1: none),
// logit_cap (0: none) and sinks describe a model's case (bench --model); mask is the mask among
// the query rows' own tokens ("causal", "non-causal", "tree" for verify, "none" for decode).
// "plans" holds the planner's host time (run_plan_grid; empty when not timed): one planning step
// (kind "extend": its two plan_prefill calls) in microseconds, and what it planned.
// "cp" (bench --cp N; "cases" and "plans" are then empty) holds each case on rank 0 alone
// ("one_rank") and sharded across the ranks ("sharded": us is the slowest rank's median, the
// roofline fraction is of ranks x the machine's), the sharding (layout "interleaved" or
// "contiguous", block its tokens per run or per rank), the exchange ("all_gather" or
// "all_to_all"), how extend's new K/V reached the ranks (kv_pass "all_gather" or "ring"),
// speedup = one_rank.us / sharded.us, and the phases of each rank's median call
// (parallel::CpTiming: local attention, communication, merge; they add up to its time).
#pragma once

#include <ostream>
#include <string>

#include "attention_bench.h"

namespace flashkv::bench {

void print_machine(std::ostream& os, const Roofline& machine);
void print_table_header(std::ostream& os);
void print_table_row(std::ostream& os, const CaseResult& r);
// One "plan (host)" line: a planner case and its host time.
void print_plan_row(std::ostream& os, const PlanResult& r);
// bench --cp: the group's line and the table header with the ranks and speed-up columns.
void print_cp_header(std::ostream& os, int ranks, const std::string& communicator);
// bench --cp: a case's one-rank and sharded rows, its sharding, and where each rank's time went.
void print_cp_case(std::ostream& os, const CpCaseResult& r);
// The machine line, the header, every case and every plan line.
void print_table(std::ostream& os, const BenchReport& report);

std::string to_json(const BenchReport& report);
std::string to_csv(const BenchReport& report);

}  // namespace flashkv::bench
