// The paged-decode kernel: one query row per request against its paged KV, every KV byte read
// once, on tensor cores.
//
// Grid: x = worker (its items are items[worker_indptr[x] .. worker_indptr[x + 1])), y = KV head,
// z = group of up to 8 * kNTiles query heads of that KV head (1 unless G > 8 * kNTiles). The
// grid depends only on the plan's worker count, so a CUDA graph replays with any batch.
//
// Schedule: a CTA walks its items as one stream of KV tiles (kTileTokens tokens each) through a
// kStages-deep cp.async pipeline that runs across item boundaries. The kv_indices of a tile are
// copied into a shared-memory ring kStages - 1 tiles before the tile's K/V copies are issued (in
// the same commit group as an earlier tile's data), so neither the index fetch nor the K/V fetch
// waits on the other; the query rows of an item ride in the stage of its first tile. The ring
// has kStages + 1 slots: the prologue issues two tiles' copies with no barrier in between.
//
// Split requests: a CTA stores the partial state of each chunk of a split tile it runs; after
// its last item it counts those chunks' arrivals in the workspace's merge counters of (tile,
// head group); the CTA that brings a count to the tile's chunk count merges all chunks into the
// output, reading them back in chunk order (so the result has the same bits whichever CTA comes
// last, and in deterministic mode whatever the rest of the batch), and sets the counter back to
// zero for the next run (a CUDA graph replays with no upload in between). No second kernel.
//
// Math (per warp, per 16-token block; the CTA's warps take blocks round-robin and merge their
// softmax states at the end of an item): tokens are the M side of the mma and query heads the N
// side, so G <= 8 heads waste no more than the N padding:
//   S^T[16 tok, 8 heads] = K[16, D] . Q^T[D, 8]            (mma m16n8k16, A = K from smem)
//   online softmax per head column (base 2)
//   O^T[D, 8 heads]    += V^T[D, 16] . P^T[16, 8]           (B = P^T by movmatrix of S^T)
// fp8 KV runs on f16 mma (every fp8 value is an f16; the hardware converts pairs): a bf16 query
// is scaled by a power of two into f16 range once per item and the scale taken out of the
// scores. The head dim is permuted consistently (Q loaded in the same order, O stored through
// the same map) so each thread's fp8 bytes come from contiguous shared memory.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "common/kernel_launch.h"
#include "common/merge_state.cuh"
#include "common/ptx.cuh"
#include "decode/trace.cuh"
#include "decode/traits.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/plan/plan.h"

namespace flashkv::cuda::decode {

constexpr float kLog2e = 1.4426950408889634f;

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
  // The one query sits at position kv_len - 1: the window starts window_left before it.
  if (p.window_left >= 0) v.lo = max(v.lo, kv_len - 1 - p.window_left);
  return v;
}

template <class Tr>
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return static_cast<uint32_t>(row * Tr::kRowBytes +
                               ((Tr::kSwizzle ? (chunk ^ (row & 7)) : chunk) << 4));
}

template <class Tr, typename QT, KvKind kKv>
struct DecodeCta {
  static constexpr int D = Tr::kHeadDim;
  static constexpr int NT = Tr::kHeads / 8;
  static constexpr int T = Tr::kTileTokens;
  static constexpr bool kFp8 = kKv != KvKind::same16;
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

  // ---- schedule -------------------------------------------------------------------------------

  // Moves a walk to the first item (from c.item on) with KV to read; the compute walk
  // (finish_empty) also stores the result of every empty item it passes (O = 0, LSE = -inf).
  __device__ void seek(Cursor& c, bool finish_empty = false) {
    for (; c.item < c.last; ++c.item) {
      c.v = item(c.item);
      if (c.v.lo < c.v.hi) {
        c.pos = c.v.lo;
        c.first = true;
        return;
      }
      if (finish_empty) {
        const float* unused = red();  // an empty item reads neither buffer
        store(c.v, unused, unused, true);
      }
    }
  }
  __device__ void advance(Cursor& c) {
    c.first = false;
    c.pos += T;
    if (c.pos >= c.v.hi) {
      ++c.item;
      seek(c);
    }
  }

  // The kv_indices entry of the index walk's tile row `row` (token ind.pos + row; entry
  // j / page_size for page size > 1), and whether that token is in the item's range (else the
  // entry is the first one, a mapped address).
  __device__ const int32_t* index_entry(const Cursor& w, int row, bool& valid) const {
    const int32_t j = w.pos + row;
    valid = j < w.v.hi;
    const int32_t e = p.page_size == 1 ? j : j / p.page_size;
    return p.kv_indices + (valid ? w.v.entry_base + e : 0);
  }

  // The pool row of token j whose kv_indices entry is `entry`, clamped into the pool as
  // unsigned, so that a negative or too-large index never addresses outside it.
  __device__ uint32_t pool_row(int32_t entry, int32_t j) const {
    uint32_t slot = static_cast<uint32_t>(entry);
    if (p.page_size > 1) slot = slot * p.page_size + j % p.page_size;
    const uint32_t last_row = static_cast<uint32_t>(min(p.num_kv_rows - 1, int64_t{UINT32_MAX}));
    return min(slot, last_row);
  }

  // Copies the kv_indices entries of the index walk's tile into its ring slot (one 4-byte copy
  // per token), and advances the walk.
  __device__ void fetch_indices() {
    if (ind.item >= ind.last) return;
    int32_t* ring = index_ring(ind_tile);
    for (int row = tid; row < T; row += Tr::kThreads) {
      bool valid;
      const int32_t* src = index_entry(ind, row, valid);
      ptx::cp_async_4(ptx::smem_addr(ring + row), src, valid);
    }
    ++ind_tile;
    advance(ind);
  }

  // The index walk's first kStages - 1 tiles, read from L2 into the ring with plain loads and
  // stores: for layout_ready, before griddepcontrol.wait (see the kernel). The caller's barrier
  // publishes the ring. Their K and V rows are prefetched into L2, so that the first copies
  // after the wait hit L2 instead of DRAM: the previous kernel's tail hides their DRAM latency.
  // (Prefetching further ahead made the streaming shapes slower: bench/NOTES.md, decode v9.)
  __device__ void fetch_first_indices_early(int32_t first_item, int32_t last_item) {
    ind.item = first_item;
    ind.last = last_item;
    seek(ind);
    for (int t = 0; t < kStages - 1 && ind.item < ind.last; ++t) {
      int32_t* ring = index_ring(ind_tile);
      for (int row = tid; row < T; row += Tr::kThreads) {
        bool valid;
        const int32_t* src = index_entry(ind, row, valid);
        const int32_t entry = valid ? __ldcg(src) : 0;
        ring[row] = entry;
        if (valid) prefetch_rows(pool_row(entry, ind.pos + row));
      }
      ++ind_tile;
      advance(ind);
    }
  }

  // K/V base pointers of this CTA's KV head, offset by `chunk` 16-byte chunks.
  __device__ const char* k_base(int chunk) const {
    return static_cast<const char*>(p.k) + (int64_t{kv_head} * p.k_stride_h) * Tr::kKvBytes +
           chunk * 16;
  }
  __device__ const char* v_base(int chunk) const {
    return static_cast<const char*>(p.v) + (int64_t{kv_head} * p.v_stride_h) * Tr::kKvBytes +
           chunk * 16;
  }

  // Bytes from one token's K (or V) row to the next: 32-bit (the launcher checks that the
  // stride fits), so that a row is one 32 x 32 -> 64-bit multiply-add off its base.
  __device__ uint32_t k_row_bytes() const {
    return static_cast<uint32_t>(p.k_stride_n) * Tr::kKvBytes;
  }
  __device__ uint32_t v_row_bytes() const {
    return static_cast<uint32_t>(p.v_stride_n) * Tr::kKvBytes;
  }

  // Prefetches pool row `row`'s K and V rows of this CTA's KV head into L2.
  __device__ void prefetch_rows(uint32_t row) const {
    const char* k = k_base(0) + uint64_t{row} * k_row_bytes();
    const char* v = v_base(0) + uint64_t{row} * v_row_bytes();
#pragma unroll
    for (int b = 0; b < Tr::kRowBytes; b += 128) {
      ptx::prefetch_l2(k + b);
      ptx::prefetch_l2(v + b);
    }
  }

  // Issues the K/V copies of the data walk's tile into stage s (and the item's query rows when
  // it is the item's first tile), then the index copies kStages - 1 tiles further on. Always
  // commits a group, so group counting stays uniform once the stream runs dry.
  __device__ void produce(int s) {
    if (prod.item < prod.last) {
      unsigned char* st = stage_ptr(s);
      const uint32_t k_smem = ptx::smem_addr(st);
      const uint32_t v_smem = k_smem + Tr::kTileBytes;
      const int chunk = tid % Tr::kChunks;
      const char* kbase = ptx::opaque(k_base(chunk));
      const char* vbase = ptx::opaque(v_base(chunk));
      const int32_t* ring = index_ring(prod_tile);
      // A slot past the range is clamped too (pool_row).
      const uint32_t k_stride = k_row_bytes(), v_stride = v_row_bytes();
#pragma unroll
      for (int i = 0; i < Tr::kPasses; ++i) {
        const int row = tid / Tr::kChunks + i * Tr::kRowsPerPass;
        const int32_t j = prod.pos + row;
        const bool valid = j < prod.v.hi;
        const uint32_t slot = pool_row(ring[row], j);
        const uint32_t off = swizzled<Tr>(row, chunk);
        ptx::cp_async_16(k_smem + off, kbase + uint64_t{slot} * k_stride, valid);
        ptx::cp_async_16(v_smem + off, vbase + uint64_t{slot} * v_stride, valid);
      }
      if (prod.first) {
        // Q rows [kHeads, D] of the item; heads past `heads` are zero (they pad the mma N side).
        const uint32_t q_smem = k_smem + 2 * Tr::kTileBytes;
        constexpr int kQChunks = Tr::kQBytes / 16, kPerHead = D / 8;
        for (int qc = tid; qc < kQChunks; qc += Tr::kThreads) {
          const int h = qc / kPerHead, d8 = (qc % kPerHead) * 8;
          const bool valid = h < heads;
          const QT* src = static_cast<const QT*>(p.q) + int64_t{prod.v.row} * p.q_stride_n +
                          int64_t{qh0 + (valid ? h : 0)} * p.q_stride_h + d8;
          ptx::cp_async_16(q_smem + qc * 16, src, valid);
        }
      }
      ++prod_tile;
      advance(prod);
    }
    fetch_indices();
    ptx::cp_async_commit();
  }

  // ---- per-item consumer state ----------------------------------------------------------------

  __device__ void reset_state() {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        m[n][j] = -INFINITY;
        l[n][j] = 0.0f;
      }
#pragma unroll
    for (int i = 0; i < Tr::kMTiles; ++i)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][n][e] = 0.0f;
  }

  // Q^T as the mma B operand (k = head dim, n = heads), in the head-dim order the K fragments
  // use: natural for 16-bit KV (ldmatrix); for fp8, thread c's k-step s covers dims
  // d0 = c * D / 4 + 4 s .. d0 + 3, as pairs (d0, d0 + 1) and (d0 + 2, d0 + 3). A bf16 query
  // for fp8 KV is scaled by 2^e into f16 range (exact; every warp derives the same e from the
  // largest |q| of the item) and the item's score scales divided by 2^e.
  __device__ void load_q_frags(const unsigned char* stage) {
    const QT* qs = reinterpret_cast<const QT*>(stage + 2 * Tr::kTileBytes);
    float q_scale = 1.0f;
    if constexpr (kFp8 && !std::is_same_v<QT, half>) {
      float mx = 0.0f;
      for (int i = lane; i < Tr::kHeads * D / 2; i += 32) {
        const float2 x = unpack2<QT>(reinterpret_cast<const uint32_t*>(qs)[i]);
        mx = fmaxf(mx, fmaxf(fabsf(x.x), fabsf(x.y)));
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      // mx < 2^e_max; scaled to below 2^15 (f16 max is 65504).
      if (mx > 0.0f && mx <= 3.0e38f) q_scale = ldexpf(1.0f, min(14 - ilogbf(mx), 126));
    }
    item_score_scale = score_scale / q_scale;
    item_softcap_in = softcap_in / q_scale;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const QT* qh = qs + (8 * n + r) * D;
#pragma unroll
      for (int s = 0; s < Tr::kKSteps; ++s) {
        const int d0 = kFp8 ? c * (D / 4) + 4 * s : 16 * s + 2 * c;
        const int d1 = kFp8 ? d0 + 2 : d0 + 8;
        const uint32_t x0 = *reinterpret_cast<const uint32_t*>(qh + d0);
        const uint32_t x1 = *reinterpret_cast<const uint32_t*>(qh + d1);
        if constexpr (std::is_same_v<MT, QT>) {
          q_frag[s][n][0] = x0;
          q_frag[s][n][1] = x1;
        } else {
          const float2 a = unpack2<QT>(x0), b = unpack2<QT>(x1);
          q_frag[s][n][0] = pack2<MT>(a.x * q_scale, a.y * q_scale);
          q_frag[s][n][1] = pack2<MT>(b.x * q_scale, b.y * q_scale);
        }
      }
    }
  }

  // ---- one 16-token block ---------------------------------------------------------------------

  // S^T = K . Q^T for tokens [16 b, 16 b + 16) of the stage, accumulated in two halves (even
  // and odd k-steps) to halve the dependent mma chain.
  __device__ void scores(uint32_t k_smem, int b, float (&s)[NT][4]) const {
    float s2[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = s2[n][e] = 0.0f;
    if constexpr (!kFp8) {
      const int mat = lane / 8;
      const int row = 16 * b + (lane % 8) + 8 * (mat % 2);
#pragma unroll
      for (int ks = 0; ks < Tr::kKSteps; ++ks) {
        uint32_t a[4];
        ptx::ldmatrix_x4(a, k_smem + swizzled<Tr>(row, 2 * ks + mat / 2));
#pragma unroll
        for (int n = 0; n < NT; ++n) ptx::mma_m16n8k16<MT>(ks % 2 ? s2[n] : s[n], a, q_frag[ks][n]);
      }
    } else {
      // Thread c reads bytes [c D/4, (c + 1) D/4) of token rows r and r + 8.
      constexpr int kWords = D / 16, kVecs = kWords / 4;
      uint32_t ka[kWords], kb[kWords];
      const int row_a = 16 * b + r, row_b = row_a + 8;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const uint4 xa = ptx::lds128(k_smem + swizzled<Tr>(row_a, c * kVecs + v));
        const uint4 xb = ptx::lds128(k_smem + swizzled<Tr>(row_b, c * kVecs + v));
        ka[4 * v] = xa.x, ka[4 * v + 1] = xa.y, ka[4 * v + 2] = xa.z, ka[4 * v + 3] = xa.w;
        kb[4 * v] = xb.x, kb[4 * v + 1] = xb.y, kb[4 * v + 2] = xb.z, kb[4 * v + 3] = xb.w;
      }
#pragma unroll
      for (int ks = 0; ks < Tr::kKSteps; ++ks) {
        const uint32_t a[4] = {
            fp8_pair_to_f16x2<kKv, false>(ka[ks]), fp8_pair_to_f16x2<kKv, false>(kb[ks]),
            fp8_pair_to_f16x2<kKv, true>(ka[ks]), fp8_pair_to_f16x2<kKv, true>(kb[ks])};
#pragma unroll
        for (int n = 0; n < NT; ++n) ptx::mma_m16n8k16<MT>(ks % 2 ? s2[n] : s[n], a, q_frag[ks][n]);
      }
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] += s2[n][e];
  }

  // O^T += V^T . P^T for tokens [16 b, 16 b + 16) of the stage.
  __device__ void accumulate(uint32_t v_smem, int b, const uint32_t (&pb)[NT][2]) {
    if constexpr (!kFp8) {
      const int mat = lane / 8;
      const int row = 16 * b + (lane % 8) + 8 * (mat / 2);
#pragma unroll
      for (int i = 0; i < Tr::kMTiles; ++i) {
        uint32_t a[4];
        ptx::ldmatrix_x4_trans(a, v_smem + swizzled<Tr>(row, 2 * i + mat % 2));
#pragma unroll
        for (int n = 0; n < NT; ++n) ptx::mma_m16n8k16<MT>(o[i][n], a, pb[n]);
      }
    } else {
      // Thread (r, c) reads bytes [r D/8, (r + 1) D/8) of token rows 2c, 2c+1, 2c+8, 2c+9; m-tile
      // i row r is dim r D/8 + 2i, row r + 8 is dim r D/8 + 2i + 1 (see out_dim).
      constexpr int kWords = D / 32;
      uint32_t x[4][kWords];
      const int rows[4] = {16 * b + 2 * c, 16 * b + 2 * c + 1, 16 * b + 2 * c + 8,
                           16 * b + 2 * c + 9};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        if constexpr (kWords == 2) {
          const uint32_t byte = r * 8;
          const uint2 v = ptx::lds64(v_smem + swizzled<Tr>(rows[t], byte / 16) + byte % 16);
          x[t][0] = v.x, x[t][1] = v.y;
        } else {
#pragma unroll
          for (int q = 0; q < kWords / 4; ++q) {
            const uint4 v = ptx::lds128(v_smem + swizzled<Tr>(rows[t], r * (kWords / 4) + q));
            x[t][4 * q] = v.x, x[t][4 * q + 1] = v.y, x[t][4 * q + 2] = v.z, x[t][4 * q + 3] = v.w;
          }
        }
      }
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // Byte pairs (token 2c, token 2c + 1) of dim 4w + 2e (low half) and 4w + 2e + 1.
          const uint32_t sel = e == 0 ? 0x5140u : 0x7362u;
          const uint32_t lo = __byte_perm(x[0][w], x[1][w], sel);
          const uint32_t hi = __byte_perm(x[2][w], x[3][w], sel);
          const uint32_t a[4] = {
              fp8_pair_to_f16x2<kKv, false>(lo), fp8_pair_to_f16x2<kKv, true>(lo),
              fp8_pair_to_f16x2<kKv, false>(hi), fp8_pair_to_f16x2<kKv, true>(hi)};
#pragma unroll
          for (int n = 0; n < NT; ++n) ptx::mma_m16n8k16<MT>(o[2 * w + e][n], a, pb[n]);
        }
      }
    }
  }

  // The dim of O^T fragment element (m-tile i, e >= 2 ? row r + 8 : row r).
  __device__ int out_dim(int i, int e) const {
    if constexpr (!kFp8)
      return 16 * i + r + (e >= 2 ? 8 : 0);
    else
      return r * (D / 8) + 2 * i + (e >= 2 ? 1 : 0);
  }

  __device__ void block(const unsigned char* stage, int b, int valid) {
    const uint32_t k_smem = ptx::smem_addr(stage);
    float s[NT][4];
    scores(k_smem, b, s);
    // Scale to base-2 logits, soft cap, and mask tokens past the tile's end.
    // Two loops under one kernel-wide condition (not a select per score: that issues both
    // paths' instructions for every score).
    if (softcap_in > 0.0f) {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[n][e] = softcap_out * ptx::tanh_fast(s[n][e] * item_softcap_in);
    } else {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= item_score_scale;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if ((r + (e >= 2 ? 8 : 0)) >= valid) s[n][e] = -INFINITY;
    // Online softmax per head column; the 8 lanes sharing c hold one column's 16 tokens.
    uint32_t pb[NT][2];
    float corr[NT][2];
    bool moved = false;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      float pr[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float bm = fmaxf(s[n][j], s[n][j + 2]);
        bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 4));
        bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 8));
        bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 16));
        const float m_new = fmaxf(m[n][j], bm);  // finite: the block has a valid token
        corr[n][j] = ptx::exp2_fast(m[n][j] - m_new);
        moved |= m_new != m[n][j];
        m[n][j] = m_new;
        pr[j] = ptx::exp2_fast(s[n][j] - m_new);
        pr[j + 2] = ptx::exp2_fast(s[n][j + 2] - m_new);
        l[n][j] = l[n][j] * corr[n][j] + pr[j] + pr[j + 2];
      }
      pb[n][0] = ptx::movmatrix_trans(pack2<MT>(pr[0], pr[1]));
      pb[n][1] = ptx::movmatrix_trans(pack2<MT>(pr[2], pr[3]));
    }
    // O is rescaled only when some column's maximum moved (else every factor is exactly 1), which
    // after a request's first blocks is rare.
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int i = 0; i < Tr::kMTiles; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            o[i][n][j] *= corr[n][j];
            o[i][n][j + 2] *= corr[n][j];
          }
    }
    accumulate(k_smem + Tr::kTileBytes, b, pb);
  }

  // ---- end of an item -------------------------------------------------------------------------

  // Stores heads [0, heads) of an item's result: the sum, in order, of `parts` un-normalised
  // [kHeads][kOutStride] buffers from `src` on (default: out_buf) times inv[h], and lse[h]; or
  // zeros and -inf when `empty`.
  __device__ void store(const ItemView& v, const float* inv, const float* lse, bool empty,
                        const float* src = nullptr, int parts = 1) {
    constexpr int kPerHead = D / 8;
    const float* ob = src != nullptr ? src : out_buf();
    for (int i = tid; i < heads * kPerHead; i += Tr::kThreads) {
      const int h = i / kPerHead, d = (i % kPerHead) * 8;
      float x[8];
      if (empty) {
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = 0.0f;
      } else {
        const float* part = ob + h * Tr::kOutStride + d;
        float4 a = *reinterpret_cast<const float4*>(part);
        float4 b = *reinterpret_cast<const float4*>(part + 4);
        for (int w = 1; w < parts; ++w) {
          part += Tr::kHeads * Tr::kOutStride;
          const float4 a2 = *reinterpret_cast<const float4*>(part);
          const float4 b2 = *reinterpret_cast<const float4*>(part + 4);
          a.x += a2.x, a.y += a2.y, a.z += a2.z, a.w += a2.w;
          b.x += b2.x, b.y += b2.y, b.z += b2.z, b.w += b2.w;
        }
        const float inv_h = inv[h];
        x[0] = a.x * inv_h, x[1] = a.y * inv_h, x[2] = a.z * inv_h, x[3] = a.w * inv_h;
        x[4] = b.x * inv_h, x[5] = b.y * inv_h, x[6] = b.z * inv_h, x[7] = b.w * inv_h;
      }
      if (v.partial < 0) {
        uint4 w;
        w.x = pack2<QT>(x[0], x[1]), w.y = pack2<QT>(x[2], x[3]);
        w.z = pack2<QT>(x[4], x[5]), w.w = pack2<QT>(x[6], x[7]);
        *reinterpret_cast<uint4*>(static_cast<QT*>(p.o) + int64_t{v.row} * p.o_stride_n +
                                  int64_t{qh0 + h} * p.o_stride_h + d) = w;
      } else {
        float4* dst = reinterpret_cast<float4*>(
            p.partial_o + (int64_t{v.partial} * p.num_qo_heads + qh0 + h) * D + d);
        dst[0] = make_float4(x[0], x[1], x[2], x[3]);
        dst[1] = make_float4(x[4], x[5], x[6], x[7]);
      }
    }
    if (tid < heads) {
      const float value = empty ? -INFINITY : lse[tid];
      if (v.partial < 0) {
        if (p.lse) p.lse[int64_t{v.row} * p.num_qo_heads + qh0 + tid] = value;
      } else {
        p.partial_lse[int64_t{v.partial} * p.num_qo_heads + qh0 + tid] = value;
      }
    }
  }

  // After the CTA's last item: counts the arrival of each of its split items (items
  // [first, last), 32 per round, one lane each) and merges the tiles whose count it completes
  // (see the top of the file). Counting once at the end, not after each item, keeps the copy
  // pipeline running across items: a count costs a release fence and an atomic round trip.
  // Release and acquire at GPU scope by the counting lanes, after / before CTA barriers: the
  // barrier orders every thread's partial stores before the release; the acquire orders the other
  // chunks' stores before the merge's reads (which go to L2).
  __device__ void merge_finished_tiles(int32_t first, int32_t last) {
    // The tiles this CTA completes in a round (out_buf is free once the last item is stored).
    TileMerge* done = reinterpret_cast<TileMerge*>(out_buf());
    int* num_done = reinterpret_cast<int*>(red());
    for (int32_t base = first; base < last; base += 32) {
      __syncthreads();  // partial stores done (and the previous round's list read)
      if (warp == 0) {
        const int32_t i = base + lane;
        bool completes = false;
        TileMerge t{};
        if (i < last) {
          const ItemView v = item(i);
          if (v.partial >= 0) {
            int32_t* counter = p.merge_counters + int64_t{v.merge} * p.num_qo_heads + qh0;
            const MergeItem m = p.merges[v.merge];
            completes = ptx::atomic_add_acq_rel_gpu(counter, 1) == m.num_chunks - 1;
            if (completes) *counter = 0;  // no other CTA touches it again in this run
            t = {v.row, m.partial, m.num_chunks, m.q_len};
          }
        }
        const uint32_t mask = __ballot_sync(0xffffffffu, completes);
        if (completes) done[__popc(mask & ((1u << lane) - 1))] = t;
        if (lane == 0) *num_done = __popc(mask);
      }
      __syncthreads();
      const int n = *num_done;
      FLASHKV_TRACE(if (base == first) timeline->mark(6);)
      if (n == 0) continue;
      FLASHKV_TRACE(merged_tiles += n;)
      // (tile, head, 4-dim vector) units spread over all threads: a round's tiles cost about one
      // L2 round trip per chunk batch, not one per tile. With more units than threads, two units
      // a thread with their loads in flight together.
      if (n * heads * (D / 4) <= Tr::kThreads)
        merge_units<1, 16>(done, n);
      else
        merge_units<2, 4>(done, n);
    }
  }

  // Folds the partial states of the split tiles done[0, n) (all chunks of each) into their
  // output rows; unit u is tile u / (heads D / 4), head (u / (D / 4)) % heads, dims 4 (u % (D / 4))
  // .. + 3. Each thread takes kUnits units at a time and keeps kBatch chunk loads of each in
  // flight before folding them in chunk order (deterministic).
  template <int kUnits, int kBatch>
  __device__ void merge_units(const TileMerge* done, int n) {
    constexpr int kVecs = D / 4;
    const int per_tile = heads * kVecs;
    const int total = n * per_tile;
    for (int u0 = tid; u0 < total; u0 += kUnits * Tr::kThreads) {
      int64_t first_row[kUnits];  // partial row of chunk 0, times Hq, plus the head
      int64_t chunk_step[kUnits];
      int32_t chunks[kUnits], out_row[kUnits];
      int h[kUnits], d[kUnits];
      int32_t most = 0;
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        const int u = min(u0 + j * Tr::kThreads, total - 1);  // past the end: a copy of the last
        const TileMerge& t = done[u / per_tile];
        h[j] = (u % per_tile) / kVecs;
        d[j] = (u % kVecs) * 4;
        first_row[j] = int64_t{t.partial} * p.num_qo_heads + qh0 + h[j];
        chunk_step[j] = int64_t{t.q_len} * p.num_qo_heads;
        chunks[j] = t.num_chunks;
        out_row[j] = t.row;
        most = max(most, chunks[j]);
      }
      MergeState st[kUnits];
      float4 acc[kUnits];
#pragma unroll
      for (int j = 0; j < kUnits; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int32_t c0 = 0; c0 < most; c0 += kBatch) {
        // L2 reads (other SMs wrote them); every load of the batch is issued before the first
        // is used (a chunk past a unit's end reloads its last chunk).
        float lse[kUnits][kBatch];
        float4 x[kUnits][kBatch];
#pragma unroll
        for (int j = 0; j < kUnits; ++j)
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            const int64_t row = first_row[j] + min(c0 + k, chunks[j] - 1) * chunk_step[j];
            lse[j][k] = __ldcg(p.partial_lse + row);
            x[j][k] = __ldcg(reinterpret_cast<const float4*>(p.partial_o + row * D + d[j]));
          }
#pragma unroll
        for (int j = 0; j < kUnits; ++j)
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {  // folded in chunk order: deterministic
            // No branch: a chunk past the unit's end adds weight 0 like an empty one (with
            // rescale 1; both have finite stored O). A branch here would let the compiler
            // sink each load to its use: one L2 round trip per chunk, ~2 us a batch. Explicit
            // fmaf: `acc * rescale + weight * x` may be contracted either way, and the two unit
            // layouts (merge_units<1, 16>, <2, 4>) must fold to the same bits.
            float rescale, weight;
            st[j].add(c0 + k < chunks[j] ? lse[j][k] : -INFINITY, rescale, weight);
            acc[j].x = fmaf(weight, x[j][k].x, acc[j].x * rescale);
            acc[j].y = fmaf(weight, x[j][k].y, acc[j].y * rescale);
            acc[j].z = fmaf(weight, x[j][k].z, acc[j].z * rescale);
            acc[j].w = fmaf(weight, x[j][k].w, acc[j].w * rescale);
          }
        FLASHKV_TRACE(if (c0 == 0 && u0 == tid) timeline->mark(7);)
      }
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        if (u0 + j * Tr::kThreads >= total) break;
        const float inv = st[j].inv_sum();
        uint2 packed;
        packed.x = pack2<QT>(acc[j].x * inv, acc[j].y * inv);
        packed.y = pack2<QT>(acc[j].z * inv, acc[j].w * inv);
        *reinterpret_cast<uint2*>(static_cast<QT*>(p.o) + int64_t{out_row[j]} * p.o_stride_n +
                                  int64_t{qh0 + h[j]} * p.o_stride_h + d[j]) = packed;
        if (d[j] == 0 && p.lse)
          p.lse[int64_t{out_row[j]} * p.num_qo_heads + qh0 + h[j]] = st[j].lse();
      }
    }
  }

  // Merges the warps' states of the finished item (in warp order: deterministic) and stores it.
  // `stage` held the item's last tile; it is free once every warp is past its blocks (its next
  // refill follows the loop's next barrier). When the warps' scaled outputs fit there, each warp
  // writes its own and store() sums them; else they are added into out_buf a warp at a time.
  __device__ void finalize(const ItemView& v, unsigned char* stage) {
    float* red_m = red();                              // [Tr::kWarps][kHeads]
    float* red_l = red_m + Tr::kWarps * Tr::kHeads;    // [Tr::kWarps][kHeads]
    float* fin_inv = red_l + Tr::kWarps * Tr::kHeads;  // [kHeads]
    float* fin_lse = fin_inv + Tr::kHeads;             // [kHeads]
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float x = l[n][j];
        x += __shfl_xor_sync(0xffffffffu, x, 4);
        x += __shfl_xor_sync(0xffffffffu, x, 8);
        x += __shfl_xor_sync(0xffffffffu, x, 16);
        l[n][j] = x;
        if (r == 0) {
          red_m[warp * Tr::kHeads + 8 * n + 2 * c + j] = m[n][j];
          red_l[warp * Tr::kHeads + 8 * n + 2 * c + j] = x;
        }
      }
    __syncthreads();
    float scale[NT][2];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int h = 8 * n + 2 * c + j;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < Tr::kWarps; ++w) mx = fmaxf(mx, red_m[w * Tr::kHeads + h]);
        // A warp whose maximum is still -inf adds its l as it is: 0 when it saw no token, NaN
        // when its only visible scores were NaN (NaN in K), which must reach O and LSE.
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < Tr::kWarps; ++w) {
          const float mw = red_m[w * Tr::kHeads + h], lw = red_l[w * Tr::kHeads + h];
          sum += mw == -INFINITY ? lw : lw * ptx::exp2_fast(mw - mx);
        }
        scale[n][j] = m[n][j] == -INFINITY ? 0.0f : ptx::exp2_fast(m[n][j] - mx);
        if (warp == 0 && r == 0) {  // != 0, not > 0: a NaN sum stays NaN
          fin_inv[h] = sum != 0.0f ? p.v_scale / sum : 0.0f;
          fin_lse[h] = sum != 0.0f ? mx + __log2f(sum) : -INFINITY;
        }
      }
    if constexpr (Tr::kWarps * Tr::kOutBytes <= Tr::kStageBytes) {
      float* ob = reinterpret_cast<float*>(stage) + warp * Tr::kHeads * Tr::kOutStride;
#pragma unroll
      for (int i = 0; i < Tr::kMTiles; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            ob[(8 * n + 2 * c + (e & 1)) * Tr::kOutStride + out_dim(i, e)] =
                o[i][n][e] * scale[n][e & 1];
      __syncthreads();
      store(v, fin_inv, fin_lse, false, reinterpret_cast<const float*>(stage), Tr::kWarps);
      return;
    }
    float* ob = out_buf();
    for (int w = 0; w < Tr::kWarps; ++w) {
      if (warp == w) {
#pragma unroll
        for (int i = 0; i < Tr::kMTiles; ++i)
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float* dst = ob + (8 * n + 2 * c + (e & 1)) * Tr::kOutStride + out_dim(i, e);
              const float x = o[i][n][e] * scale[n][e & 1];
              *dst = w == 0 ? x : *dst + x;
            }
      }
      __syncthreads();
    }
    store(v, fin_inv, fin_lse, false);
  }

  // ---- the whole CTA --------------------------------------------------------------------------

  // indices_ready: fetch_first_indices_early ran (and a barrier followed it).
  __device__ void run(int32_t first_item, int32_t last_item, bool indices_ready) {
    prod.item = cons.item = first_item;
    prod.last = cons.last = last_item;
    seek(prod);
    // Prologue: the indices of the first kStages - 1 tiles (waited for: nothing else can start),
    // then their K/V copies, each with the indices kStages - 1 tiles further on.
    if (!indices_ready) {
      ind.item = first_item;
      ind.last = last_item;
      seek(ind);
      for (int t = 0; t < kStages - 1; ++t) fetch_indices();
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
      __syncthreads();
    }
    FLASHKV_TRACE(timeline->mark(3); timeline->mark(4);)
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) produce(s);
    seek(cons, /*finish_empty=*/true);
    int stage = 0;
    FLASHKV_TRACE(uint32_t tile_count = 0;)
    uint32_t item_tile = 0;  // tiles of the current item so far
    while (cons.item < cons.last) {
      // This tile's data group (and the index group of the tile kStages - 1 further on,
      // committed with it) is complete; the barrier also retires the stage and ring slot
      // about to be refilled.
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();
      FLASHKV_TRACE(if (tile_count == 0) timeline->mark(4);)
      produce((stage + kStages - 1) % kStages);
      unsigned char* st = stage_ptr(stage);
      if (cons.first) {
        load_q_frags(st);
        reset_state();
        cons.first = false;
        item_tile = 0;
      }
      const int valid = min(T, cons.v.hi - cons.pos);
      // The warps take the tile's 16-token blocks round-robin, continuing from the item's last
      // tile. (From the item's, not the CTA's: which warp sums which blocks sets the bits of
      // the result, and in deterministic mode those must not depend on the CTA's other items.)
      // One block body indexed by the warp (not unrolled over the blocks with a test of the
      // warp): every warp's code would hold every block's copy, and fp8 ran instruction-fetch
      // bound (ncu: 41% of a warp's cycles waiting on a fetch).
      int b = warp;
      if constexpr (Tr::kBlocks % Tr::kWarps != 0)
        b = (warp + Tr::kWarps - static_cast<int>(item_tile * Tr::kBlocks % Tr::kWarps)) %
            Tr::kWarps;
#pragma unroll 1
      for (; b < Tr::kBlocks && 16 * b < valid; b += Tr::kWarps) block(st, b, valid - 16 * b);
      stage = (stage + 1) % kStages;
      FLASHKV_TRACE(++tile_count;)
      ++item_tile;
      cons.pos += T;
      if (cons.pos >= cons.v.hi) {
        finalize(cons.v, st);
        ++cons.item;
        seek(cons, /*finish_empty=*/true);
      }
    }
    ptx::cp_async_wait<0>();
    FLASHKV_TRACE(timeline->mark(5);)
    merge_finished_tiles(first_item, last_item);
    FLASHKV_TRACE(timeline->mark(8); timeline->commit(last_item - first_item, merged_tiles);)
  }
};

template <class Tr, typename QT, KvKind kKv>
__global__ void __launch_bounds__(Tr::kThreads, 2)
    decode_kernel(const __grid_constant__ AttentionParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  FLASHKV_TRACE(trace::Timeline timeline; timeline.clear(); timeline.mark(0);)
  // Every CTA of the persistent grid is resident: a dependent kernel launched with programmatic
  // stream serialization may be scheduled now (it waits in griddepcontrol.wait).
  ptx::launch_dependents();
  // Under programmatic dependent launch this grid may start while the previous kernel of the
  // stream still runs. Only the plan's worker ranges are read before waiting for it: no kernel
  // writes them (an upload is a copy, which a kernel never overlaps); Q, the KV and its indices,
  // the counters and the outputs may all be another kernel's.
  const int32_t first_item = p.worker_indptr[blockIdx.x];
  const int32_t last_item = p.worker_indptr[blockIdx.x + 1];
  // The CTA's first kItemSlots items, a thread each: plan data as well, so loaded before the
  // wait too. Their views (which read kv_indptr) are made after it.
  const bool has_item = threadIdx.x < kItemSlots && first_item + int32_t(threadIdx.x) < last_item;
  WorkItem it{};
  if (has_item) it = p.items[first_item + threadIdx.x];
  DecodeCta<Tr, QT, kKv> cta{p, smem};
  FLASHKV_TRACE(cta.timeline = &timeline;)
  cta.first_item = first_item;
  cta.tid = threadIdx.x;
  cta.warp = threadIdx.x / 32;
  cta.lane = threadIdx.x % 32;
  cta.r = cta.lane / 4;
  cta.c = cta.lane % 4;
  cta.kv_head = blockIdx.y;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int head0 = blockIdx.z * Tr::kHeads;
  cta.heads = min(Tr::kHeads, group - head0);
  cta.qh0 = blockIdx.y * group + head0;
  const float qk_scale = p.sm_scale * p.k_scale;
  cta.score_scale = qk_scale * kLog2e;
  cta.softcap_in = p.logits_soft_cap > 0.0f ? qk_scale / p.logits_soft_cap : 0.0f;
  cta.softcap_out = p.logits_soft_cap * kLog2e;
  // layout_ready: the caller promises the request layout (kv_indptr, kv_indices, last_page_len)
  // was written before the kernel ahead of this one started, so the item views and the first
  // tiles' indices are read now, under that kernel, from L2: two dependent round trips less
  // after the wait.
  if (p.layout_ready) {
    if (has_item) cta.item_views()[threadIdx.x] = view_of<true>(p, it);
    __syncthreads();
    cta.fetch_first_indices_early(first_item, last_item);
    __syncthreads();
  }
  ptx::grid_dependency_wait();
  FLASHKV_TRACE(timeline.mark(1);)
  if (!p.layout_ready) {
    if (has_item) cta.item_views()[threadIdx.x] = view_of(p, it);
    __syncthreads();
  }
  FLASHKV_TRACE(timeline.mark(2);)
  cta.run(first_item, last_item, p.layout_ready);
}

template <int D, typename QT, KvKind kKv, int kNTiles>
void launch_decode(const AttentionParams& p, cudaStream_t stream, bool programmatic) {
  using Tr = Traits<D, kKv, kNTiles>;
  auto kernel = decode_kernel<Tr, QT, kKv>;
  // Raising the dynamic shared-memory limit is per device and idempotent; it is cheap, and not
  // a stream operation (so it is legal during graph capture).
  static_assert(Tr::kSmemBytes <= 227 * 1024, "shared memory");
  detail::cuda_check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes),
      "paged_decode: cudaFuncSetAttribute");
  // Two CTAs per SM need the largest shared-memory carveout.
  detail::cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared),
                     "paged_decode: cudaFuncSetAttribute");
  const int group = p.num_qo_heads / p.num_kv_heads;
  launch_kernel(kernel, dim3(p.num_workers, p.num_kv_heads, (group + Tr::kHeads - 1) / Tr::kHeads),
                dim3(Tr::kThreads, 1, 1), Tr::kSmemBytes, stream, programmatic,
                "paged_decode: kernel launch", p);
}

}  // namespace flashkv::cuda::decode
