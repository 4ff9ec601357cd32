// The operators for Python: the planner's and the operators' option structs (BatchShape,
// PlanOptions, AttentionOptions) as classes with named fields, a Plan object (planner +
// workspace, the host half of FlashInfer's plan/run split) with the runs that use it, and the
// stateless operators (merges, KV writes). Calls that take more than a few arguments take them
// by keyword only, so that every call site names what it passes.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <utility>

#include "bind.h"
#include "flashkv/ops/attention.h"
#include "flashkv/ops/kv_ops.h"

namespace flashkv::py {
namespace {

// An array field of a struct bound for Python: the object Python set (what the getter returns),
// the array read from it (it keeps the memory of a consumed DLPack capsule alive) and the view
// the C++ struct points into.
struct ArrayField {
  nb::object object = nb::none();
  OptArray array;
  TensorView view;
};

// Sets `field` from `value` (an array, or None to clear it). `check` validates a given array
// before the field takes it, so that a failed set leaves the field as it was.
template <class Check>
void set_array(ArrayField& field, const nb::object& value, const char* name, Check check) {
  OptArray array;
  if (!value.is_none()) {
    Array a;
    FLASHKV_CHECK(nb::try_cast(value, a), name, ": expected an array (DLPack) or None, got ",
                  nb::type_name(value.type()).c_str());
    array = std::move(a);
  }
  const TensorView view = view_of(array, name);
  if (view.defined()) check(view);
  field.object = value;
  field.array = std::move(array);
  field.view = view;
}

void no_check(const TensorView&) {}

// The planner reads these arrays on the host, as int32 [n] without strides.
void check_host_i32(const TensorView& t, const char* name) {
  Expect(t, name).ndim(1).on_host().dtype(DType::i32).contiguous();
}

// BatchShape for Python: the C++ struct, with its pointers into the arrays Python set. The
// batch size is kv_len's length.
struct PyBatchShape {
  BatchShape shape;
  ArrayField kv_len, qo_indptr;

  void set_kv_len(const nb::object& value) {
    set_array(kv_len, value, "kv_len", [](const TensorView& t) { check_host_i32(t, "kv_len"); });
    shape.kv_len = static_cast<const int32_t*>(kv_len.view.data);
    shape.batch_size = kv_len.view.defined() ? static_cast<int32_t>(kv_len.view.shape[0]) : 0;
  }
  void set_qo_indptr(const nb::object& value) {
    set_array(qo_indptr, value, "qo_indptr",
              [](const TensorView& t) { check_host_i32(t, "qo_indptr"); });
    shape.qo_indptr = static_cast<const int32_t*>(qo_indptr.view.data);
  }
};

// AttentionOptions for Python: the C++ struct, with its views of the mask arrays Python set.
// The operator checks the fields (the masks against the run's device and batch) when it runs.
struct PyAttentionOptions {
  AttentionOptions opt;
  ArrayField custom_mask, mask_indptr, sinks;

  void set_sinks(const nb::object& value) {
    set_array(sinks, value, "sinks", no_check);
    opt.sinks = sinks.view;
  }
  void set_custom_mask(const nb::object& value) {
    set_array(custom_mask, value, "custom_mask", no_check);
    opt.custom_mask = custom_mask.view;
  }
  void set_mask_indptr(const nb::object& value) {
    set_array(mask_indptr, value, "mask_indptr", no_check);
    opt.mask_indptr = mask_indptr.view;
  }
};

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

  void plan(bool decode, const PyBatchShape& batch, const PlanOptions& po, uintptr_t stream) {
    // Copies: while the GIL is released, another thread may change `batch`; these keep the
    // arrays alive and the shape as it was.
    const BatchShape shape = batch.shape;
    const OptArray kv_len = batch.kv_len.array, qo_indptr = batch.qo_indptr.array;
    if (decode) {
      FLASHKV_CHECK(!batch.qo_indptr.view.defined(), "qo_indptr: a decode batch has one query ",
                    "row per request; expected None");
    } else if (batch.qo_indptr.view.defined()) {
      Expect(batch.qo_indptr.view, "qo_indptr").dim(0, int64_t{shape.batch_size} + 1);
    }
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
    if (po.cuda_graph && graph_fixed_) {
      // A captured graph reads the plan and the partial states at these addresses.
      FLASHKV_CHECK(ws_.data() == ws_before && ws_.scratch(p) == scratch_before,
                    "plan: the CUDA-graph workspace would move (the batch needs more than the ",
                    "first plan of this wrapper sized)");
    }
    ws_.upload(p, stream_of(stream));
    graph_fixed_ = po.cuda_graph;
    causal_ = shape.causal;
    window_left_ = normalize_window_left(shape.window_left);
    planned_ = true;
  }

  void run_paged(const Array& q, const Array& k, const Array& v, const Array& kv_indptr,
                 const Array& kv_indices, const OptArray& last_page_len, const OptArray& qo_indptr,
                 int page_size, float k_scale, float v_scale, const std::string& kv_dtype,
                 const PyAttentionOptions& options, const Array& out, const OptArray& lse,
                 uintptr_t stream) {
    const AttentionOptions opt = options.opt;  // copies, as in plan()
    const OptArray mask = options.custom_mask.array, mask_indptr = options.mask_indptr.array,
                   sinks = options.sinks.array;
    check_planned(opt.causal, opt.window_left);
    const PagedKV kv = paged_kv_of(k, v, kv_indptr, kv_indices, last_page_len, page_size, k_scale,
                                   v_scale, kv_dtype);
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
                  const Array& kv_indptr, const PyAttentionOptions& options, const Array& out,
                  const OptArray& lse, uintptr_t stream) {
    const AttentionOptions opt = options.opt;  // copies, as in plan()
    const OptArray mask = options.custom_mask.array, mask_indptr = options.mask_indptr.array,
                   sinks = options.sinks.array;
    check_planned(opt.causal, opt.window_left);
    FLASHKV_CHECK(!decode_,
                  "run: this plan is a decode plan; ragged attention needs a prefill plan");
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
    window_left = normalize_window_left(window_left);
    FLASHKV_CHECK(window_left_ < 0 || (window_left >= 0 && window_left <= window_left_),
                  "run: window_left=", window_left,
                  ", but the batch was planned with window_left=", window_left_,
                  " (the plan skips KV outside that window); plan with the run's window");
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

// The option structs, registered first: Plan's methods take them.
void bind_structs(nb::module_& m) {
  const BatchShape bs;
  nb::class_<PyBatchShape>(m, "BatchShape",
                           "The batch as the planner sees it: host int32 arrays and the problem "
                           "shape. batch_size is kv_len's length.")
      .def(
          "__init__",
          [](PyBatchShape* self, const nb::object& kv_len, const nb::object& qo_indptr,
             int32_t num_qo_heads, int32_t num_kv_heads, int32_t head_dim_qk, int32_t head_dim_v,
             int32_t page_size, bool causal, int32_t window_left) {
            new (self) PyBatchShape();
            self->set_kv_len(kv_len);
            self->set_qo_indptr(qo_indptr);
            BatchShape& s = self->shape;
            s.num_qo_heads = num_qo_heads;
            s.num_kv_heads = num_kv_heads;
            s.head_dim_qk = head_dim_qk;
            s.head_dim_v = head_dim_v;
            s.page_size = page_size;
            s.causal = causal;
            s.window_left = window_left;
          },
          nb::kw_only(), nb::arg("kv_len").none() = nb::none(),
          nb::arg("qo_indptr").none() = nb::none(), nb::arg("num_qo_heads") = bs.num_qo_heads,
          nb::arg("num_kv_heads") = bs.num_kv_heads, nb::arg("head_dim_qk") = bs.head_dim_qk,
          nb::arg("head_dim_v") = bs.head_dim_v, nb::arg("page_size") = bs.page_size,
          nb::arg("causal") = bs.causal, nb::arg("window_left") = bs.window_left)
      .def_prop_rw(
          "kv_len", [](const PyBatchShape& b) { return b.kv_len.object; },
          [](PyBatchShape& b, const nb::object& v) { b.set_kv_len(v); }, nb::arg("value").none(),
          "int32 [batch_size] on the host: KV tokens of each request.")
      .def_prop_rw(
          "qo_indptr", [](const PyBatchShape& b) { return b.qo_indptr.object; },
          [](PyBatchShape& b, const nb::object& v) { b.set_qo_indptr(v); }, nb::arg("value").none(),
          "int32 [batch_size + 1] on the host: request i owns query rows "
          "qo_indptr[i]:qo_indptr[i+1]. None for decode (one row a request).")
      .def_prop_ro(
          "batch_size", [](const PyBatchShape& b) { return b.shape.batch_size; },
          "Requests in the batch (kv_len's length).")
      .def_prop_rw(
          "num_qo_heads", [](const PyBatchShape& b) { return b.shape.num_qo_heads; },
          [](PyBatchShape& b, int32_t v) { b.shape.num_qo_heads = v; })
      .def_prop_rw(
          "num_kv_heads", [](const PyBatchShape& b) { return b.shape.num_kv_heads; },
          [](PyBatchShape& b, int32_t v) { b.shape.num_kv_heads = v; })
      .def_prop_rw(
          "head_dim_qk", [](const PyBatchShape& b) { return b.shape.head_dim_qk; },
          [](PyBatchShape& b, int32_t v) { b.shape.head_dim_qk = v; })
      .def_prop_rw(
          "head_dim_v", [](const PyBatchShape& b) { return b.shape.head_dim_v; },
          [](PyBatchShape& b, int32_t v) { b.shape.head_dim_v = v; })
      .def_prop_rw(
          "page_size", [](const PyBatchShape& b) { return b.shape.page_size; },
          [](PyBatchShape& b, int32_t v) { b.shape.page_size = v; })
      .def_prop_rw(
          "causal", [](const PyBatchShape& b) { return b.shape.causal; },
          [](PyBatchShape& b, bool v) { b.shape.causal = v; },
          "The runs apply a causal mask, so the planner may skip KV past each tile's last row.")
      .def_prop_rw(
          "window_left", [](const PyBatchShape& b) { return b.shape.window_left; },
          [](PyBatchShape& b, int32_t v) { b.shape.window_left = v; },
          "The runs' sliding window (< 0: none), so the planner may skip KV before it.");

  const PlanOptions po;
  nb::class_<PlanOptions>(m, "PlanOptions", "How the planner splits a batch's work.")
      .def(
          "__init__",
          [](PlanOptions* self, int32_t q_tile, bool enable_split_kv, int32_t fixed_split_size,
             int32_t kv_align, bool cuda_graph, int32_t max_batch_size, int32_t max_num_tokens,
             int32_t max_kv_len, int32_t blocks_per_sm, int32_t min_split_size) {
            PlanOptions* o = new (self) PlanOptions();
            o->q_tile = q_tile;
            o->enable_split_kv = enable_split_kv;
            o->fixed_split_size = fixed_split_size;
            o->kv_align = kv_align;
            o->cuda_graph = cuda_graph;
            o->max_batch_size = max_batch_size;
            o->max_num_tokens = max_num_tokens;
            o->max_kv_len = max_kv_len;
            o->blocks_per_sm = blocks_per_sm;
            o->min_split_size = min_split_size;
          },
          nb::kw_only(), nb::arg("q_tile") = po.q_tile,
          nb::arg("enable_split_kv") = po.enable_split_kv,
          nb::arg("fixed_split_size") = po.fixed_split_size, nb::arg("kv_align") = po.kv_align,
          nb::arg("cuda_graph") = po.cuda_graph, nb::arg("max_batch_size") = po.max_batch_size,
          nb::arg("max_num_tokens") = po.max_num_tokens, nb::arg("max_kv_len") = po.max_kv_len,
          nb::arg("blocks_per_sm") = po.blocks_per_sm,
          nb::arg("min_split_size") = po.min_split_size)
      .def_rw("q_tile", &PlanOptions::q_tile,
              "Query rows per prefill item (0: the device's default tile).")
      .def_rw("enable_split_kv", &PlanOptions::enable_split_kv,
              "Cut a long tile's KV into chunks merged afterwards (False: never split).")
      .def_rw("fixed_split_size", &PlanOptions::fixed_split_size,
              "> 0: deterministic mode, every request's KV cut at multiples of this many tokens.")
      .def_rw("kv_align", &PlanOptions::kv_align,
              "Chunk boundaries are multiples of this (0: 16 tokens), rounded up to whole pages.")
      .def_rw("cuda_graph", &PlanOptions::cuda_graph,
              "CUDA-graph mode: capacities fixed at capture, the same layout for every plan.")
      .def_rw("max_batch_size", &PlanOptions::max_batch_size, "Graph mode capacity (requests).")
      .def_rw("max_num_tokens", &PlanOptions::max_num_tokens, "Graph mode capacity (query rows).")
      .def_rw("max_kv_len", &PlanOptions::max_kv_len,
              "Graph mode with fixed_split_size: the longest request's KV.")
      .def_rw("blocks_per_sm", &PlanOptions::blocks_per_sm,
              "CUDA: workers an SM (0: 2, and prefill rounds up to whole waves of CTAs).")
      .def_rw("min_split_size", &PlanOptions::min_split_size,
              "Shortest KV chunk an automatic split makes (0: the planner's default).");

  const AttentionOptions ao;
  nb::class_<PyAttentionOptions>(m, "AttentionOptions",
                                 "The masks and scales of one attention run.")
      .def(
          "__init__",
          [](PyAttentionOptions* self, bool causal, int window_left, float logits_soft_cap,
             float sm_scale, const nb::object& custom_mask, const nb::object& mask_indptr,
             const nb::object& sinks) {
            new (self) PyAttentionOptions();
            self->opt.causal = causal;
            self->opt.window_left = window_left;
            self->opt.logits_soft_cap = logits_soft_cap;
            self->opt.sm_scale = sm_scale;
            self->set_custom_mask(custom_mask);
            self->set_mask_indptr(mask_indptr);
            self->set_sinks(sinks);
          },
          nb::kw_only(), nb::arg("causal") = ao.causal, nb::arg("window_left") = ao.window_left,
          nb::arg("logits_soft_cap") = ao.logits_soft_cap, nb::arg("sm_scale") = ao.sm_scale,
          nb::arg("custom_mask").none() = nb::none(), nb::arg("mask_indptr").none() = nb::none(),
          nb::arg("sinks").none() = nb::none())
      .def_prop_rw(
          "causal", [](const PyAttentionOptions& o) { return o.opt.causal; },
          [](PyAttentionOptions& o, bool v) { o.opt.causal = v; },
          "Causal mask, aligned to the end of each request's KV (ignored with a custom mask).")
      .def_prop_rw(
          "window_left", [](const PyAttentionOptions& o) { return o.opt.window_left; },
          [](PyAttentionOptions& o, int v) { o.opt.window_left = v; },
          "< 0: no window; else key j is visible to the row at position p iff j >= p - "
          "window_left.")
      .def_prop_rw(
          "logits_soft_cap", [](const PyAttentionOptions& o) { return o.opt.logits_soft_cap; },
          [](PyAttentionOptions& o, float v) { o.opt.logits_soft_cap = v; },
          "> 0: logits become cap * tanh(logits / cap); 0: off.")
      .def_prop_rw(
          "sm_scale", [](const PyAttentionOptions& o) { return o.opt.sm_scale; },
          [](PyAttentionOptions& o, float v) { o.opt.sm_scale = v; },
          "Softmax scale (0: 1 / sqrt(head_dim_qk)).")
      .def_prop_rw(
          "custom_mask", [](const PyAttentionOptions& o) { return o.custom_mask.object; },
          [](PyAttentionOptions& o, const nb::object& v) { o.set_custom_mask(v); },
          nb::arg("value").none(),
          "uint8/bool: request i's [qo_len, kv_len] matrix at element offset mask_indptr[i]; "
          "replaces causal.")
      .def_prop_rw(
          "mask_indptr", [](const PyAttentionOptions& o) { return o.mask_indptr.object; },
          [](PyAttentionOptions& o, const nb::object& v) { o.set_mask_indptr(v); },
          nb::arg("value").none(), "int32 [batch_size + 1]: where each request's mask starts.")
      .def_prop_rw(
          "sinks", [](const PyAttentionOptions& o) { return o.sinks.object; },
          [](PyAttentionOptions& o, const nb::object& v) { o.set_sinks(v); },
          nb::arg("value").none(),
          "float32 [num_qo_heads] on q's device, or None: one natural-log logit per query head "
          "that joins the softmax denominator with no value (attention sinks); the LSE includes "
          "it. CPU only for now.");
}

}  // namespace

void bind_ops(nb::module_& m) {
  bind_structs(m);
  nb::class_<PyPlan>(m, "Plan",
                     "A planned batch: the work split, and the workspace its runs read it from.")
      .def(nb::init<const std::string&, const OptArray&>(), nb::arg("device"),
           nb::arg("float_workspace_buffer").none() = nb::none(),
           "Plans for `device` ('cpu', 'cuda:N'); partial states of split work go into "
           "`float_workspace_buffer` (uint8 [bytes], shared between plans) when it is large "
           "enough, else into memory the plan allocates.")
      .def("plan", &PyPlan::plan, nb::kw_only(), nb::arg("decode"), nb::arg("batch"),
           nb::arg("options"), nb::arg("stream"),
           "Plans `batch` (a decode batch: qo_indptr None, one query row a request) with "
           "`options` and uploads the plan on `stream`.")
      .def("run_paged", &PyPlan::run_paged, nb::kw_only(), nb::arg("q"), nb::arg("k_cache"),
           nb::arg("v_cache"), nb::arg("paged_kv_indptr"), nb::arg("paged_kv_indices"),
           nb::arg("paged_kv_last_page_len").none(), nb::arg("qo_indptr").none(),
           nb::arg("page_size"), nb::arg("k_scale"), nb::arg("v_scale"), nb::arg("kv_dtype"),
           nb::arg("options"), nb::arg("out"), nb::arg("lse").none(), nb::arg("stream"),
           "Paged decode (a decode plan) or paged prefill (a prefill plan) into out [T, Hq, Dv] "
           "and lse [T, Hq] (float32, base 2).")
      .def("run_ragged", &PyPlan::run_ragged, nb::kw_only(), nb::arg("q"), nb::arg("k"),
           nb::arg("v"), nb::arg("qo_indptr"), nb::arg("kv_indptr"), nb::arg("options"),
           nb::arg("out"), nb::arg("lse").none(), nb::arg("stream"),
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
      nb::kw_only(), nb::arg("v_a"), nb::arg("s_a"), nb::arg("v_b"), nb::arg("s_b"),
      nb::arg("v_out"), nb::arg("s_out").none(), nb::arg("stream"),
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
      nb::kw_only(), nb::arg("v"), nb::arg("s"), nb::arg("v_out"), nb::arg("s_out").none(),
      nb::arg("stream"),
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
      nb::kw_only(), nb::arg("k_new"), nb::arg("v_new"), nb::arg("cache_loc"), nb::arg("k_cache"),
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
      nb::kw_only(), nb::arg("req_to_token"), nb::arg("req_pool_indices"), nb::arg("lens"),
      nb::arg("kv_start").none(), nb::arg("kv_indptr"), nb::arg("kv_indices"), nb::arg("stream"),
      "kv_indices[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j] for "
      "j < lens[i].");
}

}  // namespace flashkv::py
