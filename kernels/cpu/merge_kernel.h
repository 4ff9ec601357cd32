// Merges of attention states (compiled per ISA like attention_kernel.h): the partial states of
// a plan's split items, and the merge_state / merge_states operators.
#pragma once

#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/merge_kernel.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

#include "attention_kernel.h"
#include "attention_loads.h"

namespace flashkv::cpu::FLASHKV_CPU_ISA_NS {

// Merges n states of one (row, head): O = sum_s 2^(lse_s - lse) O_s, lse = log2 sum 2^lse_s,
// states folded in order. A state with lse = -inf contributes nothing; one with a NaN lse makes
// the result NaN.
template <class T, class Src, class States>
void merge_one(const States& states, int n, int dim, DType out_dtype, void* out, float* lse_out) {
  float mx = kNegInf;
  for (int s = 0; s < n; ++s) mx = merge_max(mx, states.lse(s));
  float sum = 0;
  for (int s = 0; s < n; ++s) sum += merge_weight(states.lse(s), mx);
  const float inv = sum != 0 ? 1.0f / sum : 0.0f;
  alignas(64) float buf[T::W];
  for (int d = 0; d < dim; d += T::W) {
    typename T::F acc = T::zero();
    if (mx != kNegInf)
      for (int s = 0; s < n; ++s) {
        const float w = merge_weight(states.lse(s), mx);
        if (w == 0) continue;
        acc = T::fmadd(T::set1(w), T::load_float(static_cast<const Src*>(states.o(s)) + d, dim - d),
                       acc);
      }
    T::store(buf, acc);
    store_row<T>(out_dtype, buf, inv, imin(T::W, dim - d),
                 static_cast<char*>(out) + d * static_cast<int64_t>(dtype_size(out_dtype)));
  }
  if (lse_out) *lse_out = merged_lse(mx, sum);
}

// The split chunks of a plan's merge item: chunk c of row i at partial row partial + c*q_len + i.
struct PartialStates {
  const float* o_base;
  const float* lse_base;
  int64_t row_stride_o, row_stride_lse;  // per chunk
  const void* o(int s) const { return o_base + s * row_stride_o; }
  float lse(int s) const { return lse_base[s * row_stride_lse]; }
};

template <class T>
void merge_partials_impl(const AttentionParams& p, const MergeItem& m, int32_t i) {
  const int64_t heads = p.num_qo_heads, dv = p.head_dim_v;
  const int64_t out_row = int64_t{m.q_begin} + i;
  const size_t esz = dtype_size(p.o_dtype);
  for (int h = 0; h < heads; ++h) {
    const int64_t first = (int64_t{m.partial} + i) * heads + h;
    PartialStates states{p.partial_o + first * dv, p.partial_lse + first, m.q_len * heads * dv,
                         m.q_len * heads};
    if (p.merge_o || p.sinks) {
      // The chunks' merge, then the merge with p's merge state and sink (the sink once, here).
      auto* buf = static_cast<float*>(thread_scratch(dv * sizeof(float)));
      float lse = 0;
      merge_one<T, float>(states, m.num_chunks, static_cast<int>(dv), DType::f32, buf, &lse);
      if (p.merge_o) {
        store_merged_row<T>(p, out_row, h, buf, 1.0f, lse);
        continue;
      }
      float scale = 1.0f;
      add_sink(p.sinks[h], scale, lse);
      store_row<T>(p.o_dtype, buf, scale, static_cast<int>(dv),
                   static_cast<char*>(p.o) +
                       (out_row * p.o_stride_n + h * p.o_stride_h) * static_cast<int64_t>(esz));
      if (p.lse) p.lse[out_row * heads + h] = lse;
      continue;
    }
    merge_one<T, float>(states, m.num_chunks, static_cast<int>(dv), p.o_dtype,
                        static_cast<char*>(p.o) +
                            (out_row * p.o_stride_n + h * p.o_stride_h) * static_cast<int64_t>(esz),
                        p.lse ? p.lse + out_row * heads + h : nullptr);
  }
}

// merge_state (two separate tensors) / merge_states (stacked) of one (row, head).
struct InputStates {
  const char* o0;
  const char* o1;  // null when stacked
  const float* lse0;
  const float* lse1;
  int64_t o_stride_s, lse_stride_s;  // stacked: bytes / floats between states
  const void* o(int s) const { return o1 ? (s ? o1 : o0) : o0 + s * o_stride_s; }
  float lse(int s) const { return lse1 ? (s ? *lse1 : *lse0) : lse0[s * lse_stride_s]; }
};

template <class T, class Src>
void merge_row_typed(const MergeParams& p, int64_t row) {
  const int64_t esz = static_cast<int64_t>(sizeof(Src));
  for (int h = 0; h < p.heads; ++h) {
    const int64_t o_off = (row * p.in_stride_n + h * p.in_stride_h) * esz;
    const int64_t lse_off = row * p.lse_stride_n + h;
    InputStates states;
    states.o0 = static_cast<const char*>(p.o_in[0]) + o_off;
    states.o1 = p.stacked ? nullptr : static_cast<const char*>(p.o_in[1]) + o_off;
    states.lse0 = p.lse_in[0] + lse_off;
    states.lse1 = p.stacked ? nullptr : p.lse_in[1] + lse_off;
    states.o_stride_s = p.in_stride_s * esz;
    states.lse_stride_s = p.lse_stride_s;
    merge_one<T, Src>(
        states, p.num_states, p.head_dim, p.dtype,
        static_cast<char*>(p.o_out) + (row * p.out_stride_n + h * p.out_stride_h) * esz,
        p.lse_out ? p.lse_out + row * p.heads + h : nullptr);
  }
}

template <class T>
void merge_row_impl(const MergeParams& p, int64_t row) {
  switch (p.dtype) {
    case DType::f32:
      return merge_row_typed<T, float>(p, row);
    case DType::f16:
      return merge_row_typed<T, f16_t>(p, row);
    default:
      return merge_row_typed<T, bf16_t>(p, row);
  }
}

}  // namespace flashkv::cpu::FLASHKV_CPU_ISA_NS
