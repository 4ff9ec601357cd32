// The merge of partial attention states over disjoint KV sets (SEMANTICS.md, "Merging partial
// states"), the one definition every CUDA path uses: the decode kernel's merge of split tiles
// (decode/merge.cuh), the prefill merge pass (prefill/merge.cuh), the prefill epilogue's merge
// with AttentionParams::merge_o (prefill/epilogue.cuh), merge_state / merge_states
// (cuda/merge.cu), and the attention sink (sink_lse below), one more state with O = 0.
//
// States i with base-2 LSEs lse_i and normalised outputs O_i merge to
//   O = sum_i w_i O_i / sum_i w_i,  LSE = max + log2(sum_i w_i),  w_i = 2^(lse_i - max),
// max the largest LSE. A state with LSE -inf (it saw no key) weighs 0 and its O, which may hold
// anything, is never added. A NaN LSE (NaN in the KV) weighs NaN, so the sum, O and LSE come out
// NaN. With no state that saw a key the sum is 0: O = 0 and LSE = -inf.
//
// The callers keep their own memory access (vector widths, loads in flight); they take the
// weights, the running rescale, 1 / sum and the LSE from here, in one of three shapes:
//   - two states at once: pair();
//   - any number, the maximum first: see() each state, then add() each (returns its weight) or
//     weight() for a state already added;
//   - online, one state at a time in a fixed order (the decode split merge): fold().
// kFastExp2 / kFastLog2: exp2 / log2 as the single approximate instructions (ex2.approx.ftz,
// lg2.approx.ftz) rather than exp2f / log2f. Each path keeps the functions it was written with
// (the decode kernel's softmax is all approximate), so that its results keep their bits.
#pragma once

#include <cmath>

#include "common/ptx.cuh"

namespace flashkv::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// The attention sink of query head `head` (SEMANTICS.md "Attention sinks") as a state: O = 0 and
// base-2 LSE sinks[head] * log2(e); -inf (a state that weighs 0) without sinks. Each path merges
// it once, at the row's final write, so that split KV and the extend's two parts count it once.
__device__ __forceinline__ float sink_lse(const float* sinks, int head) {
  return sinks != nullptr ? sinks[head] * kLog2e : -INFINITY;
}

template <bool kFastExp2 = false, bool kFastLog2 = kFastExp2>
struct MergeState {
  float max = -INFINITY;
  float sum = 0.0f;

  static __device__ __forceinline__ float exp2(float x) {
    if constexpr (kFastExp2)
      return ptx::exp2_fast(x);
    else
      return exp2f(x);
  }
  static __device__ __forceinline__ float log2(float x) {
    if constexpr (kFastLog2)
      return __log2f(x);
    else
      return log2f(x);
  }

  // The weight of a state with LSE `lse` against the current maximum (0 for an empty state).
  __device__ __forceinline__ float weight(float lse) const {
    return lse == -INFINITY ? 0.0f : exp2(lse - max);
  }

  // Two states: the maximum, both weights (w0, w1) and their sum.
  __device__ __forceinline__ void pair(float lse0, float lse1, float& w0, float& w1) {
    max = fmaxf(lse0, lse1);
    w0 = weight(lse0);
    w1 = weight(lse1);
    sum = w0 + w1;
  }

  // The maximum first: see(lse) for every state (fmaxf: the maximum of the numbers, NaN left
  // to the weights), then add(lse) for every state, which sums its weight and returns it.
  __device__ __forceinline__ void see(float lse) { max = fmaxf(max, lse); }
  __device__ __forceinline__ float add(float lse) {
    const float w = weight(lse);
    sum += w;
    return w;
  }

  // Online: folds in a state with LSE `lse`. Returns the factor the caller multiplies its running
  // output by (`rescale`) and the weight of the new state's output (`w`); a state with lse = -inf
  // contributes nothing. Selects, not a branch, so that callers can fold a batch of loaded states
  // without the compiler moving each load to its use.
  __device__ __forceinline__ void fold(float lse, float& rescale, float& w) {
    const bool none = lse == -INFINITY;
    const float m = fmaxf(max, lse);
    rescale = none ? 1.0f : exp2(max - m);  // max = -inf gives 0
    w = none ? 0.0f : exp2(lse - m);
    sum = fmaf(sum, rescale, w);  // explicit: the same bits in every instantiation
    max = none ? max : m;
  }

  // 1 / sum, 0 when no state saw a key (the output is then 0). != 0, not > 0: a NaN sum stays
  // NaN, and so O and LSE.
  __device__ __forceinline__ float inv_sum() const { return sum != 0.0f ? 1.0f / sum : 0.0f; }
  __device__ __forceinline__ float lse() const { return sum != 0.0f ? max + log2(sum) : -INFINITY; }
};

}  // namespace flashkv::cuda
