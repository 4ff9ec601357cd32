// The planner. Why it works the way it does:
// - Tiles: each request's query rows cut into q_tile-row tiles (decode: one row). A tile's KV
//   range is trimmed to what its rows can see (causal: up to the last row's position; window:
//   from the first row's window start), so no worker walks fully masked KV.
// - Split-KV: when there are fewer tiles than workers, long KV ranges are cut into chunks so
//   every worker gets work; the chunk is the smallest (aligned) size that keeps the number of
//   items within one wave of workers, and never below min_split_size, since every extra chunk
//   costs a partial state and a merge. Chunk boundaries are absolute multiples of the chunk
//   size, so in deterministic mode (a fixed chunk) a request's chunks, and its result, do not
//   depend on the rest of the batch.
// - Balance: items go to workers longest first, each to the least-loaded worker (LPT greedy).
// - Graph mode: the worker count and the workspace layout come from the capacities only, so a
//   graph captured once replays with any batch that fits.
#include "flashkv/plan/plan.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <numeric>
#include <queue>

#include "flashkv/core/error.h"

namespace flashkv {
namespace {

std::atomic<uint64_t> g_next_plan_id{1};
constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Tile {
  int32_t request, q_begin, q_len, kv_begin, kv_end;
};

// Per-thread scratch, so steady-state planning allocates nothing.
struct Scratch {
  std::vector<Tile> tiles;
  std::vector<int64_t> cost;
  std::vector<int32_t> order, owner, count;
  std::vector<WorkItem> items;
};
Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

void validate(const BatchShape& b, const PlanOptions& o, const DeviceInfo& dev, bool decode) {
  FLASHKV_CHECK(b.batch_size >= 0, "batch_size: expected >= 0, got ", b.batch_size);
  FLASHKV_CHECK(b.num_qo_heads > 0, "num_qo_heads: expected > 0, got ", b.num_qo_heads);
  FLASHKV_CHECK(b.num_kv_heads > 0, "num_kv_heads: expected > 0, got ", b.num_kv_heads);
  FLASHKV_CHECK(b.num_qo_heads % b.num_kv_heads == 0, "num_qo_heads: expected a multiple of num_kv_heads (",
                b.num_kv_heads, "), got ", b.num_qo_heads);
  FLASHKV_CHECK(b.head_dim_qk > 0 && b.head_dim_v > 0, "head_dim: expected > 0, got ", b.head_dim_qk,
                "/", b.head_dim_v);
  FLASHKV_CHECK(b.page_size >= 1, "page_size: expected >= 1, got ", b.page_size);
  FLASHKV_CHECK(b.batch_size == 0 || b.kv_len != nullptr, "kv_len: expected an array of ",
                b.batch_size, " lengths, got null");
  for (int32_t i = 0; i < b.batch_size; ++i)
    FLASHKV_CHECK(b.kv_len[i] >= 0, "kv_len: request ", i, ": expected >= 0, got ", b.kv_len[i]);
  if (!decode) {
    FLASHKV_CHECK(b.qo_indptr != nullptr, "qo_indptr: expected ", b.batch_size + 1, " values, got null");
    FLASHKV_CHECK(b.qo_indptr[0] >= 0, "qo_indptr: expected [0] >= 0, got ", b.qo_indptr[0]);
    for (int32_t i = 0; i < b.batch_size; ++i) {
      FLASHKV_CHECK(b.qo_indptr[i] <= b.qo_indptr[i + 1], "qo_indptr: expected non-decreasing values, got [",
                    i, "] = ", b.qo_indptr[i], " > [", i + 1, "] = ", b.qo_indptr[i + 1]);
    }
  }
  FLASHKV_CHECK(o.q_tile >= 0, "q_tile: expected >= 0, got ", o.q_tile);
  FLASHKV_CHECK(o.fixed_split_size >= 0, "fixed_split_size: expected >= 0, got ", o.fixed_split_size);
  FLASHKV_CHECK(o.kv_align >= 0, "kv_align: expected >= 0, got ", o.kv_align);
  FLASHKV_CHECK(o.blocks_per_sm >= 0, "blocks_per_sm: expected >= 0, got ", o.blocks_per_sm);
  FLASHKV_CHECK(o.min_split_size >= 0, "min_split_size: expected >= 0, got ", o.min_split_size);
  if (dev.device.is_cuda())
    FLASHKV_CHECK(dev.num_sms > 0, "device: expected num_sms > 0 for ", dev.device.str());
  if (o.cuda_graph) {
    FLASHKV_CHECK(o.max_batch_size > 0, "max_batch_size: graph mode needs a capacity > 0, got ",
                  o.max_batch_size);
    FLASHKV_CHECK(b.batch_size <= o.max_batch_size, "batch_size: ", b.batch_size,
                  " exceeds the graph capacity max_batch_size = ", o.max_batch_size);
    if (!decode) {
      FLASHKV_CHECK(o.max_num_tokens > 0, "max_num_tokens: graph mode needs a capacity > 0, got ",
                    o.max_num_tokens);
      FLASHKV_CHECK(b.qo_indptr[b.batch_size] - b.qo_indptr[0] <= o.max_num_tokens, "num_tokens: ",
                    b.qo_indptr[b.batch_size] - b.qo_indptr[0],
                    " exceeds the graph capacity max_num_tokens = ", o.max_num_tokens);
      FLASHKV_CHECK(b.qo_indptr[b.batch_size] <= o.max_num_tokens, "qo_indptr: last value ",
                    b.qo_indptr[b.batch_size], " exceeds the graph capacity max_num_tokens = ",
                    o.max_num_tokens);
    }
    if (o.fixed_split_size > 0 && o.enable_split_kv) {
      FLASHKV_CHECK(o.max_kv_len > 0, "max_kv_len: graph mode with fixed_split_size needs the longest KV length");
      for (int32_t i = 0; i < b.batch_size; ++i)
        FLASHKV_CHECK(b.kv_len[i] <= o.max_kv_len, "kv_len: request ", i, " has ", b.kv_len[i],
                      " entries, past the graph capacity max_kv_len = ", o.max_kv_len);
    }
  }
}

int32_t max_workers_of(const BatchShape& b, const DeviceInfo& dev, const PlanOptions& o) {
  if (dev.device.is_cpu()) return std::max(1, dev.num_threads);
  const int bps = o.blocks_per_sm > 0 ? o.blocks_per_sm : 2;
  return std::max(1, dev.num_sms * bps / b.num_kv_heads);
}

int32_t q_tile_of(const BatchShape& b, const DeviceInfo& dev, const PlanOptions& o, bool decode) {
  if (decode) return 1;
  if (o.q_tile > 0) return o.q_tile;
  const int group = b.num_qo_heads / b.num_kv_heads;
  const int packed_rows = dev.device.is_cpu() ? 32 : 128;  // query rows x group per tile
  return std::max(1, packed_rows / group);
}

// Smallest chunk (a multiple of align, >= min_chunk) for which the tiles cut into at most
// `budget` items; returns 0 when no split is needed or possible.
int64_t auto_chunk(const std::vector<Tile>& tiles, int64_t budget, int64_t align, int64_t min_chunk) {
  if (static_cast<int64_t>(tiles.size()) >= budget) return 0;
  int64_t longest = 0;
  for (const Tile& t : tiles) longest = std::max<int64_t>(longest, t.kv_end - t.kv_begin);
  min_chunk = ceil_div(std::max(min_chunk, align), align) * align;
  if (longest <= min_chunk) return 0;
  auto items_for = [&](int64_t c) {
    int64_t n = 0;
    for (const Tile& t : tiles) {
      if (t.kv_end <= t.kv_begin) { ++n; continue; }
      n += (t.kv_end - 1) / c - t.kv_begin / c + 1;  // absolute chunk boundaries
    }
    return n;
  };
  int64_t lo = min_chunk / align, hi = ceil_div(longest, align);  // in units of align
  if (items_for(lo * align) <= budget) return lo * align;
  while (lo + 1 < hi) {  // invariant: items_for(lo) > budget, items_for(hi) <= budget
    const int64_t mid = (lo + hi) / 2;
    if (items_for(mid * align) <= budget) hi = mid;
    else lo = mid;
  }
  const int64_t c = hi * align;
  return c >= longest ? 0 : c;
}

void plan_common(const BatchShape& b, const DeviceInfo& dev, const PlanOptions& o, bool decode,
                 Plan* out) {
  validate(b, o, dev, decode);
  Scratch& s = scratch();
  Plan& p = *out;
  p.batch_size = b.batch_size;
  p.num_qo_tokens = decode ? b.batch_size : (b.batch_size ? b.qo_indptr[b.batch_size] : 0);
  p.num_qo_heads = b.num_qo_heads;
  p.num_kv_heads = b.num_kv_heads;
  p.head_dim_qk = b.head_dim_qk;
  p.head_dim_v = b.head_dim_v;
  p.page_size = b.page_size;
  p.device = dev.device;
  p.cuda_graph = o.cuda_graph;
  p.q_tile = q_tile_of(b, dev, o, decode);
  const int32_t max_workers = max_workers_of(b, dev, o);

  // 1. Tiles, with KV trimmed to what their rows can see.
  s.tiles.clear();
  for (int32_t r = 0; r < b.batch_size; ++r) {
    const int32_t q0 = decode ? r : b.qo_indptr[r];
    const int32_t q_len = decode ? 1 : b.qo_indptr[r + 1] - q0;
    const int32_t kv_len = b.kv_len[r];
    for (int32_t t = 0; t < q_len; t += p.q_tile) {
      const int32_t rows = std::min(p.q_tile, q_len - t);
      const int64_t first_pos = int64_t{kv_len} - q_len + t;  // position of the tile's first row
      const int64_t last_pos = first_pos + rows - 1;
      int64_t lo = 0, hi = kv_len;
      if (b.causal) hi = std::clamp<int64_t>(last_pos + 1, 0, kv_len);
      if (b.window_left >= 0) lo = std::clamp<int64_t>(first_pos - b.window_left, 0, kv_len);
      if (hi < lo) hi = lo;
      s.tiles.push_back({r, q0 + t, rows, static_cast<int32_t>(lo), static_cast<int32_t>(hi)});
    }
  }
  p.num_tiles = static_cast<int32_t>(s.tiles.size());

  // 2. The chunk size.
  int64_t align = o.kv_align > 0 ? o.kv_align : 16;
  if (b.page_size > 1) align = ceil_div(align, b.page_size) * b.page_size;
  int64_t chunk = 0;
  if (o.enable_split_kv) {
    if (o.fixed_split_size > 0) chunk = o.fixed_split_size;
    else chunk = auto_chunk(s.tiles, max_workers, align, o.min_split_size > 0 ? o.min_split_size : 256);
  }
  p.kv_chunk = static_cast<int32_t>(chunk);

  // 3. Items and merges.
  s.items.clear();
  p.merges.clear();
  s.cost.clear();
  int64_t partial_rows = 0;
  for (const Tile& t : s.tiles) {
    const int64_t n = (chunk == 0 || t.kv_end <= t.kv_begin)
                          ? 1
                          : (t.kv_end - 1) / chunk - t.kv_begin / chunk + 1;
    if (n == 1) {
      s.items.push_back({t.request, t.q_begin, t.q_len, t.kv_begin, t.kv_end, -1, 0, 0});
      s.cost.push_back(int64_t{t.q_len} * (t.kv_end - t.kv_begin + 16));
      continue;
    }
    const int32_t base = static_cast<int32_t>(partial_rows);
    for (int64_t c = 0; c < n; ++c) {
      const int64_t lo = std::max<int64_t>(t.kv_begin, (t.kv_begin / chunk + c) * chunk);
      const int64_t hi = std::min<int64_t>(t.kv_end, (t.kv_begin / chunk + c + 1) * chunk);
      s.items.push_back({t.request, t.q_begin, t.q_len, static_cast<int32_t>(lo),
                         static_cast<int32_t>(hi), static_cast<int32_t>(base + c * t.q_len),
                         static_cast<int32_t>(c), 0});
      s.cost.push_back(int64_t{t.q_len} * (hi - lo + 16));
    }
    p.merges.push_back({t.q_begin, t.q_len, base, static_cast<int32_t>(n)});
    partial_rows += n * t.q_len;
  }
  p.num_partial_rows = partial_rows;
  const int32_t num_items = static_cast<int32_t>(s.items.size());

  // 4. Workers: longest item first, each to the least-loaded worker.
  p.num_workers = dev.device.is_cpu() ? max_workers
                  : o.cuda_graph      ? max_workers
                                      : std::min(max_workers, std::max(num_items, 1));
  const int32_t W = p.num_workers;
  s.owner.assign(num_items, 0);
  if (num_items <= W) {
    std::iota(s.owner.begin(), s.owner.end(), 0);
  } else {
    s.order.resize(num_items);
    std::iota(s.order.begin(), s.order.end(), 0);
    std::stable_sort(s.order.begin(), s.order.end(),
                     [&](int32_t a, int32_t c) { return s.cost[a] > s.cost[c]; });
    using Load = std::pair<int64_t, int32_t>;  // (load, worker): least load, then lowest id
    std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap;
    for (int32_t w = 0; w < W; ++w) heap.push({0, w});
    for (int32_t i : s.order) {
      Load l = heap.top();
      heap.pop();
      s.owner[i] = l.second;
      l.first += s.cost[i];
      heap.push(l);
    }
  }
  // Group by worker (stable: a worker runs its items in planning order).
  s.count.assign(W + 1, 0);
  for (int32_t i = 0; i < num_items; ++i) ++s.count[s.owner[i] + 1];
  p.worker_indptr.resize(W + 1);
  p.worker_indptr[0] = 0;
  for (int32_t w = 0; w < W; ++w) p.worker_indptr[w + 1] = p.worker_indptr[w] + s.count[w + 1];
  p.items.resize(num_items);
  for (int32_t w = 0; w < W; ++w) s.count[w] = p.worker_indptr[w];
  for (int32_t i = 0; i < num_items; ++i) p.items[s.count[s.owner[i]]++] = s.items[i];

  // 5. Workspace layout (capacities in graph mode).
  int64_t cap_items = num_items, cap_merges = static_cast<int64_t>(p.merges.size()),
          cap_rows = partial_rows;
  if (o.cuda_graph) {
    const int64_t max_tiles =
        decode ? o.max_batch_size : ceil_div(o.max_num_tokens, p.q_tile) + o.max_batch_size;
    if (o.enable_split_kv && o.fixed_split_size > 0) {
      const int64_t chunks = ceil_div(o.max_kv_len, o.fixed_split_size);
      cap_items = max_tiles * chunks;
      cap_merges = max_tiles;
      cap_rows = cap_items * p.q_tile;
    } else if (o.enable_split_kv) {
      cap_items = std::max<int64_t>(max_tiles, W);
      cap_merges = W / 2;
      cap_rows = int64_t{W} * p.q_tile;
    } else {
      cap_items = max_tiles;
      cap_merges = 0;
      cap_rows = 0;
    }
    FLASHKV_CHECK(num_items <= cap_items && static_cast<int64_t>(p.merges.size()) <= cap_merges &&
                      partial_rows <= cap_rows,
                  "plan: the batch needs ", num_items, " items / ", p.merges.size(), " merges / ",
                  partial_rows, " partial rows, past the graph capacities ", cap_items, " / ",
                  cap_merges, " / ", cap_rows);
  }
  WorkspaceLayout& l = p.layout;
  l.items = 0;
  l.worker_indptr = align_up(cap_items * sizeof(WorkItem));
  l.merges = l.worker_indptr + align_up((int64_t{W} + 1) * sizeof(int32_t));
  l.counts = l.merges + align_up(cap_merges * sizeof(MergeItem));
  l.plan_bytes = l.counts + align_up(4 * sizeof(int32_t));
  l.partial_o = l.plan_bytes;
  l.partial_lse = l.partial_o + align_up(cap_rows * b.num_qo_heads * b.head_dim_v * sizeof(float));
  l.total_bytes = l.partial_lse + align_up(cap_rows * b.num_qo_heads * sizeof(float));
  p.id = g_next_plan_id.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

void plan_decode(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt,
                 DecodePlan* out) {
  plan_common(batch, device, opt, /*decode=*/true, out);
}
void plan_prefill(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt,
                  PrefillPlan* out) {
  plan_common(batch, device, opt, /*decode=*/false, out);
}
DecodePlan plan_decode(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt) {
  DecodePlan p;
  plan_decode(batch, device, opt, &p);
  return p;
}
PrefillPlan plan_prefill(const BatchShape& batch, const DeviceInfo& device, const PlanOptions& opt) {
  PrefillPlan p;
  plan_prefill(batch, device, opt, &p);
  return p;
}

void serialize_plan(const Plan& plan, void* dst) {
  auto* base = static_cast<unsigned char*>(dst);
  if (!plan.items.empty())
    std::memcpy(base + plan.layout.items, plan.items.data(), plan.items.size() * sizeof(WorkItem));
  std::memcpy(base + plan.layout.worker_indptr, plan.worker_indptr.data(),
              plan.worker_indptr.size() * sizeof(int32_t));
  if (!plan.merges.empty())
    std::memcpy(base + plan.layout.merges, plan.merges.data(), plan.merges.size() * sizeof(MergeItem));
  const int32_t counts[4] = {static_cast<int32_t>(plan.items.size()),
                             static_cast<int32_t>(plan.merges.size()),
                             static_cast<int32_t>(plan.num_partial_rows), 0};
  std::memcpy(base + plan.layout.counts, counts, sizeof(counts));
}

}  // namespace flashkv
