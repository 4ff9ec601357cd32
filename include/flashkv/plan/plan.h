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
  // Split items (partial >= 0): the index in `merges` of the tile's MergeItem (its chunk count
  // and first partial row; the CUDA decode kernel merges the chunks itself). 0 otherwise.
  int32_t merge;
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

// The first bytes of an uploaded plan: a format check, and the counts a kernel must read from
// device memory rather than from its launch parameters (a CUDA graph freezes those at capture,
// while the plan, and with it these counts, changes before every replay).
struct PlanHeader {
  uint32_t magic;    // kPlanMagic
  uint32_t version;  // kPlanFormatVersion
  int32_t num_items;
  int32_t num_merges;  // merges[num_merges .. merge capacity) are zero (q_len 0, no chunks)
  int32_t num_workers;
  int32_t num_partial_rows;
  int32_t batch_size;
  int32_t reserved;
};
static_assert(sizeof(PlanHeader) == 32, "PlanHeader is uploaded as raw bytes");
constexpr uint32_t kPlanMagic = 0x504b5646;  // "FVKP" in little-endian bytes
// Bumped whenever PlanHeader, WorkItem, MergeItem or the order of the workspace pieces changes.
constexpr uint32_t kPlanFormatVersion = 2;

// Where each piece of a plan lives inside the workspace (byte offsets, 256-byte aligned), in
// this order: header, items, worker_indptr, merges, merge counters (together the uploaded plan
// part, plan_bytes long), then partial O and partial LSE. Sized for the capacities below: in
// graph mode those come from PlanOptions only, so every plan of a captured graph has the same
// layout.
struct WorkspaceLayout {
  size_t header = 0;         // PlanHeader
  size_t items = 0;          // WorkItem[max_items]
  size_t worker_indptr = 0;  // int32[num_workers + 1]
  size_t merges = 0;         // MergeItem[max_merges]
  // int32[max_merges, Hq]: arrival counts of a merge's chunks, per CTA head group (indexed by
  // the group's first query head); zero in every upload, and a kernel that counts leaves them
  // zero again when it ends (so a CUDA graph replays without an upload in between).
  size_t merge_counters = 0;
  size_t partial_o = 0;    // float[max_partial_rows, Hq, D_v]
  size_t partial_lse = 0;  // float[max_partial_rows, Hq]
  size_t plan_bytes = 0;   // bytes of the plan part (header .. merge counters), uploaded
  size_t total_bytes = 0;
  int64_t max_items = 0;         // graph mode: the capacity; otherwise this plan's count
  int64_t max_merges = 0;        // likewise
  int64_t max_partial_rows = 0;  // likewise
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
  // The masks the kernel will apply, so that the planner can trim KV no row of a tile can see:
  // causal past the last row's position, window_left (< 0: none) before the first row's window.
  // Must not claim more masking than the kernel applies (a custom mask replaces causal: plan
  // such batches with causal = false).
  bool causal = false;
  int32_t window_left = -1;
};

struct PlanOptions {
  // Query rows (tokens) per item for prefill; 0 picks the device's default tile.
  int32_t q_tile = 0;
  // Cut a tile's KV into chunks (partial states merged afterwards) when it is longer than one
  // worker's share of the batch: this fills the device when a few long requests are all there
  // is, and keeps one huge request from holding up a large batch. false: never split.
  bool enable_split_kv = true;
  // > 0: deterministic mode, every request's KV cut at multiples of this many tokens (rounded up
  // to a multiple of the KV alignment; whether or not the batch needs the parallelism), so its
  // chunks never depend on the rest of the batch. SGLang uses 2048 for decode, 4096 for prefill.
  int32_t fixed_split_size = 0;
  // Chunk boundaries are multiples of this (the kernel's KV tile; 0: 16 tokens), rounded up to
  // whole pages.
  int32_t kv_align = 0;
  // CUDA-graph mode: capacities fixed at capture; every plan then has the same num_workers and
  // the same workspace layout, whatever the batch.
  bool cuda_graph = false;
  int32_t max_batch_size = 0;  // graph mode capacity
  int32_t max_num_tokens = 0;  // graph mode capacity (query rows)
  int32_t max_kv_len = 0;      // graph mode with fixed_split_size: longest request's KV
  // CUDA: workers an SM (0: 2). The grid's x extent is at most num_sms * blocks_per_sm / Hkv
  // workers (grid.y runs the KV heads): one wave where the kernel fits that many CTAs an SM (the
  // sm_80 prefill kernel), else waves the hardware fills as CTAs finish. At 0 a prefill plan
  // (not in graph mode) spreads its items over that count rounded up to whole waves where it
  // takes at most 4x the CTAs, e.g. 33 workers a head at 32 KV heads on 132 SMs rather than 8
  // (256 CTAs leave 8 SMs idle); its KV split is sized on the count before rounding.
  int32_t blocks_per_sm = 0;
  // Shortest KV chunk an automatic split makes (0: 256 tokens; where no tile is longer than
  // 1024, 128 for prefill and 64 for decode; decode where none is longer than 4096: 128); smaller
  // chunks cost more in merging than they gain in parallelism.
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
  // 0: no split. Deterministic mode: the (aligned) fixed_split_size, chunks cut at absolute
  // multiples of it, even where no tile needed cutting. Automatic: the longest a part may be
  // (each split tile is cut into equal parts of whole alignment units, at most this long); with
  // equal_runs, the longest item.
  int32_t kv_chunk = 0;
  // Decode on CUDA with an automatic split, where it balances better (plan.cpp, wrap_tiles):
  // the tiles, in request order, were laid end to end and cut into runs of equal cost, one a
  // worker, each tile straddling a run's end cut there (at a multiple of the KV alignment).
  // Otherwise whole tiles, or equal parts of the long ones, went costliest first to the least
  // loaded worker.
  bool equal_runs = false;
  // CUDA: grid.x (grid.y = Hkv). CPU: max(1, threads / Hkv), so that workers x Hkv (item, KV
  // head) tasks fill the threads as the CUDA grid fills the SMs.
  int32_t num_workers = 0;
  int32_t num_tiles = 0;  // (request, query tile) pairs before splitting
  bool cuda_graph = false;

  std::vector<WorkItem> items;         // grouped by worker: items of worker w are
  std::vector<int32_t> worker_indptr;  // items[worker_indptr[w] .. worker_indptr[w + 1])
  std::vector<MergeItem> merges;
  int64_t num_partial_rows = 0;  // rows of the partial O/LSE buffers the split items write
  WorkspaceLayout layout;

  int group_size() const { return num_kv_heads ? num_qo_heads / num_kv_heads : 0; }
};

struct DecodePlan : Plan {};
struct PrefillPlan : Plan {};

// Pure host functions; throw flashkv::Error naming the argument on inconsistent input
// (non-monotonic indptr, negative lengths, zero heads, Hq % Hkv != 0, sizes past graph-mode
// capacity, ...). The reuse form below leaves `out` with id 0 (unusable) when it throws.
DecodePlan plan_decode(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt);
PrefillPlan plan_prefill(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt);
// The same, reusing `out`'s vectors so steady-state planning allocates nothing.
void plan_decode(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt,
                 DecodePlan* out);
void plan_prefill(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt,
                  PrefillPlan* out);

// Serialises the plan part (header, items, worker_indptr, merges, zero padding of the merges up
// to layout.max_merges) into `dst` as laid out by plan.layout (dst must hold
// plan.layout.plan_bytes bytes).
void serialize_plan(const Plan& plan, void* dst);

}  // namespace flashkv
