// Loads and stores of CPU attention (compiled per ISA like attention_kernel.h): where a
// request's K/V rows live, the K and V tiles of a KV block (gathered, converted, transposed or
// paired; the next block prefetched on the way), query rows into steps, output rows out.
#pragma once

#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/attention_loads.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

#include "attention_kernel.h"

namespace flashkv::cpu::FLASHKV_CPU_ISA_NS {

// KV length of request r (tokens).
inline int64_t kv_len_of(const AttentionParams& p, int32_t r) {
  const int64_t n = p.kv_indptr[r + 1] - p.kv_indptr[r];
  if (!p.paged || p.page_size == 1 || n == 0) return n;
  return (n - 1) * p.page_size + p.last_page_len[r];
}

// Which K/V row (pool slot or ragged row) holds each KV position of request r: ragged, rows
// from kv_indptr[r] on; paged, slots or pages listed in kv_indices (clamped into the pool).
struct KvRows {
  bool paged;
  const int32_t* entries;  // paged: kv_indices + kv_indptr[r]
  int64_t first_row;       // ragged: kv_indptr[r]
  int32_t page_size;
  int64_t last_row;  // num_kv_rows - 1

  KvRows(const AttentionParams& p, int32_t r)
      : paged(p.paged),
        entries(p.paged ? p.kv_indices + p.kv_indptr[r] : nullptr),
        first_row(p.kv_indptr[r]),
        page_size(p.page_size),
        last_row(p.num_kv_rows - 1) {}

  // Rows of positions j0 .. j0 + n - 1.
  void get(int64_t j0, int n, int64_t* rows) const {
    if (!paged) {
      for (int i = 0; i < n; ++i) rows[i] = first_row + j0 + i;
    } else if (page_size == 1) {
      for (int i = 0; i < n; ++i) rows[i] = clamp64(entries[j0 + i], 0, last_row);
    } else {
      int64_t page = j0 / page_size;
      int32_t offset = static_cast<int32_t>(j0 % page_size);
      for (int i = 0; i < n; ++i) {
        rows[i] = clamp64(int64_t{entries[page]} * page_size + offset, 0, last_row);
        if (++offset == page_size) {
          offset = 0;
          ++page;
        }
      }
    }
  }
};

// Prefetches are always inlined: GCC models __builtin_prefetch as touching no memory, so a
// function that only prefetches is "const" to it, and a call to it is deleted as dead code.
#define FLASHKV_ALWAYS_INLINE inline __attribute__((always_inline))

FLASHKV_ALWAYS_INLINE void prefetch_l2(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}

// One KV head's K or V: row r starts at base + r * row_bytes. `next` lists the rows of the block
// after the one being loaded: they are prefetched into L2 (not L1, which the tiles and the
// running state fill) interleaved with the loads, so the memory system always has the next
// block's lines in flight.
struct HeadRows {
  const char* base;
  int64_t row_bytes;
  int line_bytes;  // bytes of a row to prefetch
  const int64_t* rows;
  const int64_t* next;
  int n_next;

  const char* row(int i) const { return base + rows[i] * row_bytes; }
  FLASHKV_ALWAYS_INLINE void prefetch_next(int i) const {
    if (i >= n_next) return;
    prefetch_l2(base + next[i] * row_bytes, line_bytes);
  }
};

// Prefetches into L2 the K and V rows of the slots of a later block (all heads of a task: the
// bytes from a row's first head to the end of its last), a few lines per step() call. The
// few-rows path calls step() from its inner loops, so that block's lines are requested evenly
// over the work on the current one and the memory system always has lines in flight. A
// burst at the start of the block instead stalls the core (the prefetches wait for miss buffers)
// and then leaves the memory idle while the core computes. Lines go slot after slot, each slot's
// K run and then its V run in address order (one DRAM page at a time). The lines per call
// follow from the calls counted in the block before (the first block of a task, not counted
// yet, prefetches in one burst), and finish() issues whatever a block's calls left.
struct SlotPrefetcher {
  const char* k_base = nullptr;  // first head's K of row 0
  const char* v_base = nullptr;
  int64_t k_row_bytes = 0, v_row_bytes = 0;
  int k_lines = 0, v_lines = 0, lines = 0;  // 64-byte lines of a slot's K / V run; both

  const int64_t* rows = nullptr;  // rows of the block being prefetched
  int n = 0, slot = 0, line = 0;
  int per_call = 0, calls = 0;

  void init(const char* k, int64_t k_row, int64_t k_bytes, const char* v, int64_t v_row,
            int64_t v_bytes) {
    k_base = k;
    v_base = v;
    k_row_bytes = k_row;
    v_row_bytes = v_row;
    k_lines = static_cast<int>((k_bytes + 63) / 64);
    v_lines = static_cast<int>((v_bytes + 63) / 64);
    lines = k_lines + v_lines;
  }
  // Starts on the rows of the block to prefetch (count may be 0).
  void start(const int64_t* next_rows, int count) {
    const int64_t total = int64_t{count} * lines;
    per_call = calls > 0 ? static_cast<int>((total + calls - 1) / calls) : static_cast<int>(total);
    rows = next_rows;
    n = count;
    slot = line = calls = 0;
  }
  FLASHKV_ALWAYS_INLINE void step() {
    ++calls;
    issue(per_call);
  }
  FLASHKV_ALWAYS_INLINE void finish() { issue(static_cast<int>(int64_t{n - slot} * lines)); }

 private:
  // The next `count` lines. The cursor is copied into locals and written back once: kept in the
  // struct, every line stored and reloaded it (a chain of store forwards) and recomputed its
  // slot's address, ~20 instructions a line, as many as the products of the keys it feeds.
  FLASHKV_ALWAYS_INLINE void issue(int count) {
    int s = slot, l = line;
    while (count > 0 && s < n) {
      const int end = l + count < lines ? l + count : lines;
      count -= end - l;
      const char* k = k_base + rows[s] * k_row_bytes;
      const char* v = v_base + rows[s] * v_row_bytes;
      for (; l < end && l < k_lines; ++l) __builtin_prefetch(k + l * 64, 0, 2);
      for (; l < end; ++l) __builtin_prefetch(v + (l - k_lines) * 64, 0, 2);
      if (l == lines) {
        l = 0;
        ++s;
      }
    }
    slot = s;
    line = l;
  }
};

// Loads n keys (n <= kBlockKeys) of K into kt [steps, kBlockKeys]: W keys x W steps per
// transpose; keys of a partly filled group are zero.
template <class T, class Src>
void pack_k(const HeadRows& k, int n, int dim, int steps, typename T::Step* kt,
            const Fp8Tables& tables) {
  constexpr int W = T::W, P = T::kPack;
  for (int k0 = 0; k0 < n; k0 += W) {
    const int keys = imin(W, n - k0);
    for (int i = 0; i < W; ++i) k.prefetch_next(k0 + i);
    for (int s0 = 0; s0 < steps; s0 += W) {
      typename T::Vec v[W];
      const int elems = imin(W * P, dim - s0 * P);
      FLASHKV_UNROLL
      for (int i = 0; i < W; ++i)
        v[i] = i < keys ? T::load_steps(reinterpret_cast<const Src*>(k.row(k0 + i)) + s0 * P, elems,
                                        tables)
                        : T::vzero();
      T::transpose_store(v, kt + s0 * T::kBlockKeys + k0, T::kBlockKeys, imin(W, steps - s0));
    }
  }
}

// Loads n rows of V into vp [kBlockKeys / kPack, dv_pad]: fp32 rows, or (bf16) steps pairing
// rows 2i and 2i + 1 (a missing odd row is zero).
template <class T, class Src>
void pack_v(const HeadRows& v, int n, int dim, int dv_pad, typename T::Step* vp,
            const Fp8Tables& tables) {
  constexpr int W = T::W;
  if constexpr (T::kPack == 1) {
    for (int j = 0; j < n; ++j) {
      v.prefetch_next(j);
      const Src* src = reinterpret_cast<const Src*>(v.row(j));
      for (int d = 0; d < dim; d += W)
        T::vstore(vp + j * dv_pad + d, T::load_steps(src + d, dim - d, tables));
    }
  } else {
    for (int j = 0; j < n; j += 2) {
      v.prefetch_next(j);
      v.prefetch_next(j + 1);
      const Src* a = reinterpret_cast<const Src*>(v.row(j));
      const Src* b = j + 1 < n ? reinterpret_cast<const Src*>(v.row(j + 1)) : nullptr;
      typename T::Step* dst = vp + (j / 2) * dv_pad;
      for (int d = 0; d < dim; d += 2 * W) {
        typename T::Vec lo, hi;
        T::interleave(T::load_steps(a + d, dim - d, tables),
                      b ? T::load_steps(b + d, dim - d, tables) : T::vzero(), &lo, &hi);
        T::vstore(dst + d, lo);
        if (d + W < dim) T::vstore(dst + d + W, hi);
      }
    }
  }
}

// One row of `dim` elements of type Src -> steps, zero-padded to `pitch` steps.
template <class T, class Src>
void load_row_steps(const void* src, int dim, int pitch, typename T::Step* dst,
                    const Fp8Tables& tables) {
  constexpr int W = T::W, P = T::kPack;
  for (int s = 0; s < pitch; s += W)
    T::vstore(dst + s,
              s * P < dim ? T::load_steps(static_cast<const Src*>(src) + s * P, dim - s * P, tables)
                          : T::vzero());
}
template <class T>
void load_q_row(DType dtype, const void* src, int dim, int pitch, typename T::Step* dst,
                const Fp8Tables& tables) {
  switch (dtype) {
    case DType::f32:
      return load_row_steps<T, float>(src, dim, pitch, dst, tables);
    case DType::f16:
      return load_row_steps<T, f16_t>(src, dim, pitch, dst, tables);
    default:
      return load_row_steps<T, bf16_t>(src, dim, pitch, dst, tables);
  }
}

// `dim` floats times `scale` -> a row of type Dst.
template <class T, class Dst>
void store_row(const float* src, float scale, int dim, Dst* dst) {
  const typename T::F s = T::set1(scale);
  for (int d = 0; d < dim; d += T::W) T::store_float(dst + d, T::mul(T::load(src + d), s), dim - d);
}
template <class T>
void store_row(DType dtype, const float* src, float scale, int dim, void* dst) {
  switch (dtype) {
    case DType::f32:
      return store_row<T>(src, scale, dim, static_cast<float*>(dst));
    case DType::f16:
      return store_row<T>(src, scale, dim, static_cast<f16_t*>(dst));
    default:
      return store_row<T>(src, scale, dim, static_cast<bf16_t*>(dst));
  }
}

// The rule every merge of states follows (SEMANTICS.md "Merging partial states"): the maximum
// LSE, NaN when any is NaN (a NaN score on any side makes the merged row NaN); each state's
// weight 2^(lse - m), 0 for all when nothing is visible (m = -inf); the merged LSE m + log2 of
// the weights' sum, -inf for an empty merge.
inline float merge_max(float m, float lse) {
  if (std::isnan(m) || std::isnan(lse)) return std::numeric_limits<float>::quiet_NaN();
  return lse > m ? lse : m;
}
inline float merge_weight(float lse, float m) { return m == kNegInf ? 0.0f : std::exp2(lse - m); }
inline float merged_lse(float m, float sum) { return sum != 0 ? m + std::log2(sum) : kNegInf; }

// Merges the sink of a query head (SEMANTICS.md "Attention sinks": the state O = 0,
// LSE = sink * log2(e)) into a row's final state (O * scale, lse): scale and lse in place. An
// empty row (scale 0, lse -inf) gets O = 0 and LSE = the sink's; a NaN on either side makes both
// NaN. Called once per (row, head), at the row's final write only.
inline void add_sink(float sink, float& scale, float& lse) {
  const float sink_lse = sink * kLog2e;
  const float m = merge_max(lse, sink_lse);
  const float w = merge_weight(lse, m);
  const float sum = w + merge_weight(sink_lse, m);
  scale *= sum != 0 ? w / sum : 0.0f;
  lse = merged_lse(m, sum);
}

// A row's final normalisation and LSE with its head's sink merged in: what add_sink gives after
// the sink-free normalisation (scale = v_scale / l, lse = m + log2 l), with one exp2 a row more
// than that normalisation instead of three more transcendental calls. The row's unnormalised
// state has maximum m and sum l (base 2), the sink the natural-base logit `sink`. Each case is
// worked in the frame of the larger of m and the sink's base-2 logit, so no term overflows; NaN
// on any side makes both results NaN.
inline void finish_row_with_sink(float l, float m, float sink, float v_scale, float& scale,
                                 float& lse) {
  const float s = sink * kLog2e;
  if (m == kNegInf && s == kNegInf && l == 0) {  // nothing visible and no sink: an empty row
    scale = 0.0f;
    lse = kNegInf;
  } else if (s > m) {  // the sink's frame: the row's keys weigh 2^(m - s) <= 1 (0 if none)
    const float r = std::exp2(m - s);
    const float sum = l * r + 1.0f;
    scale = v_scale * r / sum;
    lse = s + std::log2(sum);
  } else {  // the row's frame (a NaN m, l or sink lands here too, and propagates)
    const float sum = l + std::exp2(s - m);
    scale = sum != 0 ? v_scale / sum : 0.0f;  // 0: no key visible and no sink
    lse = m + std::log2(sum);
  }
}

// Writes output row `row`, query head `head` of p (O and, when wanted, LSE) as the merge of the
// state (cur * cur_scale, cur_lse), cur [D_v] fp32, with p's merge state (p.merge_o / p.merge_lse,
// SEMANTICS.md "Merging partial states") and p's sink (if any); an empty state (LSE -inf) weighs
// 0 and its values are never read. The merge state's row may be the output row itself: each vector
// of it is read before the same vector is written.
template <class T, class Elem>
void store_merged_row_impl(const AttentionParams& p, int64_t row, int head, const float* cur,
                           float cur_scale, float cur_lse) {
  const int dv = p.head_dim_v;
  const float prev_lse = p.merge_lse[row * p.num_qo_heads + head];
  // The sink, when given, is a third state (O = 0): it counts once, in the merged result.
  const float sink_lse = p.sinks ? p.sinks[head] * kLog2e : kNegInf;
  const float m = merge_max(merge_max(prev_lse, cur_lse), sink_lse);
  const float w_prev = merge_weight(prev_lse, m);
  const float w_cur = merge_weight(cur_lse, m);
  const float sum = w_prev + w_cur + (p.sinks ? merge_weight(sink_lse, m) : 0.0f);
  const float inv = sum != 0 ? 1.0f / sum : 0.0f;
  const Elem* prev =
      static_cast<const Elem*>(p.merge_o) + row * p.merge_stride_n + head * p.merge_stride_h;
  Elem* out = static_cast<Elem*>(p.o) + row * p.o_stride_n + head * p.o_stride_h;
  alignas(64) float buf[T::W];
  for (int d = 0; d < dv; d += T::W) {
    typename T::F acc = T::zero();
    if (w_prev != 0) acc = T::fmadd(T::set1(w_prev), T::load_float(prev + d, dv - d), acc);
    if (w_cur != 0) acc = T::fmadd(T::set1(w_cur * cur_scale), T::load_float(cur + d, dv - d), acc);
    T::store(buf, acc);
    store_row<T>(buf, inv, imin(T::W, dv - d), out + d);
  }
  if (p.lse) p.lse[row * p.num_qo_heads + head] = merged_lse(m, sum);
}
template <class T>
void store_merged_row(const AttentionParams& p, int64_t row, int head, const float* cur,
                      float cur_scale, float cur_lse) {
  switch (p.o_dtype) {  // merge_o has out's dtype
    case DType::f32:
      return store_merged_row_impl<T, float>(p, row, head, cur, cur_scale, cur_lse);
    case DType::f16:
      return store_merged_row_impl<T, f16_t>(p, row, head, cur, cur_scale, cur_lse);
    default:
      return store_merged_row_impl<T, bf16_t>(p, row, head, cur, cur_scale, cur_lse);
  }
}

}  // namespace flashkv::cpu::FLASHKV_CPU_ISA_NS
