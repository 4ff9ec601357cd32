// The planner: per forward batch, on the host, cut each request's work into items (request,
// KV head, query tile, KV chunk), spread them over the device's workers, and lay out the
// workspace. One plan format for every device: CPU kernels hand items to threads, CUDA kernels
// give each CTA its slice of the item list.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "flashkv/core/device.h"

namespace flashkv {

// One unit of work: query rows [q_begin, q_begin + q_len) of one request (absolute rows of the
// packed Q/O, [num_tokens, Hq, D]) against the request's KV positions [kv_begin, kv_end), for
// every KV head: a CUDA kernel runs it once per KV head (grid.y), each time for the G = Hq / Hkv
// query heads of that KV head together; the CPU runs (item, KV head) pairs on its threads. The
// kernel applies the masks inside the range; the planner only trims KV that a mask (causal,
// window) makes invisible to every row of the item. An item may have an empty KV range: its
// rows then get O = 0, LSE = -inf.
struct WorkItem {
  int32_t request;
  int32_t q_begin;
  int32_t q_len;
  int32_t kv_begin;
  int32_t kv_end;
  // -1: write O and LSE straight to the outputs. Otherwise this item is chunk `chunk` of a split
  // tile, and its query row q writes partial row `partial + (q - q_begin)` of the partial
  // buffers (partial O [rows, Hq, D_v] f32, partial LSE [rows, Hq] f32).
  int32_t partial;
  int32_t chunk;
  int32_t reserved;
};
static_assert(sizeof(WorkItem) == 32, "WorkItem is uploaded as raw bytes");

// One split tile to merge: rows [q_begin, q_begin + q_len), all heads, whose num_chunks partial
// states sit at partial rows `partial + c * q_len + (q - q_begin)`, c = 0..num_chunks-1
// (merged in order c = 0, 1, ..., so the result is deterministic).
struct MergeItem {
  int32_t q_begin;
  int32_t q_len;
  int32_t partial;
  int32_t num_chunks;
};
static_assert(sizeof(MergeItem) == 16, "MergeItem is uploaded as raw bytes");

// Where each piece of a plan lives inside the workspace (byte offsets, 256-byte aligned).
struct WorkspaceLayout {
  size_t items = 0;          // WorkItem[num_items (capacity in graph mode)]
  size_t worker_indptr = 0;  // int32[num_workers + 1]
  size_t merges = 0;         // MergeItem[num_merges (capacity)]
  size_t counts = 0;         // int32[4]: num_items, num_merges, num_partial_rows, 0 — what a
                             // captured CUDA graph must read on the device, since the values
                             // baked into its launch parameters are the capture batch's
  size_t partial_o = 0;      // float[partial_rows, Hq, D_v]
  size_t partial_lse = 0;    // float[partial_rows, Hq]
  size_t plan_bytes = 0;     // bytes of the plan part (items, worker_indptr, merges, counts)
  size_t total_bytes = 0;
};

// The batch as the planner sees it: host arrays only.
struct BatchShape {
  int32_t batch_size = 0;
  const int32_t* qo_indptr = nullptr;  // [batch_size + 1]; null for decode (one row a request)
  const int32_t* kv_len = nullptr;     // [batch_size] KV entries (tokens) of each request
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim_qk = 0;
  int32_t head_dim_v = 0;
  int32_t page_size = 1;
  bool causal = false;     // lets the planner trim KV past the last query's position
  int32_t window_left = -1;  // lets the planner trim KV before the first query's window
};

struct PlanOptions {
  // Query rows (tokens) per item for prefill; 0 picks the device's default tile.
  int32_t q_tile = 0;
  // Split KV across items when it adds parallelism.
  bool enable_split_kv = true;
  // > 0: deterministic mode, every request's KV cut at multiples of this many tokens (whether
  // or not the batch needs the parallelism), so its chunks never depend on the rest of the batch.
  int32_t fixed_split_size = 0;
  // Chunk boundaries are multiples of this (the kernel's KV tile); 0 picks the device's default.
  int32_t kv_align = 0;
  // CUDA-graph mode: capacities fixed at capture; every plan then has the same num_workers and
  // the same workspace layout, whatever the batch.
  bool cuda_graph = false;
  int32_t max_batch_size = 0;   // graph mode capacity
  int32_t max_num_tokens = 0;   // graph mode capacity (query rows)
  int32_t max_kv_len = 0;       // graph mode with fixed_split_size: longest request's KV
  // CUDA: resident CTAs per SM the kernel is sized for (0: 2). The grid's x extent is
  // num_sms * blocks_per_sm / Hkv workers (grid.y runs the KV heads).
  int32_t blocks_per_sm = 0;
  // Shortest KV chunk an automatic split makes (0: 256 tokens); smaller chunks cost more in
  // merging than they gain in parallelism.
  int32_t min_split_size = 0;
};

struct Plan {
  // What was planned (the kernels check their arguments against these).
  int32_t batch_size = 0;
  int64_t num_qo_tokens = 0;
  int32_t num_qo_heads = 0, num_kv_heads = 0, head_dim_qk = 0, head_dim_v = 0, page_size = 1;
  Device device;
  uint64_t id = 0;  // unique per planning call; the workspace remembers which plan it holds
  int32_t q_tile = 1;
  int32_t kv_chunk = 0;  // 0: no request was split
  int32_t num_workers = 0;  // CUDA: grid.x (grid.y = Hkv); CPU: threads
  int32_t num_tiles = 0;    // (request, query tile) pairs before splitting
  bool cuda_graph = false;

  std::vector<WorkItem> items;         // grouped by worker: items of worker w are
  std::vector<int32_t> worker_indptr;  // items[worker_indptr[w] .. worker_indptr[w + 1])
  std::vector<MergeItem> merges;
  int64_t num_partial_rows = 0;
  WorkspaceLayout layout;

  int group_size() const { return num_kv_heads ? num_qo_heads / num_kv_heads : 0; }
};

struct DecodePlan : Plan {};
struct PrefillPlan : Plan {};

// Pure host functions; throw flashkv::Error on inconsistent input (non-monotonic indptr,
// negative lengths, zero heads, Hq % Hkv != 0, sizes past graph-mode capacity, ...).
DecodePlan plan_decode(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt);
PrefillPlan plan_prefill(const BatchShape& batch, const DeviceInfo& device,
                         const PlanOptions& opt);
// The same, reusing `out`'s vectors so steady-state planning allocates nothing.
void plan_decode(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt,
                 DecodePlan* out);
void plan_prefill(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt,
                  PrefillPlan* out);

// Serialises the plan part (items, worker_indptr, merges) into `dst` as laid out by
// plan.layout (dst must hold plan.layout.plan_bytes bytes).
void serialize_plan(const Plan& plan, void* dst);

}  // namespace flashkv
