// Online softmax in registers. A thread holds, for each of its kMTiles MMA tiles, two query rows
// (g and g + 8); the four threads of a quad share a row, so row reductions are two xor-shuffles.
// Work is in base 2: p = 2^(s * c - m * c), with c = log2(e) * sm_scale folded into one FFMA
// per element (c = log2(e) alone when a soft cap already scaled the logits).
#pragma once

#include "common/merge.cuh"
#include "prefill/primitives.cuh"

namespace flashkv::cuda::prefill_detail {

template <int kMTiles>
struct OnlineSoftmax {
  float row_max[kMTiles][2];  // running max of raw logits (-inf: nothing seen yet)
  float row_sum[kMTiles][2];  // this thread's share of sum p (reduced over the quad at the end)

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[mt][h] = -__int_as_float(0x7f800000);
        row_sum[mt][h] = 0.0f;
      }
  }

  // Folds the tile's logits s into the state: s becomes p (unnormalised probabilities) and the
  // output accumulators o are rescaled when the reference max moves.
  //
  // Lazy rescaling: the max that the exponentials are taken against is raised only when the
  // tile's max exceeds it by more than kRescaleLog2 (in base-2 units), so p stays <= 2^8 and
  // nothing overflows, while most tiles after the first few skip the O rescale (a warp-uniform
  // branch). The result is exact: l and O share the same reference, and LSE uses it too.
  static constexpr float kRescaleLog2 = 8.0f;

  template <int kNTiles, int kDvTiles>
  __device__ __forceinline__ void update(float (&s)[kMTiles][kNTiles][4],
                                         float (&o)[kMTiles][kDvTiles][4], float c) {
    float corr[kMTiles][2];
    if (update_scores(s, c, corr)) rescale(o, corr);
  }

  // update() without the O rescale: the caller applies rescale(o, corr) before O next takes a
  // product (the sm_90a kernel's P.V of the previous tile may still be writing O). Returns
  // whether any row of the warp moved its reference (else every corr is 1).
  template <int kNTiles>
  __device__ __forceinline__ bool update_scores(float (&s)[kMTiles][kNTiles][4], float c,
                                                float (&corr)[kMTiles][2]) {
    const float neg_inf = -__int_as_float(0x7f800000);
    bool raise_any = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // The row's max over the thread's 2 kNTiles logits as a tree: log2 levels of dependent
        // max instructions before the shuffles, where a running max is a chain of kNTiles + 1.
        float v[kNTiles];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) v[nt] = fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
#pragma unroll
        for (int w = 1; w < kNTiles; w *= 2)
#pragma unroll
          for (int i = 0; i + w < kNTiles; i += 2 * w) v[i] = fmaxf(v[i], v[i + w]);
        float m = fmaxf(row_max[mt][h], v[0]);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        // First visible key: -inf -> finite gives +inf > threshold. Still nothing visible:
        // (-inf) - (-inf) is NaN, which compares false, and the max stays -inf.
        const bool raise = (m - row_max[mt][h]) * c > kRescaleLog2;
        corr[mt][h] = raise ? exp2_fast(row_max[mt][h] * c - m * c) : 1.0f;
        if (raise) row_max[mt][h] = m;
        raise_any |= raise;
        // A row that has seen no visible key keeps max -inf; use 0 as its offset so that
        // 2^(-inf - 0) = 0 rather than NaN.
        const float m_scaled = row_max[mt][h] == neg_inf ? 0.0f : row_max[mt][h] * c;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          s[mt][nt][2 * h] = exp2_fast(fmaf(s[mt][nt][2 * h], c, -m_scaled));
          s[mt][nt][2 * h + 1] = exp2_fast(fmaf(s[mt][nt][2 * h + 1], c, -m_scaled));
          sum += s[mt][nt][2 * h] + s[mt][nt][2 * h + 1];
        }
        row_sum[mt][h] = row_sum[mt][h] * corr[mt][h] + sum;
      }
    return __any_sync(0xffffffffu, raise_any);
  }

  // update_scores for a tile whose P goes straight into its 16-bit fragments, with s left as it
  // was: pack(nt, h, p0, p1) takes the numerators of logits s[0][nt][2h] and s[0][nt][2h + 1]. The
  // exponentials are taken against the running references at once, without the tile's row maxima:
  // where every thread's share of each row sums to at most 2^kRescaleLog2, no numerator exceeds
  // it, so update_scores would not raise a reference either (up to the rounding of its test at
  // the threshold, where both results are exact), and its numerators, sums and fragments are these.
  // Then true is returned. Else (a larger numerator, a NaN, or a row that has seen no key yet,
  // whose first visible key sets its reference) nothing is changed and false is returned: the
  // caller runs update_scores on s.
  template <int kNTiles, typename Pack>
  __device__ __forceinline__ bool update_scores_ahead(const float (&s)[1][kNTiles][4], float c,
                                                      Pack&& pack) {
    static_assert(kMTiles == 1, "one 16-row tile a warp");
    const float neg_inf = -__int_as_float(0x7f800000);
    if (!__all_sync(0xffffffffu, row_max[0][0] != neg_inf && row_max[0][1] != neg_inf))
      return false;
    float sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_scaled = row_max[0][h] * c;
      sum[h] = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const float p0 = exp2_fast(fmaf(s[0][nt][2 * h], c, -m_scaled));
        const float p1 = exp2_fast(fmaf(s[0][nt][2 * h + 1], c, -m_scaled));
        sum[h] += p0 + p1;
        pack(nt, h, p0, p1);
      }
    }
    constexpr float kBound = static_cast<float>(1 << static_cast<int>(kRescaleLog2));
    if (!__all_sync(0xffffffffu, sum[0] <= kBound && sum[1] <= kBound)) return false;
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[0][h] += sum[h];  // update_scores' with corr 1
    return true;
  }

  template <int kDvTiles>
  static __device__ __forceinline__ void rescale(float (&o)[kMTiles][kDvTiles][4],
                                                 const float (&corr)[kMTiles][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDvTiles; ++dt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          o[mt][dt][2 * h] *= corr[mt][h];
          o[mt][dt][2 * h + 1] *= corr[mt][h];
        }
  }

  // After the last tile: the row's total over the quad, and LSE (base 2) of the logits.
  __device__ __forceinline__ void finish(float c, float (&scale)[kMTiles][2],
                                         float (&lse)[kMTiles][2], float v_scale) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float l = row_sum[mt][h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const bool empty = l == 0.0f;
        scale[mt][h] = empty ? 0.0f : v_scale / l;
        lse[mt][h] = empty ? -__int_as_float(0x7f800000) : row_max[mt][h] * c + __log2f(l);
      }
  }
};

}  // namespace flashkv::cuda::prefill_detail
