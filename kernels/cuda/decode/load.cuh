// DecodeCta (decode/cta.cuh), the producer side: the three walks over the CTA's tile stream
// (indices, K/V data, compute), the kv_indices ring, and the cp.async copies of K, V and Q into
// a pipeline stage.
#pragma once

#include "common/paging.cuh"
#include "decode/cta.cuh"

namespace flashkv::cuda::decode_detail {

// Moves a walk to the first item (from c.item on) with KV to read; the compute walk
// (finish_empty) also stores the result of every empty item it passes (O = 0, LSE = -inf).
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::seek(Cursor& c, bool finish_empty) {
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

template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::advance(Cursor& c) {
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
template <class Tr, typename QT, KvFormat kKv>
__device__ const int32_t* DecodeCta<Tr, QT, kKv>::index_entry(const Cursor& w, int row,
                                                              bool& valid) const {
  const int32_t j = w.pos + row;
  valid = j < w.v.hi;
  const int32_t e = page_index(p, j);
  return p.kv_indices + (valid ? w.v.entry_base + e : 0);
}

// The pool row of token j whose kv_indices entry is `entry`, clamped into the pool as
// unsigned, so that a negative or too-large index never addresses outside it.
template <class Tr, typename QT, KvFormat kKv>
__device__ uint32_t DecodeCta<Tr, QT, kKv>::pool_row(int32_t entry, int32_t j) const {
  uint32_t slot = static_cast<uint32_t>(entry);
  if (p.page_size > 1) slot = slot * p.page_size + page_offset(p, j);
  const uint32_t last_row = static_cast<uint32_t>(min(p.num_kv_rows - 1, int64_t{UINT32_MAX}));
  return min(slot, last_row);
}

// Copies the kv_indices entries of the index walk's tile into its ring slot (one 4-byte copy
// per token), and advances the walk.
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::fetch_indices() {
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
// (Prefetching further ahead made the streaming shapes slower: docs/perf/decode.md, the entry on
// the first tiles' K/V prefetched into L2 before the PDL wait.)
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::fetch_first_indices_early(int32_t first_item,
                                                                  int32_t last_item) {
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
template <class Tr, typename QT, KvFormat kKv>
__device__ const char* DecodeCta<Tr, QT, kKv>::k_base(int chunk) const {
  return static_cast<const char*>(p.k) + (int64_t{kv_head} * p.k_stride_h) * Tr::kKvBytes +
         chunk * 16;
}

template <class Tr, typename QT, KvFormat kKv>
__device__ const char* DecodeCta<Tr, QT, kKv>::v_base(int chunk) const {
  return static_cast<const char*>(p.v) + (int64_t{kv_head} * p.v_stride_h) * Tr::kKvBytes +
         chunk * 16;
}

// Bytes from one token's K (or V) row to the next: 32-bit (the launcher checks that the
// stride fits), so that a row is one 32 x 32 -> 64-bit multiply-add off its base.
template <class Tr, typename QT, KvFormat kKv>
__device__ uint32_t DecodeCta<Tr, QT, kKv>::k_row_bytes() const {
  return static_cast<uint32_t>(p.k_stride_n) * Tr::kKvBytes;
}

template <class Tr, typename QT, KvFormat kKv>
__device__ uint32_t DecodeCta<Tr, QT, kKv>::v_row_bytes() const {
  return static_cast<uint32_t>(p.v_stride_n) * Tr::kKvBytes;
}

// Prefetches pool row `row`'s K and V rows of this CTA's KV head into L2.
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::prefetch_rows(uint32_t row) const {
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
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::produce(int s) {
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

}  // namespace flashkv::cuda::decode_detail
