// The serving layer for Python: pools, allocators, ForwardBatch, LayerSpec and FlashKVBackend.
// Arrays handed to a ForwardBatch are kept alive by it; pool memory is exported as DLPack arrays
// owned by the pool.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "flashkv/backend/flashkv_backend.h"
#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/kvcache/swa_allocator.h"
#include "flashkv/parallel/context_parallel.h"

namespace flashkv::py {
namespace {

// ForwardBatch plus the Python objects its views and pool pointers point into.
struct PyForwardBatch {
  ForwardBatch b;
  nb::object req_pool_indices, out_cache_loc, encoder_out_cache_loc, custom_mask;
  nb::object req_to_token_pool, token_to_kv_pool;
};

// A settable array field: stores the object (keep-alive) and its view.
template <nb::object PyForwardBatch::*Obj, TensorView* (*Field)(ForwardBatch&)>
void add_array_field(nb::class_<PyForwardBatch>& cls, const char* name, const char* doc) {
  cls.def_prop_rw(
      name, [](const PyForwardBatch& f) { return f.*Obj; },
      [name](PyForwardBatch& f, const nb::object& value) {
        if (value.is_none()) {
          *Field(f.b) = TensorView();
        } else {
          *Field(f.b) = view_of(nb::cast<Array>(value), name);
        }
        f.*Obj = value;
      },
      nb::arg("value").none(), doc);
}

TensorView* field_req_pool_indices(ForwardBatch& b) { return &b.req_pool_indices; }
TensorView* field_out_cache_loc(ForwardBatch& b) { return &b.out_cache_loc; }
TensorView* field_encoder_out_cache_loc(ForwardBatch& b) { return &b.encoder_out_cache_loc; }
TensorView* field_custom_mask(ForwardBatch& b) { return &b.spec.custom_mask; }

void bind_kvcache(nb::module_& m) {
  nb::class_<KVPool>(m, "KVPool",
                     "Per-layer K [num_slots + page_size, Hkv, D_qk] and V [.., D_v] memory; "
                     "page 0 (slot 0) is reserved for padding.")
      .def(
          "__init__",
          [](KVPool* self, int64_t num_slots, int page_size, int num_layers, int num_kv_heads,
             int head_dim_qk, int head_dim_v, const std::string& dtype, const std::string& device) {
            KVPoolConfig c;
            c.num_slots = num_slots;
            c.page_size = page_size;
            c.num_layers = num_layers;
            c.num_kv_heads = num_kv_heads;
            c.head_dim_qk = head_dim_qk;
            c.head_dim_v = head_dim_v;
            c.dtype = parse_dtype(dtype.c_str());
            c.device = parse_device(device);
            new (self) KVPool(c);
          },
          nb::arg("num_slots"), nb::arg("page_size") = 1, nb::arg("num_layers") = 1,
          nb::arg("num_kv_heads") = 1, nb::arg("head_dim_qk") = 128, nb::arg("head_dim_v") = 0,
          nb::arg("dtype") = "bf16", nb::arg("device") = "cpu")
      .def_prop_ro("page_size", &KVPool::page_size)
      .def_prop_ro("num_layers", &KVPool::num_layers)
      .def_prop_ro("num_kv_heads", &KVPool::num_kv_heads)
      .def_prop_ro("head_dim_qk", &KVPool::head_dim_qk)
      .def_prop_ro("head_dim_v", &KVPool::head_dim_v)
      .def_prop_ro("num_slots", &KVPool::num_slots)
      .def_prop_ro("num_rows", &KVPool::num_rows)
      .def_prop_ro("dtype", [](const KVPool& p) { return std::string(dtype_name(p.dtype())); })
      .def_prop_ro("device", [](const KVPool& p) { return p.device().str(); })
      .def_prop_ro("bytes", &KVPool::bytes)
      .def(
          "k_buffer",
          [](nb::handle self, int layer) {
            return export_view(nb::cast<const KVPool&>(self).k(layer), self);
          },
          nb::arg("layer"),
          "Layer `layer`'s K [num_rows, Hkv, D_qk] as a DLPack array (fp8: uint8).")
      .def(
          "v_buffer",
          [](nb::handle self, int layer) {
            return export_view(nb::cast<const KVPool&>(self).v(layer), self);
          },
          nb::arg("layer"),
          "Layer `layer`'s V [num_rows, Hkv, D_v] as a DLPack array (fp8: uint8).")
      .def("k_scale", &KVPool::k_scale, nb::arg("layer"))
      .def("v_scale", &KVPool::v_scale, nb::arg("layer"))
      .def("set_scales", &KVPool::set_scales, nb::arg("layer"), nb::arg("k_scale"),
           nb::arg("v_scale"));

  nb::class_<ReqToTokenPool>(m, "ReqToTokenPool",
                             "Rows of token slots per request: req_to_token int32 "
                             "[max_reqs, max_context_len].")
      .def(
          "__init__",
          [](ReqToTokenPool* self, int64_t max_reqs, int64_t max_context_len,
             const std::string& device) {
            new (self) ReqToTokenPool(max_reqs, max_context_len, parse_device(device));
          },
          nb::arg("max_reqs"), nb::arg("max_context_len"), nb::arg("device") = "cpu")
      .def_prop_ro("max_reqs", &ReqToTokenPool::max_reqs)
      .def_prop_ro("max_context_len", &ReqToTokenPool::max_context_len)
      .def_prop_ro("num_free", &ReqToTokenPool::num_free)
      .def_prop_ro("device", [](const ReqToTokenPool& p) { return p.device().str(); })
      .def_prop_ro(
          "req_to_token",
          [](nb::handle self) {
            return export_view(nb::cast<const ReqToTokenPool&>(self).req_to_token(), self);
          },
          "int32 [max_reqs, max_context_len] as a DLPack array.")
      .def("alloc", &ReqToTokenPool::alloc, nb::arg("n"),
           "`n` free rows, or None when fewer are free.")
      .def("free", &ReqToTokenPool::free, nb::arg("rows"))
      .def(
          "write",
          [](ReqToTokenPool& p, int32_t row, int64_t start, const std::vector<int32_t>& slots) {
            p.write(row, start, slots);
          },
          nb::arg("row"), nb::arg("start"), nb::arg("slots"))
      .def(
          "read",
          [](const ReqToTokenPool& p, int32_t row, int64_t start, int64_t n) {
            return p.read(row, start, n);
          },
          nb::arg("row"), nb::arg("start"), nb::arg("n"));

  nb::class_<KVAllocator>(m, "KVAllocator", "Slot allocator of a KV pool (host-side free lists).")
      .def_prop_ro("page_size", &KVAllocator::page_size)
      .def_prop_ro("capacity", &KVAllocator::capacity)
      .def_prop_ro("num_free", &KVAllocator::num_free)
      .def("is_live", &KVAllocator::is_live, nb::arg("slot"))
      .def("alloc", &KVAllocator::alloc, nb::arg("n"),
           "Slots for a new request of `n` tokens, or None when out of memory.")
      .def(
          "alloc_extend",
          [](KVAllocator& a, const std::vector<std::tuple<int64_t, int32_t, int64_t>>& reqs) {
            std::vector<ExtendRequest> r;
            r.reserve(reqs.size());
            for (const auto& [prefix_len, last_slot, num_new] : reqs)
              r.push_back(ExtendRequest{prefix_len, last_slot, num_new});
            return a.alloc_extend(r);
          },
          nb::arg("requests"),
          "Slots for every request's new tokens, given (prefix_len, last_slot, num_new) per "
          "request, all or nothing (None when out of memory).")
      .def("free", &KVAllocator::free, nb::arg("slots"))
      .def("reset", &KVAllocator::reset);
  nb::class_<PagedAllocator, KVAllocator>(
      m, "PagedAllocator", "Page-granular slot allocator (pages 1.., page 0 reserved).")
      .def(nb::init<int64_t, int>(), nb::arg("num_slots"), nb::arg("page_size"));
  nb::class_<TokenAllocator, PagedAllocator>(m, "TokenAllocator",
                                             "Token-granular slot allocator (slots 1..num_slots).")
      .def(nb::init<int64_t>(), nb::arg("num_slots"));
  nb::class_<SWAAllocator, KVAllocator>(m, "SWAAllocator",
                                        "Full + sliding-window slots, with the full-to-SWA table.")
      .def(
          "__init__",
          [](SWAAllocator* self, int64_t num_full_slots, int64_t num_swa_slots, int page_size,
             const std::string& device) {
            new (self) SWAAllocator(num_full_slots, num_swa_slots, page_size, parse_device(device));
          },
          nb::arg("num_full_slots"), nb::arg("num_swa_slots"), nb::arg("page_size") = 1,
          nb::arg("device") = "cpu")
      .def("free_swa", &SWAAllocator::free_swa, nb::arg("full_slots"))
      .def("translate_full_to_swa",
           nb::overload_cast<const std::vector<int32_t>&>(&SWAAllocator::translate_full_to_swa,
                                                          nb::const_),
           nb::arg("full_slots"));
}

void bind_batch(nb::module_& m) {
  nb::enum_<ForwardMode>(m, "ForwardMode", "What a forward pass runs (SGLang's ForwardMode).")
      .value("EXTEND", ForwardMode::EXTEND)
      .value("DECODE", ForwardMode::DECODE)
      .value("MIXED", ForwardMode::MIXED)
      .value("IDLE", ForwardMode::IDLE)
      .value("TARGET_VERIFY", ForwardMode::TARGET_VERIFY)
      .value("DRAFT_EXTEND", ForwardMode::DRAFT_EXTEND);
  nb::enum_<AttentionType>(m, "AttentionType",
                           "Decoder (causal) or encoder-only (bidirectional) attention.")
      .value("DECODER", AttentionType::DECODER)
      .value("ENCODER_ONLY", AttentionType::ENCODER_ONLY);

  // dynamic_attr: `sinks` (an array, as SGLang's RadixAttention holds it) is a Python attribute
  // of the layer; FlashKVBackend.forward hands it to _forward, which keeps it alive for the call.
  nb::class_<LayerSpec>(m, "LayerSpec",
                        "One attention layer as the model declares it; set `sinks` (float32 "
                        "[num_qo_heads]) on it for attention sinks.",
                        nb::dynamic_attr())
      .def(
          "__init__",
          [](LayerSpec* self, int layer_id, int num_qo_heads, int num_kv_heads, int head_dim_qk,
             int head_dim_v, float scaling, float logit_cap, int sliding_window_size,
             bool is_cross_attention, AttentionType attn_type) {
            new (self) LayerSpec{
                layer_id, num_qo_heads, num_kv_heads,        head_dim_qk,        head_dim_v,
                scaling,  logit_cap,    sliding_window_size, is_cross_attention, attn_type};
          },
          nb::arg("layer_id") = 0, nb::arg("num_qo_heads") = 0, nb::arg("num_kv_heads") = 0,
          nb::arg("head_dim_qk") = 0, nb::arg("head_dim_v") = 0, nb::arg("scaling") = 0.0f,
          nb::arg("logit_cap") = 0.0f, nb::arg("sliding_window_size") = -1,
          nb::arg("is_cross_attention") = false, nb::arg("attn_type") = AttentionType::DECODER)
      .def_rw("layer_id", &LayerSpec::layer_id)
      .def_rw("num_qo_heads", &LayerSpec::num_qo_heads)
      .def_rw("num_kv_heads", &LayerSpec::num_kv_heads)
      .def_rw("head_dim_qk", &LayerSpec::head_dim_qk)
      .def_rw("head_dim_v", &LayerSpec::head_dim_v)
      .def_rw("scaling", &LayerSpec::scaling)
      .def_rw("logit_cap", &LayerSpec::logit_cap)
      .def_rw("sliding_window_size", &LayerSpec::sliding_window_size)
      .def_rw("is_cross_attention", &LayerSpec::is_cross_attention)
      .def_rw("attn_type", &LayerSpec::attn_type);

  auto fb = nb::class_<PyForwardBatch>(m, "ForwardBatch",
                                       "What the backend needs of a forward batch (SGLang's "
                                       "field names); arrays are kept alive by the batch.");
  fb.def(nb::init<>())
      .def_prop_rw(
          "forward_mode", [](const PyForwardBatch& f) { return f.b.mode; },
          [](PyForwardBatch& f, ForwardMode m) { f.b.mode = m; })
      .def_prop_rw(
          "batch_size", [](const PyForwardBatch& f) { return f.b.batch_size; },
          [](PyForwardBatch& f, int32_t n) { f.b.batch_size = n; })
      .def_prop_rw(
          "seq_lens_cpu", [](const PyForwardBatch& f) { return f.b.seq_lens_cpu; },
          [](PyForwardBatch& f, std::vector<int32_t> v) { f.b.seq_lens_cpu = std::move(v); })
      .def_prop_rw(
          "extend_prefix_lens_cpu",
          [](const PyForwardBatch& f) { return f.b.extend_prefix_lens_cpu; },
          [](PyForwardBatch& f, std::vector<int32_t> v) {
            f.b.extend_prefix_lens_cpu = std::move(v);
          })
      .def_prop_rw(
          "extend_seq_lens_cpu", [](const PyForwardBatch& f) { return f.b.extend_seq_lens_cpu; },
          [](PyForwardBatch& f, std::vector<int32_t> v) { f.b.extend_seq_lens_cpu = std::move(v); })
      .def_prop_rw(
          "encoder_lens_cpu", [](const PyForwardBatch& f) { return f.b.encoder_lens_cpu; },
          [](PyForwardBatch& f, std::vector<int32_t> v) { f.b.encoder_lens_cpu = std::move(v); })
      .def_prop_rw(
          "draft_token_num", [](const PyForwardBatch& f) { return f.b.spec.draft_token_num; },
          [](PyForwardBatch& f, int32_t n) { f.b.spec.draft_token_num = n; })
      .def_prop_rw(
          "accept_length_cpu", [](const PyForwardBatch& f) { return f.b.spec.accept_length_cpu; },
          [](PyForwardBatch& f, std::vector<int32_t> v) {
            f.b.spec.accept_length_cpu = std::move(v);
          })
      .def_prop_rw(
          "req_to_token_pool", [](const PyForwardBatch& f) { return f.req_to_token_pool; },
          [](PyForwardBatch& f, const nb::object& p) {
            f.b.req_to_token_pool = p.is_none() ? nullptr : nb::cast<ReqToTokenPool*>(p);
            f.req_to_token_pool = p;
          },
          nb::arg("value").none())
      .def_prop_rw(
          "token_to_kv_pool", [](const PyForwardBatch& f) { return f.token_to_kv_pool; },
          [](PyForwardBatch& f, const nb::object& p) {
            f.b.token_to_kv_pool = p.is_none() ? nullptr : nb::cast<KVPool*>(p);
            f.token_to_kv_pool = p;
          },
          nb::arg("value").none())
      .def_prop_ro("num_tokens", [](const PyForwardBatch& f) { return f.b.num_tokens(); });
  add_array_field<&PyForwardBatch::req_pool_indices, field_req_pool_indices>(
      fb, "req_pool_indices", "int32 [B] on the batch's device: each request's req_to_token row.");
  add_array_field<&PyForwardBatch::out_cache_loc, field_out_cache_loc>(
      fb, "out_cache_loc", "int32 [num_tokens] on the device: the KV slot of each new token.");
  add_array_field<&PyForwardBatch::encoder_out_cache_loc, field_encoder_out_cache_loc>(
      fb, "encoder_out_cache_loc", "int32 [sum encoder_lens]: KV slots of encoder tokens.");
  add_array_field<&PyForwardBatch::custom_mask, field_custom_mask>(
      fb, "custom_mask",
      "TARGET_VERIFY tree mask: uint8/bool, request i's [draft_token_num, seq_lens[i]] matrix "
      "after the previous requests'.");
}

void bind_flashkv_backend(nb::module_& m) {
  nb::class_<FlashKVBackend>(m, "FlashKVBackend",
                             "SGLang's FlashInfer attention backend over flashkv: plan once per "
                             "forward batch, attend once per layer.")
      .def(
          "__init__",
          [](FlashKVBackend* self, int num_qo_heads, int num_kv_heads, int head_dim_qk,
             int head_dim_v, const std::string& q_dtype, const std::string& device,
             int sliding_window_size, bool is_encoder_decoder, bool is_multimodal,
             bool has_encoder_only_layers, KVPool* swa_kv_pool, SWAAllocator* swa_allocator,
             bool deterministic, int decode_split_size, int prefill_split_size,
             bool disable_split_kv, std::optional<bool> use_tensor_cores,
             parallel::Communicator* cp_comm, const parallel::CpOptions* cp,
             const std::string& extend_path) {
            BackendOptions o;
            o.device = parse_device(device);
            o.q_dtype = parse_dtype(q_dtype.c_str());
            o.num_qo_heads = num_qo_heads;
            o.num_kv_heads = num_kv_heads;
            o.head_dim_qk = head_dim_qk;
            o.head_dim_v = head_dim_v;
            o.sliding_window_size = sliding_window_size;
            o.is_encoder_decoder = is_encoder_decoder;
            o.is_multimodal = is_multimodal;
            o.has_encoder_only_layers = has_encoder_only_layers;
            o.swa_kv_pool = swa_kv_pool;
            o.swa_allocator = swa_allocator;
            o.deterministic = deterministic;
            o.decode_split_size = decode_split_size;
            o.prefill_split_size = prefill_split_size;
            o.disable_split_kv = disable_split_kv;
            o.use_tensor_cores = use_tensor_cores;
            o.extend_path = parse_extend_path(extend_path);
            o.cp_comm = cp_comm;
            if (cp) o.cp = *cp;
            new (self) FlashKVBackend(o);
          },
          nb::arg("num_qo_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim_qk"),
          nb::arg("head_dim_v") = 0, nb::arg("q_dtype") = "bf16", nb::arg("device") = "cpu",
          nb::arg("sliding_window_size") = -1, nb::arg("is_encoder_decoder") = false,
          nb::arg("is_multimodal") = false, nb::arg("has_encoder_only_layers") = false,
          nb::arg("swa_kv_pool").none() = nb::none(), nb::arg("swa_allocator").none() = nb::none(),
          nb::arg("deterministic") = false, nb::arg("decode_split_size") = 2048,
          nb::arg("prefill_split_size") = 4096, nb::arg("disable_split_kv") = false,
          nb::arg("use_tensor_cores").none() = nb::none(), nb::arg("cp_comm").none() = nb::none(),
          nb::arg("cp").none() = nb::none(), nb::arg("extend_path") = "auto",
          // The SWA pool and allocator, and the communicator, must outlive the backend.
          nb::keep_alive<1, 12>(), nb::keep_alive<1, 13>(), nb::keep_alive<1, 19>())
      .def(
          "init_forward_metadata",
          [](FlashKVBackend& be, const PyForwardBatch& f) { be.init_forward_metadata(f.b); },
          nb::arg("forward_batch"))
      .def(
          "_forward",
          [](FlashKVBackend& be, const Array& q, const OptArray& k, const OptArray& v,
             const LayerSpec& layer, const PyForwardBatch& f, bool save_kv_cache, const Array& out,
             const OptArray& sinks) {
            const TensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
            const TensorView ov = view_of(out, "out");
            LayerSpec with_sinks = layer;
            with_sinks.sinks = view_of(sinks, "sinks");
            be.forward(qv, kv, vv, with_sinks, f.b, save_kv_cache, ov);
          },
          nb::kw_only(), nb::arg("q"), nb::arg("k").none(), nb::arg("v").none(), nb::arg("layer"),
          nb::arg("forward_batch"), nb::arg("save_kv_cache"), nb::arg("out"),
          nb::arg("sinks").none() = nb::none(),
          "One layer into `out` [T, Hq * D_v] (or [T, Hq, D_v]); sinks: float32 [Hq] or None.")
      .def("init_cuda_graph_state", &FlashKVBackend::init_cuda_graph_state, nb::arg("max_bs"),
           nb::arg("max_num_tokens"))
      .def(
          "init_forward_metadata_capture_cuda_graph",
          [](FlashKVBackend& be, const PyForwardBatch& f) {
            be.init_forward_metadata_capture_cuda_graph(f.b);
          },
          nb::arg("forward_batch"))
      .def(
          "init_forward_metadata_replay_cuda_graph",
          [](FlashKVBackend& be, const PyForwardBatch& f) {
            be.init_forward_metadata_replay_cuda_graph(f.b);
          },
          nb::arg("forward_batch"))
      .def("get_cuda_graph_seq_len_fill_value", &FlashKVBackend::cuda_graph_seq_len_fill_value)
      .def_prop_ro("num_wrappers", &FlashKVBackend::num_wrappers)
      .def_prop_ro("uses_ragged", &FlashKVBackend::uses_ragged)
      .def_prop_ro("extend_without_prefix", &FlashKVBackend::extend_without_prefix)
      .def_prop_ro("decode_uses_prefill_kernel", &FlashKVBackend::decode_uses_prefill_kernel);
}

}  // namespace

void bind_backend(nb::module_& m) {
  bind_kvcache(m);
  bind_batch(m);
  bind_flashkv_backend(m);
}

}  // namespace flashkv::py
