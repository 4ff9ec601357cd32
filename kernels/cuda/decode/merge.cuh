// DecodeCta (decode/cta.cuh), the end of an item: the merge of the warps' softmax states
// (finalize), the store of O and LSE (or of a partial state), and the merge of split tiles whose
// last chunk this CTA brought in (merge_finished_tiles).
#pragma once

#include "common/merge.cuh"
#include "decode/cta.cuh"

namespace flashkv::cuda::decode_detail {

// Stores heads [0, heads) of an item's result: the sum, in order, of `parts` un-normalised
// [kHeads][kOutStride] buffers from `src` on (default: out_buf) times inv[h], and lse[h]; or
// zeros and -inf when `empty`.
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::store(const ItemView& v, const float* inv, const float* lse,
                                              bool empty, const float* src, int parts) {
  constexpr int kPerHead = D / 8;
  const float* ob = src != nullptr ? src : out_buf();
  for (int i = tid; i < heads * kPerHead; i += Tr::kThreads) {
    const int h = i / kPerHead, d = (i % kPerHead) * 8;
    float x[8];
    if (empty) {
      // O = 0; with a NaN sink on a final row, NaN (the sink's state alone is the row's).
      const float zero = v.partial < 0 && isnan(sink_lse(p.sinks, qh0 + h)) ? NAN : 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] = zero;
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
      const int64_t at = int64_t{v.row} * p.o_stride_n + int64_t{qh0 + h} * p.o_stride_h + d;
      store_o<QT>(p.o, p.o_dtype == DType::f32, at, x);
    } else {
      float4* dst = reinterpret_cast<float4*>(
          p.partial_o + (int64_t{v.partial} * p.num_qo_heads + qh0 + h) * D + d);
      dst[0] = make_float4(x[0], x[1], x[2], x[3]);
      dst[1] = make_float4(x[4], x[5], x[6], x[7]);
    }
  }
  if (tid < heads) {
    // An empty final row is the sink's state alone (O = 0); an empty chunk weighs 0.
    const float value = !empty          ? lse[tid]
                        : v.partial < 0 ? sink_lse(p.sinks, qh0 + tid)
                                        : -INFINITY;
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
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::merge_finished_tiles(int32_t first, int32_t last) {
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
template <class Tr, typename QT, KvFormat kKv>
template <int kUnits, int kBatch>
__device__ void DecodeCta<Tr, QT, kKv>::merge_units(const TileMerge* done, int n) {
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
    MergeState</*kFastExp2=*/true> st[kUnits];  // approximate exp2 / log2, as the softmax
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
          // sink each load to its use: one L2 round trip per chunk (docs/perf/decode.md). Explicit
          // fmaf: `acc * rescale + weight * x` may be contracted either way, and the two unit
          // layouts (merge_units<1, 16>, <2, 4>) must fold to the same bits.
          float rescale, weight;
          st[j].fold(c0 + k < chunks[j] ? lse[j][k] : -INFINITY, rescale, weight);
          acc[j].x = fmaf(weight, x[j][k].x, acc[j].x * rescale);
          acc[j].y = fmaf(weight, x[j][k].y, acc[j].y * rescale);
          acc[j].z = fmaf(weight, x[j][k].z, acc[j].z * rescale);
          acc[j].w = fmaf(weight, x[j][k].w, acc[j].w * rescale);
        }
      FLASHKV_TRACE(if (c0 == 0 && u0 == tid) timeline->mark(7);)
    }
    if (p.sinks != nullptr) {  // the sink (O = 0) is the last state, folded once per row
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        float rescale, weight;
        st[j].fold(sink_lse(p.sinks, qh0 + h[j]), rescale, weight);
        acc[j].x *= rescale, acc[j].y *= rescale, acc[j].z *= rescale, acc[j].w *= rescale;
      }
    }
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      if (u0 + j * Tr::kThreads >= total) break;
      const float inv = st[j].inv_sum();
      const int64_t at =
          int64_t{out_row[j]} * p.o_stride_n + int64_t{qh0 + h[j]} * p.o_stride_h + d[j];
      const float x[4] = {acc[j].x * inv, acc[j].y * inv, acc[j].z * inv, acc[j].w * inv};
      store_o<QT>(p.o, p.o_dtype == DType::f32, at, x);
      if (d[j] == 0 && p.lse)
        p.lse[int64_t{out_row[j]} * p.num_qo_heads + qh0 + h[j]] = st[j].lse();
    }
  }
}

template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::load_sinks() {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int h = 8 * n + 2 * c + j;
      sink[n][j] = -INFINITY;
      ptx::ld_global_now_if(p.sinks != nullptr && h < heads, p.sinks + qh0 + h, sink[n][j]);
    }
}

// Merges the warps' states of the finished item (in warp order: deterministic) and stores it.
// `stage` held the item's last tile; it is free once every warp is past its blocks (its next
// refill follows the loop's next barrier). When the warps' scaled outputs fit there, each warp
// writes its own and store() sums them; else they are added into out_buf a warp at a time.
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::finalize(const ItemView& v, unsigned char* stage) {
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
      // A final row's sink (O = 0; -inf: none, or a split chunk's row, which must not count it)
      // is one more state beside the warps': it joins their maximum and their sum, so that it
      // adds no step to the chain that every warp waits for (fmaxf leaves a NaN sink to its
      // weight, which makes the sum, O and LSE NaN).
      const float sink_state = v.partial < 0 ? sink[n][j] * kLog2e : -INFINITY;
      float mx = sink_state;
#pragma unroll
      for (int w = 0; w < Tr::kWarps; ++w) mx = fmaxf(mx, red_m[w * Tr::kHeads + h]);
      // A warp whose maximum is still -inf adds its l as it is: 0 when it saw no token, NaN
      // when its only visible scores were NaN (NaN in K), which must reach O and LSE.
      float sum = sink_state == -INFINITY ? 0.0f : ptx::exp2_fast(sink_state - mx);
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

}  // namespace flashkv::cuda::decode_detail
