// The micro-kernels of CPU attention, written once over a vector-helper type T (cpu/simd_*.h)
// and compiled once per ISA by cpu/attention_<isa>.cpp (inside namespace flashkv::cpu::<isa>,
// with that unit's target). How a task uses them: cpu/attention_item.h.
//
// Per KV block of T::kBlockKeys keys, with K and V already loaded into two tiles
// (cpu/attention_loads.h):
//   kt [steps_qk, kBlockKeys]       K transposed: a vector holds W keys of one step, so the QK
//                                    product broadcasts one Q step and multiplies W keys at once;
//   vp [kBlockKeys / kPack, dv_pad]  V rows (bf16: steps pairing rows 2i and 2i + 1), W dims a
//                                    vector;
// QkTile computes S = Q K^T for a few rows and every key of the block in registers, then, still
// in registers, the scale, soft cap and masks and the online-softmax update in base 2 (running
// max m, lane-wise running sum l, probabilities P stored as steps); PvTile then computes
// O = O * 2^(m_old - m_new) + P V. A step is one fp32, or a pair of bf16 that one `vdpbf16ps`
// multiplies and adds.
#pragma once

#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/attention_kernel.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

#include "kernel_common.h"

// The register tiles are fixed-size arrays; they must be unrolled to live in registers, whatever
// the optimisation level the library is built with.
#if defined(__clang__)
#define FLASHKV_UNROLL _Pragma("clang loop unroll(full)")
#elif defined(__GNUC__)
#define FLASHKV_UNROLL _Pragma("GCC unroll 64")
#else
#define FLASHKV_UNROLL
#endif

namespace flashkv::cpu::FLASHKV_CPU_ISA_NS {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_inff();

inline int imin(int a, int b) { return a < b ? a : b; }
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }
inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// The state the micro-kernels of one KV head share.
template <class T>
struct Tile {
  using Step = typename T::Step;
  static constexpr int kKeyVecs = T::kBlockKeys / T::W;     // vectors of keys in a score row
  static constexpr int kPSteps = T::kBlockKeys / T::kPack;  // steps of a probability row
  const Step* q;                                            // [rows, q_pitch]
  int q_pitch, steps_qk;
  const Step* kt;  // [steps_qk, kBlockKeys]
  const Step* vp;  // [kPSteps, dv_pad]
  int dv_pad;
  int steps_pv;  // steps of P / vp rows in use in the current block
  Step* p;       // [rows, kPSteps]
  float* o;      // [rows, dv_pad] running output (not yet divided by l)
  float* m;      // [rows] running max (base-2 logits)
  float* lsum;   // [rows, W] running sum, lane-wise
  float* corr;   // [rows] 2^(m_old - m_new) of the current block
  // Raw dot products times qk_scale give base-2 logits, or, with the soft cap on
  // (cap_log2e > 0), the tanh argument: logit = tanh(dot * qk_scale) * cap_log2e.
  float qk_scale, cap_log2e;
  // Masking of the current block (keys j0 .. j0 + kBlockKeys - 1, absolute positions): when
  // `masked`, row r keeps the keys in [lo[r], hi[r]] whose byte in allowed[r] (if any) is set.
  int j0;
  bool masked;
  const int* lo;
  const int* hi;
  const uint8_t* allowed;  // [rows, kBlockKeys] or null
};

// Scores of one row (a register row of the QK tile) -> online softmax update and its P row.
template <class T>
inline void softmax_row(const Tile<T>& t, int r, typename T::F (&s)[Tile<T>::kKeyVecs]) {
  using F = typename T::F;
  constexpr int NC = Tile<T>::kKeyVecs;
  const F scale = T::set1(t.qk_scale);
  FLASHKV_UNROLL
  for (int c = 0; c < NC; ++c) s[c] = T::mul(s[c], scale);
  if (t.cap_log2e > 0) {
    const F cap = T::set1(t.cap_log2e);
    FLASHKV_UNROLL
    for (int c = 0; c < NC; ++c) s[c] = T::mul(T::tanh(s[c]), cap);
  }
  if (t.masked) {
    FLASHKV_UNROLL
    for (int c = 0; c < NC; ++c) s[c] = T::keep_range(s[c], t.j0 + c * T::W, t.lo[r], t.hi[r]);
    if (t.allowed) {
      FLASHKV_UNROLL
      for (int c = 0; c < NC; ++c)
        s[c] = T::keep_bytes(s[c], t.allowed + r * T::kBlockKeys + c * T::W);
    }
  }
  // The block's maximum over the scores that are numbers: T::max returns its second operand
  // when the first is NaN, so a NaN score (NaN in K or Q) leaves m alone and comes out of exp2
  // as a NaN probability, which carries into l and O as the reference's does.
  F mx = T::set1(kNegInf);
  FLASHKV_UNROLL
  for (int c = 0; c < NC; ++c) mx = T::max(s[c], mx);
  const float m_old = t.m[r];
  const float block_max = T::reduce_max(mx);
  const float m_new = block_max > m_old ? block_max : m_old;
  typename T::Step* prow = t.p + r * Tile<T>::kPSteps;
  if (m_new == kNegInf) {
    // Nothing visible to this row yet, unless every visible score of the block is NaN (the
    // maximum skipped them): a sum over the block's scores is NaN exactly then, and those go on
    // below, where m_new = -inf makes every probability of the block NaN, and with it the row.
    F any = s[0];
    FLASHKV_UNROLL
    for (int c = 1; c < NC; ++c) any = T::add(any, s[c]);
    if (!std::isnan(T::reduce_add(any))) {
      t.corr[r] = 1.0f;
      std::memset(prow, 0, sizeof(typename T::Step) * Tile<T>::kPSteps);
      return;
    }
  }
  const float corr = m_old == m_new ? 1.0f : std::exp2(m_old - m_new);
  const F mv = T::set1(m_new);
  F sum = T::zero();
  FLASHKV_UNROLL
  for (int c = 0; c < NC; ++c) {
    s[c] = T::exp2_probs(T::sub(s[c], mv));
    sum = T::add(sum, s[c]);
  }
  float* l = t.lsum + r * T::W;
  T::store(l, T::fmadd(T::load(l), T::set1(corr), sum));
  T::store_probs(prow, s);
  t.m[r] = m_new;
  t.corr[r] = corr;
}

// S = Q K^T for rows r0 .. r0 + RB - 1 and every key of the block, then their softmax.
template <class T, int RB>
struct QkTile {
  static void run(const Tile<T>& t, int r0) {
    using F = typename T::F;
    constexpr int NC = Tile<T>::kKeyVecs;
    F acc[RB][NC];
    FLASHKV_UNROLL
    for (int r = 0; r < RB; ++r) {
      FLASHKV_UNROLL
      for (int c = 0; c < NC; ++c) acc[r][c] = T::zero();
    }
    const typename T::Step* q = t.q + r0 * t.q_pitch;
    const typename T::Step* kt = t.kt;
    for (int s = 0; s < t.steps_qk; ++s, kt += T::kBlockKeys) {
      typename T::Vec k[NC];
      FLASHKV_UNROLL
      for (int c = 0; c < NC; ++c) k[c] = T::vload(kt + c * T::W);
      FLASHKV_UNROLL
      for (int r = 0; r < RB; ++r) {
        FLASHKV_UNROLL
        for (int c = 0; c < NC; ++c) acc[r][c] = T::madd(acc[r][c], q + r * t.q_pitch + s, k[c]);
      }
    }
    FLASHKV_UNROLL
    for (int r = 0; r < RB; ++r) softmax_row(t, r0 + r, acc[r]);
  }
};

// O[rows r0 .., dims d0 .. d0 + NV * W) = O * corr + P V.
template <class T, int RB, int NV>
struct PvTile {
  static void run(const Tile<T>& t, int r0, int d0) {
    using F = typename T::F;
    constexpr int kPSteps = Tile<T>::kPSteps;
    F acc[RB][NV];
    FLASHKV_UNROLL
    for (int r = 0; r < RB; ++r) {
      const F c = T::set1(t.corr[r0 + r]);
      const float* o = t.o + (r0 + r) * t.dv_pad + d0;
      FLASHKV_UNROLL
      for (int v = 0; v < NV; ++v) acc[r][v] = T::mul(T::load(o + v * T::W), c);
    }
    const typename T::Step* p = t.p + r0 * kPSteps;
    const typename T::Step* vp = t.vp + d0;
    for (int s = 0; s < t.steps_pv; ++s, vp += t.dv_pad) {
      typename T::Vec v[NV];
      FLASHKV_UNROLL
      for (int i = 0; i < NV; ++i) v[i] = T::vload(vp + i * T::W);
      FLASHKV_UNROLL
      for (int r = 0; r < RB; ++r) {
        FLASHKV_UNROLL
        for (int i = 0; i < NV; ++i) acc[r][i] = T::madd(acc[r][i], p + r * kPSteps + s, v[i]);
      }
    }
    FLASHKV_UNROLL
    for (int r = 0; r < RB; ++r) {
      float* o = t.o + (r0 + r) * t.dv_pad + d0;
      FLASHKV_UNROLL
      for (int v = 0; v < NV; ++v) T::store(o + v * T::W, acc[r][v]);
    }
  }
};

// QkTile over `rows` rows: tiles of T::kQkRows, then one smaller tile for the rest.
template <class T, int RB>
void qk_tail(const Tile<T>& t, int r0, int rem) {
  if constexpr (RB >= 1) {
    if (rem == RB) return QkTile<T, RB>::run(t, r0);
    qk_tail<T, RB - 1>(t, r0, rem);
  }
}
template <class T>
void qk_rows(const Tile<T>& t, int rows) {
  constexpr int RB = T::kQkRows;
  int r = 0;
  for (; r + RB <= rows; r += RB) QkTile<T, RB>::run(t, r);
  if (r < rows) qk_tail<T, RB - 1>(t, r, rows - r);
}

// PvTile over `rows` rows and all dims: T::kPvRows x T::kPvVecs tiles, smaller ones at the edges.
template <class T, int RB, int NV>
void pv_tail(const Tile<T>& t, int r0, int rem, int d0) {
  if constexpr (RB >= 1) {
    if (rem == RB) return PvTile<T, RB, NV>::run(t, r0, d0);
    pv_tail<T, RB - 1, NV>(t, r0, rem, d0);
  }
}
template <class T, int NV>
void pv_cols(const Tile<T>& t, int rows, int d0) {
  constexpr int RB = T::kPvRows;
  int r = 0;
  for (; r + RB <= rows; r += RB) PvTile<T, RB, NV>::run(t, r, d0);
  if (r < rows) pv_tail<T, RB - 1, NV>(t, r, rows - r, d0);
}
template <class T, int NV>
void pv_vec_tail(const Tile<T>& t, int rows, int d0, int vecs) {
  if constexpr (NV >= 1) {
    if (vecs == NV) return pv_cols<T, NV>(t, rows, d0);
    pv_vec_tail<T, NV - 1>(t, rows, d0, vecs);
  }
}
template <class T>
void pv_rows(const Tile<T>& t, int rows) {
  constexpr int NV = T::kPvVecs;
  const int vecs = t.dv_pad / T::W;
  int v = 0;
  for (; v + NV <= vecs; v += NV) pv_cols<T, NV>(t, rows, v * T::W);
  if (v < vecs) pv_vec_tail<T, NV - 1>(t, rows, v * T::W, vecs - v);
}

}  // namespace flashkv::cpu::FLASHKV_CPU_ISA_NS
