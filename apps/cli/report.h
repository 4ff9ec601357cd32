// Output of a benchmark run: a table for people, JSON and CSV for tools. The JSON schema is the
// output contract of `flashkv bench --json` (documented in the README):
//   {"machine": {"device", "name", "cores", "sms", "read_gbps", "copy_gbps", "matmul_gflops",
//                "matmul_kind", "buffer_bytes"},
//    "cases": [{"op", "device", "batch", "qo_len", "kv_len", "prefix_len", "num_qo_heads",
//               "num_kv_heads", "head_dim", "page_size", "kv_layout", "dtype", "kv_dtype", "us",
//               "gbps", "tflops", "roofline_fraction", "runs", "cuda_graph", "window_left",
//               "logit_cap", "sinks", "mask"}],
//    "plans": [{"kind", "device", "batch", "max_new", "max_prefix", "median_us", "min_us",
//               "plans", "items", "merges", "workers"}]}
// kv_len is the KV each query row attends to in total, prefix_len = kv_len - qo_len; kv_layout is
// "in_order" (a fresh pool), "shuffled" (pages after churn) or "none" (no paged KV); us is the
// median time of one run; gbps is 1e9 bytes/s, tflops 1e12 FLOP/s; "cores" is the CPU threads
// used (0 on a GPU), "sms" the GPU's multiprocessors (0 on a CPU); window_left (-1: none),
// logit_cap (0: none) and sinks describe a model's case (bench --model); mask is the mask among
// the query rows' own tokens ("causal", "non-causal", "tree" for verify, "none" for decode).
// "plans" holds the planner's host time (run_plan_grid; empty when not timed): one planning step
// (kind "extend": its two plan_prefill calls) in microseconds, and what it planned.
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
// The machine line, the header, every case and every plan line.
void print_table(std::ostream& os, const BenchReport& report);

std::string to_json(const BenchReport& report);
std::string to_csv(const BenchReport& report);

}  // namespace flashkv::bench
