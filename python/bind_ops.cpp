// The operators for Python: a Plan object (planner + workspace, the host half of FlashInfer's
// plan/run split) with the runs that use it, and the stateless operators (merges, KV writes).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>

#include "bind.h"
#include "flashkv/ops/attention.h"
#include "flashkv/ops/kv_ops.h"

namespace flashkv::py {
namespace {

// Host int32 [n] array (contiguous) as a pointer.
const int32_t* host_i32(const Array& a, const char* name, int64_t n) {
  TensorView t = view_of(a, name);
  Expect(t, name).ndim(1).on_host().dtype(DType::i32).contiguous().dim(0, n);
  return static_cast<const int32_t*>(t.data);
}

// One planned batch: the plan, the workspace its runs read it from, and where their partial
// states go (the caller's shared scratch when large enough, else memory of our own).
class PyPlan {
 public:
  PyPlan(const std::string& device, const OptArray& scratch) : device_(parse_device(device)) {
    if (scratch) {
      TensorView s = view_of(*scratch, "float_workspace_buffer");
      Expect(s, "float_workspace_buffer").device(device_).contiguous();
      scratch_owner_ = *scratch;
      ext_scratch_ = s.data;
      ext_scratch_bytes_ = s.nbytes();
    }
  }

  void plan(bool decode, const Array& kv_len, const OptArray& qo_indptr, int num_qo_heads,
            int num_kv_heads, int head_dim_qk, int head_dim_v, int page_size, bool causal,
            int window_left, bool enable_split_kv, int fixed_split_size, bool cuda_graph,
            int max_batch_size, int max_num_tokens, int max_kv_len, uintptr_t stream) {
    FLASHKV_CHECK(kv_len.ndim() == 1, "kv_len: expected 1 dimension, got ", kv_len.ndim());
    const int64_t batch = static_cast<int64_t>(kv_len.shape(0));
    BatchShape shape;
    shape.batch_size = static_cast<int32_t>(batch);
    shape.kv_len = host_i32(kv_len, "kv_len", batch);
    shape.qo_indptr = decode ? nullptr : host_i32(*qo_indptr, "qo_indptr", batch + 1);
    shape.num_qo_heads = num_qo_heads;
    shape.num_kv_heads = num_kv_heads;
    shape.head_dim_qk = head_dim_qk;
    shape.head_dim_v = head_dim_v;
    shape.page_size = page_size;
    shape.causal = causal;
    shape.window_left = window_left;
    PlanOptions po;
    po.enable_split_kv = enable_split_kv;
    po.fixed_split_size = fixed_split_size;
    po.cuda_graph = cuda_graph;
    po.max_batch_size = max_batch_size;
    po.max_num_tokens = max_num_tokens;
    po.max_kv_len = max_kv_len;
    const void* ws_before = ws_.data();
    const void* scratch_before = planned_ ? ws_.scratch(current()) : nullptr;
    planned_ = false;
    {
      nb::gil_scoped_release release;
      if (decode)
        plan_decode(shape, device_info(device_), po, &decode_plan_);
      else
        plan_prefill(shape, device_info(device_), po, &prefill_plan_);
    }
    decode_ = decode;
    const Plan& p = current();
    const size_t scratch_needed = p.layout.total_bytes - p.layout.plan_bytes;
    // 256 bytes of slack: set_external_scratch aligns the start.
    if (ext_scratch_ && ext_scratch_bytes_ >= scratch_needed + 256) {
      ws_.set_external_scratch(ext_scratch_, ext_scratch_bytes_);
    } else {
      if (own_scratch_.bytes() < scratch_needed + 256)
        own_scratch_ = Buffer(scratch_needed + 256, device_);
      ws_.set_external_scratch(own_scratch_.data(), own_scratch_.bytes());
    }
    ws_.reserve(std::max<size_t>(ws_.bytes_needed(p), 1), device_);
    if (cuda_graph && graph_fixed_) {
      // A captured graph reads the plan and the partial states at these addresses.
      FLASHKV_CHECK(ws_.data() == ws_before && ws_.scratch(p) == scratch_before,
                    "plan: the CUDA-graph workspace would move (the batch needs more than the ",
                    "first plan of this wrapper sized)");
    }
    ws_.upload(p, stream_of(stream));
    graph_fixed_ = cuda_graph;
    causal_ = causal;
    window_left_ = window_left < 0 ? -1 : window_left;
    planned_ = true;
  }

  void run_paged(const Array& q, const Array& k, const Array& v, const Array& kv_indptr,
                 const Array& kv_indices, const OptArray& last_page_len, const OptArray& qo_indptr,
                 int page_size, float k_scale, float v_scale, const std::string& kv_dtype,
                 bool causal, int window_left, float logits_soft_cap, float sm_scale,
                 const OptArray& custom_mask, const OptArray& mask_indptr, const Array& out,
                 const OptArray& lse, uintptr_t stream) {
    check_planned(causal, window_left);
    PagedKV kv;
    kv.k = kv_view_of(k, "k_cache", kv_dtype, page_size);
    kv.v = kv_view_of(v, "v_cache", kv_dtype, page_size);
    kv.indptr = view_of(kv_indptr, "paged_kv_indptr");
    kv.indices = view_of(kv_indices, "paged_kv_indices");
    kv.last_page_len = view_of(last_page_len, "paged_kv_last_page_len");
    kv.page_size = page_size;
    kv.k_scale = k_scale;
    kv.v_scale = v_scale;
    const AttentionOptions opt =
        options(causal, window_left, logits_soft_cap, sm_scale, custom_mask, mask_indptr);
    const TensorView qv = view_of(q, "q"), ov = view_of(out, "out"), lv = view_of(lse, "lse");
    if (decode_) {
      nb::gil_scoped_release release;
      paged_decode(decode_plan_, qv, kv, opt, ov, lv, ws_, stream_of(stream));
    } else {
      const TensorView qo = view_of(qo_indptr, "qo_indptr");
      nb::gil_scoped_release release;
      paged_prefill(prefill_plan_, qv, qo, kv, opt, ov, lv, ws_, stream_of(stream));
    }
  }

  void run_ragged(const Array& q, const Array& k, const Array& v, const Array& qo_indptr,
                  const Array& kv_indptr, bool causal, int window_left, float logits_soft_cap,
                  float sm_scale, const OptArray& custom_mask, const OptArray& mask_indptr,
                  const Array& out, const OptArray& lse, uintptr_t stream) {
    check_planned(causal, window_left);
    FLASHKV_CHECK(!decode_,
                  "run: this plan is a decode plan; ragged attention needs a prefill plan");
    const AttentionOptions opt =
        options(causal, window_left, logits_soft_cap, sm_scale, custom_mask, mask_indptr);
    const TensorView qv = view_of(q, "q"), kv_k = view_of(k, "k"), kv_v = view_of(v, "v");
    const TensorView qo = view_of(qo_indptr, "qo_indptr"), kvp = view_of(kv_indptr, "kv_indptr");
    const TensorView ov = view_of(out, "out"), lv = view_of(lse, "lse");
    nb::gil_scoped_release release;
    ragged_prefill(prefill_plan_, qv, kv_k, kv_v, qo, kvp, opt, ov, lv, ws_, stream_of(stream));
  }

  const Plan& current() const {
    if (decode_) return decode_plan_;
    return prefill_plan_;
  }
  const Plan& checked() const {
    FLASHKV_CHECK(planned_, "plan: call plan() first");
    return current();
  }
  bool decode() const { return decode_; }
  bool planned() const { return planned_; }
  size_t workspace_bytes() const { return ws_.bytes(); }
  uintptr_t workspace_ptr() const { return reinterpret_cast<uintptr_t>(ws_.data()); }
  uintptr_t scratch_ptr() const {
    return planned_ ? reinterpret_cast<uintptr_t>(ws_.scratch(current())) : 0;
  }
  bool uses_caller_scratch() const {
    return planned_ && ext_scratch_ && scratch_ptr() >= reinterpret_cast<uintptr_t>(ext_scratch_) &&
           scratch_ptr() < reinterpret_cast<uintptr_t>(ext_scratch_) + ext_scratch_bytes_;
  }

 private:
  // The planner trimmed KV that the planned masks hide; a run may add masking, never remove it.
  void check_planned(bool causal, int window_left) const {
    FLASHKV_CHECK(planned_, "run: call plan() first");
    FLASHKV_CHECK(causal || !causal_, "run: causal=False, but the batch was planned with ",
                  "causal=True (the plan skips KV past each query); plan with causal=False");
    window_left = window_left < 0 ? -1 : window_left;
    FLASHKV_CHECK(window_left_ < 0 || (window_left >= 0 && window_left <= window_left_),
                  "run: window_left=", window_left,
                  ", but the batch was planned with window_left=", window_left_,
                  " (the plan skips KV outside that window); plan with the run's window");
  }

  AttentionOptions options(bool causal, int window_left, float logits_soft_cap, float sm_scale,
                           const OptArray& custom_mask, const OptArray& mask_indptr) const {
    AttentionOptions opt;
    opt.causal = causal;
    opt.window_left = window_left;
    opt.logits_soft_cap = logits_soft_cap;
    opt.sm_scale = sm_scale;
    opt.custom_mask = view_of(custom_mask, "custom_mask");
    opt.mask_indptr = view_of(mask_indptr, "mask_indptr");
    return opt;
  }

  Device device_;
  bool decode_ = false, planned_ = false, graph_fixed_ = false, causal_ = false;
  int window_left_ = -1;
  DecodePlan decode_plan_;
  PrefillPlan prefill_plan_;
  Workspace ws_;
  OptArray scratch_owner_;  // keeps the caller's buffer alive
  void* ext_scratch_ = nullptr;
  size_t ext_scratch_bytes_ = 0;
  Buffer own_scratch_;
};

}  // namespace

void bind_ops(nb::module_& m) {
  nb::class_<PyPlan>(m, "Plan",
                     "A planned batch: the work split, and the workspace its runs read it from.")
      .def(nb::init<const std::string&, const OptArray&>(), nb::arg("device"),
           nb::arg("float_workspace_buffer").none() = nb::none(),
           "Plans for `device` ('cpu', 'cuda:N'); partial states of split work go into "
           "`float_workspace_buffer` (uint8 [bytes], shared between plans) when it is large "
           "enough, else into memory the plan allocates.")
      .def("plan", &PyPlan::plan, nb::arg("decode"), nb::arg("kv_len"), nb::arg("qo_indptr").none(),
           nb::arg("num_qo_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim_qk"),
           nb::arg("head_dim_v"), nb::arg("page_size"), nb::arg("causal"), nb::arg("window_left"),
           nb::arg("enable_split_kv"), nb::arg("fixed_split_size"), nb::arg("cuda_graph"),
           nb::arg("max_batch_size"), nb::arg("max_num_tokens"), nb::arg("max_kv_len"),
           nb::arg("stream"),
           "Plans a batch from host arrays (kv_len int32 [B]; qo_indptr int32 [B + 1] for "
           "prefill, None for decode) and uploads the plan on `stream`.")
      .def("run_paged", &PyPlan::run_paged, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"),
           nb::arg("paged_kv_indptr"), nb::arg("paged_kv_indices"),
           nb::arg("paged_kv_last_page_len").none(), nb::arg("qo_indptr").none(),
           nb::arg("page_size"), nb::arg("k_scale"), nb::arg("v_scale"), nb::arg("kv_dtype"),
           nb::arg("causal"), nb::arg("window_left"), nb::arg("logits_soft_cap"),
           nb::arg("sm_scale"), nb::arg("custom_mask").none(), nb::arg("mask_indptr").none(),
           nb::arg("out"), nb::arg("lse").none(), nb::arg("stream"),
           "Paged decode (a decode plan) or paged prefill (a prefill plan) into out [T, Hq, Dv] "
           "and lse [T, Hq] (float32, base 2).")
      .def("run_ragged", &PyPlan::run_ragged, nb::arg("q"), nb::arg("k"), nb::arg("v"),
           nb::arg("qo_indptr"), nb::arg("kv_indptr"), nb::arg("causal"), nb::arg("window_left"),
           nb::arg("logits_soft_cap"), nb::arg("sm_scale"), nb::arg("custom_mask").none(),
           nb::arg("mask_indptr").none(), nb::arg("out"), nb::arg("lse").none(), nb::arg("stream"),
           "Ragged prefill: q [Tq, Hq, D] against k/v [Tk, Hkv, D] into out and lse.")
      .def_prop_ro("planned", &PyPlan::planned)
      .def_prop_ro("decode", &PyPlan::decode)
      .def_prop_ro("batch_size", [](const PyPlan& p) { return p.checked().batch_size; })
      .def_prop_ro("num_qo_tokens", [](const PyPlan& p) { return p.checked().num_qo_tokens; })
      .def_prop_ro("num_items", [](const PyPlan& p) { return p.checked().items.size(); })
      .def_prop_ro("num_merges", [](const PyPlan& p) { return p.checked().merges.size(); })
      .def_prop_ro("kv_chunk", [](const PyPlan& p) { return p.checked().kv_chunk; })
      .def_prop_ro("num_workers", [](const PyPlan& p) { return p.checked().num_workers; })
      .def_prop_ro(
          "equal_runs", [](const PyPlan& p) { return p.checked().equal_runs; },
          "Decode on CUDA: the batch's KV was cut into runs of equal cost, one a worker.")
      .def_prop_ro("cuda_graph", [](const PyPlan& p) { return p.checked().cuda_graph; })
      .def_prop_ro("workspace_bytes", &PyPlan::workspace_bytes)
      .def_prop_ro("workspace_ptr", &PyPlan::workspace_ptr)
      .def_prop_ro("scratch_ptr", &PyPlan::scratch_ptr)
      .def_prop_ro("uses_caller_scratch", &PyPlan::uses_caller_scratch,
                   "Whether split partial states go to the caller's float workspace buffer.");

  m.def(
      "merge_state",
      [](const Array& v_a, const Array& s_a, const Array& v_b, const Array& s_b, const Array& v_out,
         const OptArray& s_out, uintptr_t stream) {
        const TensorView a = view_of(v_a, "v_a"), la = view_of(s_a, "s_a");
        const TensorView b = view_of(v_b, "v_b"), lb = view_of(s_b, "s_b");
        const TensorView o = view_of(v_out, "v_out"), lo = view_of(s_out, "s_out");
        nb::gil_scoped_release release;
        merge_state(a, la, b, lb, o, lo, stream_of(stream));
      },
      nb::arg("v_a"), nb::arg("s_a"), nb::arg("v_b"), nb::arg("s_b"), nb::arg("v_out"),
      nb::arg("s_out").none(), nb::arg("stream"),
      "Merges two attention states: v [T, H, D], s [T, H] float32 (base-2 LSE).");
  m.def(
      "merge_states",
      [](const Array& v, const Array& s, const Array& v_out, const OptArray& s_out,
         uintptr_t stream) {
        const TensorView vv = view_of(v, "v"), sv = view_of(s, "s");
        const TensorView o = view_of(v_out, "v_out"), lo = view_of(s_out, "s_out");
        nb::gil_scoped_release release;
        merge_states(vv, sv, o, lo, stream_of(stream));
      },
      nb::arg("v"), nb::arg("s"), nb::arg("v_out"), nb::arg("s_out").none(), nb::arg("stream"),
      "Folds N states: v [T, N, H, D], s [T, N, H] -> v_out [T, H, D], s_out [T, H].");
  m.def(
      "append_kv",
      [](const Array& k_new, const Array& v_new, const Array& cache_loc, const Array& k_cache,
         const Array& v_cache, float k_scale, float v_scale, const std::string& kv_dtype,
         uintptr_t stream) {
        const TensorView kn = view_of(k_new, "append_key"), vn = view_of(v_new, "append_value");
        const TensorView loc = view_of(cache_loc, "cache_loc");
        const TensorView kc = kv_view_of(k_cache, "k_cache", kv_dtype, 0);
        const TensorView vc = kv_view_of(v_cache, "v_cache", kv_dtype, 0);
        nb::gil_scoped_release release;
        append_kv(kn, vn, loc, kc, vc, k_scale, v_scale, stream_of(stream));
      },
      nb::arg("k_new"), nb::arg("v_new"), nb::arg("cache_loc"), nb::arg("k_cache"),
      nb::arg("v_cache"), nb::arg("k_scale"), nb::arg("v_scale"), nb::arg("kv_dtype"),
      nb::arg("stream"),
      "k_cache[cache_loc[t]] = k_new[t] / k_scale (v likewise); caches [slots, Hkv, D] or NHD "
      "[pages, page_size, Hkv, D].");
  m.def(
      "build_kv_indices",
      [](const Array& req_to_token, const Array& req_pool_indices, const Array& lens,
         const OptArray& kv_start, const Array& kv_indptr, const Array& kv_indices,
         uintptr_t stream) {
        const TensorView r2t = view_of(req_to_token, "req_to_token");
        const TensorView rows = view_of(req_pool_indices, "req_pool_indices");
        const TensorView l = view_of(lens, "lens"), start = view_of(kv_start, "kv_start");
        const TensorView indptr = view_of(kv_indptr, "kv_indptr");
        const TensorView indices = view_of(kv_indices, "kv_indices");
        nb::gil_scoped_release release;
        build_kv_indices(r2t, rows, l, start, indptr, indices, stream_of(stream));
      },
      nb::arg("req_to_token"), nb::arg("req_pool_indices"), nb::arg("lens"),
      nb::arg("kv_start").none(), nb::arg("kv_indptr"), nb::arg("kv_indices"), nb::arg("stream"),
      "kv_indices[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j] for "
      "j < lens[i].");
}

}  // namespace flashkv::py
