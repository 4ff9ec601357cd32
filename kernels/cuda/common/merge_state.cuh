// An attention state being folded from partial states over disjoint KV sets (SEMANTICS.md,
// "Merging partial states"): the running max of the base-2 LSEs, the sum of 2^(lse - max), and
// the weighted output accumulated by the caller, one state at a time. Used by the decode
// kernel's merge of split items (merge_state(s) in cuda/merge.cu take the max over all states
// first instead).
#pragma once

#include <cmath>

#include "common/ptx.cuh"

namespace flashkv::cuda {

struct MergeState {
  float max = -INFINITY;
  float sum = 0.0f;

  // Adds a state with base-2 LSE `lse`. Returns the factor the caller multiplies its running
  // output by (`rescale`) and the weight of the new state's output (`weight`); a state with
  // lse = -inf contributes nothing.
  // Selects, not a branch, so that callers can fold a batch of loaded states without the
  // compiler moving each load to its use.
  __device__ __forceinline__ void add(float lse, float& rescale, float& weight) {
    const bool none = lse == -INFINITY;
    const float m = fmaxf(max, lse);
    rescale = none ? 1.0f : ptx::exp2_fast(max - m);  // max = -inf gives 0
    weight = none ? 0.0f : ptx::exp2_fast(lse - m);
    sum = fmaf(sum, rescale, weight);  // explicit: the same bits in every instantiation
    max = none ? max : m;
  }
  // 1 / sum (0 when nothing was added: the output is then 0). A NaN state (lse NaN) makes the
  // sum NaN (its weight, or the rescale when it came first, is NaN), and so O and LSE.
  __device__ __forceinline__ float inv_sum() const { return sum != 0.0f ? 1.0f / sum : 0.0f; }
  __device__ __forceinline__ float lse() const {
    return sum != 0.0f ? max + __log2f(sum) : -INFINITY;
  }
};

}  // namespace flashkv::cuda
