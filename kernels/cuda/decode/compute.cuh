// DecodeCta (decode/cta.cuh), the consumer side: Q as mma fragments, and one 16-token block
// (S^T = K . Q^T, online softmax, O^T += V^T . P^T) per warp.
#pragma once

#include "decode/cta.cuh"

namespace flashkv::cuda::decode_detail {

template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::reset_state() {
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
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::load_q_frags(const unsigned char* stage) {
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

// S^T = K . Q^T for tokens [16 b, 16 b + 16) of the stage, accumulated in two halves (even
// and odd k-steps) to halve the dependent mma chain.
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::scores(uint32_t k_smem, int b, float (&s)[NT][4]) const {
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
template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::accumulate(uint32_t v_smem, int b,
                                                   const uint32_t (&pb)[NT][2]) {
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
        const uint32_t a[4] = {fp8_pair_to_f16x2<kKv, false>(lo), fp8_pair_to_f16x2<kKv, true>(lo),
                               fp8_pair_to_f16x2<kKv, false>(hi), fp8_pair_to_f16x2<kKv, true>(hi)};
#pragma unroll
        for (int n = 0; n < NT; ++n) ptx::mma_m16n8k16<MT>(o[2 * w + e][n], a, pb[n]);
      }
    }
  }
}

// The dim of O^T fragment element (m-tile i, e >= 2 ? row r + 8 : row r).
template <class Tr, typename QT, KvFormat kKv>
__device__ int DecodeCta<Tr, QT, kKv>::out_dim(int i, int e) const {
  if constexpr (!kFp8)
    return 16 * i + r + (e >= 2 ? 8 : 0);
  else
    return r * (D / 8) + 2 * i + (e >= 2 ? 1 : 0);
}

template <class Tr, typename QT, KvFormat kKv>
__device__ void DecodeCta<Tr, QT, kKv>::block(const unsigned char* stage, int b, int valid) {
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
      for (int e = 0; e < 4; ++e) s[n][e] = softcap_out * ptx::tanh_fast(s[n][e] * item_softcap_in);
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

}  // namespace flashkv::cuda::decode_detail
