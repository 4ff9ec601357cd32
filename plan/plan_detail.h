// The planner's internals shared by its translation units (plan/plan.cpp: tiles, splits, layout
// and the entry points; plan/balance.cpp: assigning items to workers). Not installed.
#pragma once

#include <cstdint>
#include <vector>

#include "flashkv/plan/plan.h"

namespace flashkv::plan_detail {

// What an item costs beyond its KV (loading Q, writing O), in units of one KV token per row.
constexpr int64_t kItemOverhead = 16;
// A worker's entry packs (load << kWorkerBits) | worker, so that one integer compare orders by
// load, then by worker id (deterministic ties).
constexpr int kWorkerBits = 20;
constexpr int64_t kMaxWorkers = int64_t{1} << kWorkerBits;
constexpr int kLoadBits = 64 - kWorkerBits - 1;  // one bit of headroom for the per-item minimum

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int bit_width(uint64_t x) { return x == 0 ? 0 : 64 - __builtin_clzll(x); }

// Chunks of `chunk` tokens, at absolute multiples of it, that KV range [lo, hi) touches (an
// empty range still needs its one item).
// KV positions are int32, so a chunk is at most INT32_MAX (a longer one cuts nothing either)
// and the divisions are 32-bit ones, several times cheaper than 64-bit ones on some hosts.
inline int32_t num_chunks(int32_t lo, int32_t hi, uint32_t chunk) {
  if (hi <= lo) return 1;
  return static_cast<int32_t>((static_cast<uint32_t>(hi) - 1) / chunk -
                              static_cast<uint32_t>(lo) / chunk + 1);
}

// Alignment units (absolute multiples of `align`) that KV range [lo, hi) touches; 0 if empty.
inline uint32_t units_of(int32_t lo, int32_t hi, uint32_t align) {
  if (hi <= lo) return 0;
  return (static_cast<uint32_t>(hi) - 1) / align - static_cast<uint32_t>(lo) / align + 1;
}

// Parts of an automatic split of `units` units into parts of at most `part` units (>= 1).
inline uint32_t num_parts(uint32_t units, uint32_t part) {
  return units <= part ? 1 : (units - 1) / part + 1;
}

inline int64_t item_cost(const WorkItem& it) {
  return int64_t{it.q_len} * (int64_t{it.kv_end} - it.kv_begin + kItemOverhead);
}

// Items in planning order, with each one's cost (item_cost) and sort key (cost_key). The
// vectors only grow (a plan reuses its scratch, and shrinking then growing would clear the
// regrown part each time); `size()` items are in use.
struct ItemList {
  std::vector<WorkItem> items;
  std::vector<uint64_t> cost;
  std::vector<uint8_t> key;
  int64_t total_cost = 0;

  // Room for at least n items; sets the size to n.
  void resize(size_t n) {
    if (items.size() < n) {
      items.resize(n);
      cost.resize(n);
      key.resize(n);
    }
    count = n;
  }
  size_t size() const { return count; }
  const WorkItem* begin() const { return items.data(); }
  const WorkItem* end() const { return items.data() + count; }

 private:
  size_t count = 0;
};

// Per-thread scratch, so steady-state planning allocates nothing.
struct Scratch {
  ItemList tiles;  // one item per (request, query tile), in request order
  ItemList split;  // the tiles cut into KV chunks (used when a chunk is set)
  std::vector<int32_t> chunks_per_tile;
  std::vector<uint32_t> order;
  std::vector<uint64_t> tree;  // see balance()
  std::vector<uint64_t> load;  // per worker
  std::vector<int32_t> owner, cursor;
  // The equal-runs candidate (wrap_tiles), swapped into the plan when it is the better one.
  std::vector<WorkItem> run_items;
  std::vector<int32_t> run_indptr;
  std::vector<MergeItem> run_merges;
  std::vector<int64_t> run_load;
};
Scratch& scratch();

// LPT: items costliest first, each to the least-loaded worker (ties: the lowest id); writes
// the items grouped by worker (each worker's in planning order) into p->items and
// p->worker_indptr. Needs more items than workers.
void balance(const ItemList& items, int32_t num_workers, Scratch& s, Plan* p);

// Equal runs (McNaughton's wrap-around rule): the tiles, in request order, cut into `runs` runs
// of equal cost, one a worker, into the scratch (s.run_*); returns the makespan, or -1 when a run
// would be empty. See balance.cpp.
int64_t wrap_tiles(const ItemList& tiles, int32_t runs, uint32_t align, Scratch& s,
                   int64_t* partial_rows);

}  // namespace flashkv::plan_detail
