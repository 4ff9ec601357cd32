// CPU attention: every (work item, KV head) pair of the plan is one task on the thread pool;
// split items write partial states that a second pass merges.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "flashkv/core/thread_pool.h"
#include "flashkv/ops/kernels.h"

namespace flashkv::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

// Loads `n` elements of type `t` starting at `src` as floats (times `scale`).
void load_floats(const void* src, DType t, int n, float scale, float* dst) {
  switch (t) {
    case DType::f32: {
      const float* s = static_cast<const float*>(src);
      for (int i = 0; i < n; ++i) dst[i] = s[i] * scale;
      return;
    }
    case DType::bf16: {
      const bf16_t* s = static_cast<const bf16_t*>(src);
      for (int i = 0; i < n; ++i) dst[i] = to_float(s[i]) * scale;
      return;
    }
    default:
      for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(load_as_double(src, t, i)) * scale;
  }
}

void store_floats(const float* src, int n, DType t, void* dst) {
  switch (t) {
    case DType::f32: std::copy(src, src + n, static_cast<float*>(dst)); return;
    case DType::bf16: {
      bf16_t* d = static_cast<bf16_t*>(dst);
      for (int i = 0; i < n; ++i) d[i] = to_bf16(src[i]);
      return;
    }
    default:
      for (int i = 0; i < n; ++i) store_from_double(dst, t, i, src[i]);
  }
}

int64_t kv_len_of(const AttentionParams& p, int32_t r) {
  const int64_t n = p.kv_indptr[r + 1] - p.kv_indptr[r];
  if (!p.paged || p.page_size == 1 || n == 0) return n;
  return (n - 1) * p.page_size + p.last_page_len[r];
}

// Row of K/V (pool slot or ragged row) holding KV position j of request r.
int64_t kv_row(const AttentionParams& p, int32_t r, int64_t j) {
  if (!p.paged) return p.kv_indptr[r] + j;
  const int64_t entry = p.kv_indices[p.kv_indptr[r] + j / p.page_size];
  return std::clamp<int64_t>(entry * p.page_size + j % p.page_size, 0, p.num_kv_rows - 1);
}

void run_item(const AttentionParams& p, const WorkItem& it, int32_t kv_head) {
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int dqk = p.head_dim_qk, dv = p.head_dim_v;
  const size_t esz = dtype_size(p.q_dtype), kv_esz = dtype_size(p.kv_dtype);
  const int32_t r = it.request;
  const int64_t q_first = p.qo_indptr ? p.qo_indptr[r] : r;
  const int64_t q_len = p.qo_indptr ? p.qo_indptr[r + 1] - q_first : 1;
  const int64_t kv_len = kv_len_of(p, r);
  const int64_t kv_begin = std::min<int64_t>(it.kv_begin, kv_len);
  const int64_t kv_end = std::min<int64_t>(it.kv_end, kv_len);
  const int64_t rows = it.q_len * int64_t{group};
  const float scale_log2 = p.sm_scale * kLog2e;

  std::vector<float> q(rows * dqk), acc(rows * dv, 0.0f), m(rows, kNegInf), l(rows, 0.0f);
  std::vector<float> k(dqk), v(dv);
  for (int64_t qi = 0; qi < it.q_len; ++qi)
    for (int g = 0; g < group; ++g) {
      const int h = kv_head * group + g;
      const char* src = static_cast<const char*>(p.q) + ((it.q_begin + qi) * p.q_stride_n + h * p.q_stride_h) * esz;
      load_floats(src, p.q_dtype, dqk, 1.0f, &q[(qi * group + g) * dqk]);
    }
  for (int64_t j = kv_begin; j < kv_end; ++j) {
    const int64_t row = kv_row(p, r, j);
    load_floats(static_cast<const char*>(p.k) + (row * p.k_stride_n + kv_head * p.k_stride_h) * kv_esz,
                p.kv_dtype, dqk, p.k_scale, k.data());
    bool v_loaded = false;
    for (int64_t qi = 0; qi < it.q_len; ++qi) {
      const int64_t local_q = it.q_begin + qi - q_first;  // row within the request
      const int64_t pos = kv_len - q_len + local_q;
      bool ok;
      if (p.custom_mask) ok = p.custom_mask[p.mask_indptr[r] + local_q * kv_len + j] != 0;
      else ok = !p.causal || j <= pos;
      if (p.window_left >= 0 && j < pos - p.window_left) ok = false;
      if (!ok) continue;
      if (!v_loaded) {
        load_floats(static_cast<const char*>(p.v) + (row * p.v_stride_n + kv_head * p.v_stride_h) * kv_esz,
                    p.kv_dtype, dv, p.v_scale, v.data());
        v_loaded = true;
      }
      for (int g = 0; g < group; ++g) {
        const int64_t x = qi * group + g;
        const float* qr = &q[x * dqk];
        float s = 0;
        for (int d = 0; d < dqk; ++d) s += qr[d] * k[d];
        s *= p.sm_scale;
        if (p.logits_soft_cap > 0) s = p.logits_soft_cap * std::tanh(s / p.logits_soft_cap);
        const float s2 = s * kLog2e;  // base-2 logits
        const float m_new = std::max(m[x], s2);
        const float corr = std::exp2(m[x] - m_new);
        const float w = std::exp2(s2 - m_new);
        float* a = &acc[x * dv];
        for (int d = 0; d < dv; ++d) a[d] = a[d] * corr + w * v[d];
        l[x] = l[x] * corr + w;
        m[x] = m_new;
      }
    }
  }
  (void)scale_log2;
  std::vector<float> o(dv);
  for (int64_t qi = 0; qi < it.q_len; ++qi)
    for (int g = 0; g < group; ++g) {
      const int64_t x = qi * group + g;
      const int h = kv_head * group + g;
      const bool empty = l[x] == 0;
      for (int d = 0; d < dv; ++d) o[d] = empty ? 0.0f : acc[x * dv + d] / l[x];
      const float lse = empty ? kNegInf : m[x] + std::log2(l[x]);
      if (it.partial < 0) {
        const int64_t row = it.q_begin + qi;
        store_floats(o.data(), dv, p.q_dtype,
                     static_cast<char*>(p.o) + (row * p.o_stride_n + h * p.o_stride_h) * esz);
        if (p.lse) p.lse[row * p.num_qo_heads + h] = lse;
      } else {
        const int64_t prow = it.partial + qi;
        std::copy(o.begin(), o.end(), p.partial_o + (prow * p.num_qo_heads + h) * dv);
        p.partial_lse[prow * p.num_qo_heads + h] = lse;
      }
    }
}

void run_merge_item(const AttentionParams& p, const MergeItem& mi, int64_t qi) {
  const int dv = p.head_dim_v;
  const size_t esz = dtype_size(p.q_dtype);
  std::vector<float> o(dv);
  for (int h = 0; h < p.num_qo_heads; ++h) {
    float m = kNegInf;
    for (int c = 0; c < mi.num_chunks; ++c)
      m = std::max(m, p.partial_lse[(mi.partial + c * int64_t{mi.q_len} + qi) * p.num_qo_heads + h]);
    std::fill(o.begin(), o.end(), 0.0f);
    float lse = kNegInf;
    if (m != kNegInf) {
      float sum = 0;
      for (int c = 0; c < mi.num_chunks; ++c) {
        const int64_t prow = mi.partial + c * int64_t{mi.q_len} + qi;
        const float w = std::exp2(p.partial_lse[prow * p.num_qo_heads + h] - m);
        sum += w;
        const float* src = p.partial_o + (prow * p.num_qo_heads + h) * dv;
        for (int d = 0; d < dv; ++d) o[d] += w * src[d];
      }
      for (int d = 0; d < dv; ++d) o[d] /= sum;
      lse = m + std::log2(sum);
    }
    const int64_t row = mi.q_begin + qi;
    store_floats(o.data(), dv, p.q_dtype, static_cast<char*>(p.o) + (row * p.o_stride_n + h * p.o_stride_h) * esz);
    if (p.lse) p.lse[row * p.num_qo_heads + h] = lse;
  }
}

}  // namespace

void attention(const AttentionParams& p) {
  ThreadPool& pool = ThreadPool::global();
  const int64_t tasks = int64_t{p.num_items} * p.num_kv_heads;
  pool.parallel_for(tasks, [&](int64_t t, int) {
    run_item(p, p.items[t / p.num_kv_heads], static_cast<int32_t>(t % p.num_kv_heads));
  });
  if (p.num_merges == 0) return;
  // One task per (merge item, query row).
  std::vector<int64_t> first(p.num_merges + 1, 0);
  for (int32_t i = 0; i < p.num_merges; ++i) first[i + 1] = first[i] + p.merges[i].q_len;
  pool.parallel_for(first.back(), [&](int64_t t, int) {
    const int32_t i = static_cast<int32_t>(std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1);
    run_merge_item(p, p.merges[i], t - first[i]);
  });
}

void merge(const MergeParams& p) {
  const size_t esz = dtype_size(p.dtype);
  ThreadPool::global().parallel_for(p.rows, [&](int64_t r, int) {
    std::vector<float> o(p.head_dim), x(p.head_dim);
    for (int h = 0; h < p.heads; ++h) {
      auto state = [&](int s, float* dst) {
        const void* base = p.stacked ? p.o_in[0] : p.o_in[s];
        const int64_t off = r * p.in_stride_n + (p.stacked ? s * p.in_stride_s : 0) + h * p.in_stride_h;
        load_floats(static_cast<const char*>(base) + off * esz, p.dtype, p.head_dim, 1.0f, dst);
        const float* lb = p.stacked ? p.lse_in[0] : p.lse_in[s];
        return lb[r * p.lse_stride_n + (p.stacked ? s * p.lse_stride_s : 0) + h];
      };
      float m = kNegInf;
      for (int s = 0; s < p.num_states; ++s) {
        const float* lb = p.stacked ? p.lse_in[0] : p.lse_in[s];
        m = std::max(m, lb[r * p.lse_stride_n + (p.stacked ? s * p.lse_stride_s : 0) + h]);
      }
      std::fill(o.begin(), o.end(), 0.0f);
      float lse = kNegInf;
      if (m != kNegInf) {
        float sum = 0;
        for (int s = 0; s < p.num_states; ++s) {
          const float w = std::exp2(state(s, x.data()) - m);
          if (w == 0) continue;
          sum += w;
          for (int d = 0; d < p.head_dim; ++d) o[d] += w * x[d];
        }
        for (int d = 0; d < p.head_dim; ++d) o[d] /= sum;
        lse = m + std::log2(sum);
      }
      store_floats(o.data(), p.head_dim, p.dtype,
                   static_cast<char*>(p.o_out) + (r * p.out_stride_n + h * p.out_stride_h) * esz);
      if (p.lse_out) p.lse_out[r * p.heads + h] = lse;
    }
  });
}

}  // namespace flashkv::cpu
