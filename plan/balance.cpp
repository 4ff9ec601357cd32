// Assigning a plan's items to its workers.
// - Balance (balance): items go to workers costliest first, each to the least-loaded worker (LPT
//   greedy). It is the planner's hot loop, so: "costliest first" is one counting-sort pass on an
//   8-bit float-like key made with the tiles (cost_key in plan.cpp: costs within 12.5% may swap;
//   the cost model is no more exact than that), the first `workers` items go one to each worker,
//   and the rest go in rounds: with the workers ranked by load once (a vector all-pairs count),
//   the next items go to them in that order for as long as that is provably what LPT does, which
//   on serving batches is nearly always (see lpt_rounds). Where rounds do not pay (<= 8 or > 64
//   workers, items much smaller than the spread of the loads), the least-loaded worker comes
//   from a tournament tree, whose update is an unrolled chain of branch-free minimums. Both give
//   the same plan. The planner's host time: docs/perf/planner.md.
// - Equal runs (wrap_tiles): the tiles laid end to end and cut into runs of equal cost, one a
//   worker; plan.cpp's try_equal_runs decides when they replace the LPT plan.
#include <algorithm>
#include <climits>
#include <cstring>
#include <utility>

#include "flashkv/core/error.h"
#include "plan_detail.h"

namespace flashkv::plan_detail {
namespace {

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

}  // namespace

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

}  // namespace flashkv::plan_detail
