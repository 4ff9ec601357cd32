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

#include "common/kernel_launch.h"
#include "decode/compute.cuh"
#include "decode/cta.cuh"
#include "decode/load.cuh"
#include "decode/merge.cuh"
#include "flashkv/core/cuda_runtime.h"

namespace flashkv::cuda::decode_detail {

// indices_ready: fetch_first_indices_early ran (and a barrier followed it).
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::run(int32_t first_item, int32_t last_item,
                                            bool indices_ready) {
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
    // bound (docs/perf/decode.md).
    int b = warp;
    if constexpr (Tr::kBlocks % Tr::kWarps != 0)
      b = (warp + Tr::kWarps - static_cast<int>(item_tile * Tr::kBlocks % Tr::kWarps)) % Tr::kWarps;
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

template <class Tr, typename QT, KvFormat kKv>
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
  cta.load_sinks();
  FLASHKV_TRACE(timeline.mark(1);)
  if (!p.layout_ready) {
    if (has_item) cta.item_views()[threadIdx.x] = view_of(p, it);
    __syncthreads();
  }
  FLASHKV_TRACE(timeline.mark(2);)
  cta.run(first_item, last_item, p.layout_ready);
}

template <int D, typename QT, KvFormat kKv, int kNTiles>
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

}  // namespace flashkv::cuda::decode_detail
