// CUDA ragged and paged prefill against the float64 reference: host inputs -> device -> run ->
// copy back -> compare. Every case poisons its outputs with NaN first and leaves unused KV pool
// slots NaN. Long cases compare sampled rows against per-row reference problems (the reference
// is O(q * kv) on the CPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>

#include "flashkv/kernels/kernels.h"
#include "flashkv/ops/attention.h"
#include "flashkv/reference/reference.h"
#include "test_util.h"

#if FLASHKV_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda_capture.h"
#endif

namespace flashkv {
namespace {

using test::Rng;

// Query rows (tokens x G) of the CUDA kernel's CTA tile, for planning full tiles.
int cta_rows(int dqk, int dv) {
#if FLASHKV_WITH_CUDA
  return cuda::prefill_cta_rows(dqk, dv);
#else
  (void)dqk;
  (void)dv;
  return 128;
#endif
}

struct Problem {
  std::vector<int32_t> q_lens;   // new tokens per request
  std::vector<int32_t> kv_lens;  // KV entries per request (prefix + new for paged extend)
  int hq = 8, hkv = 2, dqk = 128, dv = 128;
  DType dtype = DType::bf16;
  DType kv_dtype = DType::bf16;
  bool paged = true;
  int page_size = 16;
  float k_scale = 1.0f, v_scale = 1.0f;
  bool causal = true;
  int window_left = -1;
  float soft_cap = 0.0f;
  float sm_scale = 0.0f;
  bool custom_mask = false;
  // With custom_mask: every row sees its request's first mask_open_prefix keys (a verify mask's
  // cached prefix) but for mask_holes single keys hidden at random rows and keys among them.
  int mask_open_prefix = 0;
  int mask_holes = 0;
  bool with_lse = true;
  PlanOptions plan;  // q_tile 0: the kernel's full tile
  int samples = 0;   // > 0: compare this many sampled rows instead of all
  bool expect_merges = false;
  // NaN in request 0's first K row (element 0 of KV head 0) or V row (dims 0 and 1), which
  // every query row of the request sees (causal, no window, no mask).
  bool nan_k = false, nan_v = false;
  bool sinks = false;    // random per-query-head attention sinks (AttentionOptions::sinks)
  bool f32_out = false;  // out in f32 instead of q's dtype
  int o_row_pad = 0;     // out's token rows this many elements apart beyond hq * dv (NaN between)
  int q_row_pad = 0;     // q's token rows this many elements apart beyond hq * dqk (NaN between)
  // fp8 paged K/V: only zeros and subnormals (each byte's exponent bits cleared), so that a
  // kernel that loses fp8 subnormals on the way to 16 bits gives all-zero scores and outputs.
  bool fp8_subnormals = false;
  // Q's magnitude: every element times q_magnitude (a power of two, so bf16 Q stays exact), or
  // with q_mixed_magnitudes token t's times 2^-16, 1 or 2^6 in turn (t % 3), so that the rows one
  // warp holds differ by up to 2^22 (larger would make the 2^6 rows' softmax so sharp that fp32
  // rounding of near-tied logits moves it).
  double q_magnitude = 1.0;
  bool q_mixed_magnitudes = false;
  // Each request's key j times 2^floor(j / 128) (every K/V head, every dim), so that the logits'
  // scale doubles from one 128-key tile to the next: in later tiles some rows' maxima rise past
  // their running reference and others do not, so both the softmax's exact update and the one
  // that takes the exponentials against the running reference run, in the same warps.
  bool k_rising = false;
};

// Host inputs of a problem.
struct Inputs {
  Tensor q, k, v;  // k/v: pool [slots, Hkv, D] (paged) or ragged rows
  Tensor sinks;    // f32 [Hq] when the problem has sinks
  std::vector<int32_t> qo_indptr, kv_indptr, indices, last_page_len;
  Tensor mask;  // u8, packed per request
  std::vector<int32_t> mask_indptr;
};

// Sets every element of rows [begin, end) of a [rows, heads, dim] host tensor to NaN.
void poison_rows(const Tensor& t, int64_t begin, int64_t end) {
  const int64_t row = t.size(1) * t.size(2);
  for (int64_t i = begin * row; i < end * row; ++i)
    store_from_double(t.data(), t.dtype(), i, std::numeric_limits<double>::quiet_NaN());
}

Inputs make_inputs(const Problem& pr, Rng& rng) {
  Inputs in;
  const int batch = static_cast<int>(pr.q_lens.size());
  in.qo_indptr = test::indptr_of(pr.q_lens);
  in.q = test::random_tensor(rng, {in.qo_indptr.back(), pr.hq, pr.dqk}, pr.dtype);
  if (pr.q_magnitude != 1.0 || pr.q_mixed_magnitudes) {
    const int64_t row = int64_t{pr.hq} * pr.dqk;
    for (int64_t i = 0; i < in.q.numel(); ++i) {
      const int64_t t = i / row;
      constexpr int kMixed[3] = {-16, 0, 6};  // exponents of the mixed magnitudes
      const double m = pr.q_mixed_magnitudes ? std::ldexp(1.0, kMixed[t % 3]) : 1.0;
      store_from_double(in.q.data(), pr.dtype, i,
                        load_as_double(in.q.data(), pr.dtype, i) * m * pr.q_magnitude);
    }
  }
  if (pr.paged) {
    const int ps = pr.page_size;
    std::vector<int32_t> pages(batch);
    for (int i = 0; i < batch; ++i) pages[i] = (pr.kv_lens[i] + ps - 1) / ps;
    const int used = std::accumulate(pages.begin(), pages.end(), 0);
    const int pool_pages = used + 7;  // spare pages stay NaN
    std::vector<int32_t> perm(pool_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.gen());
    in.k = test::random_tensor(rng, {int64_t{pool_pages} * ps, pr.hkv, pr.dqk}, pr.kv_dtype);
    in.v = test::random_tensor(rng, {int64_t{pool_pages} * ps, pr.hkv, pr.dv}, pr.kv_dtype);
    if (pr.fp8_subnormals) {
      // The sign and mantissa bits only: e4m3 S.0000.MMM, e5m2 S.00000.MM.
      const uint8_t keep = pr.kv_dtype == DType::fp8_e4m3 ? 0x87 : 0x83;
      for (const Tensor* t : {&in.k, &in.v}) {
        auto* bytes = static_cast<uint8_t*>(t->data());
        for (int64_t i = 0; i < t->numel(); ++i) bytes[i] &= keep;
      }
    }
    std::vector<char> slot_used(static_cast<size_t>(pool_pages) * ps, 0);
    in.kv_indptr = test::indptr_of(pages);
    int next = 0;
    for (int i = 0; i < batch; ++i) {
      for (int pg = 0; pg < pages[i]; ++pg) {
        const int page = perm[next++];
        in.indices.push_back(page);
        const int tokens = std::min(ps, pr.kv_lens[i] - pg * ps);
        for (int t = 0; t < tokens; ++t) slot_used[static_cast<size_t>(page) * ps + t] = 1;
      }
      in.last_page_len.push_back(pages[i] ? pr.kv_lens[i] - (pages[i] - 1) * ps : 1);
    }
    for (size_t s = 0; s < slot_used.size(); ++s)
      if (!slot_used[s]) {
        poison_rows(in.k, s, s + 1);
        poison_rows(in.v, s, s + 1);
      }
  } else {
    in.kv_indptr = test::indptr_of(pr.kv_lens);
    const int64_t rows = in.kv_indptr.back() + 16;  // 16 trailing NaN rows
    in.k = test::random_tensor(rng, {rows, pr.hkv, pr.dqk}, pr.kv_dtype);
    in.v = test::random_tensor(rng, {rows, pr.hkv, pr.dv}, pr.kv_dtype);
    poison_rows(in.k, rows - 16, rows);
    poison_rows(in.v, rows - 16, rows);
  }
  if (pr.k_rising)
    for (int i = 0; i < batch; ++i)
      for (int j = 0; j < pr.kv_lens[i]; ++j) {
        const int64_t row =
            pr.paged ? int64_t{in.indices[in.kv_indptr[i] + j / pr.page_size]} * pr.page_size +
                           j % pr.page_size
                     : int64_t{in.kv_indptr[i]} + j;
        const double scale = std::ldexp(1.0, j / 128);
        for (int64_t e = row * pr.hkv * pr.dqk; e < (row + 1) * pr.hkv * pr.dqk; ++e)
          store_from_double(in.k.data(), pr.kv_dtype, e,
                            load_as_double(in.k.data(), pr.kv_dtype, e) * scale);
      }
  if ((pr.nan_k || pr.nan_v) && batch > 0 && pr.kv_lens[0] > 0)
    test::put_nan_in_kv_row(in.k, in.v, pr.paged ? int64_t{in.indices[0]} * pr.page_size : 0,
                            pr.nan_k);
  if (pr.custom_mask) {
    in.mask_indptr.push_back(0);
    for (int i = 0; i < batch; ++i)
      in.mask_indptr.push_back(in.mask_indptr.back() + pr.q_lens[i] * pr.kv_lens[i]);
    in.mask = Tensor::empty({std::max<int64_t>(in.mask_indptr.back(), 1)}, DType::u8);
    auto* m = in.mask.ptr<uint8_t>();
    for (int64_t e = 0; e < in.mask.numel(); ++e) m[e] = rng.uniform() < 0.7 ? 1 : 0;
    // A row that sees nothing: O = 0, LSE = -inf.
    if (batch > 0 && pr.q_lens[0] > 0) std::fill(m, m + pr.kv_lens[0], uint8_t{0});
    std::vector<int> open_requests;
    for (int i = 0; i < batch; ++i) {
      const int open = std::min(pr.mask_open_prefix, pr.kv_lens[i]);
      for (int r = 0; r < pr.q_lens[i]; ++r)
        std::fill_n(m + in.mask_indptr[i] + int64_t{r} * pr.kv_lens[i], open, uint8_t{1});
      if (open > 0 && pr.q_lens[i] > 0) open_requests.push_back(i);
    }
    // A hole's key gets, in each KV head, the K of its row's first query head of that group,
    // times 3: that head's logit for it is about 3 sqrt(d), so a kernel that lets the row see the
    // key puts nearly all of the row's weight on it, and O and the LSE are off by far more than
    // the tolerance. Other rows that see the key give it a logit of the usual size.
    const int group = pr.hq / pr.hkv;
    for (int h = 0; h < pr.mask_holes && !open_requests.empty(); ++h) {
      const int i = open_requests[rng.uniform_int(0, static_cast<int>(open_requests.size()) - 1)];
      const int r = rng.uniform_int(0, pr.q_lens[i] - 1);
      const int key = rng.uniform_int(0, std::min(pr.mask_open_prefix, pr.kv_lens[i]) - 1);
      m[in.mask_indptr[i] + int64_t{r} * pr.kv_lens[i] + key] = 0;
      const int64_t row =
          pr.paged ? int64_t{in.indices[in.kv_indptr[i] + key / pr.page_size]} * pr.page_size +
                         key % pr.page_size
                   : int64_t{in.kv_indptr[i]} + key;
      const int64_t q_row = in.qo_indptr[i] + r;
      for (int g = 0; g < pr.hkv; ++g)
        for (int d = 0; d < pr.dqk; ++d) {
          const double q = load_as_double(in.q.data(), pr.dtype,
                                          (q_row * pr.hq + int64_t{g} * group) * pr.dqk + d);
          store_from_double(in.k.data(), in.k.dtype(), (row * pr.hkv + g) * pr.dqk + d, 3.0 * q);
        }
    }
  }
  // Sinks of the logits' size and larger, so that they move both O and the LSE.
  if (pr.sinks) in.sinks = test::random_tensor(rng, {pr.hq}, DType::f32, 3.0);
  return in;
}

AttentionOptions options_of(const Problem& pr) {
  AttentionOptions o;
  o.causal = pr.causal;
  o.window_left = pr.window_left;
  o.logits_soft_cap = pr.soft_cap;
  o.sm_scale = pr.sm_scale;
  return o;
}

// The reference for request rows [q0, q0 + n) given as one row each (sampled mode).
reference::Result sampled_reference(const Problem& pr, const Inputs& in,
                                    const AttentionOptions& opt,
                                    const std::vector<std::pair<int, int>>& rows) {
  reference::Result all;
  all.rows = static_cast<int64_t>(rows.size());
  all.heads = pr.hq;
  all.head_dim = pr.dv;
  for (const auto& [req, qi] : rows) {
    // Row qi of request req sits at position kv_len - q_len + qi; as a one-row request its
    // visible KV is the first pos + 1 entries (causal) or all of them.
    const int kv_len = pr.kv_lens[req];
    const int pos = kv_len - pr.q_lens[req] + qi;
    const int kv_sub = pr.causal ? pos + 1 : kv_len;
    Tensor q1 = Tensor::empty({1, pr.hq, pr.dqk}, pr.dtype);
    const size_t row_bytes = static_cast<size_t>(pr.hq) * pr.dqk * dtype_size(pr.dtype);
    std::memcpy(q1.data(),
                static_cast<const char*>(in.q.data()) + (in.qo_indptr[req] + qi) * row_bytes,
                row_bytes);
    Tensor qo = Tensor::from_i32({0, 1});
    reference::Result r;
    if (pr.paged) {
      const int ps = pr.page_size;
      const int n = (kv_sub + ps - 1) / ps;
      std::vector<int32_t> idx(in.indices.begin() + in.kv_indptr[req],
                               in.indices.begin() + in.kv_indptr[req] + n);
      Tensor indptr = Tensor::from_i32({0, n}), indices = Tensor::from_i32(idx);
      Tensor lpl = Tensor::from_i32({n ? kv_sub - (n - 1) * ps : 1});
      PagedKV kv{in.k, in.v, indptr, indices, lpl, ps, pr.k_scale, pr.v_scale};
      r = reference::paged_attention(q1, qo, kv, opt);
    } else {
      Tensor kvp = Tensor::from_i32({in.kv_indptr[req], in.kv_indptr[req] + kv_sub});
      r = reference::ragged_attention(q1, in.k, in.v, qo, kvp, opt, pr.k_scale, pr.v_scale);
    }
    all.o.insert(all.o.end(), r.o.begin(), r.o.end());
    all.lse.insert(all.lse.end(), r.lse.begin(), r.lse.end());
  }
  return all;
}

// Rows [r] of a host [rows, heads, dim] (or [rows, heads]) tensor, gathered.
Tensor gather_rows(const Tensor& t, const std::vector<int64_t>& rows) {
  std::vector<int64_t> shape(t.view().shape, t.view().shape + t.view().ndim);
  shape[0] = static_cast<int64_t>(rows.size());
  Tensor g = Tensor::empty(shape, t.dtype());
  const size_t row_bytes = t.view().nbytes() / t.size(0);
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(static_cast<char*>(g.data()) + i * row_bytes,
                static_cast<const char*>(t.data()) + rows[i] * row_bytes, row_bytes);
  return g;
}

// The prefill plan of a problem on `dev` (q_tile 0: the CUDA kernel's full tile).
PrefillPlan plan_for(const Problem& pr, const Inputs& in, Device dev, PlanOptions po, bool causal) {
  BatchShape bs;
  bs.batch_size = static_cast<int32_t>(pr.q_lens.size());
  bs.qo_indptr = in.qo_indptr.data();
  bs.kv_len = pr.kv_lens.data();
  bs.num_qo_heads = pr.hq;
  bs.num_kv_heads = pr.hkv;
  bs.head_dim_qk = pr.dqk;
  bs.head_dim_v = pr.dv;
  bs.page_size = pr.paged ? pr.page_size : 1;
  bs.causal = causal;
  bs.window_left = pr.window_left;
  if (po.q_tile == 0) po.q_tile = std::max(1, cta_rows(pr.dqk, pr.dv) / (pr.hq / pr.hkv));
  return plan_prefill(bs, device_info(dev), po);
}

// Runs the problem on the GPU and returns (out, lse) on the host.
std::pair<Tensor, Tensor> run_on_gpu(const Problem& pr, const Inputs& in, PrefillPlan* plan_out) {
  const Device gpu = Device::cuda();
  PrefillPlan plan = plan_for(pr, in, gpu, pr.plan, pr.causal && !pr.custom_mask);
  if (pr.expect_merges) EXPECT_FALSE(plan.merges.empty()) << "the case should split KV";
  Workspace ws(std::max<size_t>(plan.layout.total_bytes, 256), gpu);
  ws.upload(plan);

  const int64_t tokens = in.qo_indptr.back();
  // out: [tokens, hq, dv] with token rows o_row_pad elements apart beyond their own.
  const int64_t o_row = int64_t{pr.hq} * pr.dv, o_stride = o_row + pr.o_row_pad;
  const DType o_dtype = pr.f32_out ? DType::f32 : pr.dtype;
  Tensor out_h = Tensor::empty({tokens, o_stride}, o_dtype);
  Tensor lse_h = Tensor::empty({tokens, pr.hq}, DType::f32);
  test::poison(out_h);
  test::poison(lse_h);
  Tensor q = in.q.to(gpu), k = in.k.to(gpu), v = in.v.to(gpu);
  // q as given to the kernel: its token rows q_row_pad elements apart beyond their own, NaN
  // between, where the problem asks for that.
  const int64_t q_row = int64_t{pr.hq} * pr.dqk, q_stride = q_row + pr.q_row_pad;
  Tensor q_rows;
  TensorView q_view = q.view();
  if (pr.q_row_pad > 0) {
    Tensor q_rows_h = Tensor::empty({tokens, q_stride}, pr.dtype);
    test::poison(q_rows_h);
    const size_t elem = dtype_size(pr.dtype);
    for (int64_t t = 0; t < tokens; ++t)
      std::memcpy(static_cast<char*>(q_rows_h.data()) + t * q_stride * elem,
                  static_cast<const char*>(in.q.data()) + t * q_row * elem, q_row * elem);
    q_rows = q_rows_h.to(gpu);
    q_view = TensorView(q_rows.data(), pr.dtype, {tokens, pr.hq, pr.dqk}, gpu);
    q_view.stride[0] = q_stride;
  }
  Tensor out_rows = out_h.to(gpu), lse = lse_h.to(gpu);
  TensorView out(out_rows.data(), o_dtype, {tokens, pr.hq, pr.dv}, gpu);
  out.stride[0] = o_stride;
  Tensor qo = Tensor::from_i32(in.qo_indptr).to(gpu), kvp = Tensor::from_i32(in.kv_indptr).to(gpu);
  Tensor mask, mask_indptr, sinks;
  AttentionOptions opt = options_of(pr);
  if (pr.sinks) {
    sinks = in.sinks.to(gpu);
    opt.sinks = sinks;
  }
  if (pr.custom_mask) {
    mask = in.mask.to(gpu);
    mask_indptr = Tensor::from_i32(in.mask_indptr).to(gpu);
    opt.custom_mask = mask;
    opt.mask_indptr = mask_indptr;
  }
  const TensorView lse_view = pr.with_lse ? lse.view() : TensorView();
  if (pr.paged) {
    Tensor idx =
        Tensor::from_i32(in.indices.empty() ? std::vector<int32_t>{0} : in.indices).to(gpu);
    Tensor lpl =
        Tensor::from_i32(in.last_page_len.empty() ? std::vector<int32_t>{1} : in.last_page_len)
            .to(gpu);
    PagedKV kv{k, v, kvp, idx, lpl, pr.page_size, pr.k_scale, pr.v_scale};
    paged_prefill(plan, q_view, qo, kv, opt, out, lse_view, ws);
  } else {
    FLASHKV_CHECK(pr.k_scale == 1.0f && pr.v_scale == 1.0f, "ragged KV has no scales");
    ragged_prefill(plan, q_view, k, v, qo, kvp, opt, out, lse_view, ws);
  }
  if (plan_out) *plan_out = plan;
  // The rows back without their padding, which must still be NaN (nothing written past a row).
  const Tensor rows_h = out_rows.to(Device::cpu());
  Tensor out_dense = Tensor::empty({tokens, pr.hq, pr.dv}, o_dtype);
  const size_t elem = dtype_size(o_dtype);
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(static_cast<char*>(out_dense.data()) + t * o_row * elem,
                static_cast<const char*>(rows_h.data()) + t * o_stride * elem, o_row * elem);
    if (pr.o_row_pad > 0) {
      const TensorView pad(static_cast<char*>(rows_h.data()) + (t * o_stride + o_row) * elem,
                           o_dtype, {pr.o_row_pad});
      bool untouched = true;
      for (int64_t i = 0; i < pr.o_row_pad; ++i) untouched &= std::isnan(pad.at({i}));
      EXPECT_TRUE(untouched) << "out: written past token row " << t;
    }
  }
  return {std::move(out_dense), lse.to(Device::cpu())};
}

// A problem's distinguishing settings, for a failure's trace.
std::string describe(const Problem& pr) {
  std::ostringstream s;
  s << (pr.paged ? "paged page size " + std::to_string(pr.page_size) : std::string("ragged"))
    << ", " << pr.q_lens.size() << " requests, " << pr.hq << "/" << pr.hkv << " heads, " << pr.dqk
    << "/" << pr.dv << ", q " << dtype_name(pr.dtype) << ", kv " << dtype_name(pr.kv_dtype)
    << (pr.causal ? ", causal" : "");
  if (pr.k_scale != 1.0f || pr.v_scale != 1.0f)
    s << ", k/v scales " << pr.k_scale << "/" << pr.v_scale;
  if (pr.window_left >= 0) s << ", window " << pr.window_left;
  if (pr.soft_cap > 0.0f) s << ", soft cap " << pr.soft_cap;
  if (pr.sm_scale > 0.0f) s << ", sm_scale " << pr.sm_scale;
  if (pr.custom_mask) s << ", custom mask";
  if (pr.sinks) s << ", sinks";
  if (pr.fp8_subnormals) s << ", fp8 subnormals only";
  if (pr.q_magnitude != 1.0) s << ", q magnitude " << pr.q_magnitude;
  if (pr.q_mixed_magnitudes) s << ", q of mixed magnitudes";
  if (pr.plan.fixed_split_size > 0) s << ", split " << pr.plan.fixed_split_size;
  return s.str();
}

void check_problem(const Problem& pr, Rng& rng) {
  SCOPED_TRACE(describe(pr));
  const Inputs in = make_inputs(pr, rng);
  auto [out, lse] = run_on_gpu(pr, in, nullptr);
  AttentionOptions ref_opt = options_of(pr);
  if (pr.sinks) ref_opt.sinks = in.sinks;
  Tensor mask_indptr;  // owns what ref_opt.mask_indptr views
  if (pr.custom_mask) {
    mask_indptr = Tensor::from_i32(in.mask_indptr);
    ref_opt.custom_mask = in.mask;
    ref_opt.mask_indptr = mask_indptr;
  }
  const bool fp8 = is_fp8(pr.kv_dtype);
  const TensorView no_lse;
  if (pr.samples == 0) {
    Tensor qo = Tensor::from_i32(in.qo_indptr), kvp = Tensor::from_i32(in.kv_indptr);
    reference::Result ref;
    if (pr.paged) {
      Tensor idx = Tensor::from_i32(in.indices), lpl = Tensor::from_i32(in.last_page_len);
      PagedKV kv{in.k, in.v, kvp, idx, lpl, pr.page_size, pr.k_scale, pr.v_scale};
      ref = reference::paged_attention(in.q, qo, kv, ref_opt);
    } else {
      ref = reference::ragged_attention(in.q, in.k, in.v, qo, kvp, ref_opt);
    }
    test::expect_close(out, pr.with_lse ? lse.view() : no_lse, ref, pr.dtype, fp8);
    if (!pr.with_lse) EXPECT_TRUE(test::has_nan(lse)) << "lse was not asked for but written";
    if (pr.nan_k || pr.nan_v)
      test::expect_nan_from_first_kv_row(out, pr.with_lse ? lse.view() : no_lse, pr.q_lens[0],
                                         pr.hq / pr.hkv, pr.nan_k);
    return;
  }
  // Sampled rows: the first and last of every request, the rest spread at random.
  std::vector<std::pair<int, int>> rows;
  std::vector<int64_t> abs_rows;
  const int batch = static_cast<int>(pr.q_lens.size());
  for (int r = 0; r < batch; ++r) {
    if (pr.q_lens[r] == 0) continue;
    std::vector<int> pick = {0, pr.q_lens[r] - 1};
    for (int s = 0; s < pr.samples; ++s) pick.push_back(rng.uniform_int(0, pr.q_lens[r] - 1));
    std::sort(pick.begin(), pick.end());
    pick.erase(std::unique(pick.begin(), pick.end()), pick.end());
    for (int qi : pick) {
      rows.push_back({r, qi});
      abs_rows.push_back(in.qo_indptr[r] + qi);
    }
  }
  const reference::Result ref = sampled_reference(pr, in, ref_opt, rows);
  Tensor out_s = gather_rows(out, abs_rows), lse_s = gather_rows(lse, abs_rows);
  test::expect_close(out_s, pr.with_lse ? lse_s.view() : no_lse, ref, pr.dtype, fp8);
}

// --- lengths and layouts ------------------------------------------------------------------------

TEST(CudaPrefill, RaggedCausalMatchesReference) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 701);
  Problem pr;
  pr.paged = false;
  pr.q_lens = {1, 17, 127, 577, 17};
  pr.kv_lens = {1, 17, 127, 577, 54};  // the last: 37 earlier keys before its 17 queries
  check_problem(pr, rng);
}

TEST(CudaPrefill, PagedPrefixPageSizes) {
  FLASHKV_REQUIRE_GPU();
  for (int ps : {1, 16}) {
    SCOPED_TRACE(testing::Message() << "page_size=" << ps);
    FLASHKV_SEEDED_RNG(rng, 702 + ps);
    Problem pr;
    pr.page_size = ps;
    pr.q_lens = {1, 17, 127, 577, 1, 5};
    const std::vector<int32_t> prefix = {0, 97, 2048, 54, 2048, 0};
    for (size_t i = 0; i < prefix.size(); ++i) pr.kv_lens.push_back(prefix[i] + pr.q_lens[i]);
    check_problem(pr, rng);
  }
}

// Paged 16-bit K/V on the warp-specialized kernel at every head dim: pages of 16 to 128 tokens
// (up to the kernel's key tile) load whole tiles by TMA, a page a copy; a tile past the block's
// keys, blocks whose keys start off a page boundary (a window may start them anywhere) and other
// page sizes are gathered with cp.async. Spare pages hold NaN, so a page loaded from the wrong
// row shows.
TEST(CudaPrefill, WholePagesOnEveryHeadDim) {
  FLASHKV_REQUIRE_GPU();
  for (const auto& [dqk, dv] :
       {std::pair{64, 64}, std::pair{128, 128}, std::pair{192, 128}, std::pair{256, 256}})
    for (int ps : {8, 16, 32, 64, 128}) {
      SCOPED_TRACE(testing::Message() << "d=" << dqk << "/" << dv << " page_size=" << ps);
      FLASHKV_SEEDED_RNG(rng, 760 + dqk + ps);
      Problem pr;
      pr.dqk = dqk;
      pr.dv = dv;
      pr.page_size = ps;
      pr.q_lens = {1, 17, 127, 300, 5};
      const std::vector<int32_t> prefix = {0, 97, 1000, 54, 256};
      for (size_t i = 0; i < prefix.size(); ++i) pr.kv_lens.push_back(prefix[i] + pr.q_lens[i]);
      check_problem(pr, rng);
      pr.dtype = pr.kv_dtype = DType::f16;
      pr.custom_mask = true;  // the tiles' verdicts arrive beside the pages
      check_problem(pr, rng);
      pr.custom_mask = false;
      pr.window_left = 200;
      check_problem(pr, rng);
      pr.window_left = -1;
      pr.plan.fixed_split_size = 256;  // chunks of whole pages and tiles
      pr.expect_merges = true;
      check_problem(pr, rng);
    }
}

TEST(CudaPrefill, SplitKvMergesInChunkOrder) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 705);
  Problem pr;  // few tiles, long KV: the planner splits
  pr.q_lens = {17, 40};
  pr.kv_lens = {2048 + 17, 1500 + 40};
  pr.expect_merges = true;
  check_problem(pr, rng);
  pr.plan.fixed_split_size = 256;  // deterministic mode
  check_problem(pr, rng);
  pr.paged = false;  // ragged, non-causal split
  pr.causal = false;
  check_problem(pr, rng);
}

TEST(CudaPrefill, EmptyRequestsAndEmptyBatch) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 706);
  Problem pr;
  pr.q_lens = {0, 3, 0, 20};
  pr.kv_lens = {5, 0, 0, 30};  // request 1 has no KV at all: O = 0, LSE = -inf
  check_problem(pr, rng);
  Problem none;  // no query rows: nothing is launched, nothing fails
  none.q_lens = {0, 0};
  none.kv_lens = {10, 0};
  const Inputs in = make_inputs(none, rng);
  PrefillPlan plan;
  run_on_gpu(none, in, &plan);
  EXPECT_TRUE(plan.items.empty());
}

TEST(CudaPrefill, LongSequencesSampled) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 707);
  Problem pr;  // 4096 new tokens on a 12288 prefix, and a 4096 self-attention request
  pr.hq = 8;
  pr.hkv = 1;
  pr.q_lens = {4096};
  pr.kv_lens = {16384};
  pr.samples = 10;
  check_problem(pr, rng);
  pr.paged = false;
  pr.kv_lens = {4096};
  check_problem(pr, rng);
}

// --- variants -----------------------------------------------------------------------------------

Problem small_variant_problem() {
  Problem pr;
  pr.q_lens = {17, 127, 1};
  pr.kv_lens = {17 + 54, 127 + 97, 1 + 200};
  return pr;
}

TEST(CudaPrefill, NonCausal) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 710);
  Problem pr = small_variant_problem();
  pr.causal = false;
  check_problem(pr, rng);
}

TEST(CudaPrefill, SlidingWindow) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 711);
  Problem pr = small_variant_problem();
  pr.window_left = 40;
  check_problem(pr, rng);
  pr.causal = false;  // window without causal: keys after the query stay visible
  pr.window_left = 5;
  check_problem(pr, rng);
}

TEST(CudaPrefill, SoftCapAndScale) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 712);
  Problem pr = small_variant_problem();
  pr.soft_cap = 5.0f;
  pr.sm_scale = 0.3f;  // large logits, so the cap matters
  check_problem(pr, rng);
  pr.soft_cap = 0.0f;
  pr.sm_scale = 0.05f;
  check_problem(pr, rng);
}

TEST(CudaPrefill, CustomMask) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 713);
  Problem pr = small_variant_problem();
  pr.custom_mask = true;
  check_problem(pr, rng);
  pr.paged = false;
  pr.window_left = 30;  // the window still applies on top of the mask
  check_problem(pr, rng);
}

// Masks that hide nothing from whole 128-key tiles, as a speculative-decoding verify mask hides
// nothing of the cached prefix, but for single hidden keys in some of them: the paged sm_90a
// kernels skip the per-element mask only for tiles in which the producer found no hidden key, so
// each hole must still hide its key. Every head dim, page sizes 1 and 16, with a window too, and
// ragged K/V.
TEST(CudaPrefill, CustomMaskOpenTilesAndHoles) {
  FLASHKV_REQUIRE_GPU();
  struct Shape {
    int hq, hkv, dqk, dv;
  };
  for (const Shape& s : {Shape{8, 2, 64, 64}, Shape{8, 2, 128, 128}, Shape{16, 2, 192, 128},
                         Shape{4, 2, 256, 256}}) {
    for (const int page_size : {1, 16}) {
      for (const int holes : {0, 1, 6}) {
        SCOPED_TRACE(testing::Message() << "d=" << s.dqk << "/" << s.dv
                                        << " page_size=" << page_size << " holes=" << holes);
        FLASHKV_SEEDED_RNG(rng, 740 + s.dqk + page_size + holes);
        Problem pr;
        pr.hq = s.hq;
        pr.hkv = s.hkv;
        pr.dqk = s.dqk;
        pr.dv = s.dv;
        pr.page_size = page_size;
        pr.causal = false;
        pr.custom_mask = true;
        // Draft tokens over cached prefixes (8 rows: a verify), a longer extend (two row blocks
        // at group 4) and one row; the open prefix ends inside a tile of the longest request.
        pr.q_lens = {8, 8, 40, 1};
        pr.kv_lens = {8 + 1000, 8 + 300, 40 + 700, 1 + 129};
        pr.mask_open_prefix = 900;
        pr.mask_holes = holes;
        check_problem(pr, rng);
        if (holes == 1) {
          pr.window_left = 500;  // the window still applies where the mask hides nothing
          check_problem(pr, rng);
        }
        if (holes == 6 && page_size == 16) {
          pr.paged = false;  // ragged K/V: every tile masked element by element
          check_problem(pr, rng);
        }
      }
    }
  }
}

TEST(CudaPrefill, NoLse) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 714);
  Problem pr = small_variant_problem();
  pr.with_lse = false;
  check_problem(pr, rng);
}

TEST(CudaPrefill, HeadDimsAndGroups) {
  FLASHKV_REQUIRE_GPU();
  struct Shape {
    int hq, hkv, dqk, dv;
  };
  for (const Shape& s : {Shape{4, 4, 64, 64}, Shape{4, 2, 256, 256}, Shape{16, 2, 192, 128},
                         Shape{6, 2, 128, 128}, Shape{32, 4, 128, 128}}) {
    SCOPED_TRACE(testing::Message()
                 << "hq=" << s.hq << " hkv=" << s.hkv << " d=" << s.dqk << "/" << s.dv);
    FLASHKV_SEEDED_RNG(rng, 720 + s.dqk + s.hq);
    Problem pr;
    pr.hq = s.hq;
    pr.hkv = s.hkv;
    pr.dqk = s.dqk;
    pr.dv = s.dv;
    pr.q_lens = {33, 150};
    pr.kv_lens = {33 + 20, 150 + 300};
    check_problem(pr, rng);
    pr.paged = false;
    pr.kv_lens = {33, 150};
    check_problem(pr, rng);
  }
}

// 32 and 16 KV heads: the plan spreads more row blocks a head than one wave's workers (8 and 16 on
// 132 SMs) over workers rounded up to whole waves; a non-causal row makes the blocks equal.
TEST(CudaPrefill, WorkersInWholeWaves) {
  FLASHKV_REQUIRE_GPU();
  for (const int h : {32, 16}) {
    SCOPED_TRACE(testing::Message() << "hq=hkv=" << h);
    FLASHKV_SEEDED_RNG(rng, 790 + h);
    Problem pr;
    pr.hq = pr.hkv = h;
    pr.dqk = pr.dv = h == 32 ? 64 : 256;
    pr.paged = false;
    pr.q_lens = {600, 1100, 77};
    pr.kv_lens = pr.q_lens;
    check_problem(pr, rng);
    pr.causal = false;
    check_problem(pr, rng);
  }
}

TEST(CudaPrefill, AnyQueryTile) {
  FLASHKV_REQUIRE_GPU();
  for (int q_tile : {7, 64, 200}) {  // items of fewer or more rows than the CTA tile
    SCOPED_TRACE(testing::Message() << "q_tile=" << q_tile);
    FLASHKV_SEEDED_RNG(rng, 730 + q_tile);
    Problem pr = small_variant_problem();
    pr.plan.q_tile = q_tile;
    check_problem(pr, rng);
  }
}

TEST(CudaPrefill, Float16) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 740);
  Problem pr = small_variant_problem();
  pr.dtype = pr.kv_dtype = DType::f16;
  check_problem(pr, rng);
}

TEST(CudaPrefill, Fp8KvWithScales) {
  FLASHKV_REQUIRE_GPU();
  for (DType kv : {DType::fp8_e4m3, DType::fp8_e5m2}) {
    SCOPED_TRACE(dtype_name(kv));
    FLASHKV_SEEDED_RNG(rng, 750 + static_cast<int>(kv));
    Problem pr = small_variant_problem();
    pr.kv_dtype = kv;
    pr.k_scale = 0.5f;
    pr.v_scale = 2.0f;
    check_problem(pr, rng);
    pr.dtype = DType::f16;
    pr.dqk = pr.dv = 256;
    pr.hq = 4;
    check_problem(pr, rng);
  }
}

// Extend split into its two passes: the prefix (non-causal, the first prefix[i] entries of each
// request's pages in the same pool) and the new tokens (ragged causal, their K/V rows gathered
// from the pool).
struct ExtendParts {
  Problem pre, fresh;
  Inputs pin, rin;
};

ExtendParts split_extend(const Problem& full, const Inputs& in,
                         const std::vector<int32_t>& prefix) {
  ExtendParts e{full, full, in, in};
  e.pre.kv_lens = prefix;
  e.pre.causal = false;
  e.pin.kv_indptr = {0};
  e.pin.indices.clear();
  e.pin.last_page_len.clear();
  for (size_t i = 0; i < prefix.size(); ++i) {
    const int n = (prefix[i] + full.page_size - 1) / full.page_size;
    e.pin.indices.insert(e.pin.indices.end(), in.indices.begin() + in.kv_indptr[i],
                         in.indices.begin() + in.kv_indptr[i] + n);
    e.pin.kv_indptr.push_back(e.pin.kv_indptr.back() + n);
    e.pin.last_page_len.push_back(n ? prefix[i] - (n - 1) * full.page_size : 1);
  }
  e.fresh.paged = false;
  e.fresh.kv_lens = full.q_lens;
  e.rin.kv_indptr = test::indptr_of(full.q_lens);
  std::vector<int64_t> slots;
  for (size_t i = 0; i < prefix.size(); ++i)
    for (int t = prefix[i]; t < full.kv_lens[i]; ++t)
      slots.push_back(int64_t{in.indices[in.kv_indptr[i] + t / full.page_size]} * full.page_size +
                      t % full.page_size);
  e.rin.k = gather_rows(in.k, slots);
  e.rin.v = gather_rows(in.v, slots);
  return e;
}

// Extend = ragged causal over the new tokens + paged non-causal over the cached prefix, merged by
// LSE (merge_state on the GPU), equals one causal paged pass over prefix + new.
TEST(CudaPrefill, ExtendComposition) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 760);
  Problem full;
  full.q_lens = {40, 130};
  const std::vector<int32_t> prefix = {100, 333};
  for (size_t i = 0; i < prefix.size(); ++i) full.kv_lens.push_back(prefix[i] + full.q_lens[i]);
  const Inputs in = make_inputs(full, rng);
  const ExtendParts e = split_extend(full, in, prefix);

  auto [o_pre, lse_pre] = run_on_gpu(e.pre, e.pin, nullptr);
  auto [o_new, lse_new] = run_on_gpu(e.fresh, e.rin, nullptr);
  // merge_state on the GPU (the states go back up: run_on_gpu returns host copies).
  const Device gpu = Device::cuda();
  Tensor o_h = Tensor::empty({o_pre.size(0), full.hq, full.dv}, full.dtype);
  Tensor lse_h = Tensor::empty({o_pre.size(0), full.hq}, DType::f32);
  test::poison(o_h);
  test::poison(lse_h);
  Tensor o_d = o_h.to(gpu), lse_d = lse_h.to(gpu);
  Tensor o_new_d = o_new.to(gpu), lse_new_d = lse_new.to(gpu);
  Tensor o_pre_d = o_pre.to(gpu), lse_pre_d = lse_pre.to(gpu);
  merge_state(o_new_d, lse_new_d, o_pre_d, lse_pre_d, o_d, lse_d);
  Tensor o = o_d.to(Device::cpu()), lse = lse_d.to(Device::cpu());
  Tensor qo = Tensor::from_i32(in.qo_indptr), kvp = Tensor::from_i32(in.kv_indptr);
  Tensor idx = Tensor::from_i32(in.indices), lpl = Tensor::from_i32(in.last_page_len);
  PagedKV kv{in.k, in.v, kvp, idx, lpl, full.page_size};
  const auto ref = reference::paged_attention(in.q, qo, kv, options_of(full));
  test::expect_close(o, lse, ref, full.dtype);
}

// --- extend with the merge fused into the prefix pass (AttentionOptions::merge_o) ---------------

struct FusedExtendCase {
  std::vector<int32_t> q_lens, prefix;
  int hq = 8, hkv = 2, page_size = 16;
  int head_dim = 128;
  int head_dim_v = 0;  // 0: head_dim
  DType dtype = DType::bf16;
  PlanOptions prefix_plan;            // e.g. fixed_split_size: split prefix items
  bool expect_merges = false;         // the prefix plan must split
  bool overlap = true;                // AttentionOptions::overlap_previous
  bool in_place = true;               // out/lse are merge_o/merge_lse; else separate, no lse
  bool empty_state = false;           // no ragged pass: merge with O = NaN, LSE = -inf
  bool graph = false;                 // graph-mode plans, both passes replayed from a CUDA graph
  bool nan_k = false, nan_v = false;  // as Problem's (request 0's first key: in its prefix)
  bool sinks = false;                 // sinks on the prefix pass, which must add them once
  bool f32_out = false;               // both passes' outputs (the merge state too) in f32
};

// Runs ragged_prefill then paged_prefill merging with its state on `dev`; checks against one
// causal paged pass of the float64 reference (the prefix alone for an empty state).
void check_fused_extend(const FusedExtendCase& c, Device dev, Rng& rng) {
  Problem full;
  full.q_lens = c.q_lens;
  full.hq = c.hq;
  full.hkv = c.hkv;
  full.dqk = c.head_dim;
  full.dv = c.head_dim_v > 0 ? c.head_dim_v : c.head_dim;
  full.page_size = c.page_size;
  full.dtype = full.kv_dtype = c.dtype;
  full.nan_k = c.nan_k;
  full.nan_v = c.nan_v;
  full.sinks = c.sinks;
  for (size_t i = 0; i < c.prefix.size(); ++i) full.kv_lens.push_back(c.prefix[i] + c.q_lens[i]);
  const Inputs in = make_inputs(full, rng);
  const ExtendParts e = split_extend(full, in, c.prefix);
  const int64_t tokens = in.qo_indptr.back();
  const int batch = static_cast<int>(c.q_lens.size());

  PlanOptions rpo, ppo = c.prefix_plan;
  if (c.graph) {
    for (PlanOptions* po : {&rpo, &ppo}) {
      po->cuda_graph = true;
      po->max_batch_size = batch;
      po->max_num_tokens = static_cast<int32_t>(tokens);
    }
    rpo.max_kv_len = *std::max_element(c.q_lens.begin(), c.q_lens.end());
    ppo.max_kv_len = *std::max_element(c.prefix.begin(), c.prefix.end());
  }
  PrefillPlan plan_r = plan_for(e.fresh, e.rin, dev, rpo, true);
  PrefillPlan plan_p = plan_for(e.pre, e.pin, dev, ppo, false);
  if (c.expect_merges) EXPECT_FALSE(plan_p.merges.empty()) << "the prefix plan should split";
  Workspace ws_r(std::max<size_t>(plan_r.layout.total_bytes, 256), dev);
  Workspace ws_p(std::max<size_t>(plan_p.layout.total_bytes, 256), dev);
  ws_r.upload(plan_r);
  ws_p.upload(plan_p);

  const DType out_dtype = c.f32_out ? DType::f32 : full.dtype;
  Tensor state_h = Tensor::empty({tokens, full.hq, full.dv}, out_dtype);
  Tensor state_lse_h = Tensor::empty({tokens, full.hq}, DType::f32);
  test::poison(state_h);
  if (c.empty_state)
    for (int64_t i = 0; i < state_lse_h.numel(); ++i)
      state_lse_h.ptr<float>()[i] = -std::numeric_limits<float>::infinity();
  else
    test::poison(state_lse_h);
  Tensor out_h = Tensor::empty({tokens, full.hq, full.dv}, out_dtype);
  test::poison(out_h);
  Tensor q = in.q.to(dev), rk = e.rin.k.to(dev), rv = e.rin.v.to(dev);
  Tensor k = in.k.to(dev), v = in.v.to(dev);
  Tensor state = state_h.to(dev), state_lse = state_lse_h.to(dev), out2 = out_h.to(dev);
  Tensor qo = Tensor::from_i32(in.qo_indptr).to(dev);
  Tensor rkvp = Tensor::from_i32(e.rin.kv_indptr).to(dev);
  Tensor pkvp = Tensor::from_i32(e.pin.kv_indptr).to(dev);
  Tensor pidx =
      Tensor::from_i32(e.pin.indices.empty() ? std::vector<int32_t>{0} : e.pin.indices).to(dev);
  Tensor plpl = Tensor::from_i32(e.pin.last_page_len).to(dev);
  PagedKV pre_kv{k, v, pkvp, pidx, plpl, full.page_size};
  AttentionOptions causal, prefix_opt;  // the ragged pass without sinks: the prefix pass adds them
  prefix_opt.causal = false;
  Tensor sinks;
  if (c.sinks) {
    sinks = in.sinks.to(dev);
    prefix_opt.sinks = sinks;
  }
  prefix_opt.merge_o = state;
  prefix_opt.merge_lse = state_lse;
  prefix_opt.overlap_previous = c.overlap;
  const TensorView out = c.in_place ? state.view() : out2.view();
  const TensorView lse = c.in_place ? state_lse.view() : TensorView();
  auto run_both = [&](Stream s) {
    if (!c.empty_state)
      ragged_prefill(plan_r, q, rk, rv, qo, rkvp, causal, state, state_lse, ws_r, s);
    paged_prefill(plan_p, q, qo, pre_kv, prefix_opt, out, lse, ws_p, s);
  };
  if (!c.graph) {
    run_both({});
  } else {
#if FLASHKV_WITH_CUDA
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    cudaGraph_t graph = test::capture_graph(stream, [&] { run_both(Stream{stream}); });
    ASSERT_NE(graph, nullptr);
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int rep = 0; rep < 2; ++rep) {  // the second replay starts from the first's outputs
      if (rep == 1) {
        copy_bytes(state.data(), dev, state_h.data(), Device::cpu(), state_h.view().nbytes());
        copy_bytes(state_lse.data(), dev, state_lse_h.data(), Device::cpu(),
                   state_lse_h.view().nbytes());
      }
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
#else
    FAIL() << "graph mode needs CUDA";
#endif
  }
  const Tensor o_res = (c.in_place ? state : out2).to(Device::cpu());
  const Tensor lse_res = state_lse.to(Device::cpu());

  Tensor ref_qo = Tensor::from_i32(in.qo_indptr);
  reference::Result ref;
  if (c.empty_state) {
    Tensor kvp = Tensor::from_i32(e.pin.kv_indptr), idx = Tensor::from_i32(e.pin.indices),
           lpl = Tensor::from_i32(e.pin.last_page_len);
    PagedKV kv{in.k, in.v, kvp, idx, lpl, full.page_size};
    AttentionOptions o;
    o.causal = false;
    if (c.sinks) o.sinks = in.sinks;
    ref = reference::paged_attention(in.q, ref_qo, kv, o);
  } else {
    Tensor kvp = Tensor::from_i32(in.kv_indptr), idx = Tensor::from_i32(in.indices),
           lpl = Tensor::from_i32(in.last_page_len);
    PagedKV kv{in.k, in.v, kvp, idx, lpl, full.page_size};
    AttentionOptions o;
    if (c.sinks) o.sinks = in.sinks;
    ref = reference::paged_attention(in.q, ref_qo, kv, o);
  }
  test::expect_close(o_res, c.in_place ? lse_res.view() : TensorView(), ref, full.dtype);
  if (c.nan_k || c.nan_v)
    test::expect_nan_from_first_kv_row(o_res, c.in_place ? lse_res.view() : TensorView(),
                                       c.q_lens[0], c.hq / c.hkv, c.nan_k);
}

// The lengths of the issue: q 1, 17, 127, 577 on prefixes 0, 54, 97, 2048, for page sizes 1 and
// 16, GQA 1/4/8, with the prefix pass split and not.
std::vector<FusedExtendCase> fused_extend_cases() {
  std::vector<FusedExtendCase> cases;
  for (int ps : {1, 16})
    for (int g : {1, 4, 8})
      for (bool split : {false, true}) {
        FusedExtendCase c;
        c.q_lens = {1, 17, 127, 577, 17, 1};
        c.prefix = {2048, 0, 54, 97, 2048, 0};
        c.page_size = ps;
        c.hkv = 8 / g;
        if (split) {
          c.prefix_plan.fixed_split_size = 256;
          c.expect_merges = true;
        }
        c.overlap = g != 4;  // both launch modes
        cases.push_back(c);
      }
  return cases;
}

TEST(CudaPrefill, FusedExtendMergeMatchesReference) {
  FLASHKV_REQUIRE_GPU();
  for (const FusedExtendCase& c : fused_extend_cases()) {
    SCOPED_TRACE(testing::Message() << "page_size=" << c.page_size << " G=" << c.hq / c.hkv
                                    << " split=" << c.expect_merges);
    FLASHKV_SEEDED_RNG(rng, 790 + c.page_size + 10 * c.hkv + c.expect_merges);
    check_fused_extend(c, Device::cuda(), rng);
  }
}

TEST(CudaPrefill, FusedExtendEmptyStateSeparateOutputFloat16AndGraph) {
  FLASHKV_REQUIRE_GPU();
  FusedExtendCase c;
  c.q_lens = {17, 1, 127};
  c.prefix = {97, 0, 54};  // request 1: both states empty, O = 0 and LSE = -inf
  for (bool split : {false, true}) {
    SCOPED_TRACE(testing::Message() << "split=" << split);
    FusedExtendCase s = c;
    if (split) s.prefix_plan.fixed_split_size = 32;
    FLASHKV_SEEDED_RNG(rng, 800 + split);
    FusedExtendCase empty = s;
    empty.empty_state = true;
    check_fused_extend(empty, Device::cuda(), rng);
    FusedExtendCase separate = s;
    separate.in_place = false;
    check_fused_extend(separate, Device::cuda(), rng);
    FusedExtendCase f16 = s;
    f16.dtype = DType::f16;
    check_fused_extend(f16, Device::cuda(), rng);
    FusedExtendCase graph = s;
    graph.graph = true;
    check_fused_extend(graph, Device::cuda(), rng);
  }
}

// The CPU kernels take the same option with the same result.
TEST(CpuPrefill, FusedExtendMergeMatchesReference) {
  FusedExtendCase c;
  c.q_lens = {1, 17, 127, 17};
  c.prefix = {300, 0, 54, 97};
  c.page_size = 1;
  for (bool split : {false, true}) {
    SCOPED_TRACE(testing::Message() << "split=" << split);
    FusedExtendCase s = c;
    if (split) s.prefix_plan.fixed_split_size = 64;
    FLASHKV_SEEDED_RNG(rng, 810 + split);
    check_fused_extend(s, Device::cpu(), rng);
    FusedExtendCase empty = s;
    empty.empty_state = true;
    check_fused_extend(empty, Device::cpu(), rng);
    FusedExtendCase separate = s;
    separate.in_place = false;
    separate.hkv = 1;
    check_fused_extend(separate, Device::cpu(), rng);
  }
}

TEST(CpuPrefill, MergeStateOptionBadInputsThrow) {
  FLASHKV_SEEDED_RNG(rng, 820);
  Problem pr = small_variant_problem();
  const Inputs in = make_inputs(pr, rng);
  const Device cpu = Device::cpu();
  PrefillPlan plan = plan_for(pr, in, cpu, PlanOptions(), true);
  Workspace ws(std::max<size_t>(plan.layout.total_bytes, 256), cpu);
  ws.upload(plan);
  const int64_t tokens = in.qo_indptr.back();
  Tensor out = Tensor::empty({tokens, pr.hq, pr.dv}, pr.dtype);
  Tensor lse = Tensor::empty({tokens, pr.hq}, DType::f32);
  Tensor qo = Tensor::from_i32(in.qo_indptr), kvp = Tensor::from_i32(in.kv_indptr);
  Tensor idx = Tensor::from_i32(in.indices), lpl = Tensor::from_i32(in.last_page_len);
  PagedKV kv{in.k, in.v, kvp, idx, lpl, pr.page_size};
  auto error = [&](const AttentionOptions& o) {
    return test::error_of([&] { paged_prefill(plan, in.q, qo, kv, o, out, lse, ws); });
  };
  AttentionOptions o;
  o.merge_o = out;
  EXPECT_NE(error(o).find("merge_o/merge_lse"), std::string::npos) << error(o);
  o = AttentionOptions();
  o.merge_lse = lse;
  EXPECT_NE(error(o).find("merge_o/merge_lse"), std::string::npos) << error(o);
  Tensor f32 = Tensor::empty({tokens, pr.hq, pr.dv}, DType::f32);
  o.merge_o = f32;
  EXPECT_NE(error(o).find("merge_o"), std::string::npos) << error(o);
  Tensor short_o = Tensor::empty({tokens - 1, pr.hq, pr.dv}, pr.dtype);
  o.merge_o = short_o;
  EXPECT_NE(error(o).find("merge_o"), std::string::npos) << error(o);
  Tensor wide_lse = Tensor::empty({tokens, pr.hq + 1}, DType::f32);
  o.merge_o = out;
  o.merge_lse = wide_lse;
  EXPECT_NE(error(o).find("merge_lse"), std::string::npos) << error(o);
  Tensor lse_i32 = Tensor::empty({tokens, pr.hq}, DType::i32);
  o.merge_lse = lse_i32;
  EXPECT_NE(error(o).find("merge_lse"), std::string::npos) << error(o);
  // The same memory as out, viewed with other strides.
  Tensor big = Tensor::empty({tokens, pr.hq, 2 * pr.dv}, pr.dtype);
  TensorView strided = big.view();
  strided.shape[2] = pr.dv;
  o.merge_lse = lse;
  o.merge_o = strided;
  TensorView out_view = big.view();
  out_view.shape[2] = pr.dv;
  out_view.stride[1] = pr.dv;
  out_view.stride[0] = int64_t{pr.hq} * pr.dv;
  EXPECT_NE(test::error_of([&] {
              paged_prefill(plan, in.q, qo, kv, o, out_view, lse, ws);
            }).find("merge_o"),
            std::string::npos);
  // Decode takes no merge state.
  o.merge_o = out;
  EXPECT_NE(test::error_of([&] {
              std::vector<int32_t> kv_len = pr.kv_lens;
              BatchShape bs;
              bs.batch_size = static_cast<int32_t>(kv_len.size());
              bs.kv_len = kv_len.data();
              bs.num_qo_heads = pr.hq;
              bs.num_kv_heads = pr.hkv;
              bs.head_dim_qk = pr.dqk;
              bs.head_dim_v = pr.dv;
              bs.page_size = pr.page_size;
              DecodePlan dp = plan_decode(bs, device_info(cpu), PlanOptions());
              Workspace dws(dp.layout.total_bytes, cpu);
              dws.upload(dp);
              Tensor dq = test::random_tensor(rng, {bs.batch_size, pr.hq, pr.dqk}, pr.dtype);
              Tensor dout = Tensor::empty({bs.batch_size, pr.hq, pr.dv}, pr.dtype);
              Tensor dlse = Tensor::empty({bs.batch_size, pr.hq}, DType::f32);
              AttentionOptions d;
              d.merge_o = dout;
              d.merge_lse = dlse;
              paged_decode(dp, dq, kv, d, dout, TensorView(), dws);
            }).find("paged_decode"),
            std::string::npos);
  // A valid merge state runs (the call above each failed before writing anything).
  o = AttentionOptions();
  Tensor prev = test::random_tensor(rng, {tokens, pr.hq, pr.dv}, pr.dtype);
  Tensor prev_lse = test::random_tensor(rng, {tokens, pr.hq}, DType::f32);
  o.merge_o = prev;
  o.merge_lse = prev_lse;
  EXPECT_EQ(error(o), "");
}

#if FLASHKV_WITH_CUDA
// The (Q.K^T, P.V) head dims the sm_90a kernels take.
constexpr std::pair<int, int> kSm90HeadDims[] = {{64, 64}, {128, 128}, {192, 128}, {256, 256}};

// Runs fn(head_dim_qk, head_dim_v) on each prefill kernel a call with 16-bit KV at head dims 64,
// 128, 256 or 192 / 128 can take on compute capability 9.0, chosen by the environment switches:
// the sm_80 kernel (FLASHKV_PREFILL_SM90=0), at 128 the cp.async sm_90a one
// (FLASHKV_PREFILL_SM90_WS=0; at the others this is the sm_80 kernel again), and the
// warp-specialized one, for ragged and for paged K/V; with FLASHKV_PREFILL_SM90_WS_PAGED=0, paged
// K/V on the kernel below the warp-specialized one while ragged K/V keeps it. Elsewhere every run
// takes the sm_80 kernel.
template <typename Fn>
void for_each_prefill_kernel(Fn&& fn) {
  const char* configs[][3] = {{"0", "0", "1"}, {"1", "0", "1"}, {"1", "1", "1"}, {"1", "1", "0"}};
  for (const auto& [dqk, dv] : kSm90HeadDims)
    for (const auto& config : configs) {
      SCOPED_TRACE(testing::Message()
                   << "head dims " << dqk << "/" << dv << " FLASHKV_PREFILL_SM90=" << config[0]
                   << " FLASHKV_PREFILL_SM90_WS=" << config[1]
                   << " FLASHKV_PREFILL_SM90_WS_PAGED=" << config[2]);
      test::ScopedEnv sm90("FLASHKV_PREFILL_SM90", config[0]);
      test::ScopedEnv ws("FLASHKV_PREFILL_SM90_WS", config[1]);
      test::ScopedEnv ws_paged("FLASHKV_PREFILL_SM90_WS_PAGED", config[2]);
      fn(dqk, dv);
    }
}

// On Hopper, head dims 64, 128, 256 and 192 / 128 with 16-bit KV run an sm_90a kernel (the
// warp-specialized one, ragged and paged), and the other tests cover the sm_80 kernel through the
// other head dims and fp8 only. Every kernel at each of those head dims (for_each_prefill_kernel),
// over the variants they share; elsewhere every run uses the sm_80 kernel.
TEST(CudaPrefill, AllKernelsAtEveryHeadDim) {
  FLASHKV_REQUIRE_GPU();
  for_each_prefill_kernel([&](int dqk, int dv) {
    FLASHKV_SEEDED_RNG(rng, 1790);
    Problem pr = small_variant_problem();
    pr.dqk = dqk;
    pr.dv = dv;
    check_problem(pr, rng);  // causal, paged (page size 16)
    pr.paged = false;
    pr.custom_mask = true;
    check_problem(pr, rng);
    pr.custom_mask = false;
    pr.soft_cap = 5.0f;
    pr.sm_scale = 0.3f;
    pr.window_left = 40;
    pr.dtype = pr.kv_dtype = DType::f16;
    check_problem(pr, rng);
    Problem split = small_variant_problem();
    split.dqk = dqk;
    split.dv = dv;
    split.page_size = 1;
    split.plan.fixed_split_size = 64;
    split.expect_merges = true;
    check_problem(split, rng);
    FusedExtendCase c = fused_extend_cases()[3];  // page size 1, G 4, split prefix pass
    c.head_dim = dqk;
    c.head_dim_v = dv;
    check_fused_extend(c, Device::cuda(), rng);
    // Ragged: many row blocks a worker (the rings' phases wrap), empty and one-token requests,
    // lengths off the 128-key tile, both dtypes.
    Problem ragged;
    ragged.dqk = dqk;
    ragged.dv = dv;
    ragged.q_lens = {300, 0, 1, 129, 517, 64};
    ragged.kv_lens = ragged.q_lens;
    ragged.hq = 32;
    ragged.hkv = 8;
    ragged.paged = false;
    ragged.samples = 96;
    check_problem(ragged, rng);
    ragged.causal = false;
    ragged.dtype = ragged.kv_dtype = DType::f16;
    ragged.kv_lens = {700, 5, 1, 129, 517, 0};
    check_problem(ragged, rng);
    // Many blocks a worker (the Q ring wraps too), every block with a partial last tile.
    Problem many = ragged;
    many.causal = true;
    many.q_lens.clear();
    for (int i = 0; i < 48; ++i) many.q_lens.push_back(150 + 37 * (i % 7));
    many.kv_lens = many.q_lens;
    many.samples = 4;
    check_problem(many, rng);
  });
}

// Logits whose scale grows along the keys (Problem::k_rising), so that rows raise their softmax
// reference in later tiles as well as in the first: every kernel and head dim, paged and ragged,
// causal and not, 16-bit and fp8 K/V.
TEST(CudaPrefill, RisingLogitsOnEveryKernel) {
  FLASHKV_REQUIRE_GPU();
  for_each_prefill_kernel([&](int dqk, int dv) {
    FLASHKV_SEEDED_RNG(rng, 1801);
    Problem pr;
    pr.dqk = dqk;
    pr.dv = dv;
    pr.q_lens = {300, 1, 129};
    pr.kv_lens = {300 + 150, 1 + 400, 129 + 5};
    pr.hq = 16;
    pr.hkv = 4;
    pr.k_rising = true;
    check_problem(pr, rng);  // paged, page size 16
    pr.page_size = 1;
    pr.causal = false;
    check_problem(pr, rng);
    pr.paged = false;
    pr.causal = true;
    pr.kv_lens = pr.q_lens;
    check_problem(pr, rng);
    if (dqk == dv) {
      pr.paged = true;
      pr.kv_lens = {300 + 150, 1 + 400, 129 + 5};
      pr.kv_dtype = DType::fp8_e4m3;
      check_problem(pr, rng);
    }
  });
}

// O with token rows further apart than hq * dv: 8 elements more keeps 16-bit rows 16-byte aligned
// (the warp-specialized kernel stores them through shared memory in 16-byte chunks), 4 more does
// not (it stores the fragments' pairs); f32 O, and a split, merged call. Every kernel, and
// nothing is written between the rows.
TEST(CudaPrefill, StridedOutputRowsOnEveryKernel) {
  FLASHKV_REQUIRE_GPU();
  for_each_prefill_kernel([&](int dqk, int dv) {
    FLASHKV_SEEDED_RNG(rng, 1795);
    for (int pad : {8, 4}) {
      SCOPED_TRACE(testing::Message() << "o_row_pad " << pad);
      Problem pr = small_variant_problem();  // paged, page size 16, causal
      pr.dqk = dqk;
      pr.dv = dv;
      pr.o_row_pad = pad;
      check_problem(pr, rng);
      pr.paged = false;
      pr.sinks = true;
      check_problem(pr, rng);
      pr.sinks = false;
      pr.f32_out = true;
      check_problem(pr, rng);
      pr.f32_out = false;
      pr.plan.fixed_split_size = 64;  // split, merged
      pr.expect_merges = true;
      check_problem(pr, rng);
    }
  });
}

// Q with token rows apart beyond their own, NaN between (a view of a wider tensor, as a fused QKV
// projection gives; CUDA prefill takes strides of whole 16-byte chunks): the Hopper kernel's
// TMA map of Q and the copies of partial blocks both follow the stride. Every kernel, paged and
// ragged, GQA 4 and 1.
TEST(CudaPrefill, StridedQueryRowsOnEveryKernel) {
  FLASHKV_REQUIRE_GPU();
  for_each_prefill_kernel([&](int dqk, int dv) {
    FLASHKV_SEEDED_RNG(rng, 1797);
    for (int pad : {8, 64}) {
      SCOPED_TRACE(testing::Message() << "q_row_pad " << pad);
      Problem pr = small_variant_problem();  // paged, page size 16, causal
      pr.dqk = dqk;
      pr.dv = dv;
      pr.q_row_pad = pad;
      check_problem(pr, rng);
      pr.paged = false;
      pr.hkv = pr.hq;  // two whole 128-row blocks in request 1
      pr.q_lens = {17, 300, 1};
      pr.kv_lens = {17 + 54, 300 + 97, 1 + 200};
      check_problem(pr, rng);
    }
  });
}

// fp8 K/V (e4m3 and e5m2, with scales) at head dims 64, 128, 256 and 192 / 128. On Hopper the
// warp-specialized kernel widens it in its producer (but at 192 / 128, which the sm_80 kernel
// takes); each head dim runs on it and on the sm_80 kernel (FLASHKV_PREFILL_SM90=0), which serves
// every other device. Paged (with scales) at page sizes 16 and 1, K/V of subnormals only, ragged
// with a custom mask, a window and a soft cap with f16 Q, bf16 Q of magnitudes f16 cannot hold
// (with and without a soft cap) and of mixed magnitudes, split KV merged, and many row blocks a
// worker with lengths off the tile (the staging ring's phases wrap, and the last tile of every
// block is zero-filled past its keys).
TEST(CudaPrefill, Fp8KvOnEveryKernel) {
  FLASHKV_REQUIRE_GPU();
  for (const auto& [dqk, dv] : kSm90HeadDims)
    for (const char* sm90 : {"1", "0"})
      for (DType kv : {DType::fp8_e4m3, DType::fp8_e5m2}) {
        SCOPED_TRACE(testing::Message()
                     << "head dims " << dqk << "/" << dv << " FLASHKV_PREFILL_SM90=" << sm90 << " "
                     << dtype_name(kv));
        test::ScopedEnv env("FLASHKV_PREFILL_SM90", sm90);
        FLASHKV_SEEDED_RNG(rng, 1900 + static_cast<int>(kv));
        const auto base = [&, dqk = dqk, dv = dv] {  // paged, page size 16, causal
          Problem b = small_variant_problem();
          b.dqk = dqk;
          b.dv = dv;
          b.kv_dtype = kv;
          return b;
        };
        Problem pr = base();
        pr.k_scale = 0.5f;
        pr.v_scale = 2.0f;
        check_problem(pr, rng);  // causal, paged (page size 16)
        // Subnormals widen exactly (scaled up so that they carry the whole result).
        Problem tiny = pr;
        tiny.fp8_subnormals = true;
        tiny.k_scale = 300.0f;
        tiny.v_scale = 200.0f;
        tiny.dtype = DType::f16;
        check_problem(tiny, rng);
        // bf16 Q beyond f16's range both ways (the sm_90a kernel runs Q.K^T in f16 with fp8
        // K/V, each warp's rows scaled by a power of two), the logits kept unit-sized by
        // sm_scale; then rows of very different magnitudes in one warp.
        for (const double magnitude : {0x1p20, 0x1p-30}) {
          Problem wide = base();
          wide.q_magnitude = magnitude;
          wide.sm_scale = static_cast<float>(1.0 / std::sqrt(double(dqk)) / magnitude);
          check_problem(wide, rng);
          wide.soft_cap = 5.0f;  // the scale folds into the cap's factor instead
          check_problem(wide, rng);
        }
        Problem mixed = base();
        mixed.q_mixed_magnitudes = true;
        check_problem(mixed, rng);
        // The sm_80 kernel's variants have their own tests; e5m2 is the same code as e4m3 but
        // for the conversion.
        if (sm90[0] == '0') continue;
        tiny.dtype = DType::bf16;
        check_problem(tiny, rng);
        if (kv == DType::fp8_e5m2) continue;
        pr.page_size = 1;
        pr.dtype = DType::f16;
        pr.soft_cap = 5.0f;
        pr.sm_scale = 0.3f;
        pr.window_left = 40;
        check_problem(pr, rng);
        Problem masked = base();  // ragged K/V take no scales
        masked.paged = false;
        masked.custom_mask = true;
        check_problem(masked, rng);
        Problem split = base();
        split.k_scale = 1.5f;
        split.page_size = 1;
        split.plan.fixed_split_size = 64;
        split.expect_merges = true;
        check_problem(split, rng);
        Problem many = base();
        many.q_lens.clear();
        many.kv_lens.clear();
        many.hq = 32;
        many.hkv = 8;
        for (int i = 0; i < 20; ++i) {
          many.q_lens.push_back(150 + 37 * (i % 7));
          many.kv_lens.push_back(many.q_lens.back() + 61 * (i % 5));
        }
        many.samples = 4;
        check_problem(many, rng);  // paged
        many.paged = false;
        many.kv_lens = many.q_lens;
        check_problem(many, rng);
      }
}

// Attention sinks (SEMANTICS.md) on every prefill kernel (as AllKernelsAtEveryHeadDim selects
// them) and path: ragged and paged, causal or not, window and soft cap, rows that see nothing (a
// custom mask, a request without KV: O = 0, LSE = the sink), split KV (the sink added once, in the
// merge pass), the extend's prefix pass merging the ragged state (once, in the fused merge; split
// and not), fp8 KV, no LSE; then the other head dims and groups on the kernel each runs.
TEST(CudaPrefill, SinksOnEveryKernelAndPath) {
  FLASHKV_REQUIRE_GPU();
  for_each_prefill_kernel([&](int dqk, int dv) {
    FLASHKV_SEEDED_RNG(rng, 1850);
    Problem pr = small_variant_problem();
    pr.dqk = dqk;
    pr.dv = dv;
    pr.sinks = true;
    check_problem(pr, rng);  // causal, paged (page size 16)
    pr.paged = false;
    pr.custom_mask = true;  // request 0's first row sees nothing
    check_problem(pr, rng);
    pr.custom_mask = false;
    pr.causal = false;
    pr.soft_cap = 5.0f;
    pr.sm_scale = 0.3f;
    pr.window_left = 40;
    pr.dtype = pr.kv_dtype = DType::f16;
    check_problem(pr, rng);
    Problem empty;
    empty.dqk = dqk;
    empty.dv = dv;
    empty.sinks = true;
    empty.q_lens = {0, 3, 0, 20};
    empty.kv_lens = {5, 0, 0, 30};  // request 1 has no KV: O = 0, LSE = the sink
    empty.with_lse = true;
    check_problem(empty, rng);
    Problem split = small_variant_problem();
    split.dqk = dqk;
    split.dv = dv;
    split.sinks = true;
    split.page_size = 1;
    split.plan.fixed_split_size = 64;
    split.expect_merges = true;
    check_problem(split, rng);
    split.with_lse = false;
    check_problem(split, rng);
    for (int i : {2, 3}) {  // page size 1, G 4, prefix pass whole and split
      FusedExtendCase c = fused_extend_cases()[i];
      c.head_dim = dqk;
      c.head_dim_v = dv;
      c.sinks = true;
      check_fused_extend(c, Device::cuda(), rng);
    }
    FusedExtendCase separate = fused_extend_cases()[1];
    separate.head_dim = dqk;
    separate.head_dim_v = dv;
    separate.sinks = true;
    separate.in_place = false;
    check_fused_extend(separate, Device::cuda(), rng);
    Problem ragged;  // many row blocks a worker
    ragged.dqk = dqk;
    ragged.dv = dv;
    ragged.sinks = true;
    ragged.q_lens = {300, 0, 1, 129, 517, 64};
    ragged.kv_lens = ragged.q_lens;
    ragged.hq = 32;
    ragged.hkv = 8;
    ragged.paged = false;
    ragged.samples = 48;
    check_problem(ragged, rng);
  });
  FLASHKV_SEEDED_RNG(rng, 1851);
  Problem fp8 = small_variant_problem();
  fp8.sinks = true;
  fp8.kv_dtype = DType::fp8_e4m3;
  fp8.k_scale = 0.75f;
  fp8.v_scale = 1.5f;
  check_problem(fp8, rng);
  struct Shape {
    int hq, hkv, dqk;
  };
  for (const Shape& s : {Shape{4, 4, 64}, Shape{8, 1, 64}, Shape{8, 2, 256}, Shape{16, 2, 128}}) {
    SCOPED_TRACE(testing::Message() << "hq=" << s.hq << " hkv=" << s.hkv << " d=" << s.dqk);
    Problem pr;
    pr.sinks = true;
    pr.hq = s.hq;
    pr.hkv = s.hkv;
    pr.dqk = pr.dv = s.dqk;
    pr.q_lens = {33, 150, 1};
    pr.kv_lens = {33 + 20, 150 + 300, 1 + 77};
    check_problem(pr, rng);
    pr.paged = false;
    pr.window_left = 17;
    pr.kv_lens = {33, 150, 1};
    check_problem(pr, rng);
  }
}

// Outputs in f32 (FlashInfer's o_data_type) on every prefill kernel and store: the unsplit
// epilogue, the split merge pass, and the extend's prefix pass merging an f32 state (in place and
// into a separate output, whole and split). Within the tolerance; where no f32 state is read, the
// same values as the 16-bit output before rounding.
TEST(CudaPrefill, F32OutputOnEveryKernelAndPath) {
  FLASHKV_REQUIRE_GPU();
  for_each_prefill_kernel([&](int dqk, int dv) {
    FLASHKV_SEEDED_RNG(rng, 1870);
    auto check = [&](Problem pr) {
      const Inputs in = make_inputs(pr, rng);
      const Tensor out16 = run_on_gpu(pr, in, nullptr).first;
      pr.f32_out = true;
      const Tensor out32 = run_on_gpu(pr, in, nullptr).first;
      test::expect_unrounded_f32(out32, out16);
      check_problem(pr, rng);  // against the reference, on other inputs
    };
    Problem pr = small_variant_problem();
    pr.dqk = dqk;
    pr.dv = dv;
    check(pr);  // causal, paged
    pr.paged = false;
    pr.causal = false;
    pr.sinks = true;
    pr.dtype = pr.kv_dtype = DType::f16;
    check(pr);
    Problem split = small_variant_problem();
    split.dqk = dqk;
    split.dv = dv;
    split.page_size = 1;
    split.plan.fixed_split_size = 64;
    split.expect_merges = true;
    check(split);
    for (int i : {2, 3}) {  // the prefix pass whole and split
      FusedExtendCase c = fused_extend_cases()[i];
      c.head_dim = dqk;
      c.head_dim_v = dv;
      c.f32_out = true;
      check_fused_extend(c, Device::cuda(), rng);
    }
    FusedExtendCase separate = fused_extend_cases()[1];
    separate.head_dim = dqk;
    separate.head_dim_v = dv;
    separate.f32_out = true;
    separate.sinks = true;
    separate.in_place = false;
    check_fused_extend(separate, Device::cuda(), rng);
  });
  FLASHKV_SEEDED_RNG(rng, 1871);
  Problem big;  // head dims 64 and 256 on the kernels they run
  for (int d : {64, 256}) {
    big.dqk = big.dv = d;
    big.q_lens = {33, 150, 1};
    big.kv_lens = {33 + 20, 150 + 300, 1 + 77};
    Problem pr = big;
    pr.f32_out = true;
    check_problem(pr, rng);
  }
}

// NaN in request 0's first key or value reaches exactly the query heads and dims that use it, as
// in the reference: every prefill kernel at head dim 128 (and the sm_80 one at 64, fp8 KV),
// ragged and paged, whole and split (the merge pass), and the extend whose merge is fused into
// the prefix pass (the NaN in the prefix state).
TEST(CudaPrefill, NaNInKvReachesTheOutput) {
  FLASHKV_REQUIRE_GPU();
  const char* configs[][2] = {{"0", "0"}, {"1", "0"}, {"1", "1"}};
  for (const auto& config : configs)
    for (bool nan_k : {true, false}) {
      SCOPED_TRACE(testing::Message()
                   << "FLASHKV_PREFILL_SM90=" << config[0]
                   << " FLASHKV_PREFILL_SM90_WS=" << config[1] << (nan_k ? " K" : " V"));
      test::ScopedEnv sm90("FLASHKV_PREFILL_SM90", config[0]);
      test::ScopedEnv ws("FLASHKV_PREFILL_SM90_WS", config[1]);
      FLASHKV_SEEDED_RNG(rng, 1795 + nan_k);
      Problem pr = small_variant_problem();  // paged, page size 16, a prefix
      pr.nan_k = nan_k;
      pr.nan_v = !nan_k;
      check_problem(pr, rng);
      pr.soft_cap = 20.0f;
      pr.plan.fixed_split_size = 64;  // split, merged
      pr.page_size = 1;
      pr.expect_merges = true;
      check_problem(pr, rng);
      Problem ragged = pr;  // row 0 of request 0 sees the NaN key alone
      ragged.paged = false;
      ragged.soft_cap = 0.0f;
      ragged.expect_merges = false;
      ragged.plan = PlanOptions();
      ragged.kv_lens = ragged.q_lens;
      check_problem(ragged, rng);
      ragged.q_lens = ragged.kv_lens = {300, 0, 129};
      ragged.hq = 32;
      ragged.hkv = 8;
      check_problem(ragged, rng);
      FusedExtendCase f = fused_extend_cases()[3];  // page size 1, G 4, split prefix pass
      f.nan_k = nan_k;
      f.nan_v = !nan_k;
      check_fused_extend(f, Device::cuda(), rng);
      f = fused_extend_cases()[2];  // not split
      f.nan_k = nan_k;
      f.nan_v = !nan_k;
      check_fused_extend(f, Device::cuda(), rng);
    }
  for (bool nan_k : {true, false}) {  // head dim 64, and fp8 KV at 128
    FLASHKV_SEEDED_RNG(rng, 1797 + nan_k);
    Problem pr = small_variant_problem();
    pr.dqk = pr.dv = 64;
    pr.nan_k = nan_k;
    pr.nan_v = !nan_k;
    check_problem(pr, rng);
    pr.dqk = pr.dv = 128;
    pr.kv_dtype = DType::fp8_e4m3;
    pr.k_scale = 0.5f;
    pr.v_scale = 2.0f;
    check_problem(pr, rng);
  }
}

// A prefill captured into a CUDA graph with a graph-mode plan replays correctly after a new plan
// (same batch size and token count, other lengths, split differently) is uploaded.
TEST(CudaPrefill, GraphCaptureReplaysNewPlan) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 770);
  const Device gpu = Device::cuda();
  Problem a;
  a.q_lens = {30, 2};
  a.kv_lens = {30 + 100, 2 + 1500};
  Problem b = a;
  b.q_lens = {1, 31};
  b.kv_lens = {1 + 900, 31 + 5};
  const Inputs in_a = make_inputs(a, rng);
  const Inputs in_b = make_inputs(b, rng);
  PlanOptions po;
  po.cuda_graph = true;
  po.max_batch_size = 2;
  po.max_num_tokens = 32;
  po.q_tile = cta_rows(a.dqk, a.dv) / (a.hq / a.hkv);

  auto plan_for = [&](const Problem& pr, const Inputs& in) {
    BatchShape bs;
    bs.batch_size = 2;
    bs.qo_indptr = in.qo_indptr.data();
    bs.kv_len = pr.kv_lens.data();
    bs.num_qo_heads = pr.hq;
    bs.num_kv_heads = pr.hkv;
    bs.head_dim_qk = pr.dqk;
    bs.head_dim_v = pr.dv;
    bs.page_size = pr.page_size;
    bs.causal = true;
    return plan_prefill(bs, device_info(gpu), po);
  };
  PrefillPlan plan_a = plan_for(a, in_a), plan_b = plan_for(b, in_b);
  ASSERT_EQ(plan_a.layout.total_bytes, plan_b.layout.total_bytes);
  Workspace ws(plan_a.layout.total_bytes, gpu);

  // Fixed device buffers, sized for both batches.
  const int64_t slots = std::max(in_a.k.size(0), in_b.k.size(0));
  const int64_t max_idx = 256;
  Tensor q = Tensor::empty({32, a.hq, a.dqk}, a.dtype, gpu);
  Tensor k = Tensor::empty({slots, a.hkv, a.dqk}, a.kv_dtype, gpu);
  Tensor v = Tensor::empty({slots, a.hkv, a.dv}, a.kv_dtype, gpu);
  Tensor out = Tensor::empty({32, a.hq, a.dv}, a.dtype, gpu);
  Tensor lse = Tensor::empty({32, a.hq}, DType::f32, gpu);
  Tensor qo = Tensor::empty({3}, DType::i32, gpu), kvp = Tensor::empty({3}, DType::i32, gpu);
  Tensor idx = Tensor::empty({max_idx}, DType::i32, gpu), lpl = Tensor::empty({2}, DType::i32, gpu);
  auto load = [&](const Inputs& in) {
    copy_bytes(q.data(), gpu, in.q.data(), Device::cpu(), in.q.view().nbytes());
    copy_bytes(k.data(), gpu, in.k.data(), Device::cpu(), in.k.view().nbytes());
    copy_bytes(v.data(), gpu, in.v.data(), Device::cpu(), in.v.view().nbytes());
    copy_bytes(qo.data(), gpu, in.qo_indptr.data(), Device::cpu(), 3 * 4);
    copy_bytes(kvp.data(), gpu, in.kv_indptr.data(), Device::cpu(), 3 * 4);
    ASSERT_LE(static_cast<int64_t>(in.indices.size()), max_idx);
    copy_bytes(idx.data(), gpu, in.indices.data(), Device::cpu(), in.indices.size() * 4);
    copy_bytes(lpl.data(), gpu, in.last_page_len.data(), Device::cpu(), 2 * 4);
    fill_bytes(out.data(), gpu, 0xff, out.view().nbytes());  // NaN
    fill_bytes(lse.data(), gpu, 0xff, lse.view().nbytes());
    synchronize(gpu);
  };
  auto check = [&](const Problem& pr, const Inputs& in) {
    Tensor out_h = out.to(Device::cpu()), lse_h = lse.to(Device::cpu());
    Tensor qo_h = Tensor::from_i32(in.qo_indptr), kvp_h = Tensor::from_i32(in.kv_indptr);
    Tensor idx_h = Tensor::from_i32(in.indices), lpl_h = Tensor::from_i32(in.last_page_len);
    // Compare against a pool of the device's size: the reference reads only listed slots.
    Tensor k_h = Tensor::empty({slots, pr.hkv, pr.dqk}, pr.kv_dtype);
    Tensor v_h = Tensor::empty({slots, pr.hkv, pr.dv}, pr.kv_dtype);
    copy_bytes(k_h.data(), Device::cpu(), k.data(), gpu, k.view().nbytes());
    copy_bytes(v_h.data(), Device::cpu(), v.data(), gpu, v.view().nbytes());
    PagedKV kv{k_h, v_h, kvp_h, idx_h, lpl_h, pr.page_size};
    const auto ref = reference::paged_attention(in.q, qo_h, kv, options_of(pr));
    test::expect_close(out_h, lse_h, ref, pr.dtype);
  };

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const Stream s{stream};
  PagedKV kv{k, v, kvp, idx, lpl, a.page_size};
  AttentionOptions opt;
  load(in_a);
  ws.upload(plan_a, s);
  cudaGraph_t graph =
      test::capture_graph(stream, [&] { paged_prefill(plan_a, q, qo, kv, opt, out, lse, ws, s); });
  ASSERT_NE(graph, nullptr);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  check(a, in_a);

  load(in_b);
  ws.upload(plan_b, s);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  check(b, in_b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}
#endif

// --- rejected configurations ---------------------------------------------------------------------

TEST(CudaPrefill, UnsupportedConfigurationsThrow) {
  FLASHKV_REQUIRE_GPU();
  FLASHKV_SEEDED_RNG(rng, 780);
  Problem f32 = small_variant_problem();
  f32.dtype = f32.kv_dtype = DType::f32;
  const Inputs in32 = make_inputs(f32, rng);
  EXPECT_THROW(run_on_gpu(f32, in32, nullptr), Error);
  Problem d80 = small_variant_problem();
  d80.dqk = d80.dv = 80;
  const Inputs in80 = make_inputs(d80, rng);
  EXPECT_THROW(run_on_gpu(d80, in80, nullptr), Error);
  Problem mixed = small_variant_problem();
  mixed.dqk = 128;
  mixed.dv = 64;
  const Inputs inm = make_inputs(mixed, rng);
  EXPECT_THROW(run_on_gpu(mixed, inm, nullptr), Error);
}

}  // namespace
}  // namespace flashkv
