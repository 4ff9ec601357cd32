// The two tensor-core products of one KV tile, per warp: S = Q K^T (A = Q from shared memory,
// B = K rows by ldmatrix) and O += P V (A = P straight from the S accumulators, B = V by
// ldmatrix.trans). Every B fragment read feeds kMTiles MMAs; fragment layouts follow the PTX
// m16n8k16 description (thread g = lane / 4, t = lane % 4).
#pragma once

#include "prefill/tile_config.cuh"

namespace flashkv::cuda::prefill_detail {

// ldmatrix addresses into a swizzled tile, kept in 4 registers per operand. A lane reads, for
// chunk pair kc (chunks 2kc and 2kc + 1 of 8 elements), logical chunk c = 2kc + bit of a row r
// whose r % 8 is fixed for the lane; its physical chunk is c ^ (r % 8)
//   = 8 (kc / 4) + ((2 (kc % 4)) ^ c0),  c0 = bit ^ (r % 8),
// so its byte address is x[kc % 4] + 128 (kc / 4) with x[q] = row base + ((32 q) ^ (16 c0)).
// The kc / 4 part, the row steps and the pipeline stage are then plain immediate offsets.
struct LdmatrixBase {
  uint32_t x[4];
  __device__ __forceinline__ void init(uint32_t row_addr, int c0) {
#pragma unroll
    for (int q = 0; q < 4; ++q) x[q] = row_addr + ((q << 5) ^ (c0 << 4));
  }
  __device__ __forceinline__ uint32_t at(int kc, int byte_offset) const {
    return x[kc & 3] + (kc >> 2) * 128 + byte_offset;
  }
};

// Per-warp ldmatrix bases of the Q, K and V tiles (K and V of pipeline stage 0).
template <typename Cfg>
struct FragmentAddresses {
  LdmatrixBase q, k, v;
  __device__ __forceinline__ void init(uint32_t sq, uint32_t sk, uint32_t sv, int warp_row0,
                                       int lane) {
    // A (Q): lane l reads row l % 16, chunk bit l / 16 of a 16x16 tile.
    q.init(sq + (warp_row0 + (lane & 15)) * Cfg::kDqk * 2, (lane >> 4) ^ (lane & 7));
    // B (K rows): lane l reads key (l % 8) + 8 (l / 16), chunk bit (l / 8) % 2.
    k.init(sk + ((lane & 7) + ((lane >> 4) << 3)) * Cfg::kDqk * 2, ((lane >> 3) & 1) ^ (lane & 7));
    // B (V rows, transposed): lane l reads key (l % 8) + 8 ((l / 8) % 2), chunk bit l / 16.
    v.init(sv + ((lane & 7) + (((lane >> 3) & 1) << 3)) * Cfg::kDv * 2, (lane >> 4) ^ (lane & 7));
  }
};

// s[mt][nt] = Q[warp rows of tile mt] . K[keys nt*8 .. nt*8+7]^T over the whole D_qk.
// k_stage: byte offset of the K tile's pipeline stage.
template <typename Cfg>
__device__ __forceinline__ void qk_product(const FragmentAddresses<Cfg>& fa, uint32_t k_stage,
                                           float (&s)[Cfg::kMTiles][Cfg::kKvTile / 8][4]) {
  using QT = typename Cfg::Q;
  constexpr int kNTiles = Cfg::kKvTile / 8;
  constexpr int kRowBytes = Cfg::kDqk * 2;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
  LdmatrixBase k = fa.k;
#pragma unroll
  for (int q = 0; q < 4; ++q) k.x[q] += k_stage;
#pragma unroll
  for (int kk = 0; kk < Cfg::kDqk / 16; ++kk) {
    uint32_t a[Cfg::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) ldmatrix_x4(a[mt], fa.q.at(kk, mt * 16 * kRowBytes));
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, k.at(kk, np * 16 * kRowBytes));
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
        mma_16816<QT>(s[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<QT>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// O = 0 before a block's first tile.
template <int kMTiles, int kDvTiles>
__device__ __forceinline__ void zero_output(float (&o)[kMTiles][kDvTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDvTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.0f;
}

// P (the softmax numerators s) rounded to the 16-bit type QT, V's (Q's, but f16 where the Hopper
// kernel widens fp8 K/V), as MMA A fragments: the C fragments of key tiles 2kk and 2kk+1 are
// exactly the A fragment of k16 step kk.
template <typename Cfg>
using PFragments = uint32_t[Cfg::kMTiles][Cfg::kKvTile / 16][4];

// The fragment word of P tile mt that holds the numerators of C-fragment elements 2h and 2h + 1
// of key tile nt.
template <typename Cfg>
__device__ __forceinline__ uint32_t& p_word(PFragments<Cfg>& pf, int mt, int nt, int h) {
  return pf[mt][nt / 2][(nt % 2) * 2 + h];
}

template <typename Cfg, typename QT = typename Cfg::Q>
__device__ __forceinline__ void pack_p(const float (&s)[Cfg::kMTiles][Cfg::kKvTile / 8][4],
                                       PFragments<Cfg>& pf) {
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Cfg::kKvTile / 8; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        p_word<Cfg>(pf, mt, nt, h) = pack2<QT>(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
}

// o[mt][dt] += P[warp rows of tile mt, all keys of the tile] . V[keys, dims dt*8 .. dt*8+7].
// v_stage: byte offset of the V tile's pipeline stage.
template <typename Cfg>
__device__ __forceinline__ void pv_product(const PFragments<Cfg>& pf,
                                           const FragmentAddresses<Cfg>& fa, uint32_t v_stage,
                                           float (&o)[Cfg::kMTiles][Cfg::kDv / 8][4]) {
  using QT = typename Cfg::Q;
  constexpr int kRowBytes = Cfg::kDv * 2;
  LdmatrixBase v = fa.v;
#pragma unroll
  for (int q = 0; q < 4; ++q) v.x[q] += v_stage;
#pragma unroll
  for (int kk = 0; kk < Cfg::kKvTile / 16; ++kk)
#pragma unroll
    for (int np = 0; np < Cfg::kDv / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v.at(np, kk * 16 * kRowBytes));
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
        mma_16816<QT>(o[mt][2 * np], pf[mt][kk], b[0], b[1]);
        mma_16816<QT>(o[mt][2 * np + 1], pf[mt][kk], b[2], b[3]);
      }
    }
}

// Soft cap on the logits: s = cap * tanh(s * scale / cap) (scale = sm_scale * k_scale). The
// caller then uses c = log2(e) in the softmax instead of folding the scale in there.
template <typename Cfg>
__device__ __forceinline__ void apply_soft_cap(float (&s)[Cfg::kMTiles][Cfg::kKvTile / 8][4],
                                               float cap, float scale_over_cap) {
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Cfg::kKvTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = cap * tanh_fast(s[mt][nt][e] * scale_over_cap);
}

}  // namespace flashkv::cuda::prefill_detail
