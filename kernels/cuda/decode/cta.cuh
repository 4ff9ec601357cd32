// One CTA of the paged-decode kernel (decode_kernel.cuh): its state, its shared-memory layout
// and the views of its items. The member functions are defined by role: the tile schedule and
// the K/V/Q copies in decode/load.cuh, the per-block math in decode/compute.cuh, the end of an
// item and the merge of split tiles in decode/merge.cuh; decode_kernel.cuh composes them (run).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "common/swizzle.cuh"
#include "decode/trace.cuh"
#include "decode/traits.h"
#include "flashkv/core/visibility.h"
#include "flashkv/plan/plan.h"

namespace flashkv::cuda::decode_detail {

// An item as the kernel walks it (the first kItemSlots items of a CTA sit in shared memory,
// made once at the start, so that moving to the next item costs no dependent global loads).
struct alignas(8) ItemView {
  int32_t row;         // query / output row
  int32_t partial;     // -1: write the output; else the partial row
  int32_t lo, hi;      // KV positions to attend, [lo, hi); empty when lo >= hi
  int32_t entry_base;  // kv_indptr[request]: first kv_indices entry of the request
  int32_t merge;       // split items: the tile's MergeItem
};
static_assert(sizeof(ItemView) == kItemViewBytes, "ItemView size (traits.h)");

// A split tile whose last chunk a CTA brought in: where its chunks' partial states are (rows
// partial + c * q_len, c < num_chunks) and its output row.
struct TileMerge {
  int32_t row, partial, num_chunks, q_len;
};

// Request-layout reads. kL2: from L2 (ld.global.cg), for reads made before griddepcontrol.wait
// (AttentionParams::layout_ready), which must not see lines this SM's L1 kept from earlier work.
template <bool kL2 = false>
__device__ __forceinline__ int32_t layout_load(const int32_t* ptr) {
  if constexpr (kL2)
    return __ldcg(ptr);
  else
    return *ptr;
}

template <bool kL2 = false>
__device__ __forceinline__ int32_t kv_len_of(const AttentionParams& p, int32_t r) {
  const int32_t n = layout_load<kL2>(p.kv_indptr + r + 1) - layout_load<kL2>(p.kv_indptr + r);
  if (p.page_size == 1 || n <= 0) return n > 0 ? n : 0;
  return (n - 1) * p.page_size + layout_load<kL2>(p.last_page_len + r);
}

template <bool kL2 = false>
__device__ __forceinline__ ItemView view_of(const AttentionParams& p, const WorkItem& it) {
  const int32_t kv_len = kv_len_of<kL2>(p, it.request);
  ItemView v;
  v.row = it.q_begin;
  v.partial = it.partial;
  v.merge = it.merge;
  v.entry_base = layout_load<kL2>(p.kv_indptr + it.request);
  v.lo = max(it.kv_begin, 0);
  v.hi = min(it.kv_end, kv_len);
  // The one query sits at position kv_len - 1 (core/visibility.h): the window starts
  // window_left before it. Causal masking hides nothing from the last position.
  if (p.window_left >= 0)
    v.lo = max(v.lo, window_first_key(query_position(kv_len, 1, 0), p.window_left));
  return v;
}

// Byte offset of 16-byte chunk `chunk` of K/V tile row `row` (common/swizzle.cuh).
template <class Tr>
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return static_cast<uint32_t>(swizzled_offset<Tr::kChunks, 1, Tr::kSwizzle>(row, chunk));
}

template <class Tr, typename QT, KvFormat kKv>
struct DecodeCta {
  static constexpr int D = Tr::kHeadDim;
  static constexpr int NT = Tr::kHeads / 8;
  static constexpr int T = Tr::kTileTokens;
  static constexpr bool kFp8 = kKv != KvFormat::kSame;
  using MT = std::conditional_t<kFp8, half, QT>;  // mma operand type

  const AttentionParams& p;
  unsigned char* smem;
  int tid, warp, lane, r, c;  // r = lane / 4, c = lane % 4: the mma fragment coordinates
  int kv_head, heads, qh0;    // heads handled (<= kHeads) and the first one's global index
  int32_t first_item;         // the CTA's first item (its view is item_views()[0])
  float score_scale, softcap_in, softcap_out;  // for the whole kernel
  float item_score_scale, item_softcap_in;     // the same over the item's query scale
  FLASHKV_TRACE(trace::Timeline* timeline; int merged_tiles = 0;)

  // Three walks over the same tile stream: the indices (kStages - 1 tiles ahead of the data),
  // the K/V data (kStages - 1 tiles ahead of the compute) and the compute.
  struct Cursor {
    int32_t item, last, pos;
    bool first;
    ItemView v;
  } ind, prod, cons;
  int32_t ind_tile = 0, prod_tile = 0;  // tiles issued so far by each walk (ring positions)

  // Consumer state of this warp.
  uint32_t q_frag[Tr::kKSteps][NT][2];
  float m[NT][2], l[NT][2];
  float o[Tr::kMTiles][NT][4];
  // The sink logits (as stored, natural base; -inf: none) of this lane's heads 8n + 2c + j, which
  // finalize merges in (in base 2); every warp needs them, since the sink can raise the row's
  // maximum that each warp rescales its output to. Loaded once at the start by a predicated load
  // into this register, which nothing reads before finalize, so that its latency overlaps the
  // first item instead of delaying the CTA's start or the end of every item.
  float sink[NT][2];

  __device__ unsigned char* stage_ptr(int s) const { return smem + s * Tr::kStageBytes; }
  __device__ float* out_buf() const {
    return reinterpret_cast<float*>(smem + kStages * Tr::kStageBytes);
  }
  __device__ float* red() const {
    return reinterpret_cast<float*>(smem + kStages * Tr::kStageBytes + Tr::kOutBytes);
  }
  __device__ int32_t* index_ring(int tile) const {
    return reinterpret_cast<int32_t*>(smem + kStages * Tr::kStageBytes + Tr::kOutBytes +
                                      Tr::kRedBytes) +
           (tile % Tr::kIndexSlots) * T;
  }
  __device__ ItemView* item_views() const {
    return reinterpret_cast<ItemView*>(smem + kStages * Tr::kStageBytes + Tr::kOutBytes +
                                       Tr::kRedBytes + Tr::kIndexBytes);
  }
  // Item idx of this CTA: from shared memory for the first kItemSlots, else from the plan.
  __device__ ItemView item(int32_t idx) const {
    const int32_t k = idx - first_item;
    return k < kItemSlots ? item_views()[k] : view_of<true>(p, p.items[idx]);
  }

  // ---- schedule and copies (decode/load.cuh) ----------------------------------------------

  __device__ void seek(Cursor& c, bool finish_empty = false);
  __device__ void advance(Cursor& c);
  __device__ const int32_t* index_entry(const Cursor& w, int row, bool& valid) const;
  __device__ uint32_t pool_row(int32_t entry, int32_t j) const;
  __device__ void fetch_indices();
  __device__ void fetch_first_indices_early(int32_t first_item, int32_t last_item);
  __device__ const char* k_base(int chunk) const;
  __device__ const char* v_base(int chunk) const;
  __device__ uint32_t k_row_bytes() const;
  __device__ uint32_t v_row_bytes() const;
  __device__ void prefetch_rows(uint32_t row) const;
  __device__ void produce(int s);

  // ---- per-item consumer state and one 16-token block (decode/compute.cuh) ----------------

  __device__ void reset_state();
  __device__ void load_q_frags(const unsigned char* stage);
  __device__ void scores(uint32_t k_smem, int b, float (&s)[NT][4]) const;
  __device__ void accumulate(uint32_t v_smem, int b, const uint32_t (&pb)[NT][2]);
  __device__ int out_dim(int i, int e) const;
  __device__ void block(const unsigned char* stage, int b, int valid);

  // ---- end of an item, merge of split tiles (decode/merge.cuh) ----------------------------

  __device__ void store(const ItemView& v, const float* inv, const float* lse, bool empty,
                        const float* src = nullptr, int parts = 1);
  __device__ void merge_finished_tiles(int32_t first, int32_t last);
  template <int kUnits, int kBatch>
  __device__ void merge_units(const TileMerge* done, int n);
  __device__ void finalize(const ItemView& v, unsigned char* stage);
  __device__ void load_sinks();

  // ---- the whole CTA (decode_kernel.cuh) -------------------------------------------------

  __device__ void run(int32_t first_item, int32_t last_item, bool indices_ready);
};

}  // namespace flashkv::cuda::decode_detail
