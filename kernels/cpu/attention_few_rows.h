// The few-rows path of CPU attention (compiled per ISA like attention_kernel.h), for tasks with
// at most kFewRows rows per KV head: decode (one token x G heads) and short extends.
//
// With few rows, transposing K into the kt tile (attention_loads.h) would cost more than the
// products it feeds, and every K/V element is used only G times; so this path reads the K and V
// rows where they are. QK: a vector holds one key's steps; W keys' partial sums are reduced
// and transposed in registers into one vector of W scores (lanes = keys, as QkTile makes them),
// which then go through the same softmax. PV: V rows are loaded (bf16: two rows interleaved
// into steps) and multiplied into O in registers, without a V tile.
#pragma once

#ifndef FLASHKV_CPU_ISA_NS
#error \
    "include cpu/attention_few_rows.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

#include "attention_kernel.h"
#include "attention_loads.h"

namespace flashkv::cpu::FLASHKV_CPU_ISA_NS {

constexpr int kFewRows = 8;

// Scores of n keys (row pointers `keys`) for every row: scores [rows, kBlockKeys]. Keys go
// four at a time through a register tile of up to 4 rows x 4 keys, each K vector loaded once
// for those rows; the per-key vectors are then reduced to lanes (one key per lane). `pf` issues
// a step of a later block's prefetches per W keys (per key with one lane), and few_rows_pv one
// per pass over the block: outside the register tiles, whose loops stay free of its state.
template <class T, class Src>
void few_rows_qk(const Tile<T>& t, int rows, const char* const* keys, int n, int dim, float* scores,
                 const Fp8Tables& tables, SlotPrefetcher& pf) {
  using F = typename T::F;
  constexpr int W = T::W, P = T::kPack;
  const int vecs = t.q_pitch / W;
  if constexpr (W < 4) {  // one lane: plain dot products
    for (int j = 0; j < n; ++j) {
      pf.step();
      for (int r = 0; r < rows; ++r) {
        F acc = T::zero();
        for (int c = 0; c < vecs; ++c)
          acc = T::dot(acc, T::vload(t.q + r * t.q_pitch + c * W),
                       T::load_steps(reinterpret_cast<const Src*>(keys[j]) + c * W * P,
                                     dim - c * W * P, tables));
        scores[r * T::kBlockKeys + j] = T::reduce_add(acc);
      }
    }
  } else {
    for (int k0 = 0; k0 < n; k0 += W) {
      pf.step();
      for (int r0 = 0; r0 < rows; r0 += 4) {
        const int rq = imin(4, rows - r0);
        F quads[W / 4][4];  // [key quad][row]
        FLASHKV_UNROLL
        for (int qd = 0; qd < W / 4; ++qd) {
          const int first = k0 + 4 * qd;
          if (first >= n) {
            FLASHKV_UNROLL
            for (int r = 0; r < 4; ++r) quads[qd][r] = T::zero();
            continue;
          }
          F acc[4][4];
          FLASHKV_UNROLL
          for (int r = 0; r < 4; ++r) {
            FLASHKV_UNROLL
            for (int i = 0; i < 4; ++i) acc[r][i] = T::zero();
          }
          const char* rows4[4];
          FLASHKV_UNROLL
          for (int i = 0; i < 4; ++i) rows4[i] = keys[first + i < n ? first + i : first];
          for (int c = 0; c < vecs; ++c) {
            const int elems = dim - c * W * P;
            typename T::Vec k[4];
            FLASHKV_UNROLL
            for (int i = 0; i < 4; ++i)
              k[i] =
                  T::load_steps(reinterpret_cast<const Src*>(rows4[i]) + c * W * P, elems, tables);
            FLASHKV_UNROLL
            for (int r = 0; r < 4; ++r) {
              if (r >= rq) break;
              const typename T::Vec q = T::vload(t.q + (r0 + r) * t.q_pitch + c * W);
              FLASHKV_UNROLL
              for (int i = 0; i < 4; ++i) acc[r][i] = T::dot(acc[r][i], q, k[i]);
            }
          }
          FLASHKV_UNROLL
          for (int r = 0; r < 4; ++r) quads[qd][r] = T::reduce_quad(acc[r]);
        }
        for (int r = 0; r < rq; ++r) {
          F t4[W / 4];
          FLASHKV_UNROLL
          for (int qd = 0; qd < W / 4; ++qd) t4[qd] = quads[qd][r];
          T::store(scores + (r0 + r) * T::kBlockKeys + k0, T::finish_quads(t4));
        }
      }
    }
  }
}

// O[rows 0 .. RB - 1, dims d0 .. d0 + NV * W) = O * corr + P V, V rows read in place.
template <class T, class Src, int RB, int NV>
struct FewRowsPv {
  static void run(const Tile<T>& t, const char* const* values, int n, int dim, int d0,
                  const Fp8Tables& tables) {
    using F = typename T::F;
    constexpr int W = T::W, kPSteps = Tile<T>::kPSteps;
    F acc[RB][NV];
    FLASHKV_UNROLL
    for (int r = 0; r < RB; ++r) {
      const F c = T::set1(t.corr[r]);
      FLASHKV_UNROLL
      for (int v = 0; v < NV; ++v) acc[r][v] = T::mul(T::load(t.o + r * t.dv_pad + d0 + v * W), c);
    }
    for (int s = 0; s < t.steps_pv; ++s) {
      typename T::Vec v[NV + 1];
      if constexpr (T::kPack == 1) {
        const Src* row = reinterpret_cast<const Src*>(values[s]);
        FLASHKV_UNROLL
        for (int i = 0; i < NV; ++i)
          v[i] = T::load_steps(row + d0 + i * W, dim - d0 - i * W, tables);
      } else {
        const Src* a = reinterpret_cast<const Src*>(values[2 * s]);
        const Src* b = 2 * s + 1 < n ? reinterpret_cast<const Src*>(values[2 * s + 1]) : nullptr;
        FLASHKV_UNROLL
        for (int i = 0; i < NV; i += 2) {
          const int elems = dim - d0 - i * W;
          T::interleave(T::load_steps(a + d0 + i * W, elems, tables),
                        b ? T::load_steps(b + d0 + i * W, elems, tables) : T::vzero(), &v[i],
                        &v[i + 1]);
        }
      }
      FLASHKV_UNROLL
      for (int r = 0; r < RB; ++r) {
        FLASHKV_UNROLL
        for (int i = 0; i < NV; ++i) acc[r][i] = T::madd(acc[r][i], t.p + r * kPSteps + s, v[i]);
      }
    }
    FLASHKV_UNROLL
    for (int r = 0; r < RB; ++r) {
      FLASHKV_UNROLL
      for (int v = 0; v < NV; ++v) T::store(t.o + r * t.dv_pad + d0 + v * W, acc[r][v]);
    }
  }
};

// All dims of RB rows: chunks of NV vectors (NV * RB <= 16 accumulators), a smaller last one.
template <class T, class Src, int RB, int NV>
void few_rows_pv_tail(const Tile<T>& t, const char* const* values, int n, int dim, int d0, int vecs,
                      const Fp8Tables& tables, SlotPrefetcher& pf) {
  if constexpr (NV >= 1) {
    if (vecs == NV) {
      pf.step();
      return FewRowsPv<T, Src, RB, NV>::run(t, values, n, dim, d0, tables);
    }
    few_rows_pv_tail<T, Src, RB, NV - 1>(t, values, n, dim, d0, vecs, tables, pf);
  }
}
template <class T, class Src, int RB>
void few_rows_pv_rows(const Tile<T>& t, const char* const* values, int n, int dim,
                      const Fp8Tables& tables, SlotPrefetcher& pf) {
  constexpr int NV = RB <= 1 ? 16 : RB == 2 ? 8 : RB <= 4 ? 4 : 2;
  const int vecs = t.dv_pad / T::W;
  int v = 0;
  for (; v + NV <= vecs; v += NV) {
    pf.step();
    FewRowsPv<T, Src, RB, NV>::run(t, values, n, dim, v * T::W, tables);
  }
  if (v < vecs)
    few_rows_pv_tail<T, Src, RB, NV - 1>(t, values, n, dim, v * T::W, vecs - v, tables, pf);
}
template <class T, class Src, int RB = kFewRows>
void few_rows_pv(const Tile<T>& t, int rows, const char* const* values, int n, int dim,
                 const Fp8Tables& tables, SlotPrefetcher& pf) {
  if constexpr (RB >= 1) {
    if (rows == RB) return few_rows_pv_rows<T, Src, RB>(t, values, n, dim, tables, pf);
    few_rows_pv<T, Src, RB - 1>(t, rows, values, n, dim, tables, pf);
  }
}

// ---- K/V split into even and odd lanes (units with T::kSplitKv: AVX2) -----------------------
//
// Without bf16 dot products, each bf16 or fp8 value must become an fp32 lane. Widening bf16
// costs two operations per 8 values (and, for K, a staged fp32 copy of the block), fp8 a gather
// from a table; T::split makes two fp32 vectors out of 16 values loaded at once: the
// even-indexed values and the odd-indexed ones (bf16: one operation each; fp8: a few integer
// operations and an f16 conversion). Dot products do not care about the order of the dims, so
// Q is kept with each group of 16 dims in that order (even dims, then odd dims), and so is O,
// which natural_order puts back in order (times the factor split() left out) before it is
// stored. QK takes rows 2 at a time (fp8: 4 first), the last one alone; PV 4, then 2 and 1.

template <class T, class = void>
struct HasSplitKv : std::false_type {};
template <class T>
struct HasSplitKv<T, std::void_t<decltype(T::kSplitKv)>>
    : std::integral_constant<bool, T::kSplitKv> {};

template <class KvType>
constexpr bool kSplitType = std::is_same_v<KvType, bf16_t> || std::is_same_v<KvType, fp8_e4m3_t> ||
                            std::is_same_v<KvType, fp8_e5m2_t>;
// What split() leaves out of the values (e4m3 comes out as value / 256; see simd_avx2.h).
template <class KvType>
constexpr float kSplitFactor = std::is_same_v<KvType, fp8_e4m3_t> ? 256.0f : 1.0f;

// Whether the split path runs a task of `rows` rows per head and these head dims.
template <class T, class KvType>
bool few_rows_split_applies(int rows, int dim_qk, int dim_v) {
  if constexpr (HasSplitKv<T>::value && kSplitType<KvType>)
    return rows > 0 && dim_qk % 16 == 0 && dim_v % 16 == 0;
  return false;
}

// Row x [dim] (dim % 16 == 0) from natural order to the split order, and back (times factor).
inline void split_order(float* x, int dim) {
  for (int g = 0; g < dim; g += 16) {
    float tmp[16];
    for (int i = 0; i < 8; ++i) {
      tmp[i] = x[g + 2 * i];
      tmp[8 + i] = x[g + 2 * i + 1];
    }
    std::memcpy(x + g, tmp, sizeof(tmp));
  }
}
inline void natural_order(float* x, int dim, float factor) {
  for (int g = 0; g < dim; g += 16) {
    float tmp[16];
    for (int i = 0; i < 8; ++i) {
      tmp[2 * i] = x[g + i] * factor;
      tmp[2 * i + 1] = x[g + 8 + i] * factor;
    }
    std::memcpy(x + g, tmp, sizeof(tmp));
  }
}

// Scores of keys kr[0..3] for 2 rows of Q (split order, row pitch `pitch`): 2 rows x 4 keys of
// accumulators; the 4 Q vectors of a step stay in registers for the 4 keys, and each split K
// load feeds both rows.
template <class T, class Src>
void qk_split_2rows(const float* q, int pitch, const Src* const (&kr)[4], int dim, float* scores,
                    int stride) {
  using F = typename T::F;
  F acc[2][4];
  FLASHKV_UNROLL
  for (int r = 0; r < 2; ++r) {
    FLASHKV_UNROLL
    for (int k = 0; k < 4; ++k) acc[r][k] = T::zero();
  }
  for (int d = 0; d < dim; d += 16) {
    const F qe0 = T::load(q + d), qo0 = T::load(q + d + 8);
    const F qe1 = T::load(q + pitch + d), qo1 = T::load(q + pitch + d + 8);
    FLASHKV_UNROLL
    for (int k = 0; k < 4; ++k) {
      F e, o;
      T::split(kr[k] + d, e, o);
      acc[0][k] = T::fmadd(qo0, o, T::fmadd(qe0, e, acc[0][k]));
      acc[1][k] = T::fmadd(qo1, o, T::fmadd(qe1, e, acc[1][k]));
    }
  }
  const F quads[2] = {T::reduce_quad(acc[0]), T::reduce_quad(acc[1])};
  float lanes[8];
  T::store(lanes, T::finish_quads(quads));  // lane 4r + k: row r, key k
  std::memcpy(scores, lanes, 4 * sizeof(float));
  std::memcpy(scores + stride, lanes + 4, 4 * sizeof(float));
}

// Scores of keys kr[0..3] for 4 rows of Q (split order, row pitch `pitch`): 4 rows x 2 keys of
// accumulators, each K vector pair used by the 4 rows; two such tiles make the 4 keys' scores.
template <class T, class Src>
void qk_split_4rows(const float* q, int pitch, const Src* const (&kr)[4], int dim, float* scores,
                    int stride) {
  using F = typename T::F;
  F pairs[2];
  FLASHKV_UNROLL
  for (int half = 0; half < 2; ++half) {
    const Src* a = kr[2 * half];
    const Src* b = kr[2 * half + 1];
    F acc[4][2];
    FLASHKV_UNROLL
    for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = T::zero();
    for (int d = 0; d < dim; d += 16) {
      F ae, ao, be, bo;
      T::split(a + d, ae, ao);
      T::split(b + d, be, bo);
      FLASHKV_UNROLL
      for (int r = 0; r < 4; ++r) {
        const F qe = T::load(q + r * pitch + d), qo = T::load(q + r * pitch + d + 8);
        acc[r][0] = T::fmadd(qo, ao, T::fmadd(qe, ae, acc[r][0]));
        acc[r][1] = T::fmadd(qo, bo, T::fmadd(qe, be, acc[r][1]));
      }
    }
    const F lo[4] = {acc[0][0], acc[0][1], acc[1][0], acc[1][1]};
    const F hi[4] = {acc[2][0], acc[2][1], acc[3][0], acc[3][1]};
    const F quads[2] = {T::reduce_quad(lo), T::reduce_quad(hi)};
    pairs[half] = T::finish_quads(quads);  // lane 2r + k: row r, key 2 half + k
  }
  T::store_scores_4x4(pairs[0], pairs[1], scores, stride);
}

// The same for R = 1 (a last odd row) or 2 rows: R rows x 4 / R keys a pass, with separate
// accumulators for the even and the odd dims (8 in all), so that no FMA waits for another of the
// same pass.
template <class T, class Src, int R>
void qk_split_few(const float* q, int pitch, const Src* const (&kr)[4], int dim, float* scores,
                  int stride) {
  using F = typename T::F;
  constexpr int KK = 4 / R;
  FLASHKV_UNROLL
  for (int k0 = 0; k0 < 4; k0 += KK) {
    F acc[R][KK][2];
    FLASHKV_UNROLL
    for (int r = 0; r < R; ++r) {
      FLASHKV_UNROLL
      for (int k = 0; k < KK; ++k) acc[r][k][0] = acc[r][k][1] = T::zero();
    }
    for (int d = 0; d < dim; d += 16) {
      FLASHKV_UNROLL
      for (int k = 0; k < KK; ++k) {
        F e, o;
        T::split(kr[k0 + k] + d, e, o);
        FLASHKV_UNROLL
        for (int r = 0; r < R; ++r) {
          acc[r][k][0] = T::fmadd(T::load(q + r * pitch + d), e, acc[r][k][0]);
          acc[r][k][1] = T::fmadd(T::load(q + r * pitch + d + 8), o, acc[r][k][1]);
        }
      }
    }
    F sums[4];
    FLASHKV_UNROLL
    for (int r = 0; r < R; ++r) {
      FLASHKV_UNROLL
      for (int k = 0; k < KK; ++k) sums[r * KK + k] = T::add(acc[r][k][0], acc[r][k][1]);
    }
    const F quads[2] = {T::reduce_quad(sums), T::zero()};
    float lanes[8];
    T::store(lanes, T::finish_quads(quads));  // lane i < 4: the sum of sums[i]
    FLASHKV_UNROLL
    for (int r = 0; r < R; ++r) {
      FLASHKV_UNROLL
      for (int k = 0; k < KK; ++k) scores[r * stride + k0 + k] = lanes[r * KK + k];
    }
  }
}

// Scores of keys kr[0..3] for `rows` rows of Q (split order): bf16 K, split in one operation per
// 8 values, in 2-row tiles, which keep the step's Q vectors in registers; fp8 K, whose split
// takes about 6 operations per 8 values, first in 4-row tiles, which split each K vector once for
// the 4 rows; an odd last row alone.
template <class T, class Src>
void qk_split_rows(const float* q, int pitch, int rows, const Src* const (&kr)[4], int dim,
                   float* scores, int stride) {
  int r0 = 0;
  if constexpr (!std::is_same_v<Src, bf16_t>) {
    for (; r0 + 4 <= rows; r0 += 4)
      qk_split_4rows<T>(q + r0 * pitch, pitch, kr, dim, scores + r0 * stride, stride);
  }
  for (; r0 + 2 <= rows; r0 += 2)
    qk_split_2rows<T>(q + r0 * pitch, pitch, kr, dim, scores + r0 * stride, stride);
  if (r0 < rows)
    qk_split_few<T, Src, 1>(q + r0 * pitch, pitch, kr, dim, scores + r0 * stride, stride);
}

// acc[r][g] += P[r, j] V[j, d0 + 16 g ..] over the n keys (the even / odd dims of group g in
// acc[r][g][0 / 1]): NG groups of 16 dims, a split V load per group and key, R broadcasts a key.
template <class T, class Src, int R, int NG>
FLASHKV_ALWAYS_INLINE void pv_split_pass(const float* p, const char* const* values, int n, int d0,
                                         typename T::F (&acc)[R][NG][2]) {
  using F = typename T::F;
  constexpr int kPSteps = Tile<T>::kPSteps;
  for (int j = 0; j < n; ++j) {
    const Src* v = reinterpret_cast<const Src*>(values[j]) + d0;
    F pr[R];
    FLASHKV_UNROLL
    for (int r = 0; r < R; ++r) pr[r] = T::set1(p[r * kPSteps + j]);
    FLASHKV_UNROLL
    for (int g = 0; g < NG; ++g) {
      F ve, vo;
      T::split(v + 16 * g, ve, vo);
      FLASHKV_UNROLL
      for (int r = 0; r < R; ++r) {
        acc[r][g][0] = T::fmadd(pr[r], ve, acc[r][g][0]);
        acc[r][g][1] = T::fmadd(pr[r], vo, acc[r][g][1]);
      }
    }
  }
}

// O = O * corr + P V over n V rows (O in split order) for R rows from r0 and the NG groups of 16
// dims from d0, so that the R x NG x 2 accumulators take one split V load per group and key.
template <class T, class Src, int R, int NG>
void pv_split_groups(const Tile<T>& t, int r0, const char* const* values, int n, int d0) {
  using F = typename T::F;
  constexpr int kPSteps = Tile<T>::kPSteps;
  F acc[R][NG][2];
  FLASHKV_UNROLL
  for (int r = 0; r < R; ++r) {
    const F c = T::set1(t.corr[r0 + r]);
    const float* o = t.o + (r0 + r) * t.dv_pad + d0;
    FLASHKV_UNROLL
    for (int g = 0; g < NG; ++g) {
      acc[r][g][0] = T::mul(T::load(o + 16 * g), c);
      acc[r][g][1] = T::mul(T::load(o + 16 * g + 8), c);
    }
  }
  pv_split_pass<T, Src, R, NG>(t.p + r0 * kPSteps, values, n, d0, acc);
  FLASHKV_UNROLL
  for (int r = 0; r < R; ++r) {
    float* o = t.o + (r0 + r) * t.dv_pad + d0;
    FLASHKV_UNROLL
    for (int g = 0; g < NG; ++g) {
      T::store(o + 16 * g, acc[r][g][0]);
      T::store(o + 16 * g + 8, acc[r][g][1]);
    }
  }
}
template <class T, class Src, int R>
void pv_split_rows(const Tile<T>& t, int r0, const char* const* values, int n, int dim) {
  constexpr int NG = 4 / R;
  int d0 = 0;
  for (; d0 + 16 * NG <= dim; d0 += 16 * NG) pv_split_groups<T, Src, R, NG>(t, r0, values, n, d0);
  if constexpr (NG > 1) {  // the rest: 1 - 3 groups of 16
    for (; d0 < dim; d0 += 16) pv_split_groups<T, Src, R, 1>(t, r0, values, n, d0);
  }
}
template <class T, class Src>
void few_rows_pv_split(const Tile<T>& t, int rows, const char* const* values, int n, int dim) {
  int r0 = 0;
  for (; r0 + 4 <= rows; r0 += 4) pv_split_rows<T, Src, 4>(t, r0, values, n, dim);
  if (r0 + 2 <= rows) {
    pv_split_rows<T, Src, 2>(t, r0, values, n, dim);
    r0 += 2;
  }
  if (r0 < rows) pv_split_rows<T, Src, 1>(t, r0, values, n, dim);
}

// Loads the score rows back into registers for the shared softmax.
template <class T>
void few_rows_softmax(const Tile<T>& t, int rows, const float* scores) {
  constexpr int NC = Tile<T>::kKeyVecs;
  for (int r = 0; r < rows; ++r) {
    typename T::F s[NC];
    FLASHKV_UNROLL
    for (int c = 0; c < NC; ++c) s[c] = T::load(scores + r * T::kBlockKeys + c * T::W);
    softmax_row(t, r, s);
  }
}

}  // namespace flashkv::cpu::FLASHKV_CPU_ISA_NS
