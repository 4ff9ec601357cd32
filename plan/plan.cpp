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
// - Balance: items go to workers costliest first, each to the least-loaded worker (LPT), and,
//   for decode on CUDA where a few workers would end up streaming alone (40 x 4096 on 33
//   workers: 7 of them take a second request), equal runs instead: the tiles laid end to end and
//   cut into runs of equal cost, one a worker (McNaughton's wrap-around rule), chosen where a
//   fluid model of a bandwidth-bound GPU says they run at least 3% faster, since the extra cuts
//   cost items and merges (try_equal_runs). The assignment itself is in plan/balance.cpp.
// - Graph mode: the worker count and the workspace layout come from the capacities only, so a
//   graph captured once replays with any batch that fits.
#include "flashkv/plan/plan.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <functional>
#include <numeric>
#include <type_traits>
#include <utility>

#include "flashkv/core/error.h"
#include "flashkv/core/visibility.h"
#include "plan_detail.h"

namespace flashkv {

namespace plan_detail {
Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}
}  // namespace plan_detail

namespace {

using namespace plan_detail;

std::atomic<uint64_t> g_next_plan_id{1};
constexpr size_t kAlign = 256;
constexpr int32_t kDefaultKvAlign = 16;
constexpr int32_t kDefaultMinSplit = 256;
constexpr int32_t kDefaultBlocksPerSm = 2;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
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

// The workers a KV head a CUDA prefill's items are spread over, at the default blocks_per_sm:
// `workers` (one wave's) rounded up to whole waves. The sm_90a kernels fit one CTA an SM, so a
// grid of num_sms * 2 - k CTAs leaves k SMs idle through its second wave (256 CTAs at 32 KV
// heads on 132 SMs), where 33 workers a head (1056 CTAs, 8 waves) keep them busy. Where whole
// waves would take more than 8 waves of one CTA an SM, the count stays. Only the spreading
// changes: the KV split is still sized on `workers`. Decode (measured for prefill only) and an
// explicit blocks_per_sm keep `workers`; the caller asks on CUDA outside graph mode only (graph
// mode has a fixed count, which short batches would pay for in empty CTAs).
int32_t spread_workers_of(int32_t workers, const BatchShape& b, const DeviceInfo& dev,
                          const PlanOptions& o, bool decode) {
  if (decode || o.blocks_per_sm > 0) return workers;
  const int64_t slots = int64_t{dev.num_sms} * kDefaultBlocksPerSm;
  const int64_t unit = slots / std::gcd<int64_t>(slots, b.num_kv_heads);
  const int64_t whole = ceil_div(workers, unit) * unit;
  return whole * b.num_kv_heads <= 4 * slots && whole <= kMaxWorkers ? static_cast<int32_t>(whole)
                                                                     : workers;
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
// which are fixed per batch. The batch's fields are read into locals first: the key stores are
// bytes, which may alias anything, and would otherwise reload them for every tile.
int64_t build_tiles(const BatchShape& b, bool decode, int32_t q_tile, ItemList* tiles) {
  const int32_t batch = b.batch_size;
  const int32_t* const qo_indptr = b.qo_indptr;
  const int32_t* const kv_lens = b.kv_len;
  const int32_t window = b.window_left;
  // Room for the most tiles the rows can make (no division per request), trimmed below.
  const int64_t room =
      decode ? batch : max_tiles_of(qo_indptr[batch] - qo_indptr[0], batch, q_tile);
  tiles->resize(room);
  WorkItem* const first = tiles->items.data();
  WorkItem* t = first;
  uint64_t* cost = tiles->cost.data();
  uint8_t* key = tiles->key.data();
  int64_t longest = 0, total = 0;
  auto emit = [&](int32_t r, int32_t q_begin, int32_t q_len, int32_t lo, int32_t hi) {
    const WorkItem item{r, q_begin, q_len, lo, hi, -1, 0, 0};
    *t++ = item;
    const int64_t c = item_cost(item);
    *cost++ = static_cast<uint64_t>(c);
    *key++ = cost_key(static_cast<uint64_t>(c));
    longest = std::max(longest, int64_t{hi} - lo);
    total += c;
  };
  with_flag(window >= 0, [&](auto windowed) {
    if (decode) {
      for (int32_t r = 0; r < batch; ++r) {
        const int32_t kv_len = kv_lens[r];
        // The one row sits at position kv_len - 1: causal trims nothing.
        int32_t lo = 0;
        if constexpr (windowed)
          lo = std::clamp(window_first_key(query_position(kv_len, 1, 0), window), 0, kv_len);
        emit(r, r, 1, lo, kv_len);
      }
      return;
    }
    with_flag(b.causal, [&](auto causal) {
      for (int32_t r = 0; r < batch; ++r) {
        const int32_t q0 = qo_indptr[r];
        const int32_t q_len = qo_indptr[r + 1] - q0;
        const int64_t kv_len = kv_lens[r];
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
          emit(r, q0 + row, rows, static_cast<int32_t>(lo), static_cast<int32_t>(hi));
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
    for (const WorkItem& t : tiles)
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
    for (const WorkItem& t : tiles) {
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
  p.num_workers =
      (dev.device.is_cpu() || o.cuda_graph)
          ? max_workers
          : std::min(spread_workers_of(max_workers, b, dev, o, decode), std::max(num_items, 1));
  const int32_t W = p.num_workers;
  if (num_items <= W) {  // one item a worker, in planning order
    p.worker_indptr.resize(W + 1);
    for (int32_t w = 0; w <= W; ++w) p.worker_indptr[w] = std::min(w, num_items);
    p.items.assign(items->begin(), items->end());
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
