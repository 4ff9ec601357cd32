// The planner, on random batches: coverage (every visible (request, query row, KV position)
// in exactly one item, every row in one tile), merge lists, partial rows, worker grouping,
// workspace layout and serialization; deterministic mode across thousands of batches; graph
// mode's fixed layout; when split-KV happens; mask trimming; bad input.
#include "flashkv/plan/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "flashkv/core/error.h"
#include "test_util.h"

namespace flashkv {
namespace {

using test::Rng;
using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;

// ---------------------------------------------------------------------------------------------
// Batches and devices

struct Batch {
  bool decode = true;
  std::vector<int32_t> q_len, kv_len, qo_indptr;
  BatchShape shape;

  // Points `shape` at this batch's arrays (call after copying or changing a Batch).
  void bind() {
    qo_indptr = test::indptr_of(q_len);
    shape.batch_size = static_cast<int32_t>(kv_len.size());
    shape.kv_len = kv_len.data();
    shape.qo_indptr = decode ? nullptr : qo_indptr.data();
  }
  int32_t rows_of(int32_t r) const { return decode ? 1 : q_len[r]; }
  int32_t first_row(int32_t r) const { return decode ? r : qo_indptr[r]; }
};

Batch make_batch(bool decode, std::vector<int32_t> q_len, std::vector<int32_t> kv_len, int hq = 32,
                 int hkv = 8, int head_dim = 128) {
  Batch b;
  b.decode = decode;
  b.kv_len = std::move(kv_len);
  b.q_len = decode ? std::vector<int32_t>(b.kv_len.size(), 1) : std::move(q_len);
  b.shape.num_qo_heads = hq;
  b.shape.num_kv_heads = hkv;
  b.shape.head_dim_qk = b.shape.head_dim_v = head_dim;
  b.bind();
  return b;
}

DeviceInfo cuda_like(int num_sms = 132) {
  DeviceInfo d;
  d.device = Device::cuda(0);
  d.name = "cuda-like";
  d.num_sms = num_sms;
  return d;
}

DeviceInfo cpu_like(int num_threads) {
  DeviceInfo d;
  d.device = Device::cpu();
  d.name = "cpu";
  d.num_threads = num_threads;
  return d;
}

// Lengths that break tidy arithmetic: 0, 1, around powers of two, or anything up to `max`.
int32_t awkward_len(Rng& rng, int32_t max) {
  static const int32_t kEdges[] = {2, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 256, 257};
  switch (rng.uniform_int(0, 5)) {
    case 0:
      return 0;
    case 1:
      return std::min(1, max);
    case 2:
      return std::min(kEdges[rng.uniform_int(0, 13)], max);
    default:
      return rng.uniform_int(0, max);
  }
}

// A random batch; prefill KV is the cached prefix plus the new rows (kv >= q), except now and
// then a request with fewer KV entries than rows (its first rows then see nothing causally).
Batch random_batch(Rng& rng, bool decode, int max_batch, int32_t max_q, int32_t max_kv) {
  const int n = rng.uniform_int(0, max_batch);
  std::vector<int32_t> q(n), kv(n);
  for (int i = 0; i < n; ++i) {
    q[i] = decode ? 1 : awkward_len(rng, max_q);
    const int32_t prefix = awkward_len(rng, max_kv);
    kv[i] = decode ? prefix : (rng.uniform_int(0, 9) == 0 ? prefix : prefix + q[i]);
  }
  return make_batch(decode, q, kv);
}

// The most workers a KV head: num_threads or num_sms x blocks_per_sm over the KV heads, and a
// CUDA prefill at the default blocks_per_sm (not in graph mode) rounded up to whole waves where
// that takes at most 8 waves of one CTA an SM: found by search, not by the planner's formula.
int32_t workers_per_kv_head(const DeviceInfo& dev, const PlanOptions& o, int hkv, bool decode) {
  const int64_t slots = dev.device.is_cpu()
                            ? dev.num_threads
                            : int64_t{dev.num_sms} * (o.blocks_per_sm > 0 ? o.blocks_per_sm : 2);
  const int64_t floor = std::max<int64_t>(1, slots / hkv);
  if (dev.device.is_cpu() || decode || o.cuda_graph || o.blocks_per_sm > 0) return floor;
  for (int64_t w = floor; w * hkv <= 4 * slots; ++w)
    if (w * hkv % slots == 0) return static_cast<int32_t>(w);
  return static_cast<int32_t>(floor);
}

int64_t cost_of(const WorkItem& it) { return int64_t{it.q_len} * (it.kv_end - it.kv_begin + 16); }

// Each worker's load: the cost of its items.
std::vector<int64_t> worker_loads(const Plan& p) {
  std::vector<int64_t> load(p.num_workers, 0);
  for (int32_t w = 0; w < p.num_workers; ++w)
    for (int32_t i = p.worker_indptr[w]; i < p.worker_indptr[w + 1]; ++i)
      load[w] += cost_of(p.items[i]);
  return load;
}

// KV positions [lo, hi) that query row `q` (0-based within its request) may see.
std::pair<int64_t, int64_t> visible(const BatchShape& s, int64_t q_len, int64_t kv_len, int64_t q) {
  const int64_t pos = kv_len - q_len + q;
  const int64_t lo = s.window_left >= 0 ? std::max<int64_t>(0, pos - s.window_left) : 0;
  const int64_t hi = s.causal ? std::min<int64_t>(kv_len, pos + 1) : kv_len;
  return {lo, std::max(lo, hi)};
}

// ---------------------------------------------------------------------------------------------
// The invariants every plan must satisfy.

#define PLAN_CHECK(cond, ...)                                                        \
  do {                                                                               \
    if (!(cond)) return AssertionFailure() << #cond << ": " << str_cat(__VA_ARGS__); \
  } while (0)

AssertionResult check_layout(const Plan& p) {
  const WorkspaceLayout& l = p.layout;
  PLAN_CHECK(l.max_items >= static_cast<int64_t>(p.items.size()), "item capacity");
  PLAN_CHECK(l.max_merges >= static_cast<int64_t>(p.merges.size()), "merge capacity");
  PLAN_CHECK(l.max_partial_rows >= p.num_partial_rows, "partial row capacity");
  const int64_t rows = l.max_partial_rows * p.num_qo_heads;
  struct Region {
    const char* name;
    size_t offset, bytes;
  };
  const Region regions[] = {
      {"header", l.header, sizeof(PlanHeader)},
      {"items", l.items, static_cast<size_t>(l.max_items) * sizeof(WorkItem)},
      {"worker_indptr", l.worker_indptr, (p.worker_indptr.size()) * sizeof(int32_t)},
      {"merges", l.merges, static_cast<size_t>(l.max_merges) * sizeof(MergeItem)},
      {"merge_counters", l.merge_counters,
       static_cast<size_t>(l.max_merges * p.num_qo_heads) * sizeof(int32_t)},
      {"partial_o", l.partial_o, static_cast<size_t>(rows * p.head_dim_v) * sizeof(float)},
      {"partial_lse", l.partial_lse, static_cast<size_t>(rows) * sizeof(float)},
  };
  size_t end = 0;
  for (const Region& r : regions) {
    PLAN_CHECK(r.offset % 256 == 0, r.name, " at ", r.offset, " is not 256-byte aligned");
    PLAN_CHECK(r.offset >= end, r.name, " at ", r.offset, " overlaps the previous piece (ends at ",
               end, ")");
    end = r.offset + r.bytes;
    PLAN_CHECK(end <= l.total_bytes, r.name, " ends at ", end, " past total_bytes ", l.total_bytes);
    if (std::string(r.name) == "merge_counters")
      PLAN_CHECK(end <= l.plan_bytes && l.plan_bytes <= l.partial_o, "plan_bytes ", l.plan_bytes,
                 " does not end the plan part (merge counters end at ", end, ")");
  }
  return AssertionSuccess();
}

// Checks every structural property of `p` for batch `b`; with `brute_force`, also counts every
// (row, KV position) of every item explicitly.
AssertionResult check_plan(const Plan& p, const Batch& b, const DeviceInfo& dev,
                           const PlanOptions& o, bool brute_force = false) {
  const BatchShape& s = b.shape;
  const int32_t B = s.batch_size;
  PLAN_CHECK(p.id != 0, "plan id");
  PLAN_CHECK(p.batch_size == B, "batch_size ", p.batch_size);
  PLAN_CHECK(p.num_qo_tokens == (b.decode ? B : b.qo_indptr[B]), "num_qo_tokens");
  PLAN_CHECK(p.num_qo_heads == s.num_qo_heads && p.num_kv_heads == s.num_kv_heads &&
                 p.head_dim_qk == s.head_dim_qk && p.head_dim_v == s.head_dim_v &&
                 p.page_size == s.page_size && p.device == dev.device,
             "shape fields");
  PLAN_CHECK(p.num_tiles >= 0 && p.q_tile >= 1, "q_tile");
  if (b.decode) PLAN_CHECK(p.q_tile == 1, "decode q_tile ", p.q_tile);
  if (o.q_tile > 0 && !b.decode) PLAN_CHECK(p.q_tile == o.q_tile, "q_tile option ignored");

  // Workers and grouping.
  const int32_t max_workers = workers_per_kv_head(dev, o, s.num_kv_heads, b.decode);
  const int32_t W = p.num_workers;
  const int32_t n = static_cast<int32_t>(p.items.size());
  PLAN_CHECK(W >= 1 && W <= max_workers, "num_workers ", W, " (max ", max_workers, ")");
  // Equal runs only for decode on CUDA with an automatic split; then one run a worker (the
  // workers past the runs idle in graph mode).
  if (p.equal_runs)
    PLAN_CHECK(b.decode && dev.device.is_cuda() && o.enable_split_kv && o.fixed_split_size == 0,
               "equal runs outside automatic decode splits on CUDA");
  if (dev.device.is_cpu() || o.cuda_graph)
    PLAN_CHECK(W == max_workers, "num_workers ", W);
  else if (!p.equal_runs)
    PLAN_CHECK(W == std::min(max_workers, std::max(n, 1)), "num_workers ", W);
  PLAN_CHECK(static_cast<int32_t>(p.worker_indptr.size()) == W + 1, "worker_indptr size");
  PLAN_CHECK(p.worker_indptr[0] == 0 && p.worker_indptr[W] == n, "worker_indptr ends");
  for (int32_t w = 0; w < W; ++w) {
    PLAN_CHECK(p.worker_indptr[w] <= p.worker_indptr[w + 1], "worker_indptr decreases at ", w);
    // A worker runs its items in planning order: by row, then by chunk.
    for (int32_t i = p.worker_indptr[w] + 1; i < p.worker_indptr[w + 1]; ++i)
      PLAN_CHECK(std::make_pair(p.items[i - 1].q_begin, p.items[i - 1].chunk) <
                     std::make_pair(p.items[i].q_begin, p.items[i].chunk),
                 "worker ", w, ": items out of planning order at ", i);
  }

  // Equal runs: the runs are the workers up to the last one with items, none of them empty; the
  // items, worker after worker, are in planning order; each run's load is the average give or
  // take an alignment unit and an item's overhead (plan.cpp, wrap_tiles).
  if (p.equal_runs) {
    int32_t runs = W;
    while (runs > 0 && p.worker_indptr[runs - 1] == p.worker_indptr[runs]) --runs;
    PLAN_CHECK(runs >= 2, "equal runs: ", runs, " runs");
    for (int32_t w = 0; w < runs; ++w)
      PLAN_CHECK(p.worker_indptr[w] < p.worker_indptr[w + 1], "equal runs: run ", w, " is empty");
    for (int32_t i = 1; i < n; ++i)
      PLAN_CHECK(std::make_pair(p.items[i - 1].q_begin, p.items[i - 1].chunk) <
                     std::make_pair(p.items[i].q_begin, p.items[i].chunk),
                 "equal runs: items out of planning order at ", i);
    const int64_t unit =
        (int64_t{o.kv_align > 0 ? o.kv_align : 16} + s.page_size - 1) / s.page_size * s.page_size;
    const std::vector<int64_t> load = worker_loads(p);  // the workers past the runs: 0
    const int64_t total = std::accumulate(load.begin(), load.end(), int64_t{0});
    const int64_t makespan = *std::max_element(load.begin(), load.end());
    PLAN_CHECK(makespan <= total / runs + 2 * unit + 2 * 16 + 1, "equal runs: makespan ", makespan,
               " of ", runs, " runs, total ", total, ", unit ", unit);
  }
  // Balance: LPT is list scheduling, whose makespan is at most total / W + the largest item.
  if (!p.equal_runs) {
    const std::vector<int64_t> load = worker_loads(p);
    const int64_t total = std::accumulate(load.begin(), load.end(), int64_t{0});
    const int64_t makespan = *std::max_element(load.begin(), load.end());
    int64_t largest = 0;
    for (const WorkItem& it : p.items) largest = std::max(largest, cost_of(it));
    PLAN_CHECK(makespan <= total / W + largest + 1, "makespan ", makespan, " > total/W ", total / W,
               " + largest ", largest);
  }
  // LPT (costliest first, each to a least-loaded worker): when a worker got its last item, its
  // load was the least, so at most the least final load. Items go in descending order of a
  // cost class finer than the power of two, so the last item is among the worker's items of
  // its lowest power of two: load - the costliest of those <= the least load.
  if (!p.equal_runs) {
    const std::vector<int64_t> load = worker_loads(p);
    const int64_t least = *std::min_element(load.begin(), load.end());
    for (int32_t w = 0; w < W; ++w) {
      int lowest_class = 64;
      int64_t last_bound = 0;  // the costliest item of the lowest class
      for (int32_t i = p.worker_indptr[w]; i < p.worker_indptr[w + 1]; ++i) {
        const int64_t c = cost_of(p.items[i]);
        const int cls = 64 - __builtin_clzll(static_cast<uint64_t>(c));
        if (cls < lowest_class) {
          lowest_class = cls;
          last_bound = c;
        } else if (cls == lowest_class) {
          last_bound = std::max(last_bound, c);
        }
      }
      PLAN_CHECK(load[w] - last_bound <= least, "worker ", w, ": load ", load[w],
                 " minus its last item (<= ", last_bound, ") exceeds the least load ", least,
                 ": not least-loaded first");
    }
  }

  // Items one by one.
  for (int32_t i = 0; i < n; ++i) {
    const WorkItem& it = p.items[i];
    PLAN_CHECK(it.request >= 0 && it.request < B, "item ", i, ": request ", it.request);
    const int32_t r = it.request;
    PLAN_CHECK(it.q_len >= 1 && it.q_len <= p.q_tile, "item ", i, ": q_len ", it.q_len);
    PLAN_CHECK(
        it.q_begin >= b.first_row(r) && it.q_begin + it.q_len <= b.first_row(r) + b.rows_of(r),
        "item ", i, ": rows [", it.q_begin, ", +", it.q_len, ") outside request ", r);
    PLAN_CHECK(0 <= it.kv_begin && it.kv_begin <= it.kv_end && it.kv_end <= b.kv_len[r], "item ", i,
               ": KV [", it.kv_begin, ", ", it.kv_end, ") outside [0, ", b.kv_len[r], ")");
    // Deterministic mode: chunks end at absolute multiples of kv_chunk. Automatic: no chunk is
    // longer than kv_chunk, and each cut (not a tile's own ends) sits at a multiple of the
    // alignment (checked in the tile loop below).
    if (p.kv_chunk > 0 && it.kv_end > it.kv_begin && o.fixed_split_size > 0)
      PLAN_CHECK(it.kv_begin / p.kv_chunk == (it.kv_end - 1) / p.kv_chunk, "item ", i, ": KV [",
                 it.kv_begin, ", ", it.kv_end, ") crosses a multiple of kv_chunk ", p.kv_chunk);
    if (p.kv_chunk > 0)
      PLAN_CHECK(it.kv_end - it.kv_begin <= p.kv_chunk, "item ", i, ": KV [", it.kv_begin, ", ",
                 it.kv_end, ") longer than kv_chunk ", p.kv_chunk);
  }

  // Tiles: the items of one (request, first row) are the chunks of one tile.
  const int64_t kv_unit =
      (int64_t{o.kv_align > 0 ? o.kv_align : 16} + s.page_size - 1) / s.page_size * s.page_size;
  std::map<int32_t, std::vector<const WorkItem*>> tiles;  // by q_begin
  for (const WorkItem& it : p.items) tiles[it.q_begin].push_back(&it);
  PLAN_CHECK(static_cast<int32_t>(tiles.size()) == p.num_tiles, "num_tiles ", p.num_tiles,
             ", found ", tiles.size());
  std::map<int32_t, const MergeItem*> merges;  // by q_begin
  for (const MergeItem& m : p.merges) {
    PLAN_CHECK(merges.emplace(m.q_begin, &m).second, "two merges of rows from ", m.q_begin);
  }
  std::vector<int32_t> partial_owner(p.num_partial_rows, -1);
  int32_t split_tiles = 0;
  std::vector<std::vector<std::pair<int32_t, int32_t>>> rows_of_request(B);  // tile row ranges
  for (auto& [q_begin, chunks] : tiles) {
    std::sort(chunks.begin(), chunks.end(),
              [](const WorkItem* a, const WorkItem* c) { return a->chunk < c->chunk; });
    const WorkItem& first = *chunks.front();
    const int32_t r = first.request;
    rows_of_request[r].push_back({first.q_begin, first.q_len});
    const int32_t num = static_cast<int32_t>(chunks.size());
    for (int32_t c = 0; c < num; ++c) {
      const WorkItem& it = *chunks[c];
      PLAN_CHECK(it.request == r && it.q_len == first.q_len, "rows from ", q_begin,
                 " in two different tiles");
      PLAN_CHECK(it.chunk == c, "tile at row ", q_begin, ": chunk ", it.chunk, ", expected ", c);
      if (c > 0)
        PLAN_CHECK(it.kv_begin == chunks[c - 1]->kv_end, "tile at row ", q_begin, ": chunk ", c,
                   " starts at ", it.kv_begin, ", the previous one ends at ",
                   chunks[c - 1]->kv_end);
      if (c > 0)
        PLAN_CHECK(it.kv_begin % kv_unit == 0, "tile at row ", q_begin, ": chunk ", c,
                   " starts at ", it.kv_begin, ", not a multiple of the alignment ", kv_unit);
      if (num > 1) PLAN_CHECK(it.kv_end > it.kv_begin, "empty chunk ", c, " of a split tile");
    }
    auto mi = merges.find(q_begin);
    if (num == 1) {
      PLAN_CHECK(first.partial == -1, "unsplit tile at row ", q_begin, " writes partial rows");
      PLAN_CHECK(mi == merges.end(), "unsplit tile at row ", q_begin, " has a merge");
    } else {
      ++split_tiles;
      PLAN_CHECK(mi != merges.end(), "split tile at row ", q_begin, " has no merge");
      const MergeItem& m = *mi->second;
      PLAN_CHECK(m.q_len == first.q_len && m.num_chunks == num, "merge of row ", q_begin,
                 ": q_len ", m.q_len, " / num_chunks ", m.num_chunks, ", expected ", first.q_len,
                 " / ", num);
      for (int32_t c = 0; c < num; ++c) {
        const WorkItem& it = *chunks[c];
        PLAN_CHECK(it.partial == m.partial + c * m.q_len, "chunk ", c, " of row ", q_begin,
                   ": partial ", it.partial, ", merge says ", m.partial + c * m.q_len);
        PLAN_CHECK(it.merge >= 0 && it.merge < static_cast<int32_t>(p.merges.size()) &&
                       &p.merges[it.merge] == &m,
                   "chunk ", c, " of row ", q_begin, ": merge index ", it.merge,
                   " is not its tile's merge");
        PLAN_CHECK(it.partial >= 0 && it.partial + it.q_len <= p.num_partial_rows,
                   "partial rows outside [0, ", p.num_partial_rows, ")");
        for (int32_t x = it.partial; x < it.partial + it.q_len; ++x) {
          PLAN_CHECK(partial_owner[x] == -1, "partial row ", x, " written twice");
          partial_owner[x] = q_begin;
        }
      }
    }
    // The tile's KV: exactly the span its rows can see (trimmed, but nothing visible lost).
    const int32_t local = q_begin - b.first_row(r);
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int32_t q = local; q < local + first.q_len; ++q) {
      const auto [vlo, vhi] = visible(s, b.rows_of(r), b.kv_len[r], q);
      if (vhi > vlo) {
        lo = std::min(lo, vlo);
        hi = std::max(hi, vhi);
      }
    }
    const int64_t span_lo = first.kv_begin, span_hi = chunks.back()->kv_end;
    if (lo == INT64_MAX) {
      PLAN_CHECK(span_lo == span_hi, "tile at row ", q_begin, " sees nothing but walks KV [",
                 span_lo, ", ", span_hi, ")");
    } else {
      PLAN_CHECK(span_lo == lo && span_hi == hi, "tile at row ", q_begin, ": KV [", span_lo, ", ",
                 span_hi, "), its rows see [", lo, ", ", hi, ")");
    }
  }
  PLAN_CHECK(split_tiles == static_cast<int32_t>(p.merges.size()), "merges without a tile");
  for (int64_t x = 0; x < p.num_partial_rows; ++x)
    PLAN_CHECK(partial_owner[x] != -1, "partial row ", x, " is never written");

  // Rows: each request's tiles cover its rows exactly once.
  for (int32_t r = 0; r < B; ++r) {
    auto& ranges = rows_of_request[r];
    std::sort(ranges.begin(), ranges.end());
    int32_t next = b.first_row(r);
    for (const auto& [begin, len] : ranges) {
      PLAN_CHECK(begin == next, "request ", r, ": rows from ", next, " not covered exactly once");
      next = begin + len;
    }
    PLAN_CHECK(next == b.first_row(r) + b.rows_of(r), "request ", r, ": rows from ", next,
               " not covered");
  }

  if (brute_force) {
    // count[(row, j)] over every item; every visible position exactly once.
    for (int32_t r = 0; r < B; ++r) {
      const int32_t rows = b.rows_of(r), kv = b.kv_len[r], row0 = b.first_row(r);
      std::vector<int> count(static_cast<size_t>(rows) * kv, 0);
      for (const WorkItem& it : p.items) {
        if (it.request != r) continue;
        for (int32_t q = it.q_begin - row0; q < it.q_begin - row0 + it.q_len; ++q)
          for (int32_t j = it.kv_begin; j < it.kv_end; ++j) ++count[size_t(q) * kv + j];
      }
      for (int32_t q = 0; q < rows; ++q) {
        const auto [vlo, vhi] = visible(s, rows, kv, q);
        for (int32_t j = 0; j < kv; ++j) {
          const int c = count[size_t(q) * kv + j];
          PLAN_CHECK(c <= 1, "request ", r, " row ", q, " KV ", j, " in ", c, " items");
          if (j >= vlo && j < vhi)
            PLAN_CHECK(c == 1, "request ", r, " row ", q, " KV ", j, " visible but in no item");
        }
      }
    }
  }
  return check_layout(p);
}

// ---------------------------------------------------------------------------------------------
// Random plans

struct RandomSetup {
  Batch batch;
  DeviceInfo device;
  PlanOptions options;
};

RandomSetup random_setup(Rng& rng, bool decode, int max_batch, int32_t max_q, int32_t max_kv) {
  RandomSetup r;
  r.batch = random_batch(rng, decode, max_batch, max_q, max_kv);
  static const int kHeads[][2] = {{1, 1}, {8, 8}, {32, 8}, {28, 4}, {64, 1}, {12, 3}};
  const auto& h = kHeads[rng.uniform_int(0, 5)];
  BatchShape& s = r.batch.shape;
  s.num_qo_heads = h[0];
  s.num_kv_heads = h[1];
  s.head_dim_qk = rng.uniform_int(0, 1) ? 128 : 96;
  s.head_dim_v = rng.uniform_int(0, 1) ? s.head_dim_qk : 64;
  s.page_size = std::vector<int>{1, 1, 16, 48, 64}[rng.uniform_int(0, 4)];
  s.causal = rng.uniform_int(0, 1) == 1;
  s.window_left = rng.uniform_int(0, 2) == 0 ? awkward_len(rng, max_kv) : -1;
  if (rng.uniform_int(0, 1)) {
    static const int kSms[] = {1, 7, 132, 132};
    r.device = cuda_like(kSms[rng.uniform_int(0, 3)]);
  } else {
    r.device = cpu_like(std::vector<int>{1, 2, 7, 64}[rng.uniform_int(0, 3)]);
  }
  PlanOptions& o = r.options;
  o.q_tile = rng.uniform_int(0, 2) == 0 ? awkward_len(rng, 70) : 0;
  o.enable_split_kv = rng.uniform_int(0, 4) != 0;
  // Fixed chunks of a few tokens are fine on small batches; on large ones they would only make
  // millions of items.
  if (rng.uniform_int(0, 3) == 0)
    o.fixed_split_size = max_kv <= 300 ? 1 + awkward_len(rng, 300) : rng.uniform_int(256, 4096);
  o.kv_align = rng.uniform_int(0, 2) == 0 ? awkward_len(rng, 40) : 0;
  o.blocks_per_sm = rng.uniform_int(0, 3);
  o.min_split_size = rng.uniform_int(0, 1) ? 1 + awkward_len(rng, 64) : 0;
  return r;
}

Plan plan_of(const RandomSetup& r) {
  if (r.batch.decode) return plan_decode(r.batch.shape, r.device, r.options);
  return plan_prefill(r.batch.shape, r.device, r.options);
}

TEST(Plan, RandomBatchesCoverEveryVisiblePositionOnce) {
  FLASHKV_SEEDED_RNG(rng, 41);
  // How often each situation came up, so that the generator is known to reach them all.
  int split = 0, balanced = 0, windowed = 0, empty_items = 0, empty_batches = 0;
  for (int iter = 0; iter < 600; ++iter) {
    const bool decode = iter % 2 == 0;
    const bool small = iter % 3 == 0;  // small enough to count every (row, KV position)
    RandomSetup r =
        small ? random_setup(rng, decode, 6, 40, 300) : random_setup(rng, decode, 80, 600, 9000);
    SCOPED_TRACE(::testing::Message() << "iter " << iter << (decode ? " decode" : " prefill"));
    const Plan p = plan_of(r);
    ASSERT_TRUE(check_plan(p, r.batch, r.device, r.options, small));
    split += !p.merges.empty();
    balanced += static_cast<int>(p.items.size()) > p.num_workers;
    windowed += r.batch.shape.window_left >= 0;
    empty_batches += p.items.empty();
    empty_items += std::any_of(p.items.begin(), p.items.end(),
                               [](const WorkItem& it) { return it.kv_begin == it.kv_end; });
  }
  EXPECT_GT(split, 50);
  EXPECT_GT(balanced, 100);
  EXPECT_GT(windowed, 100);
  EXPECT_GT(empty_items, 50);
  EXPECT_GT(empty_batches, 5);
}

TEST(Plan, BalanceIsCloseToIdealOnServingLikeBatches) {
  // 256 decode requests with KV lengths spread over 1..8192 on 33 workers: costliest-first
  // greedy lands within a few percent of the average load (a cost-blind order would not).
  FLASHKV_SEEDED_RNG(rng, 42);
  const DeviceInfo gpu = cuda_like(132);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int32_t> kv(256);
    for (int32_t& x : kv) x = rng.uniform_int(1, 8192);
    Batch b = make_batch(true, {}, kv);
    DecodePlan p = plan_decode(b.shape, gpu, PlanOptions{});
    ASSERT_TRUE(check_plan(p, b, gpu, PlanOptions{}));
    ASSERT_EQ(p.num_workers, 33);
    const std::vector<int64_t> load = worker_loads(p);
    const int64_t total = std::accumulate(load.begin(), load.end(), int64_t{0});
    const int64_t makespan = *std::max_element(load.begin(), load.end());
    EXPECT_LE(makespan, 1.04 * total / p.num_workers) << "trial " << trial;
  }
}

TEST(Plan, RowsThatSeeNothingStillGetAnItem) {
  // Causal rows before the first KV entry (q_len > kv_len), a zero window on KV 0, and an
  // empty request: each row keeps an item (with an empty KV range) so that it is written.
  Batch b = make_batch(/*decode=*/false, {8, 3, 4}, {3, 0, 9});
  b.shape.causal = true;
  PlanOptions o;
  o.q_tile = 4;
  const DeviceInfo dev = cuda_like();
  PrefillPlan p = plan_prefill(b.shape, dev, o);
  ASSERT_TRUE(check_plan(p, b, dev, o, /*brute_force=*/true));
  std::map<int32_t, std::pair<int32_t, int32_t>> kv_of_tile;
  for (const WorkItem& it : p.items) kv_of_tile[it.q_begin] = {it.kv_begin, it.kv_end};
  ASSERT_EQ(kv_of_tile.size(), 4u);                      // rows 0-3, 4-7 | 8-10 | 11-14
  EXPECT_EQ(kv_of_tile[0].first, kv_of_tile[0].second);  // positions -5..-2: nothing visible
  EXPECT_EQ(kv_of_tile[4], std::make_pair(0, 3));        // positions -1..2
  EXPECT_EQ(kv_of_tile[8], std::make_pair(0, 0));        // request without KV
  EXPECT_EQ(kv_of_tile[11], std::make_pair(0, 9));       // positions 5..8 of 9

  Batch d = make_batch(/*decode=*/true, {}, {0, 5, 0});
  DecodePlan dp = plan_decode(d.shape, dev, PlanOptions{});
  ASSERT_TRUE(check_plan(dp, d, dev, PlanOptions{}, true));
  EXPECT_EQ(dp.items.size(), 3u);
}

TEST(Plan, CausalAndWindowTrimming) {
  const DeviceInfo dev = cuda_like();
  PlanOptions o;
  o.q_tile = 4;
  o.enable_split_kv = false;
  auto tiles = [&](const Batch& b) {
    PrefillPlan p = plan_prefill(b.shape, dev, o);
    EXPECT_TRUE(check_plan(p, b, dev, o, /*brute_force=*/true));
    std::map<int32_t, std::pair<int32_t, int32_t>> kv;
    for (const WorkItem& it : p.items) kv[it.q_begin] = {it.kv_begin, it.kv_end};
    return kv;
  };
  using Range = std::map<int32_t, std::pair<int32_t, int32_t>>;
  // 10 rows at positions 90..99 of 100 KV entries.
  Batch b = make_batch(false, {10}, {100});
  b.shape.causal = true;
  EXPECT_EQ(tiles(b), (Range{{0, {0, 94}}, {4, {0, 98}}, {8, {0, 100}}}));
  b.shape.window_left = 5;  // row at position p sees [p - 5, p]
  EXPECT_EQ(tiles(b), (Range{{0, {85, 94}}, {4, {89, 98}}, {8, {93, 100}}}));
  b.shape.causal = false;  // the window alone trims only the front
  EXPECT_EQ(tiles(b), (Range{{0, {85, 100}}, {4, {89, 100}}, {8, {93, 100}}}));
  b.shape.window_left = 0;
  b.shape.causal = true;  // each row sees itself only
  EXPECT_EQ(tiles(b), (Range{{0, {90, 94}}, {4, {94, 98}}, {8, {98, 100}}}));
  b.shape.window_left = 1000;  // a window longer than the KV trims nothing
  EXPECT_EQ(tiles(b), (Range{{0, {0, 94}}, {4, {0, 98}}, {8, {0, 100}}}));

  // Decode: the row is the last position; only the window trims.
  Batch d = make_batch(true, {}, {100, 7, 0});
  d.shape.causal = true;
  d.shape.window_left = 10;
  DecodePlan dp = plan_decode(d.shape, dev, o);
  ASSERT_TRUE(check_plan(dp, d, dev, o, true));
  std::map<int32_t, std::pair<int32_t, int32_t>> kv;
  for (const WorkItem& it : dp.items) kv[it.request] = {it.kv_begin, it.kv_end};
  EXPECT_EQ(kv, (Range{{0, {89, 100}}, {1, {0, 7}}, {2, {0, 0}}}));
}

// ---------------------------------------------------------------------------------------------
// Split-KV

TEST(Plan, SplitKvForSmallBatchesWithLongKvOnly) {
  const DeviceInfo gpu = cuda_like(132);
  const int workers = 132 * 2 / 8;  // Hkv = 8
  for (int n : {1, 2, 4}) {
    Batch b = make_batch(true, {}, std::vector<int32_t>(n, 32768));
    DecodePlan p = plan_decode(b.shape, gpu, PlanOptions{});
    ASSERT_TRUE(check_plan(p, b, gpu, PlanOptions{}));
    EXPECT_EQ(static_cast<int>(p.merges.size()), n) << n << " requests";
    EXPECT_GT(p.kv_chunk, 0);
    EXPECT_GE(static_cast<int>(p.items.size()), workers - n) << "the GPU is not filled";
    EXPECT_EQ(p.num_workers, std::min<int>(workers, static_cast<int>(p.items.size())));
  }
  // A large batch of ordinary lengths fills the GPU by itself.
  Rng rng(7);
  std::vector<int32_t> kv(512);
  for (int32_t& x : kv) x = rng.uniform_int(1000, 4000);
  Batch large = make_batch(true, {}, kv);
  DecodePlan p = plan_decode(large.shape, gpu, PlanOptions{});
  ASSERT_TRUE(check_plan(p, large, gpu, PlanOptions{}));
  EXPECT_TRUE(p.merges.empty());
  EXPECT_EQ(p.kv_chunk, 0);
  EXPECT_EQ(p.items.size(), 512u);
  // ... but one huge request among them is cut into about one worker's share.
  kv[100] = 1 << 20;
  Batch skewed = make_batch(true, {}, kv);
  p = plan_decode(skewed.shape, gpu, PlanOptions{});
  ASSERT_TRUE(check_plan(p, skewed, gpu, PlanOptions{}));
  ASSERT_EQ(p.merges.size(), 1u);
  EXPECT_EQ(p.merges[0].q_begin, 100);
  // Split disabled: never.
  PlanOptions off;
  off.enable_split_kv = false;
  Batch one = make_batch(true, {}, {32768});
  p = plan_decode(one.shape, gpu, off);
  ASSERT_TRUE(check_plan(p, one, gpu, off));
  EXPECT_EQ(p.items.size(), 1u);
  EXPECT_TRUE(p.merges.empty());

  // Prefill: a short extend over a long prefix splits; a big extend does not.
  Batch small_prefill = make_batch(false, {64}, {32768 + 64});
  small_prefill.shape.causal = true;
  PrefillPlan pp = plan_prefill(small_prefill.shape, gpu, PlanOptions{});
  ASSERT_TRUE(check_plan(pp, small_prefill, gpu, PlanOptions{}));
  EXPECT_FALSE(pp.merges.empty());
  Batch big_prefill =
      make_batch(false, std::vector<int32_t>(64, 512), std::vector<int32_t>(64, 4096));
  big_prefill.shape.causal = true;
  pp = plan_prefill(big_prefill.shape, gpu, PlanOptions{});
  ASSERT_TRUE(check_plan(pp, big_prefill, gpu, PlanOptions{}));
  EXPECT_TRUE(pp.merges.empty());
}

TEST(Plan, ChunksAreAlignedToPagesAndKvTile) {
  // Equal parts (the CPU here) have a kv_chunk of whole alignment units; equal runs (decode on
  // CUDA) cut at multiples of the alignment too (check_plan checks every cut).
  for (const DeviceInfo& dev : {cpu_like(64), cuda_like(132)}) {
    for (int page : {1, 16, 48, 64}) {
      for (int kv_align : {0, 32, 100}) {
        SCOPED_TRACE(testing::Message()
                     << dev.device.str() << " page " << page << " kv_align " << kv_align);
        Batch b = make_batch(true, {}, {100003, 77777});
        b.shape.page_size = page;
        PlanOptions o;
        o.kv_align = kv_align;
        const int64_t unit = (kv_align > 0 ? kv_align : 16);
        const int64_t align = (unit + page - 1) / page * page;
        DecodePlan p = plan_decode(b.shape, dev, o);
        ASSERT_TRUE(check_plan(p, b, dev, o));
        ASSERT_GT(p.kv_chunk, 0);
        if (!p.equal_runs) {
          EXPECT_EQ(p.kv_chunk % align, 0);
          EXPECT_GE(p.kv_chunk, 256);  // the default min_split_size
        }
        o.fixed_split_size = 1000;  // rounded up to the alignment too
        p = plan_decode(b.shape, dev, o);
        ASSERT_TRUE(check_plan(p, b, dev, o));
        EXPECT_FALSE(p.equal_runs);
        EXPECT_EQ(p.kv_chunk, (1000 + align - 1) / align * align);
      }
    }
  }
}

TEST(Plan, AutomaticChunksOfATileDifferByAtMostOneUnit) {
  // Equal parts, not multiples of the share: no short tail chunks (4096 at a share of ~2000 was
  // 2000 + 2000 + 96, and the tails piled up on one worker). Plans in equal runs (decode on
  // CUDA where they run faster) cut where the runs end instead; see
  // EqualRunsWhereWorkersWouldStreamAlone.
  FLASHKV_SEEDED_RNG(rng, 45);
  for (int trial = 0; trial < 300; ++trial) {
    const int sms = std::vector<int>{1, 7, 66, 132}[rng.uniform_int(0, 3)];
    // The same worker counts on both (8 KV heads; 2 CTAs an SM).
    const DeviceInfo gpu = rng.uniform_int(0, 1) ? cuda_like(sms) : cpu_like(2 * sms);
    const int batch = rng.uniform_int(1, 40);
    std::vector<int32_t> kv(batch);
    for (int32_t& x : kv)
      x = rng.uniform_int(0, 3) == 0 ? rng.uniform_int(0, 300) : rng.uniform_int(1, 70000);
    Batch b = make_batch(true, {}, kv);
    b.shape.page_size = std::vector<int>{1, 1, 16, 48}[rng.uniform_int(0, 3)];
    PlanOptions o;
    o.kv_align = rng.uniform_int(0, 1) ? 0 : rng.uniform_int(1, 100);
    o.min_split_size = rng.uniform_int(0, 1) ? 0 : rng.uniform_int(1, 600);
    const int64_t unit = (int64_t{o.kv_align > 0 ? o.kv_align : 16} + b.shape.page_size - 1) /
                         b.shape.page_size * b.shape.page_size;
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " sms " << sms << " unit " << unit);
    const DecodePlan p = plan_decode(b.shape, gpu, o);
    ASSERT_TRUE(check_plan(p, b, gpu, o));
    if (p.equal_runs) continue;
    std::map<int32_t, std::pair<int32_t, int32_t>> shortest_longest;  // by request
    for (const WorkItem& it : p.items) {
      if (it.partial < 0) continue;
      auto [entry, fresh] =
          shortest_longest.emplace(it.request, std::make_pair(INT32_MAX, INT32_MIN));
      entry->second.first = std::min(entry->second.first, it.kv_end - it.kv_begin);
      entry->second.second = std::max(entry->second.second, it.kv_end - it.kv_begin);
    }
    for (const auto& [request, range] : shortest_longest)
      EXPECT_LE(range.second - range.first, unit)
          << "request " << request << " of " << kv[request] << " tokens";
  }
  // The shapes on an H200 (132 SMs, 32/8 heads: 33 workers a KV head).
  const DeviceInfo h200 = cuda_like(132);
  auto chunk_lengths = [&](int batch, int32_t len) {
    Batch b = make_batch(true, {}, std::vector<int32_t>(batch, len));
    const DecodePlan p = plan_decode(b.shape, h200, PlanOptions{});
    EXPECT_TRUE(check_plan(p, b, h200, PlanOptions{}));
    std::map<int32_t, int> count;
    for (const WorkItem& it : p.items) ++count[it.kv_end - it.kv_begin];
    return count;
  };
  // 1 x 32768: 33 parts of 62 or 63 units, one a worker.
  EXPECT_EQ(chunk_lengths(1, 32768), (std::map<int32_t, int>{{992, 31}, {1008, 2}}));
  // Short tiles take shorter parts (the in-kernel merge folds 8 a batch of loads).
  EXPECT_EQ(chunk_lengths(1, 1024), (std::map<int32_t, int>{{64, 16}}));
  EXPECT_EQ(chunk_lengths(1, 4096), (std::map<int32_t, int>{{128, 32}}));
  // 16 x 4096 on the CPU's equal parts: one wave of halves, rather than two waves of thirds.
  Batch b = make_batch(true, {}, std::vector<int32_t>(16, 4096));
  const DecodePlan p = plan_decode(b.shape, cpu_like(264), PlanOptions{});
  ASSERT_TRUE(check_plan(p, b, cpu_like(264), PlanOptions{}));
  for (const WorkItem& it : p.items) EXPECT_EQ(it.kv_end - it.kv_begin, 2048);
  EXPECT_EQ(p.items.size(), 32u);
}

// A CUDA prefill's grid fills whole waves: at 132 SMs (264 slots at two a SM), 32 KV heads take 33
// workers a head (1056 CTAs, 8 waves of one CTA an SM) where 8 a head would leave 8 SMs idle
// through the second wave. Decode, graph mode, an explicit blocks_per_sm and the CPU keep
// slots / Hkv; where whole waves would take more than 8, so does the prefill.
TEST(Plan, CudaPrefillWorkersFillWholeWaves) {
  const DeviceInfo gpu = cuda_like(132);
  auto workers = [&](int hkv, bool decode, PlanOptions o = {}, const DeviceInfo* dev = nullptr) {
    // Enough rows that no head runs out of items: 64 requests of 2048 tokens, q_tile 16.
    Batch b = make_batch(decode, std::vector<int32_t>(64, decode ? 1 : 2048),
                         std::vector<int32_t>(64, 2048), hkv, hkv, 128);
    o.q_tile = decode ? 0 : 16;
    o.enable_split_kv = false;
    if (o.cuda_graph) {
      o.max_batch_size = 64;
      o.max_num_tokens = 64 * 2048;
    }
    const DeviceInfo& d = dev ? *dev : gpu;
    if (decode) {
      const DecodePlan p = plan_decode(b.shape, d, o);
      EXPECT_TRUE(check_plan(p, b, d, o));
      return p.num_workers;
    }
    const PrefillPlan p = plan_prefill(b.shape, d, o);
    EXPECT_TRUE(check_plan(p, b, d, o));
    return p.num_workers;
  };
  EXPECT_EQ(workers(32, false), 33);  // 1056 CTAs: 8 waves
  EXPECT_EQ(workers(16, false), 33);  // 528: 4 waves
  EXPECT_EQ(workers(8, false), 33);   // 264: 2 waves, as slots / Hkv
  EXPECT_EQ(workers(12, false), 22);  // 264
  EXPECT_EQ(workers(64, false), 4);   // whole waves would take 16: 256 CTAs
  EXPECT_EQ(workers(32, true), 8);
  PlanOptions two;
  two.blocks_per_sm = 2;
  EXPECT_EQ(workers(32, false, two), 8);
  PlanOptions graph;
  graph.cuda_graph = true;
  EXPECT_EQ(workers(32, false, graph), 8);
  const DeviceInfo a100 = cuda_like(108);  // 216 slots: 27 a head at 32 heads, 864 CTAs
  EXPECT_EQ(workers(32, false, {}, &a100), 27);
  const DeviceInfo cpu = cpu_like(64);
  EXPECT_EQ(workers(32, false, {}, &cpu), 2);
  // The KV split is still sized on one wave's count: a 1 x 2048 prefill at 32 KV heads keeps its
  // 16 tiles a head whole (33 workers would split them), one a worker.
  Batch one = make_batch(false, {2048}, {2048}, 32, 32, 128);
  const PrefillPlan p = plan_prefill(one.shape, gpu, PlanOptions{});
  ASSERT_TRUE(check_plan(p, one, gpu, PlanOptions{}));
  EXPECT_EQ(p.num_workers, 16);
  EXPECT_TRUE(p.merges.empty());
}

// Decode on CUDA: where whole tiles or equal parts leave a few workers streaming alone at the
// end, the tiles are laid out in equal runs, one a worker, and the workers end together. Where
// the device's bandwidth is shared by enough workers either way, or the plans differ by a few
// percent, the plan stays as it was (plan.cpp, fluid_time: equal runs cost items and merges).
TEST(Plan, EqualRunsWhereWorkersWouldStreamAlone) {
  const DeviceInfo h200 = cuda_like(132);  // 33 workers a KV head at Hkv = 8
  const DeviceInfo cpu = cpu_like(264);    // as many workers, always equal parts
  struct Shape {
    int batch;
    int32_t len;
    bool runs;         // laid out in equal runs
    double old_ratio;  // the makespan of equal parts / costliest first, over the average
  };
  for (const Shape& sh :
       {Shape{40, 4096, true, 1.65}, Shape{48, 4096, true, 1.375}, Shape{100, 4096, true, 1.32},
        Shape{24, 4096, false, 1.375}, Shape{16, 4096, false, 1.035}, Shape{64, 4096, false, 1.031},
        Shape{256, 2048, false, 1.031}, Shape{8, 65536, false, 1.032}, Shape{33, 4096, false, 1.0},
        Shape{1, 32768, false, 1.031}}) {
    SCOPED_TRACE(testing::Message() << sh.batch << " x " << sh.len);
    Batch b = make_batch(true, {}, std::vector<int32_t>(sh.batch, sh.len));
    const DecodePlan p = plan_decode(b.shape, h200, PlanOptions{});
    ASSERT_TRUE(check_plan(p, b, h200, PlanOptions{}));
    EXPECT_EQ(p.equal_runs, sh.runs);
    const DecodePlan q = plan_decode(b.shape, cpu, PlanOptions{});
    ASSERT_TRUE(check_plan(q, b, cpu, PlanOptions{}));
    auto makespan = [](const Plan& x) {
      const std::vector<int64_t> load = worker_loads(x);
      return *std::max_element(load.begin(), load.end());
    };
    const double average = int64_t{sh.batch} * (sh.len + 16) / 33.0;
    EXPECT_NEAR(makespan(q) / average, sh.old_ratio, 0.01);
    if (sh.runs) {
      EXPECT_EQ(p.num_workers, 33);
      EXPECT_LE(makespan(p), average + 3 * 16);  // the cuts' overheads, an alignment unit
      EXPECT_LT(static_cast<int>(p.merges.size()), 33);
    } else {
      EXPECT_EQ(makespan(p), makespan(q));
    }
  }
  // Graph mode: the same runs on the fixed grid.
  PlanOptions graph;
  graph.cuda_graph = true;
  graph.max_batch_size = 64;
  Batch b = make_batch(true, {}, std::vector<int32_t>(40, 4096));
  const DecodePlan p = plan_decode(b.shape, h200, graph);
  ASSERT_TRUE(check_plan(p, b, h200, graph));
  EXPECT_TRUE(p.equal_runs);
}

// ---------------------------------------------------------------------------------------------
// Deterministic mode

// The probe request's items, relative to its own rows, in (row, chunk) order.
std::vector<WorkItem> items_of(const Plan& p, int32_t request, int32_t first_row) {
  std::vector<WorkItem> out;
  for (WorkItem it : p.items) {
    if (it.request != request) continue;
    it.request = 0;
    it.q_begin -= first_row;
    it.partial = it.partial < 0 ? -1 : 0;  // where partials go depends on the batch
    it.merge = 0;                          // and so does the merge's place in the list
    out.push_back(it);
  }
  std::sort(out.begin(), out.end(), [](const WorkItem& a, const WorkItem& b) {
    return std::make_pair(a.q_begin, a.chunk) < std::make_pair(b.q_begin, b.chunk);
  });
  return out;
}

bool same_items(const std::vector<WorkItem>& a, const std::vector<WorkItem>& b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](const WorkItem& x, const WorkItem& y) {
           return std::memcmp(&x, &y, sizeof(WorkItem)) == 0;
         });
}

TEST(Plan, DeterministicChunksDoNotDependOnTheBatch) {
  FLASHKV_SEEDED_RNG(rng, 43);
  struct Probe {
    int32_t q, kv;
  };
  const std::vector<Probe> decode_probes = {{1, 0},    {1, 1},    {1, 2047},
                                            {1, 2048}, {1, 2049}, {1, 30001}};
  const std::vector<Probe> prefill_probes = {
      {1, 5000}, {200, 4096}, {333, 9000}, {64, 64}, {0, 100}};
  int batches = 0;
  for (const bool decode : {true, false}) {
    for (const DeviceInfo& dev : {cuda_like(132), cuda_like(7), cpu_like(64)}) {
      PlanOptions o;
      o.fixed_split_size = decode ? 2048 : 4096;
      for (const Probe& probe : decode ? decode_probes : prefill_probes) {
        Batch alone = make_batch(decode, {probe.q}, {probe.kv});
        alone.shape.causal = !decode;
        const Plan ref = decode ? Plan(plan_decode(alone.shape, dev, o))
                                : Plan(plan_prefill(alone.shape, dev, o));
        const std::vector<WorkItem> expected = items_of(ref, 0, 0);
        for (int trial = 0; trial < 110; ++trial, ++batches) {
          Batch b = random_batch(rng, decode, 48, 300, 12000);
          const int at = rng.uniform_int(0, static_cast<int>(b.kv_len.size()));
          b.kv_len.insert(b.kv_len.begin() + at, probe.kv);
          b.q_len.insert(b.q_len.begin() + at, decode ? 1 : probe.q);
          b.shape.causal = !decode;
          b.bind();
          const Plan p =
              decode ? Plan(plan_decode(b.shape, dev, o)) : Plan(plan_prefill(b.shape, dev, o));
          ASSERT_EQ(p.kv_chunk, ref.kv_chunk);
          ASSERT_TRUE(same_items(items_of(p, at, b.first_row(at)), expected))
              << "probe q " << probe.q << " kv " << probe.kv << " at " << at << " of "
              << b.kv_len.size() << " on " << dev.device.str();
          if (trial % 10 == 0) ASSERT_TRUE(check_plan(p, b, dev, o));
        }
      }
    }
  }
  EXPECT_GT(batches, 2000);

  // Splitting disabled in deterministic mode: nothing is cut.
  PlanOptions off;
  off.fixed_split_size = 2048;
  off.enable_split_kv = false;
  Batch b = make_batch(true, {}, {100000, 3});
  DecodePlan p = plan_decode(b.shape, cuda_like(), off);
  ASSERT_TRUE(check_plan(p, b, cuda_like(), off));
  EXPECT_EQ(p.kv_chunk, 0);
  EXPECT_TRUE(p.merges.empty());
}

// ---------------------------------------------------------------------------------------------
// CUDA-graph mode

void expect_same_layout(const Plan& a, const Plan& b) {
  EXPECT_EQ(a.num_workers, b.num_workers);
  EXPECT_EQ(a.worker_indptr.size(), b.worker_indptr.size());
  const WorkspaceLayout &x = a.layout, &y = b.layout;
  EXPECT_EQ(x.header, y.header);
  EXPECT_EQ(x.items, y.items);
  EXPECT_EQ(x.worker_indptr, y.worker_indptr);
  EXPECT_EQ(x.merges, y.merges);
  EXPECT_EQ(x.merge_counters, y.merge_counters);
  EXPECT_EQ(x.partial_o, y.partial_o);
  EXPECT_EQ(x.partial_lse, y.partial_lse);
  EXPECT_EQ(x.plan_bytes, y.plan_bytes);
  EXPECT_EQ(x.total_bytes, y.total_bytes);
  EXPECT_EQ(x.max_items, y.max_items);
  EXPECT_EQ(x.max_merges, y.max_merges);
  EXPECT_EQ(x.max_partial_rows, y.max_partial_rows);
}

TEST(Plan, GraphModeGivesOneLayoutForEveryBatchThatFits) {
  FLASHKV_SEEDED_RNG(rng, 44);
  const DeviceInfo gpu = cuda_like(132);
  for (const bool decode : {true, false}) {
    for (int mode = 0; mode < 3; ++mode) {  // automatic split, fixed split, no split
      PlanOptions o;
      o.cuda_graph = true;
      o.max_batch_size = 48;
      o.max_num_tokens = 700;
      o.max_kv_len = 20000;
      o.enable_split_kv = mode != 2;
      o.fixed_split_size = mode == 1 ? 2048 : 0;
      SCOPED_TRACE(::testing::Message() << (decode ? "decode" : "prefill") << " mode " << mode);
      Batch empty = make_batch(decode, {}, {});
      const Plan ref =
          decode ? Plan(plan_decode(empty.shape, gpu, o)) : Plan(plan_prefill(empty.shape, gpu, o));
      EXPECT_EQ(ref.num_workers, 132 * 2 / 8);
      for (int trial = 0; trial < 300; ++trial) {
        // Up to the capacities, with full batches now and then.
        Batch b = random_batch(rng, decode, o.max_batch_size, 60, o.max_kv_len);
        if (trial % 7 == 0) {
          std::vector<int32_t> q(o.max_batch_size), kv(o.max_batch_size);
          for (int i = 0; i < o.max_batch_size; ++i) {
            q[i] = decode ? 1 : (i == 0 ? o.max_num_tokens - (o.max_batch_size - 1) : 1);
            kv[i] = rng.uniform_int(0, 1) ? o.max_kv_len : awkward_len(rng, o.max_kv_len);
          }
          b = make_batch(decode, q, kv);
        }
        for (int32_t& kv : b.kv_len) kv = std::min(kv, o.max_kv_len);
        int32_t tokens = 0;
        for (int32_t& q : b.q_len) {
          if (!decode) q = std::min(q, o.max_num_tokens - tokens);
          tokens += q;
        }
        b.shape.causal = !decode && rng.uniform_int(0, 1);
        b.bind();
        const Plan p =
            decode ? Plan(plan_decode(b.shape, gpu, o)) : Plan(plan_prefill(b.shape, gpu, o));
        ASSERT_TRUE(check_plan(p, b, gpu, o));
        expect_same_layout(p, ref);
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Worker counts, reuse, serialization

TEST(Plan, WorkerCountsFollowTheDevice) {
  Batch b = make_batch(true, {}, std::vector<int32_t>(5, 60));
  b.shape.num_qo_heads = 32;
  b.shape.num_kv_heads = 8;
  PlanOptions o;
  // CPU: threads / Hkv workers, so that workers x Hkv tasks fill the threads.
  EXPECT_EQ(plan_decode(b.shape, cpu_like(64), o).num_workers, 8);
  EXPECT_EQ(plan_decode(b.shape, cpu_like(4), o).num_workers, 1);
  // CUDA: never more than there are items, nor than SMs x blocks per SM / Hkv.
  EXPECT_EQ(plan_decode(b.shape, cuda_like(132), o).num_workers, 5);
  Batch big = make_batch(true, {}, std::vector<int32_t>(500, 100));
  EXPECT_EQ(plan_decode(big.shape, cuda_like(132), o).num_workers, 33);
  o.blocks_per_sm = 3;
  EXPECT_EQ(plan_decode(big.shape, cuda_like(132), o).num_workers, 49);
  Batch none = make_batch(true, {}, {});
  EXPECT_EQ(plan_decode(none.shape, cuda_like(132), o).num_workers, 1);
  EXPECT_TRUE(plan_decode(none.shape, cuda_like(132), o).items.empty());
}

TEST(Plan, ReuseFormMatchesAFreshPlan) {
  FLASHKV_SEEDED_RNG(rng, 45);
  PrefillPlan reused;
  uint64_t last_id = 0;
  for (int iter = 0; iter < 50; ++iter) {
    RandomSetup r = random_setup(rng, /*decode=*/false, 40, 300, 5000);
    const Plan fresh = plan_of(r);
    plan_prefill(r.batch.shape, r.device, r.options, &reused);
    ASSERT_NE(reused.id, fresh.id);
    ASSERT_GT(reused.id, last_id);
    last_id = reused.id;
    ASSERT_TRUE(same_items(reused.items, fresh.items));
    ASSERT_EQ(reused.worker_indptr, fresh.worker_indptr);
    ASSERT_EQ(reused.merges.size(), fresh.merges.size());
    ASSERT_EQ(0, reused.merges.empty() ? 0
                                       : std::memcmp(reused.merges.data(), fresh.merges.data(),
                                                     fresh.merges.size() * sizeof(MergeItem)));
    expect_same_layout(reused, fresh);
    ASSERT_TRUE(check_plan(reused, r.batch, r.device, r.options));
  }
  // A failed planning call leaves the plan unusable rather than stale.
  Batch bad = make_batch(false, {3}, {-1});
  EXPECT_THROW(plan_prefill(bad.shape, cuda_like(), PlanOptions{}, &reused), Error);
  EXPECT_EQ(reused.id, 0u);
}

TEST(Plan, SerializeWritesHeaderItemsAndZeroPaddedMerges) {
  PlanOptions o;
  o.cuda_graph = true;
  o.max_batch_size = 16;
  o.fixed_split_size = 256;
  o.max_kv_len = 4000;
  Batch b = make_batch(true, {}, {3000, 10, 600});
  const DeviceInfo gpu = cuda_like(132);
  DecodePlan p = plan_decode(b.shape, gpu, o);
  ASSERT_TRUE(check_plan(p, b, gpu, o));
  ASSERT_EQ(p.merges.size(), 2u);
  ASSERT_GT(p.layout.max_merges, 2);
  std::vector<unsigned char> buf(p.layout.plan_bytes, 0xcd);
  serialize_plan(p, buf.data());
  PlanHeader h;
  std::memcpy(&h, buf.data() + p.layout.header, sizeof(h));
  EXPECT_EQ(h.magic, kPlanMagic);
  EXPECT_EQ(h.version, kPlanFormatVersion);
  EXPECT_EQ(h.num_items, static_cast<int32_t>(p.items.size()));
  EXPECT_EQ(h.num_merges, 2);
  EXPECT_EQ(h.num_workers, p.num_workers);
  EXPECT_EQ(h.num_partial_rows, p.num_partial_rows);
  EXPECT_EQ(h.batch_size, 3);
  EXPECT_EQ(0, std::memcmp(buf.data() + p.layout.items, p.items.data(),
                           p.items.size() * sizeof(WorkItem)));
  EXPECT_EQ(0, std::memcmp(buf.data() + p.layout.worker_indptr, p.worker_indptr.data(),
                           p.worker_indptr.size() * sizeof(int32_t)));
  EXPECT_EQ(0, std::memcmp(buf.data() + p.layout.merges, p.merges.data(), 2 * sizeof(MergeItem)));
  for (int64_t m = 2; m < p.layout.max_merges; ++m) {
    MergeItem pad;
    std::memcpy(&pad, buf.data() + p.layout.merges + m * sizeof(MergeItem), sizeof(pad));
    ASSERT_EQ(pad.q_len, 0) << "merge slot " << m;
    ASSERT_EQ(pad.num_chunks, 0) << "merge slot " << m;
  }
  // The merge counters start at zero in every upload (the buffer was filled with 0xcd).
  for (size_t x = p.layout.merge_counters; x < p.layout.plan_bytes; ++x)
    ASSERT_EQ(buf[x], 0) << "counter byte " << x - p.layout.merge_counters;
  EXPECT_THROW(serialize_plan(Plan{}, buf.data()), Error);
}

// ---------------------------------------------------------------------------------------------
// Bad input

void expect_error(const std::function<void()>& fn, const std::string& argument) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << argument;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(argument), std::string::npos)
        << "message '" << e.what() << "' does not name " << argument;
  }
}

TEST(Plan, BadInputNamesTheArgument) {
  const DeviceInfo gpu = cuda_like();
  Batch good = make_batch(false, {3, 5}, {10, 20});
  auto prefill = [&](const std::function<void(Batch&, PlanOptions&, DeviceInfo&)>& change,
                     const std::string& argument) {
    Batch b = good;
    b.bind();
    PlanOptions o;
    DeviceInfo d = gpu;
    change(b, o, d);
    SCOPED_TRACE(argument);
    expect_error([&] { plan_prefill(b.shape, d, o); }, argument);
  };
  auto decode = [&](const std::function<void(Batch&, PlanOptions&, DeviceInfo&)>& change,
                    const std::string& argument) {
    Batch b = make_batch(true, {}, {10, 20});
    PlanOptions o;
    DeviceInfo d = gpu;
    change(b, o, d);
    SCOPED_TRACE(argument);
    expect_error([&] { plan_decode(b.shape, d, o); }, argument);
  };
  using B = Batch&;
  using O = PlanOptions&;
  using D = DeviceInfo&;
  prefill([](B b, O, D) { b.shape.batch_size = -1; }, "batch_size");
  prefill([](B b, O, D) { b.shape.num_qo_heads = 0; }, "num_qo_heads");
  prefill([](B b, O, D) { b.shape.num_kv_heads = 0; }, "num_kv_heads");
  prefill([](B b, O, D) { b.shape.num_kv_heads = -2; }, "num_kv_heads");
  prefill([](B b, O, D) { b.shape.num_qo_heads = 12; }, "num_qo_heads");  // Hkv = 8
  prefill([](B b, O, D) { b.shape.head_dim_qk = 0; }, "head_dim_qk");
  prefill([](B b, O, D) { b.shape.head_dim_v = -64; }, "head_dim_v");
  prefill([](B b, O, D) { b.shape.page_size = 0; }, "page_size");
  prefill([](B b, O, D) { b.shape.kv_len = nullptr; }, "kv_len");
  prefill([](B b, O, D) { b.kv_len[1] = -1; }, "kv_len");
  prefill([](B b, O, D) { b.shape.qo_indptr = nullptr; }, "qo_indptr");
  prefill([](B b, O, D) { b.qo_indptr[1] = 9; }, "qo_indptr");  // 9 > qo_indptr[2] = 8
  prefill([](B b, O, D) { b.qo_indptr[0] = -1; }, "qo_indptr");
  prefill([](B, O o, D) { o.q_tile = -1; }, "q_tile");
  prefill([](B, O o, D) { o.fixed_split_size = -1; }, "fixed_split_size");
  prefill([](B, O o, D) { o.kv_align = -16; }, "kv_align");
  prefill([](B, O o, D) { o.blocks_per_sm = -1; }, "blocks_per_sm");
  prefill([](B, O o, D) { o.min_split_size = -1; }, "min_split_size");
  prefill([](B, O, D d) { d.num_sms = 0; }, "num_sms");
  prefill(
      [](B b, O, D d) {
        d = cpu_like(1 << 22);
        b.shape.num_qo_heads = b.shape.num_kv_heads = 1;
      },
      "num_threads");
  // Graph mode: graph(change) sets capacities the good batch fits exactly, then `change`.
  auto graph = [](const std::function<void(O)>& change) {
    return [change](B, O o, D) {
      o.cuda_graph = true;
      o.max_batch_size = 2;
      o.max_num_tokens = 8;
      change(o);
    };
  };
  prefill(graph([](O o) { o.max_batch_size = 0; }), "max_batch_size");
  prefill(graph([](O o) { o.max_batch_size = 1; }), "max_batch_size");
  prefill(graph([](O o) { o.max_num_tokens = 0; }), "max_num_tokens");
  prefill(graph([](O o) { o.max_num_tokens = 7; }), "max_num_tokens");
  prefill(graph([](O o) { o.fixed_split_size = 64; }), "max_kv_len");
  prefill(
      [&](B b, O o, D d) {
        graph([](O o) { o.fixed_split_size = 64; })(b, o, d);
        b.kv_len[0] = b.kv_len[1] = 0;  // no request past the capacity: the capacity is missing
      },
      "max_kv_len");
  prefill(graph([](O o) { o.fixed_split_size = 64, o.max_kv_len = 19; }), "max_kv_len");
  decode([](B b, O, D) { b.shape.kv_len = nullptr; }, "kv_len");
  decode([](B b, O, D) { b.kv_len[0] = -5; }, "kv_len");
  decode(graph([](O o) { o.max_batch_size = 1; }), "max_batch_size");
  decode(graph([](O o) { o.fixed_split_size = 16, o.max_kv_len = 10; }), "max_kv_len");
  // Chunks so small that the partial rows leave the int32 range of the plan (checked before
  // anything is allocated).
  Batch huge = make_batch(false, {64, 64}, {INT32_MAX, INT32_MAX});
  PlanOptions tiny;
  tiny.fixed_split_size = 16;
  expect_error([&] { plan_prefill(huge.shape, gpu, tiny); }, "fixed_split_size");

  // The good batch itself plans, with the graph capacities above.
  Batch b = good;
  b.bind();
  PlanOptions o;
  DeviceInfo d = gpu;
  graph([](O o) { o.fixed_split_size = 64, o.max_kv_len = 20; })(b, o, d);
  EXPECT_NO_THROW(plan_prefill(b.shape, d, o));
}

}  // namespace
}  // namespace flashkv
