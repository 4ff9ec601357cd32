// Argument validation and device dispatch of the attention operators.
#include "flashkv/ops/attention.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flashkv/kernels/kernels.h"

namespace flashkv {
namespace {

#if !FLASHKV_WITH_CUDA
[[noreturn]] void no_cuda_build(const char* op) {
  throw_error(str_cat(op, ": CUDA tensors given, but this flashkv was built without CUDA"));
}
// The same, naming the attention operator of `p`.
[[noreturn]] void no_cuda_build(const AttentionParams& p, bool decode) {
  no_cuda_build(decode ? "paged_decode" : p.paged ? "paged_prefill" : "ragged_prefill");
}
#endif

void check_plan_matches(const Plan& plan, const char* op, const TensorView& q, int64_t batch,
                        int64_t hkv, int64_t dqk, int64_t dv, const Workspace& ws) {
  FLASHKV_CHECK(plan.id != 0, op, ": plan: expected a plan from plan_decode/plan_prefill");
  FLASHKV_CHECK_EQ(str_cat(op, ": plan.batch_size"), int64_t{plan.batch_size}, batch);
  FLASHKV_CHECK_EQ(str_cat(op, ": plan.num_qo_tokens"), plan.num_qo_tokens, q.shape[0]);
  FLASHKV_CHECK_EQ(str_cat(op, ": plan.num_qo_heads"), int64_t{plan.num_qo_heads}, q.shape[1]);
  FLASHKV_CHECK_EQ(str_cat(op, ": plan.num_kv_heads"), int64_t{plan.num_kv_heads}, hkv);
  FLASHKV_CHECK_EQ(str_cat(op, ": plan.head_dim_qk"), int64_t{plan.head_dim_qk}, dqk);
  FLASHKV_CHECK_EQ(str_cat(op, ": plan.head_dim_v"), int64_t{plan.head_dim_v}, dv);
  FLASHKV_CHECK(plan.device == q.device, op, ": plan was made for ", plan.device.str(),
                ", tensors are on ", q.device.str());
  FLASHKV_CHECK(ws.device() == q.device, op, ": workspace: expected device ", q.device.str(),
                ", got ", ws.device().str());
  FLASHKV_CHECK(ws.bytes() >= ws.bytes_needed(plan), op, ": workspace: expected at least ",
                ws.bytes_needed(plan), " bytes, got ", ws.bytes());
  const size_t scratch_needed = plan.layout.total_bytes - plan.layout.plan_bytes;
  FLASHKV_CHECK(!ws.has_external_scratch() || ws.external_scratch_bytes() >= scratch_needed, op,
                ": workspace scratch: expected at least ", scratch_needed, " bytes, got ",
                ws.external_scratch_bytes());
  FLASHKV_CHECK(ws.plan_id() == plan.id, op,
                ": workspace: this plan was not uploaded (call Workspace::upload(plan) after "
                "planning)");
}

// Fills the Q/O/LSE, variant and plan parts of the params.
AttentionParams common_params(const Plan& plan, const char* op, const TensorView& q,
                              const TensorView& out, const TensorView& lse,
                              const AttentionOptions& opt, int64_t dv, const Workspace& ws) {
  const Device dev = q.device;
  Expect(q, "q").ndim(3).float_dtype().inner_contiguous();
  // O in q's dtype, or f32 (FlashInfer's o_data_type: partial outputs kept unrounded).
  Expect(out, "out")
      .ndim(3)
      .device(dev)
      .dtype_in({q.dtype, DType::f32})
      .inner_contiguous()
      .dim(0, q.shape[0], "num_qo_tokens")
      .dim(1, q.shape[1], "num_qo_heads")
      .dim(2, dv, "head_dim_v");
  if (lse.defined())
    Expect(lse, "lse")
        .ndim(2)
        .device(dev)
        .dtype(DType::f32)
        .contiguous()
        .dim(0, q.shape[0], "num_qo_tokens")
        .dim(1, q.shape[1], "num_qo_heads");
  FLASHKV_CHECK(opt.sm_scale >= 0 && std::isfinite(opt.sm_scale),
                "sm_scale: expected >= 0 (0: 1/sqrt(head_dim)), got ", opt.sm_scale);
  FLASHKV_CHECK(opt.logits_soft_cap >= 0 && std::isfinite(opt.logits_soft_cap),
                "logits_soft_cap: expected >= 0 (0: off), got ", opt.logits_soft_cap);
  AttentionParams p;
  p.q = q.data;
  p.o = out.data;
  p.q_dtype = q.dtype;
  p.o_dtype = out.dtype;
  p.q_stride_n = q.stride[0];
  p.q_stride_h = q.stride[1];
  p.o_stride_n = out.stride[0];
  p.o_stride_h = out.stride[1];
  p.lse = lse.defined() ? static_cast<float*>(lse.data) : nullptr;
  p.num_qo_tokens = q.shape[0];
  p.num_qo_heads = static_cast<int32_t>(q.shape[1]);
  p.head_dim_qk = static_cast<int32_t>(q.shape[2]);
  p.head_dim_v = static_cast<int32_t>(dv);
  p.batch_size = plan.batch_size;
  p.causal = opt.causal;
  p.window_left = normalize_window_left(opt.window_left);
  p.logits_soft_cap = opt.logits_soft_cap;
  p.sm_scale = opt.sm_scale > 0 ? opt.sm_scale : 1.0f / std::sqrt(static_cast<float>(q.shape[2]));
  if (opt.custom_mask.defined()) {
    Expect(opt.custom_mask, "custom_mask").ndim(1).device(dev).dtype(DType::u8);
    Expect(opt.mask_indptr, "mask_indptr")
        .ndim(1)
        .device(dev)
        .dtype(DType::i32)
        .dim(0, int64_t{plan.batch_size} + 1, "batch + 1");
    p.custom_mask = static_cast<const uint8_t*>(opt.custom_mask.data);
    p.mask_indptr = static_cast<const int32_t*>(opt.mask_indptr.data);
  }
  if (opt.sinks.defined()) {
    Expect(opt.sinks, "sinks")
        .ndim(1)
        .device(dev)
        .dtype(DType::f32)
        .contiguous()
        .dim(0, q.shape[1], "num_qo_heads");
    p.sinks = static_cast<const float*>(opt.sinks.data);
  }
  // The plan as uploaded into the workspace.
  const auto* base = static_cast<unsigned char*>(ws.data());
  const WorkspaceLayout& l = plan.layout;
  p.plan_header = reinterpret_cast<const PlanHeader*>(base + l.header);
  p.items = reinterpret_cast<const WorkItem*>(base + l.items);
  p.worker_indptr = reinterpret_cast<const int32_t*>(base + l.worker_indptr);
  p.merges = reinterpret_cast<const MergeItem*>(base + l.merges);
  p.merge_counters =
      reinterpret_cast<int32_t*>(static_cast<unsigned char*>(ws.data()) + l.merge_counters);
  p.num_items = static_cast<int32_t>(plan.items.size());
  p.num_merges = static_cast<int32_t>(plan.merges.size());
  p.num_workers = plan.num_workers;
  p.cuda_graph = plan.cuda_graph;
  p.max_merges = static_cast<int32_t>(l.max_merges);
  unsigned char* scratch = ws.scratch(plan);
  p.partial_o = reinterpret_cast<float*>(scratch + (l.partial_o - l.plan_bytes));
  p.partial_lse = reinterpret_cast<float*>(scratch + (l.partial_lse - l.plan_bytes));
  return p;
}

// AttentionOptions::merge_o / merge_lse (prefill operators): the state each output row is merged
// with before it is written.
void set_merge(AttentionParams& p, const AttentionOptions& opt, const TensorView& q,
               const TensorView& out, int64_t dv) {
  FLASHKV_CHECK(opt.merge_o.defined() == opt.merge_lse.defined(),
                "merge_o/merge_lse: expected both or neither, got ",
                opt.merge_o.defined() ? "merge_o only" : "merge_lse only");
  if (!opt.merge_o.defined()) return;
  Expect(opt.merge_o, "merge_o")
      .ndim(3)
      .device(q.device)
      .dtype(out.dtype)
      .inner_contiguous()
      .dim(0, q.shape[0], "num_qo_tokens")
      .dim(1, q.shape[1], "num_qo_heads")
      .dim(2, dv, "head_dim_v");
  Expect(opt.merge_lse, "merge_lse")
      .ndim(2)
      .device(q.device)
      .dtype(DType::f32)
      .contiguous()
      .dim(0, q.shape[0], "num_qo_tokens")
      .dim(1, q.shape[1], "num_qo_heads");
  // In place is fine (a row is read before it is written); a shifted view of out is not.
  FLASHKV_CHECK(opt.merge_o.data != out.data || (opt.merge_o.stride[0] == out.stride[0] &&
                                                 opt.merge_o.stride[1] == out.stride[1]),
                "merge_o: the same memory as out needs out's strides (", out.stride[0], "/",
                out.stride[1], "), got ", opt.merge_o.stride[0], "/", opt.merge_o.stride[1]);
  p.merge_o = opt.merge_o.data;
  p.merge_stride_n = opt.merge_o.stride[0];
  p.merge_stride_h = opt.merge_o.stride[1];
  p.merge_lse = static_cast<const float*>(opt.merge_lse.data);
  p.overlap_previous = opt.overlap_previous;
}

void set_kv(AttentionParams& p, const TensorView& k, const TensorView& v, const TensorView& q,
            const char* kname, const char* vname) {
  Expect(k, kname).ndim(3).device(q.device).inner_contiguous().dim(2, q.shape[2], "head_dim_qk");
  FLASHKV_CHECK(k.shape[1] > 0 && q.shape[1] % k.shape[1] == 0,
                "num_qo_heads: expected a multiple of num_kv_heads (", k.shape[1], "), got ",
                q.shape[1]);
  Expect(v, vname)
      .ndim(3)
      .device(q.device)
      .inner_contiguous()
      .dtype(k.dtype)
      .dim(0, k.shape[0], "rows of k")
      .dim(1, k.shape[1], "num_kv_heads");
  if (!is_fp8(k.dtype))
    Expect(k, kname).dtype(q.dtype);
  else
    Expect(k, kname).dtype_in({DType::fp8_e4m3, DType::fp8_e5m2});
  p.k = k.data;
  p.v = v.data;
  p.kv_dtype = k.dtype;
  p.k_stride_n = k.stride[0];
  p.k_stride_h = k.stride[1];
  p.v_stride_n = v.stride[0];
  p.v_stride_h = v.stride[1];
  p.num_kv_heads = static_cast<int32_t>(k.shape[1]);
  p.num_kv_rows = k.shape[0];
}

void check_indptr(const TensorView& t, const char* name, int64_t batch, Device dev) {
  Expect(t, name).ndim(1).device(dev).dtype(DType::i32).contiguous().dim(0, batch + 1, "batch + 1");
  if (!dev.is_cpu()) return;
  const auto* a = static_cast<const int32_t*>(t.data);
  FLASHKV_CHECK(a[0] >= 0, name, ": expected indptr[0] >= 0, got ", a[0]);
  for (int64_t i = 0; i < batch; ++i)
    FLASHKV_CHECK(a[i] <= a[i + 1], name, ": expected non-decreasing values, got [", i,
                  "] = ", a[i], " > [", i + 1, "] = ", a[i + 1]);
}

// Paged KV arguments; on the host, also every index against the pool.
void set_paged(AttentionParams& p, const PagedKV& kv, const TensorView& q, int64_t batch) {
  set_kv(p, kv.k, kv.v, q, "kv.k", "kv.v");
  FLASHKV_CHECK(kv.page_size >= 1, "kv.page_size: expected >= 1, got ", kv.page_size);
  FLASHKV_CHECK(
      kv.k_scale > 0 && std::isfinite(kv.k_scale) && kv.v_scale > 0 && std::isfinite(kv.v_scale),
      "kv.k_scale/kv.v_scale: expected finite values > 0, got ", kv.k_scale, "/", kv.v_scale);
  check_indptr(kv.indptr, "kv.indptr", batch, q.device);
  Expect(kv.indices, "kv.indices").ndim(1).device(q.device).dtype(DType::i32).contiguous();
  if (kv.page_size > 1)
    Expect(kv.last_page_len, "kv.last_page_len")
        .ndim(1)
        .device(q.device)
        .dtype(DType::i32)
        .contiguous()
        .dim(0, batch, "batch");
  if (q.device.is_cpu()) {
    const auto* indptr = static_cast<const int32_t*>(kv.indptr.data);
    FLASHKV_CHECK(indptr[batch] <= kv.indices.numel(), "kv.indices: expected at least ",
                  indptr[batch], " entries (kv.indptr[batch]), got ", kv.indices.numel());
    const auto* idx = static_cast<const int32_t*>(kv.indices.data);
    // Every listed page must lie wholly inside the pool.
    const int64_t num_pages = kv.k.shape[0] / kv.page_size;
    for (int64_t e = indptr[0]; e < indptr[batch]; ++e)
      FLASHKV_CHECK(idx[e] >= 0 && idx[e]<num_pages, "kv.indices: entry ", e, " = ", idx[e],
                                          " outside the pool's ", num_pages, kv.page_size> 1
                        ? " pages"
                        : " slots");
    if (kv.page_size > 1) {
      const auto* lpl = static_cast<const int32_t*>(kv.last_page_len.data);
      for (int64_t i = 0; i < batch; ++i)
        FLASHKV_CHECK(indptr[i] == indptr[i + 1] || (lpl[i] >= 1 && lpl[i] <= kv.page_size),
                      "kv.last_page_len: request ", i, ": expected 1..", kv.page_size, ", got ",
                      lpl[i]);
    }
  }
  p.paged = true;
  p.kv_indptr = static_cast<const int32_t*>(kv.indptr.data);
  p.kv_indices = static_cast<const int32_t*>(kv.indices.data);
  p.last_page_len = kv.page_size > 1 ? static_cast<const int32_t*>(kv.last_page_len.data) : nullptr;
  p.page_size = kv.page_size;
  p.page_shift = -1;
  for (int32_t s = 0; s < 31; ++s)
    if (kv.page_size == (int64_t{1} << s)) p.page_shift = s;
  p.k_scale = kv.k_scale;
  p.v_scale = kv.v_scale;
}

void check_query_rows(const TensorView& qo_indptr, int64_t num_tokens) {
  if (!qo_indptr.device.is_cpu()) return;
  const auto* a = static_cast<const int32_t*>(qo_indptr.data);
  const int64_t batch = qo_indptr.numel() - 1;
  FLASHKV_CHECK(a[batch] <= num_tokens, "qo_indptr: last value ", a[batch], " exceeds q's ",
                num_tokens, " rows");
}

void check_mask_extent(const AttentionParams& p, const AttentionOptions& opt) {
  if (!p.custom_mask || !opt.custom_mask.device.is_cpu()) return;
  // Each request's matrix must lie inside the mask tensor.
  for (int32_t i = 0; i < p.batch_size; ++i) {
    const int64_t q_len = p.qo_indptr ? p.qo_indptr[i + 1] - p.qo_indptr[i] : 1;
    int64_t kv_len;
    if (!p.paged) {
      kv_len = p.kv_indptr[i + 1] - p.kv_indptr[i];
    } else {
      const int64_t n = p.kv_indptr[i + 1] - p.kv_indptr[i];
      kv_len = p.page_size == 1 ? n : (n == 0 ? 0 : (n - 1) * p.page_size + p.last_page_len[i]);
    }
    const int64_t off = p.mask_indptr[i];
    FLASHKV_CHECK(off >= 0 && off + q_len * kv_len <= opt.custom_mask.numel(),
                  "custom_mask: request ", i, " needs elements [", off, ", ", off + q_len * kv_len,
                  "), mask has ", opt.custom_mask.numel());
  }
}

// The device kernels' own limits (dtypes, head dims, alignment), checked without launching.
void check_device_support(const AttentionParams& p, Device dev, bool decode) {
  if (dev.is_cpu()) return;
#if FLASHKV_WITH_CUDA
  if (decode)
    cuda::check_paged_decode(p);
  else
    cuda::check_prefill(p);
#else
  no_cuda_build(p, decode);
#endif
}

// The checks that end every prepare_*: the mask's extent and what the device's kernels take. The
// parameters, once checked, are shared by the prepared call.
std::shared_ptr<const AttentionParams> checked(const AttentionParams& p,
                                               const AttentionOptions& opt, Device dev,
                                               bool decode) {
  check_mask_extent(p, opt);
  check_device_support(p, dev, decode);
  return std::make_shared<const AttentionParams>(p);
}

}  // namespace

int64_t paged_kv_len(const PagedKV& kv, int64_t i) {
  const int64_t n = index_at(kv.indptr, i + 1) - index_at(kv.indptr, i);
  FLASHKV_CHECK(n >= 0, "kv.indptr: decreasing at request ", i);
  if (kv.page_size == 1 || n == 0) return n;
  const int64_t last = index_at(kv.last_page_len, i);
  FLASHKV_CHECK(last >= 1 && last <= kv.page_size, "kv.last_page_len: request ", i,
                ": expected 1..", kv.page_size, ", got ", last);
  return (n - 1) * kv.page_size + last;
}

void Workspace::reserve(size_t bytes, Device device) {
  if (buffer_.bytes() >= bytes && buffer_.device() == device && buffer_.data()) return;
  buffer_ = Buffer(bytes, device);
  plan_id_ = 0;
}

void Workspace::set_external_scratch(void* data, size_t bytes) {
  if (data == nullptr) {
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    return;
  }
  const auto addr = reinterpret_cast<uintptr_t>(data);
  const size_t pad = (256 - addr % 256) % 256;
  scratch_ = static_cast<unsigned char*>(data) + pad;
  scratch_bytes_ = bytes > pad ? bytes - pad : 0;
}

size_t Workspace::bytes_needed(const Plan& plan) const {
  return scratch_ ? plan.layout.plan_bytes : plan.layout.total_bytes;
}

unsigned char* Workspace::scratch(const Plan& plan) const {
  return scratch_ ? scratch_ : static_cast<unsigned char*>(data()) + plan.layout.plan_bytes;
}

void Workspace::upload(const Plan& plan, Stream stream) {
  FLASHKV_CHECK(plan.id != 0,
                "Workspace::upload: plan: expected a plan from plan_decode/plan_prefill");
  FLASHKV_CHECK(device() == plan.device, "Workspace::upload: workspace is on ", device().str(),
                ", plan is for ", plan.device.str());
  FLASHKV_CHECK(bytes() >= bytes_needed(plan), "Workspace::upload: workspace: expected at least ",
                bytes_needed(plan), " bytes, got ", bytes());
  if (device().is_cpu()) {
    serialize_plan(plan, data());
  } else {
    host_staging_.resize(plan.layout.plan_bytes);
    serialize_plan(plan, host_staging_.data());
    copy_bytes(data(), device(), host_staging_.data(), Device::cpu(), plan.layout.plan_bytes,
               stream);
  }
  plan_id_ = plan.id;
}

PreparedAttention prepare_ragged_prefill(const PrefillPlan& plan, const TensorView& q,
                                         const TensorView& k, const TensorView& v,
                                         const TensorView& qo_indptr, const TensorView& kv_indptr,
                                         const AttentionOptions& opt, const TensorView& out,
                                         const TensorView& lse, Workspace& ws) {
  Expect(q, "q").ndim(3);
  Expect(v, "v").ndim(3);
  const int64_t batch = qo_indptr.defined() ? qo_indptr.numel() - 1 : -1;
  check_indptr(qo_indptr, "qo_indptr", plan.batch_size, q.device);
  check_indptr(kv_indptr, "kv_indptr", plan.batch_size, q.device);
  AttentionParams p = common_params(plan, "ragged_prefill", q, out, lse, opt, v.shape[2], ws);
  set_merge(p, opt, q, out, v.shape[2]);
  set_kv(p, k, v, q, "k", "v");
  check_plan_matches(plan, "ragged_prefill", q, batch, k.shape[1], q.shape[2], v.shape[2], ws);
  check_query_rows(qo_indptr, q.shape[0]);
  if (q.device.is_cpu()) {
    const int32_t last = static_cast<const int32_t*>(kv_indptr.data)[batch];
    FLASHKV_CHECK(last <= k.shape[0], "kv_indptr: last value ", last, " exceeds k's ", k.shape[0],
                  " rows");
  }
  p.qo_indptr = static_cast<const int32_t*>(qo_indptr.data);
  p.kv_indptr = static_cast<const int32_t*>(kv_indptr.data);
  return PreparedAttention(checked(p, opt, q.device, false), q.device, false);
}

PreparedAttention prepare_paged_prefill(const PrefillPlan& plan, const TensorView& q,
                                        const TensorView& qo_indptr, const PagedKV& kv,
                                        const AttentionOptions& opt, const TensorView& out,
                                        const TensorView& lse, Workspace& ws) {
  Expect(q, "q").ndim(3);
  Expect(kv.v, "kv.v").ndim(3);
  check_indptr(qo_indptr, "qo_indptr", plan.batch_size, q.device);
  AttentionParams p = common_params(plan, "paged_prefill", q, out, lse, opt, kv.v.shape[2], ws);
  set_merge(p, opt, q, out, kv.v.shape[2]);
  set_paged(p, kv, q, plan.batch_size);
  check_plan_matches(plan, "paged_prefill", q, qo_indptr.numel() - 1, kv.k.shape[1], q.shape[2],
                     kv.v.shape[2], ws);
  check_query_rows(qo_indptr, q.shape[0]);
  p.qo_indptr = static_cast<const int32_t*>(qo_indptr.data);
  return PreparedAttention(checked(p, opt, q.device, false), q.device, false);
}

PreparedAttention prepare_paged_decode(const DecodePlan& plan, const TensorView& q,
                                       const PagedKV& kv, const AttentionOptions& opt,
                                       const TensorView& out, const TensorView& lse,
                                       Workspace& ws) {
  Expect(q, "q").ndim(3);
  Expect(kv.v, "kv.v").ndim(3);
  FLASHKV_CHECK(!opt.merge_o.defined() && !opt.merge_lse.defined(),
                "merge_o/merge_lse: paged_decode does not take a state to merge with (use "
                "merge_state)");
  AttentionParams p = common_params(plan, "paged_decode", q, out, lse, opt, kv.v.shape[2], ws);
  p.layout_ready = opt.layout_ready;
  set_paged(p, kv, q, q.shape[0]);
  check_plan_matches(plan, "paged_decode", q, q.shape[0], kv.k.shape[1], q.shape[2], kv.v.shape[2],
                     ws);
  return PreparedAttention(checked(p, opt, q.device, true), q.device, true);
}

int normalize_window_left(int window_left) { return window_left < 0 ? -1 : window_left; }

void PreparedAttention::run(Stream stream) const {
  if (device_.is_cpu()) {
    cpu::attention(*params_);
    return;
  }
#if FLASHKV_WITH_CUDA
  if (decode_)
    cuda::paged_decode(*params_, stream);
  else
    cuda::prefill(*params_, stream);
#else
  (void)stream;
  no_cuda_build(*params_, decode_);
#endif
}

void ragged_prefill(const PrefillPlan& plan, const TensorView& q, const TensorView& k,
                    const TensorView& v, const TensorView& qo_indptr, const TensorView& kv_indptr,
                    const AttentionOptions& opt, const TensorView& out, const TensorView& lse,
                    Workspace& ws, Stream stream) {
  prepare_ragged_prefill(plan, q, k, v, qo_indptr, kv_indptr, opt, out, lse, ws).run(stream);
}

void paged_prefill(const PrefillPlan& plan, const TensorView& q, const TensorView& qo_indptr,
                   const PagedKV& kv, const AttentionOptions& opt, const TensorView& out,
                   const TensorView& lse, Workspace& ws, Stream stream) {
  prepare_paged_prefill(plan, q, qo_indptr, kv, opt, out, lse, ws).run(stream);
}

void paged_decode(const DecodePlan& plan, const TensorView& q, const PagedKV& kv,
                  const AttentionOptions& opt, const TensorView& out, const TensorView& lse,
                  Workspace& ws, Stream stream) {
  prepare_paged_decode(plan, q, kv, opt, out, lse, ws).run(stream);
}

namespace {
void run_merge(const MergeParams& p, Device dev, Stream stream) {
  if (dev.is_cpu()) {
    cpu::merge(p);
    return;
  }
#if FLASHKV_WITH_CUDA
  cuda::merge(p, stream);
#else
  (void)stream;
  no_cuda_build("merge_state");
#endif
}
}  // namespace

void merge_state(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
                 const TensorView& lse_b, const TensorView& o, const TensorView& lse,
                 Stream stream) {
  Expect(o_a, "o_a").ndim(3).float_dtype().inner_contiguous();
  const Device dev = o_a.device;
  const int64_t rows = o_a.shape[0], heads = o_a.shape[1], dim = o_a.shape[2];
  Expect(o_b, "o_b")
      .ndim(3)
      .device(dev)
      .dtype(o_a.dtype)
      .inner_contiguous()
      .dim(0, rows)
      .dim(1, heads)
      .dim(2, dim);
  Expect(o, "o")
      .ndim(3)
      .device(dev)
      .dtype(o_a.dtype)
      .inner_contiguous()
      .dim(0, rows)
      .dim(1, heads)
      .dim(2, dim);
  for (auto [t, name] : {std::pair{&lse_a, "lse_a"}, std::pair{&lse_b, "lse_b"}})
    Expect(*t, name).ndim(2).device(dev).dtype(DType::f32).contiguous().dim(0, rows).dim(1, heads);
  if (lse.defined())
    Expect(lse, "lse")
        .ndim(2)
        .device(dev)
        .dtype(DType::f32)
        .contiguous()
        .dim(0, rows)
        .dim(1, heads);
  FLASHKV_CHECK(o_a.stride[0] == o_b.stride[0] && o_a.stride[1] == o_b.stride[1],
                "o_b: expected the same strides as o_a");
  MergeParams p;
  p.o_in[0] = o_a.data;
  p.o_in[1] = o_b.data;
  p.lse_in[0] = static_cast<const float*>(lse_a.data);
  p.lse_in[1] = static_cast<const float*>(lse_b.data);
  p.in_stride_n = o_a.stride[0];
  p.in_stride_h = o_a.stride[1];
  p.lse_stride_n = heads;
  p.num_states = 2;
  p.dtype = o_a.dtype;
  p.o_out = o.data;
  p.out_stride_n = o.stride[0];
  p.out_stride_h = o.stride[1];
  p.lse_out = lse.defined() ? static_cast<float*>(lse.data) : nullptr;
  p.rows = rows;
  p.heads = static_cast<int32_t>(heads);
  p.head_dim = static_cast<int32_t>(dim);
  run_merge(p, dev, stream);
}

void merge_states(const TensorView& states, const TensorView& lse, const TensorView& o,
                  const TensorView& lse_out, Stream stream) {
  Expect(states, "states").ndim(4).float_dtype().inner_contiguous();
  const Device dev = states.device;
  const int64_t rows = states.shape[0], n = states.shape[1], heads = states.shape[2],
                dim = states.shape[3];
  FLASHKV_CHECK(n >= 1, "states: expected at least one state in dimension 1, got ", n);
  Expect(lse, "lse")
      .ndim(3)
      .device(dev)
      .dtype(DType::f32)
      .contiguous()
      .dim(0, rows)
      .dim(1, n)
      .dim(2, heads);
  Expect(o, "o")
      .ndim(3)
      .device(dev)
      .dtype(states.dtype)
      .inner_contiguous()
      .dim(0, rows)
      .dim(1, heads)
      .dim(2, dim);
  if (lse_out.defined())
    Expect(lse_out, "lse_out")
        .ndim(2)
        .device(dev)
        .dtype(DType::f32)
        .contiguous()
        .dim(0, rows)
        .dim(1, heads);
  MergeParams p;
  p.stacked = true;
  p.o_in[0] = states.data;
  p.lse_in[0] = static_cast<const float*>(lse.data);
  p.in_stride_n = states.stride[0];
  p.in_stride_s = states.stride[1];
  p.in_stride_h = states.stride[2];
  p.lse_stride_n = n * heads;
  p.lse_stride_s = heads;
  p.num_states = static_cast<int32_t>(n);
  p.dtype = states.dtype;
  p.o_out = o.data;
  p.out_stride_n = o.stride[0];
  p.out_stride_h = o.stride[1];
  p.lse_out = lse_out.defined() ? static_cast<float*>(lse_out.data) : nullptr;
  p.rows = rows;
  p.heads = static_cast<int32_t>(heads);
  p.head_dim = static_cast<int32_t>(dim);
  run_merge(p, dev, stream);
}

}  // namespace flashkv
