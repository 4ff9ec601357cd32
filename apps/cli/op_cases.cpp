#include "op_cases.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>

#include "flashkv/core/buffer.h"
#include "flashkv/ops/attention.h"

namespace flashkv::app {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A paged KV of random contents, pages in shuffled order, unused slots NaN.
struct HostPaged {
  Tensor k, v, indptr, indices, last_page_len;
  int page_size = 1;
  float k_scale = 1, v_scale = 1;
  PagedKV view() const {
    return {k, v, indptr, indices, last_page_len, page_size, k_scale, v_scale};
  }
};

HostPaged make_paged(const OpCase& c, const std::vector<int32_t>& lens, std::mt19937_64& gen) {
  HostPaged h;
  h.page_size = c.page_size;
  const int P = c.page_size;
  std::vector<int32_t> pages_of(lens.size());
  int64_t total_pages = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    pages_of[i] = (lens[i] + P - 1) / P;
    total_pages += pages_of[i];
  }
  const int64_t pool_pages = total_pages + 3;  // spare pages stay NaN
  std::vector<int32_t> perm(pool_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), gen);
  std::vector<int32_t> indptr(lens.size() + 1, 0), indices, last(lens.size(), P);
  for (size_t i = 0; i < lens.size(); ++i) {
    for (int32_t p = 0; p < pages_of[i]; ++p) indices.push_back(perm[indptr[i] + p]);
    indptr[i + 1] = indptr[i] + pages_of[i];
    if (lens[i] > 0) last[i] = lens[i] - (pages_of[i] - 1) * P;
  }
  const bool fp8 = is_fp8(c.kv_dtype);
  h.k_scale = fp8 ? 0.5f : 1.0f;
  h.v_scale = fp8 ? 2.0f : 1.0f;
  h.k = Tensor::empty({pool_pages * P, c.hkv, c.head_dim}, c.kv_dtype);
  h.v = Tensor::empty({pool_pages * P, c.hkv, c.head_dim_v}, c.kv_dtype);
  std::normal_distribution<double> normal;
  for (Tensor* t : {&h.k, &h.v}) {
    const double inv_scale = 1.0 / (t == &h.k ? h.k_scale : h.v_scale);
    for (int64_t e = 0; e < t->numel(); ++e) store_from_double(t->data(), t->dtype(), e, kNaN);
    // Write the used slots with values whose dequantized magnitude is unit normal.
    const int64_t row = t->numel() / t->size(0);
    for (size_t i = 0; i < lens.size(); ++i)
      for (int32_t j = 0; j < lens[i]; ++j) {
        const int64_t slot = int64_t{indices[indptr[i] + j / P]} * P + j % P;
        for (int64_t e = 0; e < row; ++e)
          store_from_double(t->data(), t->dtype(), slot * row + e, normal(gen) * inv_scale);
      }
  }
  h.indptr = Tensor::from_i32(indptr);
  h.indices = Tensor::from_i32(indices.empty() ? std::vector<int32_t>{0} : indices);
  h.last_page_len = Tensor::from_i32(last);
  return h;
}

Tensor random_host(std::initializer_list<int64_t> shape, DType dtype, std::mt19937_64& gen) {
  Tensor t = Tensor::empty(shape, dtype);
  fill_normal(t, gen());
  return t;
}

std::vector<int32_t> prefix_sums(const std::vector<int32_t>& lens) {
  std::vector<int32_t> p(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) p[i + 1] = p[i] + lens[i];
  return p;
}

struct DevicePaged {
  Tensor k, v, indptr, indices, last_page_len;
  PagedKV view(const HostPaged& h) const {
    return {k, v, indptr, indices, last_page_len, h.page_size, h.k_scale, h.v_scale};
  }
};
DevicePaged to_device(const HostPaged& h, Device d) {
  return {h.k.to(d), h.v.to(d), h.indptr.to(d), h.indices.to(d), h.last_page_len.to(d)};
}

// Plans, uploads and returns a ready workspace for one operator run.
template <typename PlanT>
struct Planned {
  PlanT plan;
  Workspace ws;
};

BatchShape shape_of(const OpCase& c, const std::vector<int32_t>* qo_indptr,
                    const std::vector<int32_t>& kv_lens, bool causal) {
  BatchShape b;
  b.batch_size = static_cast<int32_t>(kv_lens.size());
  b.qo_indptr = qo_indptr ? qo_indptr->data() : nullptr;
  b.kv_len = kv_lens.data();
  b.num_qo_heads = c.hq;
  b.num_kv_heads = c.hkv;
  b.head_dim_qk = c.head_dim;
  b.head_dim_v = c.head_dim_v;
  b.page_size = c.page_size;
  b.causal = causal && !c.custom_mask;
  b.window_left = c.window_left;
  return b;
}

PlanOptions plan_options(const OpCase& c) {
  PlanOptions o;
  o.fixed_split_size = c.fixed_split;
  return o;
}

template <typename PlanT, typename F>
void plan_into(Planned<PlanT>& p, const BatchShape& b, const OpCase& c, Device d, F plan_fn) {
  p.plan = plan_fn(b, device_info(d), plan_options(c));
  p.ws.reserve(std::max<size_t>(p.plan.layout.total_bytes, 1), d);
  p.ws.upload(p.plan);
}

AttentionOptions options_of(const OpCase& c, bool causal, const TensorView& sinks = {}) {
  AttentionOptions o;
  o.causal = causal;
  o.window_left = c.window_left;
  o.logits_soft_cap = c.soft_cap;
  o.sinks = sinks;
  return o;
}

// The case's sink logits as a host f32 [Hq] (undefined without sinks): normal with std 2, as
// learned sinks are a few units around 0, and one random head -inf (no sink there). They come
// from their own generator, so a case's other inputs are the same with and without sinks.
Tensor make_sinks(const OpCase& c) {
  if (!c.sinks) return {};
  std::mt19937_64 gen(c.seed ^ 0x51A4C0DEULL);
  Tensor t = Tensor::empty({c.hq}, DType::f32);
  std::normal_distribution<double> normal(0, 2);
  for (int h = 0; h < c.hq; ++h) t.ptr<float>()[h] = static_cast<float>(normal(gen));
  t.ptr<float>()[std::uniform_int_distribution<int>(0, c.hq - 1)(gen)] =
      -std::numeric_limits<float>::infinity();
  return t;
}

// A random tree-like mask per request: each query row sees a random subset of the prefix and
// itself, as a speculative-decoding verify mask does.
void make_mask(const std::vector<int32_t>& q_lens, const std::vector<int32_t>& kv_lens,
               std::mt19937_64& gen, Tensor* mask, Tensor* mask_indptr) {
  std::vector<int32_t> offs(q_lens.size() + 1, 0);
  for (size_t i = 0; i < q_lens.size(); ++i) offs[i + 1] = offs[i] + q_lens[i] * kv_lens[i];
  *mask = Tensor::empty({std::max(offs.back(), 1)}, DType::u8);
  std::bernoulli_distribution coin(0.7);
  for (int32_t e = 0; e < offs.back(); ++e) mask->ptr<uint8_t>()[e] = coin(gen) ? 1 : 0;
  *mask_indptr = Tensor::from_i32(offs);
}

}  // namespace

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::decode:
      return "decode";
    case OpKind::ragged_prefill:
      return "ragged_prefill";
    case OpKind::paged_prefill:
      return "paged_prefill";
    case OpKind::extend:
      return "extend";
    case OpKind::merge_states:
      return "merge_states";
  }
  return "?";
}

std::string OpCase::describe() const {
  std::ostringstream os;
  os << "B=" << kv_lens.size() << " Hq/Hkv=" << hq << "/" << hkv << " D=" << head_dim;
  if (head_dim_v != head_dim) os << "/" << head_dim_v;
  os << " P=" << page_size << " " << dtype_name(dtype);
  if (kv_dtype != dtype) os << "/kv " << dtype_name(kv_dtype);
  if (op != OpKind::decode && op != OpKind::merge_states)
    os << (custom_mask ? " mask" : causal ? " causal" : " full");
  if (window_left >= 0) os << " win=" << window_left;
  if (soft_cap > 0) os << " cap=" << soft_cap;
  if (fixed_split > 0) os << " split=" << fixed_split;
  if (sinks) os << " sinks";
  return os.str();
}

OpResult run_op_case(const OpCase& c, Device d) {
  OpResult r;
  r.tolerance = tolerance_for(c.dtype, is_fp8(c.kv_dtype));
  try {
    std::mt19937_64 gen(c.seed);
    const int B = static_cast<int>(c.kv_lens.size());
    reference::Result ref;
    Tensor out_host, lse_host;
    // Sinks: the reference reads the host copy, the operator the device one.
    const Tensor sinks = make_sinks(c);
    const Tensor sinks_d = sinks.defined() ? sinks.to(d) : Tensor();
    if (c.op == OpKind::decode) {
      HostPaged h = make_paged(c, c.kv_lens, gen);
      Tensor q = random_host({B, c.hq, c.head_dim}, c.dtype, gen);
      AttentionOptions opt = options_of(c, true, sinks);
      ref = reference::paged_attention(q, TensorView(), h.view(), opt);
      opt.sinks = sinks_d;
      DevicePaged dk = to_device(h, d);
      Tensor qd = q.to(d), out = Tensor::empty({B, c.hq, c.head_dim_v}, c.dtype, d),
             lse = Tensor::empty({B, c.hq}, DType::f32, d);
      Planned<DecodePlan> p;
      plan_into(p, shape_of(c, nullptr, c.kv_lens, true), c, d,
                [](auto&&... a) { return plan_decode(a...); });
      paged_decode(p.plan, qd, dk.view(h), opt, out, lse, p.ws);
      out_host = out.to(Device::cpu());
      lse_host = lse.to(Device::cpu());
    } else if (c.op == OpKind::merge_states) {
      const int T = c.kv_lens[0], N = std::max(1, c.hkv);
      Tensor states = random_host({T, N, c.hq, c.head_dim_v}, c.dtype, gen);
      Tensor lse = Tensor::empty({T, N, c.hq}, DType::f32);
      std::normal_distribution<double> normal(0, 3);
      for (int64_t e = 0; e < lse.numel(); ++e)
        lse.ptr<float>()[e] = (e % 7 == 3) ? -std::numeric_limits<float>::infinity()
                                           : static_cast<float>(normal(gen));
      std::vector<reference::Result> parts(N);
      for (int n = 0; n < N; ++n) {
        parts[n].rows = T;
        parts[n].heads = c.hq;
        parts[n].head_dim = c.head_dim_v;
        for (int t = 0; t < T; ++t)
          for (int h = 0; h < c.hq; ++h) {
            parts[n].lse.push_back(lse.ptr<float>()[(t * N + n) * c.hq + h]);
            for (int e = 0; e < c.head_dim_v; ++e)
              parts[n].o.push_back(states.view().at({t, n, h, e}));
          }
      }
      ref = reference::merge_states(parts);
      Tensor out = Tensor::empty({T, c.hq, c.head_dim_v}, c.dtype, d),
             lse_out = Tensor::empty({T, c.hq}, DType::f32, d);
      merge_states(states.to(d), lse.to(d), out, lse_out);
      out_host = out.to(Device::cpu());
      lse_host = lse_out.to(Device::cpu());
    } else {
      // Prefill family. q rows: qo_lens per request.
      const std::vector<int32_t> qo = prefix_sums(c.qo_lens);
      const int T = qo.back();
      Tensor q = random_host({T, c.hq, c.head_dim}, c.dtype, gen);
      Tensor qo_t = Tensor::from_i32(qo);
      Tensor out = Tensor::empty({T, c.hq, c.head_dim_v}, c.dtype, d),
             lse = Tensor::empty({T, c.hq}, DType::f32, d);
      Tensor mask, mask_indptr;
      if (c.op == OpKind::ragged_prefill) {
        const std::vector<int32_t> kvp = prefix_sums(c.kv_lens);
        Tensor k = random_host({kvp.back(), c.hkv, c.head_dim}, c.dtype, gen);
        Tensor v = random_host({kvp.back(), c.hkv, c.head_dim_v}, c.dtype, gen);
        Tensor kvp_t = Tensor::from_i32(kvp);
        AttentionOptions opt = options_of(c, c.causal, sinks);
        if (c.custom_mask) {
          make_mask(c.qo_lens, c.kv_lens, gen, &mask, &mask_indptr);
          opt.custom_mask = mask;
          opt.mask_indptr = mask_indptr;
        }
        ref = reference::ragged_attention(q, k, v, qo_t, kvp_t, opt);
        Tensor mask_d = c.custom_mask ? mask.to(d) : Tensor(),
               mi_d = c.custom_mask ? mask_indptr.to(d) : Tensor();
        opt.custom_mask = mask_d;
        opt.mask_indptr = mi_d;
        opt.sinks = sinks_d;
        Planned<PrefillPlan> p;
        plan_into(p, shape_of(c, &qo, c.kv_lens, c.causal), c, d,
                  [](auto&&... a) { return plan_prefill(a...); });
        ragged_prefill(p.plan, q.to(d), k.to(d), v.to(d), qo_t.to(d), kvp_t.to(d), opt, out, lse,
                       p.ws);
      } else if (c.op == OpKind::paged_prefill) {
        HostPaged h = make_paged(c, c.kv_lens, gen);
        AttentionOptions opt = options_of(c, c.causal, sinks);
        if (c.custom_mask) {
          make_mask(c.qo_lens, c.kv_lens, gen, &mask, &mask_indptr);
          opt.custom_mask = mask;
          opt.mask_indptr = mask_indptr;
        }
        ref = reference::paged_attention(q, qo_t, h.view(), opt);
        Tensor mask_d = c.custom_mask ? mask.to(d) : Tensor(),
               mi_d = c.custom_mask ? mask_indptr.to(d) : Tensor();
        opt.custom_mask = mask_d;
        opt.mask_indptr = mi_d;
        opt.sinks = sinks_d;
        DevicePaged dk = to_device(h, d);
        Planned<PrefillPlan> p;
        plan_into(p, shape_of(c, &qo, c.kv_lens, c.causal), c, d,
                  [](auto&&... a) { return plan_prefill(a...); });
        paged_prefill(p.plan, q.to(d), qo_t.to(d), dk.view(h), opt, out, lse, p.ws);
      } else {  // extend: ragged causal over the new tokens, merged with the paged prefix
        HostPaged h = make_paged(c, c.kv_lens, gen);
        Tensor k = random_host({T, c.hkv, c.head_dim}, c.dtype, gen);
        Tensor v = random_host({T, c.hkv, c.head_dim_v}, c.dtype, gen);
        // The sink belongs to the prefix side only, so the merged reference holds it once.
        const AttentionOptions causal = options_of(c, true);
        AttentionOptions full = options_of(c, false, sinks);
        auto ref_new = reference::ragged_attention(q, k, v, qo_t, qo_t, causal);
        auto ref_prefix = reference::paged_attention(q, qo_t, h.view(), full);
        ref = reference::merge_states({ref_new, ref_prefix});
        full.sinks = sinks_d;
        DevicePaged dk = to_device(h, d);
        Tensor qd = q.to(d), qo_d = qo_t.to(d);
        Tensor o2 = Tensor::empty({T, c.hq, c.head_dim_v}, c.dtype, d),
               lse2 = Tensor::empty({T, c.hq}, DType::f32, d);
        Planned<PrefillPlan> pr, pp;
        plan_into(pr, shape_of(c, &qo, c.qo_lens, true), c, d,
                  [](auto&&... a) { return plan_prefill(a...); });
        plan_into(pp, shape_of(c, &qo, c.kv_lens, false), c, d,
                  [](auto&&... a) { return plan_prefill(a...); });
        ragged_prefill(pr.plan, qd, k.to(d), v.to(d), qo_d, qo_d, causal, out, lse, pr.ws);
        if (c.sinks) {
          // As the backend runs it: the prefix pass merges the new tokens' state in (merge_o)
          // and adds the sink once to the merged rows.
          full.merge_o = out;
          full.merge_lse = lse;
          paged_prefill(pp.plan, qd, qo_d, dk.view(h), full, out, lse, pp.ws);
        } else {
          paged_prefill(pp.plan, qd, qo_d, dk.view(h), full, o2, lse2, pp.ws);
          merge_state(out, lse, o2, lse2, out, lse);
        }
      }
      out_host = out.to(Device::cpu());
      lse_host = lse.to(Device::cpu());
    }
    r.errors = compare(out_host, lse_host, ref);
    r.passed = r.errors.within(r.tolerance);
  } catch (const Error& e) {
    r.error = e.what();
    r.passed = false;
  }
  return r;
}

std::vector<OpCase> op_case_grid(bool quick, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<OpCase> cases;
  auto lens = [&](int n, int lo, int hi) {
    std::vector<int32_t> v(n);
    std::uniform_int_distribution<int> dist(lo, hi);
    for (int& x : v) x = dist(gen);
    return v;
  };
  const std::vector<std::pair<int, int>> heads = {{8, 8}, {8, 2}, {16, 2}};
  const std::vector<int> dims = quick ? std::vector<int>{64, 128} : std::vector<int>{64, 128, 256};
  const std::vector<DType> kv_types = {DType::bf16, DType::fp8_e4m3};
  int sinks_turn = 0;
  for (auto [hq, hkv] : heads)
    for (int dim : dims)
      for (int page : {1, 16}) {
        OpCase c;
        c.hq = hq;
        c.hkv = hkv;
        c.head_dim = c.head_dim_v = dim;
        c.page_size = page;
        c.seed = gen();
        const int scale = quick ? 1 : 4;
        // decode, with and without forced splits, bf16 and fp8 KV
        for (DType kvt : kv_types) {
          OpCase x = c;
          x.op = OpKind::decode;
          x.kv_dtype = kvt;
          x.kv_lens = lens(5, 0, 300 * scale);
          x.fixed_split = (page == 16) ? 64 : 0;
          x.seed = gen();
          cases.push_back(x);
        }
        OpCase ragged = c;
        ragged.op = OpKind::ragged_prefill;
        ragged.qo_lens = lens(3, 1, 40 * scale);
        ragged.kv_lens = ragged.qo_lens;
        ragged.seed = gen();
        cases.push_back(ragged);
        OpCase paged = c;
        paged.op = OpKind::paged_prefill;
        paged.qo_lens = lens(3, 1, 30 * scale);
        paged.kv_lens = paged.qo_lens;
        for (size_t i = 0; i < paged.kv_lens.size(); ++i)
          paged.kv_lens[i] += lens(1, 0, 90 * scale)[0];
        paged.seed = gen();
        cases.push_back(paged);
        OpCase ext = paged;
        ext.op = OpKind::extend;
        ext.kv_lens = lens(3, 0, 100 * scale);  // prefix lengths
        ext.seed = gen();
        cases.push_back(ext);
        // The full grid repeats one of this shape's five cases with sinks, a different one on
        // each shape (its seed derived, so the draws of the cases after it do not change).
        if (!quick) {
          OpCase x = cases[cases.size() - 1 - sinks_turn++ % 5];
          x.sinks = true;
          x.seed ^= 0x5EED;
          cases.push_back(x);
        }
      }
  // Variants on one shape.
  OpCase base;
  base.hq = 8;
  base.hkv = 2;
  base.head_dim = base.head_dim_v = 64;
  {
    OpCase x = base;
    x.op = OpKind::decode;
    x.kv_lens = lens(4, 1, 200);
    x.soft_cap = 30.0f;
    x.window_left = 37;
    x.seed = gen();
    cases.push_back(x);
    x.kv_dtype = DType::fp8_e5m2;
    x.seed = gen();
    cases.push_back(x);
  }
  {
    OpCase x = base;
    x.op = OpKind::paged_prefill;
    x.qo_lens = {5, 1, 9};
    x.kv_lens = {40, 17, 9};
    x.custom_mask = true;
    x.seed = gen();
    cases.push_back(x);
    x.op = OpKind::ragged_prefill;
    x.causal = false;
    x.custom_mask = false;
    x.kv_lens = {3, 50, 0};
    x.seed = gen();
    cases.push_back(x);
    x.causal = true;
    x.window_left = 4;
    x.kv_lens = x.qo_lens;
    x.soft_cap = 20.0f;
    x.seed = gen();
    cases.push_back(x);
  }
  {
    OpCase x = base;
    x.op = OpKind::merge_states;
    x.kv_lens = {13};
    x.hkv = 3;  // number of states
    x.seed = gen();
    cases.push_back(x);
  }
  if (!quick) {
    OpCase x = base;
    x.op = OpKind::decode;
    x.dtype = x.kv_dtype = DType::f16;
    x.kv_lens = lens(16, 500, 3000);
    x.seed = gen();
    cases.push_back(x);
  }
  // Attention sinks (SEMANTICS.md "Attention sinks") on the base shape, last so that the cases
  // above draw the same lengths as without them. Rows that see no key (a decode request with no
  // KV, a non-causal request against none, an extend without a prefix in its prefix pass) take
  // the sink's state alone.
  {
    const int scale = quick ? 1 : 4;
    OpCase s = base;
    s.sinks = true;
    // Decode with the KV split in chunks: the sink joins once, at the final merge.
    OpCase x = s;
    x.op = OpKind::decode;
    x.page_size = 16;
    x.kv_lens = lens(4, 1, 300 * scale);
    x.kv_lens.push_back(0);
    x.fixed_split = 64;
    x.seed = gen();
    cases.push_back(x);
    // Decode with a window, a soft cap (which the sink escapes) and an fp8 KV cache.
    x = s;
    x.op = OpKind::decode;
    x.kv_lens = lens(4, 1, 200 * scale);
    x.window_left = 37;
    x.soft_cap = 30.0f;
    x.kv_dtype = DType::fp8_e4m3;
    x.seed = gen();
    cases.push_back(x);
    // Ragged prefill: causal with a soft cap on a wider shape, then non-causal with an empty KV.
    x = s;
    x.op = OpKind::ragged_prefill;
    x.hq = 16;
    x.head_dim = x.head_dim_v = 128;
    x.qo_lens = lens(3, 1, 40 * scale);
    x.kv_lens = x.qo_lens;
    x.soft_cap = 20.0f;
    x.seed = gen();
    cases.push_back(x);
    x = s;
    x.op = OpKind::ragged_prefill;
    x.causal = false;
    x.qo_lens = {5, 1, 9};
    x.kv_lens = {3, 50 * scale, 0};
    x.seed = gen();
    cases.push_back(x);
    // Paged prefill: a tree mask on pages of 16, then a window with the KV split in chunks.
    x = s;
    x.op = OpKind::paged_prefill;
    x.page_size = 16;
    x.qo_lens = {5, 1, 9};
    x.kv_lens = {40, 17, 9};
    x.custom_mask = true;
    x.seed = gen();
    cases.push_back(x);
    x = s;
    x.op = OpKind::paged_prefill;
    x.qo_lens = lens(3, 1, 30 * scale);
    x.kv_lens = x.qo_lens;
    for (int32_t& kv : x.kv_lens) kv += lens(1, 0, 90 * scale)[0];
    x.window_left = 20;
    x.fixed_split = 32;
    x.seed = gen();
    cases.push_back(x);
    // Extend (ragged new tokens merged into the paged prefix pass, which adds the sink): one
    // request without a prefix; a soft cap and split chunks on pages of 16, then fp8 KV on a
    // wider shape.
    x = s;
    x.op = OpKind::extend;
    x.page_size = 16;
    x.qo_lens = lens(3, 1, 30 * scale);
    x.kv_lens = lens(3, 0, 100 * scale);
    x.kv_lens[1] = 0;
    x.soft_cap = 30.0f;
    x.fixed_split = 32;
    x.seed = gen();
    cases.push_back(x);
    x = s;
    x.op = OpKind::extend;
    x.hq = 16;
    x.head_dim = x.head_dim_v = 128;
    x.kv_dtype = DType::fp8_e4m3;
    x.qo_lens = lens(3, 1, 30 * scale);
    x.kv_lens = lens(3, 1, 100 * scale);
    x.seed = gen();
    cases.push_back(x);
  }
  // Head dims 192 / 128 (Q.K^T over 192 dims, V of 128: DeepSeek's prefill, one KV head a query
  // head), which only prefill and extend take. Last, so that the cases above keep their draws.
  {
    const int scale = quick ? 1 : 4;
    OpCase x = base;
    x.hq = x.hkv = 8;
    x.head_dim = 192;
    x.head_dim_v = 128;
    x.op = OpKind::ragged_prefill;
    x.qo_lens = lens(3, 1, 40 * scale);
    x.kv_lens = x.qo_lens;
    x.seed = gen();
    cases.push_back(x);
    x.op = OpKind::paged_prefill;
    x.page_size = 16;
    for (int32_t& kv : x.kv_lens) kv += lens(1, 0, 90 * scale)[0];
    x.seed = gen();
    cases.push_back(x);
    x.op = OpKind::extend;
    x.page_size = 1;
    x.kv_lens = lens(3, 0, 100 * scale);  // prefix lengths
    x.seed = gen();
    cases.push_back(x);
  }
  // Paged prefill and extend with an fp8 pool (e4m3 and e5m2 in turn) at each head dim and page
  // size, 4 query heads a KV head: on Hopper the warp-specialized kernel widens it to 16 bits.
  // Last, so that the cases above keep their draws.
  {
    const int scale = quick ? 1 : 4;
    int turn = 0;
    for (int dim : dims)
      for (int page : {1, 16}) {
        OpCase x = base;
        x.hq = 16;
        x.hkv = 4;
        x.head_dim = x.head_dim_v = dim;
        x.page_size = page;
        x.kv_dtype = turn++ % 2 ? DType::fp8_e5m2 : DType::fp8_e4m3;
        x.op = OpKind::paged_prefill;
        x.qo_lens = lens(3, 1, 30 * scale);
        x.kv_lens = x.qo_lens;
        for (int32_t& kv : x.kv_lens) kv += lens(1, 0, 90 * scale)[0];
        x.seed = gen();
        cases.push_back(x);
        x.op = OpKind::extend;
        x.kv_lens = lens(3, 0, 100 * scale);  // prefix lengths
        x.seed = gen();
        cases.push_back(x);
      }
  }
  return cases;
}

}  // namespace flashkv::app
