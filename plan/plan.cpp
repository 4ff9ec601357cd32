// The planner. Why it works the way it does:
// - Tiles: each request's query rows cut into q_tile-row tiles (decode: one row). A tile's KV
//   range is trimmed to what its rows can see (causal: up to the last row's position; window:
//   from the first row's window start), so no worker walks fully masked KV. Rows that see
//   nothing keep an item with an empty KV range, so that their O = 0 / LSE = -inf get written.
// - Split-KV (automatic): a tile whose KV is longer than one worker's share of the batch would
//   keep its worker busy after the others are done, so long tiles are cut into chunks of about
//   that share: total cost / workers, in KV tokens of a full tile. This both fills the GPU when
//   a few long requests are all there is, and cuts the one huge request of a large batch. A
//   chunk is never shorter than min_split_size (every chunk costs a partial state and a merge),
//   and the split never adds more than `workers` items (bounded graph-mode capacities). An
//   automatic split cuts each long tile into equal parts (whole alignment units, the parts
//   differing by at most one unit), not at multiples of the share: those leave short tails (4096
//   at a share of 2000: 2000 + 2000 + 96) that cost a whole item each and pile up on one worker.
//   Where the tiles are few (the split is there to fill the device), the part count is chosen
//   by the estimated makespan: 16 x 4096 on 33 workers runs as 32 halves of 2048 in one wave,
//   not as 48 thirds of ~1366 in two.
//   In deterministic mode (a fixed chunk) boundaries are absolute multiples of the chunk size,
//   so a request's chunks, and its result, do not depend on the rest of the batch.
// - Balance: items go to workers costliest first, each to the least-loaded worker (LPT greedy).
//   It is the planner's hot loop, so: "costliest first" is one counting-sort pass on an 8-bit
//   float-like key made with the tiles (costs within 12.5% may swap; the cost model is no more
//   exact than that), the first `workers` items go one to each worker, and the rest go in
//   rounds: with the workers ranked by load once (a vector all-pairs count), the next items go
//   to them in that order for as long as that is provably what LPT does, which on serving
//   batches is nearly always (see lpt_rounds). Where rounds do not pay (<= 8 or > 64 workers,
//   items much smaller than the spread of the loads), the least-loaded worker comes from a
//   tournament tree, whose update is an unrolled chain of branch-free minimums. Both give the
//   same plan. The planner's host time: docs/perf/planner.md.
// - Equal runs (decode on CUDA, automatic split): when a few workers would end up streaming
//   alone (40 x 4096 on 33 workers: 7 of them take a second request), the tiles are instead laid
//   end to end and cut into runs of equal cost, one a worker (McNaughton's wrap-around rule), so
//   the workers end together; chosen where a fluid model of a bandwidth-bound GPU says it runs
//   at least 3% faster, since the extra cuts cost items and merges (wrap_tiles, try_equal_runs).
// - Graph mode: the worker count and the workspace layout come from the capacities only, so a
//   graph captured once replays with any batch that fits.
#include "flashkv/plan/plan.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>

#include "flashkv/core/error.h"
#include "flashkv/core/visibility.h"

namespace flashkv {
namespace {

std::atomic<uint64_t> g_next_plan_id{1};
constexpr size_t kAlign = 256;
constexpr int32_t kDefaultKvAlign = 16;
constexpr int32_t kDefaultMinSplit = 256;
constexpr int32_t kDefaultBlocksPerSm = 2;
// What an item costs beyond its KV (loading Q, writing O), in units of one KV token per row.
constexpr int64_t kItemOverhead = 16;
// A worker's entry packs (load << kWorkerBits) | worker, so that one integer compare orders by
// load, then by worker id (deterministic ties).
constexpr int kWorkerBits = 20;
constexpr int64_t kMaxWorkers = int64_t{1} << kWorkerBits;
constexpr int kLoadBits = 64 - kWorkerBits - 1;  // one bit of headroom for the per-item minimum

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int bit_width(uint64_t x) { return x == 0 ? 0 : 64 - __builtin_clzll(x); }

// Chunks of `chunk` tokens, at absolute multiples of it, that KV range [lo, hi) touches (an
// empty range still needs its one item).
// KV positions are int32, so a chunk is at most INT32_MAX (a longer one cuts nothing either)
// and the divisions are 32-bit ones, several times cheaper than 64-bit ones on some hosts.
int32_t num_chunks(int32_t lo, int32_t hi, uint32_t chunk) {
  if (hi <= lo) return 1;
  return static_cast<int32_t>((static_cast<uint32_t>(hi) - 1) / chunk -
                              static_cast<uint32_t>(lo) / chunk + 1);
}

// Alignment units (absolute multiples of `align`) that KV range [lo, hi) touches; 0 if empty.
uint32_t units_of(int32_t lo, int32_t hi, uint32_t align) {
  if (hi <= lo) return 0;
  return (static_cast<uint32_t>(hi) - 1) / align - static_cast<uint32_t>(lo) / align + 1;
}

// Parts of an automatic split of `units` units into parts of at most `part` units (>= 1).
uint32_t num_parts(uint32_t units, uint32_t part) {
  return units <= part ? 1 : (units - 1) / part + 1;
}

int64_t item_cost(const WorkItem& it) {
  return int64_t{it.q_len} * (int64_t{it.kv_end} - it.kv_begin + kItemOverhead);
}

// Items in planning order, with each one's cost (item_cost) and sort key (cost_key).
struct ItemList {
  std::vector<WorkItem> items;
  std::vector<uint64_t> cost;
  std::vector<uint8_t> key;
  int64_t total_cost = 0;

  void resize(size_t n) {
    items.resize(n);
    cost.resize(n);
    key.resize(n);
  }
  size_t size() const { return items.size(); }
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
Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

// The first i in [0, n) for which ok(i) is false, or -1. One branch-free pass first: on good
// input (the case to be fast) the loop vectorizes; a second pass finds the culprit.
template <typename Ok>
int32_t first_failing(int32_t n, Ok ok) {
  int32_t failed = 0;  // an int, not a bool, so that the loop vectorizes
  for (int32_t i = 0; i < n; ++i) failed |= !ok(i);
  if (!failed) return -1;
  for (int32_t i = 0; i < n; ++i)
    if (!ok(i)) return i;
  return -1;
}

void validate(const BatchShape& b, const PlanOptions& o, const DeviceInfo& dev, bool decode) {
  FLASHKV_CHECK(b.batch_size >= 0, "batch_size: expected >= 0, got ", b.batch_size);
  FLASHKV_CHECK(b.num_qo_heads > 0, "num_qo_heads: expected > 0, got ", b.num_qo_heads);
  FLASHKV_CHECK(b.num_kv_heads > 0, "num_kv_heads: expected > 0, got ", b.num_kv_heads);
  FLASHKV_CHECK(b.num_qo_heads % b.num_kv_heads == 0,
                "num_qo_heads: expected a multiple of num_kv_heads (", b.num_kv_heads, "), got ",
                b.num_qo_heads);
  FLASHKV_CHECK(b.head_dim_qk > 0, "head_dim_qk: expected > 0, got ", b.head_dim_qk);
  FLASHKV_CHECK(b.head_dim_v > 0, "head_dim_v: expected > 0, got ", b.head_dim_v);
  FLASHKV_CHECK(b.page_size >= 1, "page_size: expected >= 1, got ", b.page_size);
  FLASHKV_CHECK(b.batch_size == 0 || b.kv_len != nullptr, "kv_len: expected an array of ",
                b.batch_size, " lengths, got null");
  const int32_t* kv = b.kv_len;
  if (const int32_t i = first_failing(b.batch_size, [&](int32_t i) { return kv[i] >= 0; }); i >= 0)
    throw_error(str_cat("kv_len: request ", i, ": expected >= 0, got ", kv[i]));
  if (!decode) {
    const int32_t* qo = b.qo_indptr;
    FLASHKV_CHECK(qo != nullptr, "qo_indptr: expected ", int64_t{b.batch_size} + 1,
                  " values, got null");
    FLASHKV_CHECK(qo[0] >= 0, "qo_indptr: expected [0] >= 0, got ", qo[0]);
    if (const int32_t i =
            first_failing(b.batch_size, [&](int32_t i) { return qo[i] <= qo[i + 1]; });
        i >= 0)
      throw_error(str_cat("qo_indptr: expected non-decreasing values, got [", i, "] = ", qo[i],
                          " > [", i + 1, "] = ", qo[i + 1]));
  }
  FLASHKV_CHECK(o.q_tile >= 0, "q_tile: expected >= 0 (0: the device's default), got ", o.q_tile);
  FLASHKV_CHECK(o.fixed_split_size >= 0, "fixed_split_size: expected >= 0 (0: automatic), got ",
                o.fixed_split_size);
  FLASHKV_CHECK(o.kv_align >= 0, "kv_align: expected >= 0 (0: default), got ", o.kv_align);
  FLASHKV_CHECK(o.blocks_per_sm >= 0, "blocks_per_sm: expected >= 0 (0: default), got ",
                o.blocks_per_sm);
  FLASHKV_CHECK(o.min_split_size >= 0, "min_split_size: expected >= 0 (0: default), got ",
                o.min_split_size);
  if (dev.device.is_cuda())
    FLASHKV_CHECK(dev.num_sms > 0, "device: expected num_sms > 0 for ", dev.device.str(), ", got ",
                  dev.num_sms);
  if (o.cuda_graph) {
    FLASHKV_CHECK(o.max_batch_size > 0, "max_batch_size: graph mode needs a capacity > 0, got ",
                  o.max_batch_size);
    FLASHKV_CHECK(b.batch_size <= o.max_batch_size, "batch_size: ", b.batch_size,
                  " exceeds the graph capacity max_batch_size = ", o.max_batch_size);
    if (!decode) {
      FLASHKV_CHECK(o.max_num_tokens > 0, "max_num_tokens: graph mode needs a capacity > 0, got ",
                    o.max_num_tokens);
      FLASHKV_CHECK(b.qo_indptr[b.batch_size] <= o.max_num_tokens, "qo_indptr: last value ",
                    b.qo_indptr[b.batch_size],
                    " exceeds the graph capacity max_num_tokens = ", o.max_num_tokens);
    }
    if (o.fixed_split_size > 0 && o.enable_split_kv) {
      FLASHKV_CHECK(o.max_kv_len > 0,
                    "max_kv_len: graph mode with fixed_split_size needs the longest KV length "
                    "(> 0), got ",
                    o.max_kv_len);
      const int32_t cap = o.max_kv_len;
      if (const int32_t i = first_failing(b.batch_size, [&](int32_t i) { return kv[i] <= cap; });
          i >= 0)
        throw_error(str_cat("kv_len: request ", i, " has ", kv[i],
                            " entries, past the graph capacity max_kv_len = ", cap));
    }
  }
}

// Workers of one wave: CUDA CTAs per KV head (grid.y runs the heads), CPU threads per KV head.
int32_t max_workers_of(const BatchShape& b, const DeviceInfo& dev, const PlanOptions& o) {
  const int64_t slots =
      dev.device.is_cpu()
          ? int64_t{dev.num_threads}
          : int64_t{dev.num_sms} * (o.blocks_per_sm > 0 ? o.blocks_per_sm : kDefaultBlocksPerSm);
  const int64_t workers = std::max<int64_t>(1, slots / b.num_kv_heads);
  FLASHKV_CHECK(workers <= kMaxWorkers, "device: ", workers, " workers per KV head (",
                dev.device.is_cpu() ? "num_threads" : "num_sms x blocks_per_sm",
                " / num_kv_heads) exceed the planner's limit of ", kMaxWorkers);
  return static_cast<int32_t>(workers);
}

int32_t q_tile_of(const BatchShape& b, const DeviceInfo& dev, const PlanOptions& o, bool decode) {
  if (decode) return 1;
  if (o.q_tile > 0) return o.q_tile;
  const int group = b.num_qo_heads / b.num_kv_heads;
  // Query rows x group per tile. CUDA: the CTA's row tile. CPU: the kernel's row chunk (each K/V
  // block it loads and converts serves all rows of the item, so more rows amortize the loads;
  // 128 rows of bf16 D=128 state still sit in L2).
  const int packed_rows = 128;
  return std::max(1, packed_rows / group);
}

// The most q_tile-row tiles that `tokens` query rows of `requests` requests can make: each
// request's last tile may be partial, so sum_r ceil(q_r / q_tile) <= (tokens + nonempty
// requests * (q_tile - 1)) / q_tile, and no tile is empty.
int64_t max_tiles_of(int64_t tokens, int64_t requests, int64_t q_tile) {
  const int64_t nonempty = std::min(requests, tokens);
  return std::min(tokens, (tokens + nonempty * (q_tile - 1)) / q_tile);
}

// An 8-bit sort key, monotonic in the cost: its exponent (costs are >= kItemOverhead = 16, so
// it starts at 4; costs of 2^36 and more share the top key) and 3 mantissa bits. Costs within
// 12.5% may swap places in the LPT order, which costs next to nothing in balance (the cost
// model is no finer) and lets one counting-sort pass order the items.
uint8_t cost_key(uint64_t cost) {
  // A float's bits above the top 3 mantissa bits are 8 * exponent + those 3 bits, biased by
  // 8 * (127 + 4) for the smallest cost; the conversion rounds, which keeps the order.
  const float f = static_cast<float>(static_cast<int64_t>(cost));
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint8_t>(std::min<uint32_t>((bits >> 20) - 8 * (127 + 4), 255));
}

// Calls fn(std::bool_constant<flag>) so that a hot loop can be specialised on a runtime flag.
template <typename Fn>
decltype(auto) with_flag(bool flag, Fn&& fn) {
  return flag ? fn(std::true_type()) : fn(std::false_type());
}

// One item per (request, q_tile rows), KV trimmed to what the tile's rows can see, with its
// cost and sort key; returns the longest KV range. The loops are specialised on the masks,
// which are fixed per batch.
int64_t build_tiles(const BatchShape& b, bool decode, int32_t q_tile, ItemList* tiles) {
  // Room for the most tiles the rows can make (no division per request), trimmed below.
  const int64_t room =
      decode ? b.batch_size
             : max_tiles_of(b.qo_indptr[b.batch_size] - b.qo_indptr[0], b.batch_size, q_tile);
  tiles->resize(room);
  WorkItem* const first = tiles->items.data();
  WorkItem* t = first;
  uint64_t* cost = tiles->cost.data();
  uint8_t* key = tiles->key.data();
  int64_t longest = 0, total = 0;
  auto emit = [&](const WorkItem& item) {
    *t++ = item;
    const int64_t c = item_cost(item);
    *cost++ = static_cast<uint64_t>(c);
    *key++ = cost_key(static_cast<uint64_t>(c));
    longest = std::max<int64_t>(longest, item.kv_end - item.kv_begin);
    total += c;
  };
  const int32_t window = b.window_left;
  with_flag(window >= 0, [&](auto windowed) {
    if (decode) {
      for (int32_t r = 0; r < b.batch_size; ++r) {
        const int32_t kv_len = b.kv_len[r];
        // The one row sits at position kv_len - 1: causal trims nothing.
        int32_t lo = 0;
        if constexpr (windowed)
          lo = std::clamp(window_first_key(query_position(kv_len, 1, 0), window), 0, kv_len);
        emit({r, r, 1, lo, kv_len, -1, 0, 0});
      }
      return;
    }
    with_flag(b.causal, [&](auto causal) {
      for (int32_t r = 0; r < b.batch_size; ++r) {
        const int32_t q0 = b.qo_indptr[r];
        const int32_t q_len = b.qo_indptr[r + 1] - q0;
        const int64_t kv_len = b.kv_len[r];
        for (int32_t row = 0; row < q_len; row += q_tile) {
          const int32_t rows = std::min(q_tile, q_len - row);
          // The tile's rows sit at first_pos .. last_pos (core/visibility.h); together they see
          // the keys from the first row's window start to the last row's causal end.
          const int64_t first_pos = query_position<int64_t>(kv_len, q_len, row);
          const int64_t last_pos = first_pos + rows - 1;
          int64_t lo = 0, hi = kv_len;
          if constexpr (windowed)
            lo = std::clamp<int64_t>(window_first_key<int64_t>(first_pos, window), 0, kv_len);
          if constexpr (causal) hi = std::clamp<int64_t>(causal_key_end(last_pos), lo, kv_len);
          emit({r, q0 + row, rows, static_cast<int32_t>(lo), static_cast<int32_t>(hi), -1, 0, 0});
        }
      }
    });
  });
  tiles->resize(t - first);
  tiles->total_cost = total;
  return longest;
}

// The shortest part of an automatic split when PlanOptions::min_split_size is 0: 256 tokens,
// shorter for batches of short tiles only, which parts of 256 leave filling little of the device
// (1 x 1024 would be 4 parts on 33 workers a KV head). Prefill: parts of 128 for tiles of up to
// 1024 keys. Decode, whose split merge runs inside the kernel and folds up to 16 parts a batch of
// loads: parts of 64 for tiles of up to 1024 tokens, 128 for up to 4096; on short requests more,
// shorter parts fill more of the device than the extra merges cost (figures: docs/perf/decode.md,
// the in-kernel merge's timeline).
int64_t default_min_split(bool decode, int64_t longest) {
  if (decode && longest <= 1024) return 64;
  if (longest <= (decode ? 4096 : 1024)) return 128;
  return kDefaultMinSplit;
}

// The automatic split (see the top of the file): the longest part, in alignment units, that the
// tiles are cut into (each tile into num_parts(units, part) equal parts); 0 when no tile is
// longer than one worker's share. Starts from the share (aligned, >= min_chunk), raised where
// needed so that the split adds at most `workers` items; where the tiles are at most `workers`,
// also tries the longest parts that fit in fewer waves of `workers` items, and keeps the one of
// least estimated makespan (ties: fewer items).
int64_t auto_part(const ItemList& tiles, int64_t longest, int64_t workers, int64_t q_tile,
                  int64_t align, int64_t min_chunk) {
  const int64_t share = ceil_div(ceil_div(tiles.total_cost, workers), q_tile);
  const int64_t first = ceil_div(std::max<int64_t>({min_chunk, share, 1}), align);
  if (longest <= first * align) return 0;
  const uint32_t a = static_cast<uint32_t>(align);
  // Every tile touches at most `whole` units: parts that long cut nothing.
  const int64_t whole = ceil_div(longest, align) + 1;
  auto items_at = [&](int64_t part) {
    int64_t n = 0;
    for (const WorkItem& t : tiles.items)
      n += num_parts(units_of(t.kv_begin, t.kv_end, a), static_cast<uint32_t>(part));
    return n;
  };
  // The shortest part >= from (in [from, whole]) that makes at most `limit` items (>= tiles).
  auto shortest_fitting = [&](int64_t from, int64_t limit) {
    if (items_at(from) <= limit) return from;
    int64_t lo = from, hi = whole;  // items_at(lo) > limit >= items_at(whole)
    while (lo + 1 < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (items_at(mid) <= limit)
        hi = mid;
      else
        lo = mid;
    }
    return hi;
  };
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  int64_t best = shortest_fitting(first, num_tiles + workers);
  if (best >= whole) return 0;
  if (num_tiles > workers) return best;
  // Makespan estimate: waves of `workers` items of the average cost, or the costliest item.
  auto makespan = [&](int64_t part, int64_t* items) {
    int64_t n = 0, total = 0, costliest = 0;
    for (const WorkItem& t : tiles.items) {
      const uint32_t units = units_of(t.kv_begin, t.kv_end, a);
      const uint32_t parts = num_parts(units, static_cast<uint32_t>(part));
      const int64_t len = int64_t{t.kv_end} - t.kv_begin;
      const int64_t longest_part = std::min<int64_t>(len, ceil_div(units, parts) * align);
      n += parts;
      total += t.q_len * (len + int64_t{parts} * kItemOverhead);
      costliest = std::max<int64_t>(costliest, t.q_len * (longest_part + kItemOverhead));
    }
    *items = n;
    return std::max(costliest, ceil_div(n, workers) * ceil_div(total, n));
  };
  int64_t items = 0;
  int64_t best_makespan = makespan(best, &items);
  for (int64_t waves = ceil_div(items, workers) - 1; waves >= 1; --waves) {
    const int64_t part = shortest_fitting(best, waves * workers);
    if (part >= whole) break;
    const int64_t m = makespan(part, &items);
    if (m <= best_makespan) {
      best = part;
      best_makespan = m;
    }
  }
  return best;
}

// Cuts the tiles into chunks; fills `out` (planning order), the merges and the partial rows.
// part == 0: deterministic mode, chunks at absolute multiples of `chunk` (<= INT32_MAX) tokens.
// part > 0: automatic, each tile cut into num_parts(units, part) parts of whole `align`-token
// units (absolute multiples of align), the first parts floor(units / parts) units long and the
// last units % parts of them one unit longer, so a tile's parts differ by at most one unit
// (the first and last cut at the tile's ends). `chunks`: scratch for each tile's chunk count.
void split_tiles(const ItemList& tiles, int32_t chunk, uint32_t part, uint32_t align, ItemList* out,
                 std::vector<MergeItem>* merges, int64_t* partial_rows,
                 std::vector<int32_t>* chunks) {
  auto count = [&](const WorkItem& t) {
    return part > 0 ? static_cast<int32_t>(num_parts(units_of(t.kv_begin, t.kv_end, align), part))
                    : num_chunks(t.kv_begin, t.kv_end, static_cast<uint32_t>(chunk));
  };
  // Count first: the sizes must fit the int32 fields before anything is written.
  int64_t num_items = 0, num_merges = 0, rows = 0;
  chunks->resize(tiles.size());
  for (size_t i = 0; i < tiles.size(); ++i) {
    const WorkItem& t = tiles.items[i];
    const int32_t n = count(t);
    (*chunks)[i] = n;
    num_items += n;
    if (n > 1) {
      ++num_merges;
      rows += int64_t{n} * t.q_len;
    }
  }
  FLASHKV_CHECK(num_items <= INT32_MAX && rows <= INT32_MAX, "fixed_split_size: chunks of ", chunk,
                " tokens make ", num_items, " items and ", rows,
                " partial rows, past the int32 range of the plan");
  out->resize(num_items);
  merges->resize(num_merges);
  WorkItem* it = out->items.data();
  uint64_t* cost = out->cost.data();
  uint8_t* key = out->key.data();
  MergeItem* m = merges->data();
  int32_t base = 0;
  int64_t total = 0;
  for (size_t i = 0; i < tiles.size(); ++i) {
    const WorkItem& t = tiles.items[i];
    const int32_t n = (*chunks)[i];
    if (n == 1) {
      *it++ = t;
      *cost++ = tiles.cost[i];
      *key++ = tiles.key[i];
      total += static_cast<int64_t>(tiles.cost[i]);
      continue;
    }
    // Chunk c covers [max(kv_begin, boundary c), min(kv_end, boundary c + 1)), where boundary
    // c + 1 is the end of chunk c: an absolute multiple of the chunk, or of the alignment.
    const int64_t first_unit = static_cast<uint32_t>(t.kv_begin) / std::max(align, 1u);
    const uint32_t units = part > 0 ? units_of(t.kv_begin, t.kv_end, align) : 0;
    const uint32_t per_part = part > 0 ? units / static_cast<uint32_t>(n) : 0;
    const int32_t short_parts =
        part > 0 ? n - static_cast<int32_t>(units % static_cast<uint32_t>(n)) : n;
    auto end_of = [&](int32_t c) -> int64_t {
      if (part == 0)
        return int64_t{t.kv_begin} - static_cast<uint32_t>(t.kv_begin) % chunk +
               int64_t{c + 1} * chunk;
      // Units before the end of part c: c + 1 parts of per_part, plus one per long part.
      const int64_t done = int64_t{c + 1} * per_part + std::max(0, c + 1 - short_parts);
      return (first_unit + done) * align;
    };
    int64_t lo = t.kv_begin;
    for (int32_t c = 0; c < n; ++c) {
      const int64_t hi = std::min<int64_t>(t.kv_end, end_of(c));
      *it++ = {t.request,
               t.q_begin,
               t.q_len,
               static_cast<int32_t>(lo),
               static_cast<int32_t>(hi),
               base + c * t.q_len,
               c,
               static_cast<int32_t>(m - merges->data())};
      const int64_t chunk_cost = t.q_len * (hi - lo + kItemOverhead);
      *cost++ = static_cast<uint64_t>(chunk_cost);
      *key++ = cost_key(static_cast<uint64_t>(chunk_cost));
      total += chunk_cost;
      lo = hi;
    }
    *m++ = {t.q_begin, t.q_len, base, n};
    base += n * t.q_len;
  }
  *partial_rows = rows;
  out->total_cost = total;
}

// The LPT loop, for the items order[begin, end), over a tournament tree of 2^kDepth leaves (see
// balance()). The depth is a template argument so that the walk up unrolls into a straight
// chain of loads and branch-free minimums.
struct LptState {
  const uint32_t* order;
  const uint64_t* cost;
  int shift;
  uint64_t* tree;
  int32_t* owner;
  int32_t* per_worker;
};
constexpr uint64_t kWorkerMask = (uint64_t{1} << kWorkerBits) - 1;

template <int kDepth>
void lpt_walk(const LptState& st, uint32_t begin, uint32_t end) {
  constexpr uint32_t kLeaves = 1u << kDepth;
  const uint32_t* const order = st.order;
  const uint64_t* const cost = st.cost;
  const int shift = st.shift;
  uint64_t* const tree = st.tree;
  int32_t* const owner = st.owner;
  int32_t* const per_worker = st.per_worker;
  uint64_t least = tree[1];
  for (uint32_t j = begin; j < end; ++j) {
    const uint32_t i = order[j];
    const uint32_t w = static_cast<uint32_t>(least & kWorkerMask);
    owner[i] = static_cast<int32_t>(w);
    ++per_worker[w];
    uint64_t entry = least + (std::max<uint64_t>(1, cost[i] >> shift) << kWorkerBits);
    uint32_t node = kLeaves + w;
    tree[node] = entry;
#pragma GCC unroll 32
    for (int level = 0; level < kDepth; ++level) {
      entry = std::min(entry, tree[node ^ 1]);
      node >>= 1;
      tree[node] = entry;
    }
    least = entry;
  }
}

template <size_t... kDepths>
void lpt_walk_dispatch(int depth, const LptState& st, uint32_t begin, uint32_t end,
                       std::index_sequence<kDepths...>) {
  using Walk = void (*)(const LptState&, uint32_t, uint32_t);
  static constexpr Walk kWalks[] = {&lpt_walk<static_cast<int>(kDepths)>...};
  kWalks[depth](st, begin, end);
}

void lpt_walk_for_depth(int depth, const LptState& st, uint32_t begin, uint32_t end) {
  // depth <= kWorkerBits, since workers <= kMaxWorkers.
  lpt_walk_dispatch(depth, st, begin, end, std::make_index_sequence<kWorkerBits + 1>());
}

// LPT in rounds, for up to kMaxRankedWorkers workers. At the start of a round, with the workers
// ranked by entry (load, then id) E_0 < E_1 < ..., LPT gives the round's next item to worker
// rank 0, and the one after to rank 1 as long as rank 0's new entry is above E_1, and so on:
// item t goes to rank t while the minimum of the new entries of ranks 0..t-1 is above E_t.
// That holds for nearly every item of serving-like batches (one round is the next `workers`
// items, of similar costs), so a round ranks the workers once (a branch-free all-pairs count,
// four workers per vector compare) and then assigns item after item with no dependency chain
// through a tree; the first item it cannot prove ends the round, and the next round re-ranks.
// The result is exactly the tournament tree's (the same packed entries and ties).
// Up to 8 workers the tree is three levels deep and at least as fast as rounds
// (docs/perf/planner.md).
constexpr int32_t kMinRankedWorkers = 9;
constexpr int32_t kMaxRankedWorkers = 64;

// rank[w] = how many of entry[0, num) are below entry[w], for w < kLanes * kChunks (entry is
// padded to that length with INT32_MAX, above every entry). Vec: kLanes int32 lanes.
template <typename Vec, int kLanes, int kChunks>
__attribute__((always_inline)) inline void rank_entries(const int32_t* entry, int32_t num,
                                                        int32_t* rank) {
  Vec value[kChunks], below[kChunks];
  for (int c = 0; c < kChunks; ++c) {
    std::memcpy(&value[c], entry + kLanes * c, sizeof(Vec));
    below[c] = Vec{} + 0;
  }
  for (int32_t other = 0; other < num; ++other) {
    const Vec pivot = Vec{} + entry[other];
    for (int c = 0; c < kChunks; ++c) below[c] -= (value[c] > pivot);  // true is -1
  }
  for (int c = 0; c < kChunks; ++c) std::memcpy(rank + kLanes * c, &below[c], sizeof(Vec));
}

// The same, 4 or 8 lanes at a time: SSE2 (every x86-64) or AVX2 where the host has it.
// kChunks8: groups of 8 entries (the padding covers both).
using Int32x4 = int32_t __attribute__((vector_size(16)));
template <int kChunks8>
void rank_entries_sse2(const int32_t* entry, int32_t num, int32_t* rank) {
  rank_entries<Int32x4, 4, 2 * kChunks8>(entry, num, rank);
}
#if defined(__x86_64__) || defined(__i386__)
template <int kChunks8>
__attribute__((target("avx2"))) void rank_entries_avx2(const int32_t* entry, int32_t num,
                                                       int32_t* rank) {
  using Int32x8 = int32_t __attribute__((vector_size(32)));
  rank_entries<Int32x8, 8, kChunks8>(entry, num, rank);
}
bool host_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#else
template <int kChunks8>
void rank_entries_avx2(const int32_t* entry, int32_t num, int32_t* rank) {
  rank_entries_sse2<kChunks8>(entry, num, rank);
}
bool host_has_avx2() { return false; }
#endif

struct RoundsState {
  const uint32_t* order;
  const uint64_t* cost;  // unscaled (rounds run only where the tree's shift is 0)
  int32_t workers;
  uint64_t* load;  // [workers]
  int32_t* owner;
  int32_t* per_worker;
};

// Assigns the items order[begin, end) in rounds; returns where it stopped: `end`, or earlier
// when rounds got too short to pay for their ranking (items much smaller than the spread of
// the loads), leaving the rest to the tree. Entries are 32-bit, relative to the least load
// (the spread of LPT's loads is at most the largest item; the caller checks that it fits).
template <int kChunks8>
uint32_t lpt_rounds(const RoundsState& st, uint32_t begin, uint32_t end) {
  constexpr int kPadded = 8 * kChunks8;
  const bool avx2 = host_has_avx2();
  const int32_t workers = st.workers;
  // Bits of a worker id in an entry: those of 8 * kChunks8 - 1, the same as of workers - 1.
  constexpr int bits = kChunks8 <= 2 ? 4 : kChunks8 <= 4 ? 5 : 6;
  const int32_t min_round = std::max(1, workers / 4);
  uint64_t* const load = st.load;
  alignas(32) int32_t entry[kPadded];
  int32_t rank[kPadded], by_rank[kPadded];
  uint64_t base = load[0];
  for (int32_t w = 1; w < workers; ++w) base = std::min(base, load[w]);
  for (int32_t w = workers; w < kPadded; ++w) entry[w] = INT32_MAX;
  uint32_t j = begin;
  while (j < end) {
    for (int32_t w = 0; w < workers; ++w)
      entry[w] = static_cast<int32_t>(((load[w] - base) << bits) | static_cast<uint32_t>(w));
    if (avx2)
      rank_entries_avx2<kChunks8>(entry, workers, rank);
    else
      rank_entries_sse2<kChunks8>(entry, workers, rank);
    for (int32_t w = 0; w < workers; ++w) by_rank[rank[w]] = w;
    const uint32_t round = std::min<uint32_t>(static_cast<uint32_t>(workers), end - j);
    uint64_t least_new = UINT64_MAX;  // the least new entry of this round
    uint32_t t = 0;
    for (;;) {
      const int32_t w = by_rank[t];
      const uint32_t i = st.order[j + t];
      const uint64_t c = st.cost[i];
      st.owner[i] = w;
      ++st.per_worker[w];
      load[w] += c;
      least_new = std::min(least_new, static_cast<uint64_t>(entry[w]) + (c << bits));
      if (++t == round || least_new < static_cast<uint64_t>(entry[by_rank[t]])) break;
    }
    j += t;
    // The least load now: the least new entry, or an untouched rank-t worker's.
    const uint64_t least = t < static_cast<uint32_t>(workers)
                               ? std::min(least_new, static_cast<uint64_t>(entry[by_rank[t]]))
                               : least_new;
    base += least >> bits;
    if (static_cast<int32_t>(t) < min_round) break;
  }
  return j;
}

template <size_t... kChunks8>
uint32_t lpt_rounds_dispatch(const RoundsState& st, uint32_t begin, uint32_t end,
                             std::index_sequence<kChunks8...>) {
  using Rounds = uint32_t (*)(const RoundsState&, uint32_t, uint32_t);
  static constexpr Rounds kRounds[] = {&lpt_rounds<static_cast<int>(kChunks8) + 1>...};
  return kRounds[(st.workers - 1) / 8](st, begin, end);
}

// LPT: items costliest first, each to the least-loaded worker (ties: the lowest id); writes
// the items grouped by worker (each worker's in planning order) into p->items and
// p->worker_indptr. Needs more items than workers.
void balance(const ItemList& items, int32_t num_workers, Scratch& s, Plan* p) {
  const uint32_t n = static_cast<uint32_t>(items.size());
  const WorkItem* src = items.items.data();
  const uint64_t* cost = items.cost.data();
  const uint8_t* key = items.key.data();
  const uint64_t total = static_cast<uint64_t>(items.total_cost);
  s.order.resize(n);
  s.owner.resize(n);
  uint32_t* order = s.order.data();
  int32_t* owner = s.owner.data();

  // 1. The items in descending cost order, by a counting sort on their keys. Items alternate
  // between two counter sets, so that runs of equal keys (the tiles of one request) do not
  // serialize on one counter; within a key, even-numbered items come first, then odd ones, each
  // in item order.
  // The key range first, in its own loop: it vectorizes there, while next to the counting it
  // would be two chains of one dependent minimum per item.
  uint8_t lowest = 255, highest = 0;
  for (uint32_t i = 0; i < n; ++i) {
    lowest = std::min(lowest, key[i]);
    highest = std::max(highest, key[i]);
  }
  uint32_t count[256][2];
  std::memset(count + lowest, 0, std::max(0, highest - lowest + 1) * sizeof(count[0]));
  for (uint32_t i = 0; i < n; ++i) ++count[key[i]][i & 1];
  uint32_t next = 0;
  for (int k = highest; k >= lowest; --k) {
    const uint32_t even = count[k][0], odd = count[k][1];
    count[k][0] = next;
    count[k][1] = next + even;
    next += even + odd;
  }
  for (uint32_t i = 0; i < n; ++i) order[count[key[i]][i & 1]++] = i;

  // 2. LPT. The least-loaded worker comes from a tournament tree over packed (load, worker)
  // entries: updating a leaf walks up its log2(workers) ancestors, loading only siblings, so
  // one item's assignment is a short chain of branch-free minimums. Loads are scaled down when
  // they could overflow the packed entries.
  const int shift = std::max(0, bit_width(total) - kLoadBits + 1);
  // worker_indptr[w + 1] counts worker w's items first.
  p->worker_indptr.assign(num_workers + 1, 0);
  int32_t* per_worker = p->worker_indptr.data() + 1;
  s.load.resize(num_workers);
  uint64_t* load = s.load.data();
  // The costliest `num_workers` items: one to each worker, as LPT would (all loads are 0).
  for (int32_t w = 0; w < num_workers; ++w) {
    owner[order[w]] = w;
    per_worker[w] = 1;
    load[w] = std::max<uint64_t>(1, cost[order[w]] >> shift);
  }
  uint32_t done = static_cast<uint32_t>(num_workers);
  // Rounds need entries (spread of the loads << worker bits | worker) below INT32_MAX; the
  // spread is at most the largest item, below 2^(highest / 8 + 5) (see cost_key). They use
  // the costs unscaled, as the tree does below 2^42 in all.
  const int worker_bits = bit_width(static_cast<uint64_t>(num_workers - 1));  // <= 6
  // (A round must assign a quarter of the workers' worth of items to pay for its ranking.)
  if (num_workers >= kMinRankedWorkers && num_workers <= kMaxRankedWorkers &&
      n - done >= static_cast<uint32_t>(num_workers / 4) && shift == 0 && highest < 255 &&
      highest / 8 + 6 + worker_bits <= 30) {
    const RoundsState rounds{order, cost, num_workers, load, owner, per_worker};
    done = lpt_rounds_dispatch(rounds, done, n, std::make_index_sequence<kMaxRankedWorkers / 8>());
  }
  if (done < n) {
    int depth = 0;
    while ((1 << depth) < num_workers) ++depth;
    const int32_t leaves = 1 << depth;
    // tree[leaves + w]: worker w's entry (padding leaves: never the minimum); tree[i] for
    // 1 <= i < leaves: the minimum of its two children.
    s.tree.assign(2 * static_cast<size_t>(leaves), UINT64_MAX);
    uint64_t* tree = s.tree.data();
    for (int32_t w = 0; w < num_workers; ++w)
      tree[leaves + w] = (load[w] << kWorkerBits) | static_cast<uint64_t>(w);
    for (int32_t i = leaves - 1; i >= 1; --i) tree[i] = std::min(tree[2 * i], tree[2 * i + 1]);
    const LptState state{order, cost, shift, tree, owner, per_worker};
    lpt_walk_for_depth(depth, state, done, n);
  }

  // 3. Group by worker.
  int32_t* indptr = p->worker_indptr.data();
  for (int32_t w = 0; w < num_workers; ++w) indptr[w + 1] += indptr[w];
  s.cursor.assign(indptr, indptr + num_workers);
  p->items.resize(n);
  WorkItem* dst = p->items.data();
  int32_t* cursor = s.cursor.data();
  for (uint32_t i = 0; i < n; ++i) dst[cursor[owner[i]]++] = src[i];
}

// Decode on CUDA, automatic split: McNaughton's wrap-around rule. The tiles (one query row each),
// in request order, are laid end to end and cut into `runs` runs of equal cost, one a worker; a
// tile that straddles a run's end is cut there, down to a multiple of `align`, and its pieces
// are merged. Every worker's load is then the average give or take about an alignment unit and
// an item's overhead, where whole tiles (or equal parts of the long ones) assigned costliest
// first can leave a worker a whole tile above the rest: 40 x 4096 on 33 workers ran as two
// waves of whole requests, the second on 7 workers. At most runs - 1 cuts (each an item and its
// overhead more). Writes the items (grouped by worker: the runs in order), worker_indptr
// (runs + 1 entries), the merges and their partial rows into the scratch (s.run_*); returns the
// makespan, or -1 when a run would be empty (a tile longer than the rest shifted a cut past a
// whole run; the caller then keeps its plan).
int64_t wrap_tiles(const ItemList& tiles, int32_t runs, uint32_t align, Scratch& s,
                   int64_t* partial_rows) {
  // Each cut adds an item's overhead; the run ends are spaced for runs - 1 of them.
  const int64_t total = tiles.total_cost + int64_t{runs - 1} * kItemOverhead;
  // Run w ends at floor(total (w + 1) / runs), stepped without a division per run.
  const int64_t each = total / runs, spare = total % runs;
  int64_t end = each, carry = spare;
  // Room for every item (each cut adds one), written field by field: an item built whole and
  // pushed costs a store-forwarding stall each (twice the planner's time at 256 requests).
  std::vector<WorkItem>& out = s.run_items;
  std::vector<MergeItem>& merges = s.run_merges;
  out.resize(tiles.size() + static_cast<size_t>(runs));
  merges.clear();
  WorkItem* const items = out.data();
  size_t n = 0;
  s.run_indptr.assign(static_cast<size_t>(runs) + 1, 0);
  s.run_load.assign(static_cast<size_t>(runs), 0);
  int32_t* per_run = s.run_indptr.data() + 1;
  int64_t* load = s.run_load.data();
  int64_t rows = 0, pos = 0;  // pos: the cost laid out so far
  int32_t w = 0;
  for (size_t i = 0; i < tiles.size(); ++i) {
    const WorkItem& t = tiles.items[i];
    const size_t first = n;
    auto emit = [&](int64_t lo, int64_t hi) {
      WorkItem& it = items[n];
      it.request = t.request;
      it.q_begin = t.q_begin;
      it.q_len = t.q_len;
      it.kv_begin = static_cast<int32_t>(lo);
      it.kv_end = static_cast<int32_t>(hi);
      it.partial = -1;
      it.chunk = static_cast<int32_t>(n - first);
      it.merge = 0;
      const int64_t cost = item_cost(it);
      ++n;
      ++per_run[w];
      load[w] += cost;
      pos += cost;
    };
    int64_t lo = t.kv_begin;
    const int64_t hi = t.kv_end;
    for (;;) {
      if (w == runs - 1 || pos + (hi - lo + kItemOverhead) <= end) {
        emit(lo, hi);
        break;
      }
      // The head that fills run w: what is left of it, down to an alignment unit (so no run
      // ends past its end; cut < hi, since the rest does not fit).
      const int64_t room = end - pos - kItemOverhead;
      // (lo + room < hi: a KV position, so the division is a 32-bit one.)
      const int64_t cut =
          room <= 0 ? lo : static_cast<uint32_t>(lo + room) / align * int64_t{align};
      if (cut > lo) {
        emit(lo, cut);
        lo = cut;
      }
      ++w;  // run w is full; the next one ends a run's share further on
      end += each;
      carry += spare;
      if (carry >= runs) {
        carry -= runs;
        ++end;
      }
    }
    const int32_t pieces = static_cast<int32_t>(n - first);
    if (pieces > 1) {
      const int32_t merge = static_cast<int32_t>(merges.size());
      merges.push_back({t.q_begin, t.q_len, static_cast<int32_t>(rows), pieces});
      for (int32_t c = 0; c < pieces; ++c) {
        WorkItem& it = items[first + c];
        it.partial = static_cast<int32_t>(rows + int64_t{c} * t.q_len);
        it.merge = merge;
      }
      rows += int64_t{pieces} * t.q_len;
    }
  }
  out.resize(n);
  int64_t makespan = 0;
  for (int32_t r = 0; r < runs; ++r) {
    if (per_run[r] == 0) return -1;
    makespan = std::max(makespan, load[r]);
  }
  for (int32_t r = 0; r < runs; ++r) per_run[r] += per_run[r - 1];  // per_run[-1] is 0
  *partial_rows = rows;
  return makespan;
}

// Workspace capacities: this plan's counts, or in graph mode bounds from the options alone.
void set_capacities(const PlanOptions& o, bool decode, int64_t chunk, int32_t workers, Plan* p) {
  WorkspaceLayout& l = p->layout;
  l.max_items = static_cast<int64_t>(p->items.size());
  l.max_merges = static_cast<int64_t>(p->merges.size());
  l.max_partial_rows = p->num_partial_rows;
  if (!o.cuda_graph) return;
  const int64_t max_tokens = decode ? o.max_batch_size : o.max_num_tokens;
  const int64_t max_tiles = max_tiles_of(max_tokens, o.max_batch_size, p->q_tile);
  int64_t items = max_tiles, merges = 0, rows = 0;
  if (o.enable_split_kv && o.fixed_split_size > 0) {
    // A tile's KV lies in [0, max_kv_len): it touches at most this many absolute chunks.
    const int64_t chunks = ceil_div(o.max_kv_len, chunk);
    items = max_tiles * chunks;
    if (chunks > 1) {
      merges = max_tiles;
      rows = chunks * max_tokens;
    }
  } else if (o.enable_split_kv) {
    // An automatic split adds at most `workers` items, and a tile cut into n >= 2 chunks adds
    // n - 1 of them: at most `workers` merges, and partial rows sum(n * q_len) <= 2 * workers *
    // q_tile.
    items = max_tiles + workers;
    merges = std::min<int64_t>(max_tiles, workers);
    rows = 2 * int64_t{workers} * p->q_tile;
  }
  FLASHKV_CHECK(l.max_items <= items && l.max_merges <= merges && l.max_partial_rows <= rows,
                "plan: the batch needs ", l.max_items, " items / ", l.max_merges, " merges / ",
                l.max_partial_rows, " partial rows, past the graph capacities ", items, " / ",
                merges, " / ", rows);
  FLASHKV_CHECK(items <= INT32_MAX && rows <= INT32_MAX,
                "max_num_tokens/max_kv_len: the graph "
                "capacities need ",
                items, " items and ", rows, " partial rows, past the int32 range of the plan");
  l.max_items = items;
  l.max_merges = merges;
  l.max_partial_rows = rows;
}

void set_layout(const BatchShape& b, Plan* p) {
  WorkspaceLayout& l = p->layout;
  l.header = 0;
  l.items = align_up(sizeof(PlanHeader));
  l.worker_indptr = l.items + align_up(l.max_items * sizeof(WorkItem));
  l.merges = l.worker_indptr + align_up((int64_t{p->num_workers} + 1) * sizeof(int32_t));
  l.merge_counters = l.merges + align_up(l.max_merges * sizeof(MergeItem));
  l.plan_bytes = l.merge_counters + align_up(l.max_merges * b.num_qo_heads * sizeof(int32_t));
  const size_t rows = static_cast<size_t>(l.max_partial_rows) * b.num_qo_heads;
  l.partial_o = l.plan_bytes;
  l.partial_lse = l.partial_o + align_up(rows * b.head_dim_v * sizeof(float));
  l.total_bytes = l.partial_lse + align_up(rows * sizeof(float));
}

// How long a plan with these worker loads runs, in a fluid model of a bandwidth-bound device:
// each worker streams at one unit of load per unit of time while at most `busy` (>= 1) workers
// stream, and they share `busy` units between them when more do. With the loads sorted, largest
// first, the k largest are the ones still streaming while the load falls from L_k to L_k+1:
// time = sum_k (L_k - L_k+1) max(1, k / busy) = L_1 + L_m+1 ((m + 1) / busy - 1) + the sum of
// L_m+2 .. L_n over busy, for m = floor(busy): a selection, not a sort. Reorders `loads`.
double fluid_time(std::vector<int64_t>& loads, double busy) {
  const size_t n = loads.size(), m = static_cast<size_t>(busy);
  if (n == 0) return 0;
  if (n <= m) return static_cast<double>(*std::max_element(loads.begin(), loads.end()));
  std::nth_element(loads.begin(), loads.begin() + m, loads.end(), std::greater<int64_t>());
  int64_t rest = 0;
  for (size_t k = m + 1; k < n; ++k) rest += loads[k];
  const int64_t largest = *std::max_element(loads.begin(), loads.begin() + m);  // m >= 1
  return static_cast<double>(largest) +
         static_cast<double>(loads[m]) * ((static_cast<double>(m) + 1) / busy - 1) +
         static_cast<double>(rest) / busy;
}

// The share of a wave's workers that saturates memory bandwidth (fluid_time's `busy`), and the
// gain equal runs must bring in that model to replace a plan. kBusyShare: about that share of
// the CTA slots, each streaming at its own small rate, saturates HBM, so more streaming workers
// share the bandwidth rather than add to it. kRunsGain: equal runs cost a little more in items
// and merges where both plans run in the same time, so they must win by more than that; they win
// where costliest-first plans end with a few workers streaming alone. Figures:
// docs/perf/decode.md, "Equal runs".
constexpr double kBusyShare = 0.625;
constexpr double kRunsGain = 1.03;

// Replaces the plan's assignment by equal runs (wrap_tiles) where fluid_time says they run at
// least kRunsGain times faster. The runs: one a worker, or fewer where the batch's KV is short
// (one a tile, and no more than the tokens in min_split_size parts, as the split of one short
// tile).
void try_equal_runs(Scratch& s, int32_t max_workers, int64_t align, const PlanOptions& o,
                    int64_t longest, Plan* p) {
  const ItemList& tiles = s.tiles;
  // Decode tiles are one row each: their cost is their KV plus the item overhead.
  const int64_t tokens = tiles.total_cost - static_cast<int64_t>(tiles.size()) * kItemOverhead;
  const int64_t min_chunk =
      o.min_split_size > 0 ? o.min_split_size : default_min_split(true, longest);
  const int64_t runs = std::min<int64_t>(
      max_workers,
      std::max<int64_t>({int64_t{1}, static_cast<int64_t>(tiles.size()), tokens / min_chunk}));
  if (runs < 2) return;
  const double busy = std::max(1.0, kBusyShare * max_workers);
  // This plan's time, and the least that equal runs could take (every run the average).
  std::vector<int64_t>& loads = s.run_load;
  loads.assign(static_cast<size_t>(p->num_workers), 0);
  for (int32_t w = 0; w < p->num_workers; ++w)
    for (int32_t i = p->worker_indptr[w]; i < p->worker_indptr[w + 1]; ++i)
      loads[w] += item_cost(p->items[i]);
  const double current = fluid_time(loads, busy);
  const double ideal = static_cast<double>(tiles.total_cost) / static_cast<double>(runs) *
                       std::max(1.0, static_cast<double>(runs) / busy);
  if (ideal * kRunsGain >= current) return;
  int64_t rows = 0;
  if (wrap_tiles(tiles, static_cast<int32_t>(runs), static_cast<uint32_t>(align), s, &rows) < 0)
    return;
  if (fluid_time(s.run_load, busy) * kRunsGain >= current) return;
  p->items.swap(s.run_items);
  p->merges.swap(s.run_merges);
  p->worker_indptr.swap(s.run_indptr);
  p->num_partial_rows = rows;
  if (!p->cuda_graph) {
    p->num_workers = static_cast<int32_t>(runs);
  } else {  // a fixed grid: the workers past the runs get no items
    p->worker_indptr.resize(static_cast<size_t>(p->num_workers) + 1, p->worker_indptr.back());
  }
  int32_t longest_item = 0;
  for (const WorkItem& it : p->items)
    longest_item = std::max(longest_item, it.kv_end - it.kv_begin);
  p->kv_chunk = p->merges.empty() ? 0 : longest_item;
  p->equal_runs = true;
}

void plan_common(const BatchShape& b, const DeviceInfo& dev, const PlanOptions& o, bool decode,
                 Plan* out) {
  Plan& p = *out;
  p.id = 0;  // unusable until planning completes (a throw leaves it so)
  validate(b, o, dev, decode);
  Scratch& s = scratch();
  p.batch_size = b.batch_size;
  p.num_qo_tokens = decode ? b.batch_size : b.qo_indptr[b.batch_size];
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
  const int64_t longest = build_tiles(b, decode, p.q_tile, &s.tiles);
  p.num_tiles = static_cast<int32_t>(s.tiles.size());

  // 2. The chunk size: chunks never cut a page, and are multiples of the kernel's KV tile.
  int64_t align = o.kv_align > 0 ? o.kv_align : kDefaultKvAlign;
  align = ceil_div(align, b.page_size) * b.page_size;
  int64_t chunk = 0, part = 0;
  if (o.enable_split_kv && o.fixed_split_size > 0) {
    chunk = ceil_div(o.fixed_split_size, align) * align;
  } else if (o.enable_split_kv) {
    part = auto_part(s.tiles, longest, max_workers, p.q_tile, align,
                     o.min_split_size > 0 ? o.min_split_size : default_min_split(decode, longest));
    chunk = part * align;
  }
  p.kv_chunk = static_cast<int32_t>(std::min<int64_t>(chunk, INT32_MAX));

  // 3. Items (planning order) and merges.
  const ItemList* items = &s.tiles;
  p.merges.clear();
  p.num_partial_rows = 0;
  if (chunk > 0) {
    split_tiles(s.tiles, p.kv_chunk, static_cast<uint32_t>(part), static_cast<uint32_t>(align),
                &s.split, &p.merges, &p.num_partial_rows, &s.chunks_per_tile);
    items = &s.split;
  }
  const int32_t num_items = static_cast<int32_t>(items->size());

  // 4. Workers: a fixed count on the CPU and in graph mode, else no more than there are items.
  p.num_workers = (dev.device.is_cpu() || o.cuda_graph)
                      ? max_workers
                      : std::min(max_workers, std::max(num_items, 1));
  const int32_t W = p.num_workers;
  if (num_items <= W) {  // one item a worker, in planning order
    p.worker_indptr.resize(W + 1);
    for (int32_t w = 0; w <= W; ++w) p.worker_indptr[w] = std::min(w, num_items);
    p.items.assign(items->items.begin(), items->items.end());
  } else {
    balance(*items, W, s, &p);
  }
  p.equal_runs = false;
  if (decode && !dev.device.is_cpu() && o.enable_split_kv && o.fixed_split_size == 0)
    try_equal_runs(s, max_workers, align, o, longest, &p);

  // 5. Workspace layout (capacities in graph mode).
  set_capacities(o, decode, chunk, W, &p);
  set_layout(b, &p);
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
PrefillPlan plan_prefill(const BatchShape& batch, const DeviceInfo& device,
                         const PlanOptions& opt) {
  PrefillPlan p;
  plan_prefill(batch, device, opt, &p);
  return p;
}

void serialize_plan(const Plan& plan, void* dst) {
  const WorkspaceLayout& l = plan.layout;
  FLASHKV_CHECK(plan.id != 0,
                "serialize_plan: plan: expected a plan from plan_decode/plan_prefill");
  FLASHKV_CHECK(dst != nullptr, "serialize_plan: dst: expected ", l.plan_bytes, " bytes, got null");
  auto* base = static_cast<unsigned char*>(dst);
  const PlanHeader header{kPlanMagic,
                          kPlanFormatVersion,
                          static_cast<int32_t>(plan.items.size()),
                          static_cast<int32_t>(plan.merges.size()),
                          plan.num_workers,
                          static_cast<int32_t>(plan.num_partial_rows),
                          plan.batch_size,
                          0};
  std::memcpy(base + l.header, &header, sizeof(header));
  if (!plan.items.empty())
    std::memcpy(base + l.items, plan.items.data(), plan.items.size() * sizeof(WorkItem));
  std::memcpy(base + l.worker_indptr, plan.worker_indptr.data(),
              plan.worker_indptr.size() * sizeof(int32_t));
  if (!plan.merges.empty())
    std::memcpy(base + l.merges, plan.merges.data(), plan.merges.size() * sizeof(MergeItem));
  // Graph mode: a merge launch sized for the capacity finds empty merges past the real ones.
  const size_t used = plan.merges.size() * sizeof(MergeItem);
  std::memset(base + l.merges + used, 0,
              static_cast<size_t>(l.max_merges) * sizeof(MergeItem) - used);
  std::memset(base + l.merge_counters, 0, l.plan_bytes - l.merge_counters);
}

}  // namespace flashkv
