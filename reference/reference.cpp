#include "flashkv/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "flashkv/core/thread_pool.h"
#include "flashkv/core/visibility.h"

namespace flashkv::reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Reads row r, head h of a [rows, heads, dim] tensor as doubles times `scale`.
void load_row(const TensorView& t, int64_t r, int64_t h, double scale, double* dst) {
  const int64_t base = r * t.stride[0] + h * t.stride[1];
  for (int64_t d = 0; d < t.shape[2]; ++d)
    dst[d] = load_as_double(t.data, t.dtype, base + d * t.stride[2]) * scale;
}

struct Shapes {
  int64_t hq, hkv, dqk, dv;
};

Shapes check_qkv(const TensorView& q, const TensorView& k, const TensorView& v) {
  Expect(q, "q").ndim(3).on_host().float_dtype();
  Expect(k, "k").ndim(3).on_host().dim(2, q.shape[2], "head_dim_qk");
  Expect(v, "v").ndim(3).on_host().dim(1, k.shape[1], "num_kv_heads").dim(0, k.shape[0], "slots");
  Expect(k, "k").dtype_in({DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3, DType::fp8_e5m2});
  Expect(v, "v").dtype(k.dtype);
  FLASHKV_CHECK(k.shape[1] > 0 && q.shape[1] % k.shape[1] == 0,
                "num_qo_heads: expected a multiple of num_kv_heads ", k.shape[1], ", got ",
                q.shape[1]);
  return {q.shape[1], k.shape[1], q.shape[2], v.shape[2]};
}

// One request's share of a batch: query rows [q_begin, q_begin + q_len) of q, KV entries
// j = 0..kv_len-1 at rows kv_row[j] of k/v; mask: the request's [q_len, kv_len] matrix or null.
struct RequestRows {
  int64_t q_begin = 0, q_len = 0;
  std::vector<int64_t> kv_row;
  const uint8_t* mask = nullptr;
};

// A request's K/V rows as doubles times their scales: [kv_len, Hkv, D] each.
struct DequantizedKv {
  std::vector<double> k, v;
};

// Rows [j0, j1) of request r's K/V into kv (sized for the whole request).
void dequantize(const RequestRows& r, const TensorView& k, const TensorView& v, double k_scale,
                double v_scale, int64_t j0, int64_t j1, DequantizedKv& kv) {
  const int64_t hkv = k.shape[1], dqk = k.shape[2], dv = v.shape[2];
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t h = 0; h < hkv; ++h) {
      load_row(k, r.kv_row[j], h, k_scale, &kv.k[(j * hkv + h) * dqk]);
      load_row(v, r.kv_row[j], h, v_scale, &kv.v[(j * hkv + h) * dv]);
    }
}

// Query row qi of request r, query heads [h0, h1), written to their own places in out.
void attend_row(const TensorView& q, const Shapes& s, const RequestRows& r, const DequantizedKv& kv,
                const AttentionOptions& opt, int64_t qi, int64_t h0, int64_t h1, Result& out) {
  const int64_t group = s.hq / s.hkv;
  const int64_t kv_len = static_cast<int64_t>(r.kv_row.size());
  const double sm_scale = opt.sm_scale > 0 ? opt.sm_scale : 1.0 / std::sqrt(double(s.dqk));
  std::vector<double> qd(s.dqk), score(kv_len);
  std::vector<char> allowed(kv_len);
  // The visibility rule (core/visibility.h): a mask replaces causal, the window applies to both.
  const int64_t pos = query_position<int64_t>(kv_len, r.q_len, qi);
  const bool causal = opt.causal && !r.mask;
  for (int64_t j = 0; j < kv_len; ++j)
    allowed[j] = (!r.mask || r.mask[qi * kv_len + j] != 0) &&
                 visible<int64_t>(j, pos, causal, opt.window_left);
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t kvh = h / group;
    load_row(q, r.q_begin + qi, h, 1.0, qd.data());
    double m = kNegInf;  // over the numbers among the scores: a NaN score is not a maximum
    bool any = false;
    for (int64_t j = 0; j < kv_len; ++j) {
      if (!allowed[j]) continue;
      any = true;
      const double* kr = &kv.k[(j * s.hkv + kvh) * s.dqk];
      double dot = 0;
      for (int64_t d = 0; d < s.dqk; ++d) dot += qd[d] * kr[d];
      double sc = dot * sm_scale;
      if (opt.logits_soft_cap > 0) sc = opt.logits_soft_cap * std::tanh(sc / opt.logits_soft_cap);
      score[j] = sc;
      m = std::max(m, sc);
    }
    double* o = &out.o[((r.q_begin + qi) * s.hq + h) * s.dv];
    double& lse = out.lse[(r.q_begin + qi) * s.hq + h];
    std::fill(o, o + s.dv, 0.0);
    // The sink (SEMANTICS.md "Attention sinks"): one more logit in the maximum and the sum, with
    // no value vector, neither scaled nor capped. -inf: no sink; NaN: m, O and LSE NaN.
    const double sink =
        opt.sinks.defined() ? load_as_double(opt.sinks.data, DType::f32, h) : kNegInf;
    if (!any && sink == kNegInf) {
      lse = kNegInf;
      continue;
    }
    if (!(sink <= m)) m = sink;
    // A NaN score (NaN in K) makes p, the sum, O and LSE NaN, as plain arithmetic would; even
    // when it is the only allowed entry (m still -inf).
    double sum = sink == kNegInf ? 0.0 : std::exp(sink - m);
    for (int64_t j = 0; j < kv_len; ++j) {
      if (!allowed[j]) continue;
      const double p = std::exp(score[j] - m);
      sum += p;
      const double* vr = &kv.v[(j * s.hkv + kvh) * s.dv];
      for (int64_t d = 0; d < s.dv; ++d) o[d] += p * vr[d];
    }
    for (int64_t d = 0; d < s.dv; ++d) o[d] /= sum;
    lse = (m + std::log(sum)) / std::log(2.0);
  }
}

// Requests are taken in groups of up to 4 per thread, whose dequantized K/V is held at once, up
// to this size (at least one request a group).
constexpr int64_t kDequantizedBytes = int64_t{256} << 20;
// KV rows a request's dequantization hands to one thread at a time.
constexpr int64_t kDequantizeRows = 256;

// Attention of every request (validated by the caller) on the process's thread pool: a group of
// requests is dequantized in runs of rows side by side, then computed in items of one query row
// and a range of its heads (whole rows when there are enough of them to keep every thread busy;
// a check of a few rows of a long context splits their heads). Each (row, head) is computed by
// one item in the order a serial loop would use, so the result does not depend on the number of
// threads.
void attend_requests(const TensorView& q, const Shapes& s, const std::vector<RequestRows>& reqs,
                     const TensorView& k, const TensorView& v, double k_scale, double v_scale,
                     const AttentionOptions& opt, Result& out) {
  ThreadPool& pool = ThreadPool::global();
  // Requests a group holds at most, and the items a group should have: 4 a thread.
  const int64_t per_group = 4 * static_cast<int64_t>(pool.size());
  const int64_t row_bytes = s.hkv * (s.dqk + s.dv) * static_cast<int64_t>(sizeof(double));
  // Bytes of a request's dequantized K/V (none without query rows: it is not read).
  auto kv_bytes = [&](const RequestRows& r) {
    return r.q_len > 0 ? static_cast<int64_t>(r.kv_row.size()) * row_bytes : 0;
  };
  for (size_t first = 0; first < reqs.size();) {
    size_t end = first;
    int64_t bytes = 0;
    do {
      bytes += kv_bytes(reqs[end]);
      ++end;
    } while (end < reqs.size() && static_cast<int64_t>(end - first) < per_group &&
             bytes + kv_bytes(reqs[end]) <= kDequantizedBytes);
    std::vector<DequantizedKv> kv(end - first);
    std::vector<std::pair<size_t, int64_t>> runs;  // (request, first KV row)
    int64_t rows = 0;                              // query rows of the group
    for (size_t i = first; i < end; ++i) {
      const RequestRows& r = reqs[i];
      if (r.q_len == 0) continue;
      const int64_t n = static_cast<int64_t>(r.kv_row.size());
      kv[i - first].k.resize(n * s.hkv * s.dqk);
      kv[i - first].v.resize(n * s.hkv * s.dv);
      for (int64_t j = 0; j < n; j += kDequantizeRows) runs.emplace_back(i, j);
      rows += r.q_len;
    }
    pool.parallel_for(static_cast<int64_t>(runs.size()), [&](int64_t it, int) {
      const auto [i, j] = runs[it];
      const RequestRows& r = reqs[i];
      dequantize(r, k, v, k_scale, v_scale, j,
                 std::min<int64_t>(j + kDequantizeRows, static_cast<int64_t>(r.kv_row.size())),
                 kv[i - first]);
    });
    const int64_t splits =
        std::clamp<int64_t>((per_group + rows - 1) / std::max<int64_t>(rows, 1), 1, s.hq);
    const int64_t heads_per_item = (s.hq + splits - 1) / splits;
    struct Item {
      size_t request;
      int64_t row, head0;
    };
    std::vector<Item> items;
    for (size_t i = first; i < end; ++i)
      for (int64_t qi = 0; qi < reqs[i].q_len; ++qi)
        for (int64_t h = 0; h < s.hq; h += heads_per_item) items.push_back({i, qi, h});
    pool.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t it, int) {
      const Item& w = items[it];
      attend_row(q, s, reqs[w.request], kv[w.request - first], opt, w.row, w.head0,
                 std::min(w.head0 + heads_per_item, s.hq), out);
    });
    first = end;
  }
}

// AttentionOptions::sinks, when given: f32 [Hq] on the host.
void check_sinks(const AttentionOptions& opt, const Shapes& s) {
  if (!opt.sinks.defined()) return;
  Expect(opt.sinks, "sinks")
      .ndim(1)
      .on_host()
      .dtype(DType::f32)
      .contiguous()
      .dim(0, s.hq, "num_qo_heads");
}

Result make_result(int64_t rows, const Shapes& s) {
  Result r;
  r.rows = rows;
  r.heads = static_cast<int>(s.hq);
  r.head_dim = static_cast<int>(s.dv);
  r.o.assign(rows * s.hq * s.dv, 0.0);
  r.lse.assign(rows * s.hq, kNegInf);
  return r;
}

// Checks the custom mask arguments of a batch of `batch` requests (when a mask is given).
void check_mask(const AttentionOptions& opt, int64_t batch) {
  if (!opt.custom_mask.defined()) return;
  Expect(opt.custom_mask, "custom_mask").ndim(1).on_host().dtype(DType::u8);
  if (opt.mask_indptr.defined())
    Expect(opt.mask_indptr, "mask_indptr")
        .ndim(1)
        .on_host()
        .index_dtype()
        .dim_at_least(0, batch + 1, "batch + 1");
}

// The mask of request i, or null; checks it lies inside the mask tensor.
const uint8_t* request_mask(const AttentionOptions& opt, int64_t i, int64_t* running, int64_t q_len,
                            int64_t kv_len) {
  if (!opt.custom_mask.defined()) return nullptr;
  const int64_t off = opt.mask_indptr.defined() ? index_at(opt.mask_indptr, i) : *running;
  *running = off + q_len * kv_len;
  FLASHKV_CHECK(off >= 0 && off + q_len * kv_len <= opt.custom_mask.numel(),
                "custom_mask: request ", i, " needs elements [", off, ", ", off + q_len * kv_len,
                "), tensor has ", opt.custom_mask.numel());
  return static_cast<const uint8_t*>(opt.custom_mask.data) + off;
}

}  // namespace

Result ragged_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& qo_indptr, const TensorView& kv_indptr,
                        const AttentionOptions& opt, float k_scale, float v_scale) {
  const Shapes s = check_qkv(q, k, v);
  Expect(qo_indptr, "qo_indptr").ndim(1).on_host().index_dtype().dim_at_least(0, 1, "batch + 1");
  Expect(kv_indptr, "kv_indptr")
      .ndim(1)
      .on_host()
      .index_dtype()
      .dim(0, qo_indptr.numel(), "batch + 1");
  Result out = make_result(q.shape[0], s);
  const int64_t batch = qo_indptr.numel() - 1;
  check_mask(opt, batch);
  check_sinks(opt, s);
  int64_t mask_running = 0;
  std::vector<RequestRows> reqs(batch);
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t qb = index_at(qo_indptr, i), qe = index_at(qo_indptr, i + 1);
    const int64_t kb = index_at(kv_indptr, i), ke = index_at(kv_indptr, i + 1);
    FLASHKV_CHECK(qb >= 0 && qb <= qe && qe <= q.shape[0], "qo_indptr: request ", i, " rows [", qb,
                  ", ", qe, ") outside q's ", q.shape[0], " rows");
    FLASHKV_CHECK(kb >= 0 && kb <= ke && ke <= k.shape[0], "kv_indptr: request ", i, " rows [", kb,
                  ", ", ke, ") outside k's ", k.shape[0], " rows");
    RequestRows& r = reqs[i];
    r.q_begin = qb;
    r.q_len = qe - qb;
    r.kv_row.resize(ke - kb);
    for (int64_t j = 0; j < ke - kb; ++j) r.kv_row[j] = kb + j;
    r.mask = request_mask(opt, i, &mask_running, qe - qb, ke - kb);
  }
  attend_requests(q, s, reqs, k, v, k_scale, v_scale, opt, out);
  return out;
}

Result paged_attention(const TensorView& q, const TensorView& qo_indptr, const PagedKV& kv,
                       const AttentionOptions& opt) {
  const Shapes s = check_qkv(q, kv.k, kv.v);
  Expect(kv.indptr, "kv.indptr").ndim(1).on_host().index_dtype().dim_at_least(0, 1, "batch + 1");
  Expect(kv.indices, "kv.indices").ndim(1).on_host().index_dtype();
  FLASHKV_CHECK(kv.page_size >= 1, "kv.page_size: expected >= 1, got ", kv.page_size);
  const int64_t batch = kv.indptr.numel() - 1;
  if (kv.page_size > 1)
    Expect(kv.last_page_len, "kv.last_page_len")
        .ndim(1)
        .on_host()
        .index_dtype()
        .dim(0, batch, "batch");
  check_mask(opt, batch);
  check_sinks(opt, s);
  if (qo_indptr.defined()) {
    Expect(qo_indptr, "qo_indptr").ndim(1).on_host().index_dtype().dim(0, batch + 1, "batch + 1");
  } else {
    Expect(q, "q").dim(0, batch, "batch (decode: one row per request)");
  }
  Result out = make_result(q.shape[0], s);
  int64_t mask_running = 0;
  std::vector<RequestRows> reqs(batch);
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t qb = qo_indptr.defined() ? index_at(qo_indptr, i) : i;
    const int64_t qe = qo_indptr.defined() ? index_at(qo_indptr, i + 1) : i + 1;
    FLASHKV_CHECK(qb >= 0 && qb <= qe && qe <= q.shape[0], "qo_indptr: request ", i, " rows [", qb,
                  ", ", qe, ") outside q's ", q.shape[0], " rows");
    const int64_t kv_len = paged_kv_len(kv, i);
    const int64_t e0 = index_at(kv.indptr, i), e1 = index_at(kv.indptr, i + 1);
    FLASHKV_CHECK(e0 >= 0 && e1 <= kv.indices.numel(), "kv.indptr: request ", i, " entries [", e0,
                  ", ", e1, ") outside kv.indices' ", kv.indices.numel(), " entries");
    RequestRows& r = reqs[i];
    r.q_begin = qb;
    r.q_len = qe - qb;
    r.kv_row.resize(kv_len);
    for (int64_t j = 0; j < kv_len; ++j) {
      const int64_t entry = index_at(kv.indices, e0 + j / kv.page_size);
      const int64_t slot = entry * kv.page_size + j % kv.page_size;
      FLASHKV_CHECK(slot >= 0 && slot < kv.k.shape[0], "kv.indices: request ", i, " entry ",
                    e0 + j / kv.page_size, " points at slot ", slot, ", pool has ", kv.k.shape[0]);
      r.kv_row[j] = slot;
    }
    r.mask = request_mask(opt, i, &mask_running, qe - qb, kv_len);
  }
  attend_requests(q, s, reqs, kv.k, kv.v, kv.k_scale, kv.v_scale, opt, out);
  return out;
}

Result merge_states(const std::vector<Result>& parts) {
  FLASHKV_CHECK(!parts.empty(), "merge_states: expected at least one state");
  Result out = parts[0];
  const int64_t n = out.rows * out.heads;
  for (size_t p = 1; p < parts.size(); ++p)
    FLASHKV_CHECK(parts[p].rows == out.rows && parts[p].heads == out.heads &&
                      parts[p].head_dim == out.head_dim,
                  "merge_states: state ", p, " has a different shape");
  for (int64_t i = 0; i < n; ++i) {
    double m = kNegInf;
    bool nan = false;
    for (const Result& r : parts) {
      m = std::max(m, r.lse[i]);
      nan |= std::isnan(r.lse[i]);
    }
    double* o = &out.o[i * out.head_dim];
    if (nan) {  // a NaN state makes the merge NaN
      std::fill(o, o + out.head_dim, std::numeric_limits<double>::quiet_NaN());
      out.lse[i] = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    std::fill(o, o + out.head_dim, 0.0);
    if (m == kNegInf) {
      out.lse[i] = kNegInf;
      continue;
    }
    double sum = 0;
    for (const Result& r : parts) sum += std::exp2(r.lse[i] - m);
    const double lse = m + std::log2(sum);
    for (const Result& r : parts) {
      const double w = std::exp2(r.lse[i] - lse);
      for (int d = 0; d < out.head_dim; ++d) o[d] += w * r.o[i * out.head_dim + d];
    }
    out.lse[i] = lse;
  }
  return out;
}

}  // namespace flashkv::reference
