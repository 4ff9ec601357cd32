#include "flashkv/backend/flashkv_backend.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "backend_detail.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/kvcache/swa_allocator.h"
#include "flashkv/ops/kv_ops.h"
#include "index_buffer.h"

namespace flashkv {

using backend_detail::check_host_entries;
using backend_detail::check_index_room;
using backend_detail::check_pool;
using backend_detail::decode_options;
using backend_detail::flat_output;
using backend_detail::layer_io;
using backend_detail::LayerIO;
using backend_detail::paged_view;
using backend_detail::prefix_sums_into;
using backend_detail::prepare_save;
using backend_detail::upload_indices;
using backend_detail::with_index_room;

namespace {

// What a wrapper's KV index set covers for each request.
enum class WrapperKind {
  full,    // every token of the request (decoder self attention)
  window,  // the sliding window's tokens
  cross,   // the encoder's tokens (cross attention)
};

// A 3-D view [rows, heads, dim] of a [rows, heads * dim] or [rows, heads, dim] tensor.
TensorView as_heads(const TensorView& t, int64_t heads, int64_t dim, const char* name) {
  Expect(t, name).defined();
  if (t.ndim == 3) {
    Expect(t, name).dim(1, heads, "heads").dim(2, dim, "head_dim");
    return t;
  }
  Expect(t, name).ndim(2).dim(1, heads * dim, "heads * head_dim").inner_contiguous();
  TensorView v = t;
  v.ndim = 3;
  v.shape[1] = heads;
  v.shape[2] = dim;
  v.stride[0] = t.stride[0];
  v.stride[1] = dim;
  v.stride[2] = 1;
  return v;
}

// An extend planned for the ragged path runs it on the full wrapper's self-attention layers: the
// new tokens attend to each other from the given k / v, and to the cached prefix from the pool.
bool ragged_layer(bool use_ragged, WrapperKind kind, const LayerSpec& layer) {
  return use_ragged && kind == WrapperKind::full && !layer.is_cross_attention &&
         layer.attn_type != AttentionType::ENCODER_ONLY;
}

// Whether an extend on cached prefixes runs as one paged pass (BackendOptions::extend_path) with a
// pool of this dtype: automatic takes it unless the pool is fp8.
bool extend_in_one_pass(const BackendOptions& o, DType pool_dtype) {
  switch (o.extend_path) {
    case ExtendPath::ragged:
      return false;
    case ExtendPath::one_paged_pass:
      return true;
    case ExtendPath::automatic:
      break;
  }
  return !is_fp8(pool_dtype);
}

}  // namespace

const char* extend_path_name(ExtendPath path) {
  switch (path) {
    case ExtendPath::automatic:
      return "auto";
    case ExtendPath::ragged:
      return "ragged";
    case ExtendPath::one_paged_pass:
      return "one_paged_pass";
  }
  return "?";
}

ExtendPath parse_extend_path(const std::string& name) {
  for (ExtendPath p : {ExtendPath::automatic, ExtendPath::ragged, ExtendPath::one_paged_pass})
    if (name == extend_path_name(p)) return p;
  throw_error(str_cat("extend_path: expected auto, ragged or one_paged_pass, got '", name, "'"));
}

// The host half of a planned batch: everything init_forward_metadata decides before it touches a
// device buffer. prepare() builds it without changing what forward runs; commit() installs it.
struct FlashKVBackend::HostPlan {
  struct Wrapper {
    WrapperKind kind = WrapperKind::full;
    std::vector<int32_t> kv_len, kv_start, kv_indptr;
    DecodePlan decode;  // DECODE through the decode operator
    PrefillPlan paged;  // every other paged pass (DECODE through the prefill kernel included)
    bool paged_causal = true;
  };
  std::vector<Wrapper> wrappers;
  ForwardMode mode = ForwardMode::IDLE;
  int32_t batch_size = 0;
  int64_t num_tokens = 0;
  bool use_ragged = false, extend_no_prefix = false;
  bool decode_via_prefill = false;  // DECODE through paged_prefill (use_tensor_cores)
  bool external_indices = false;    // DECODE over the caller's spec.kv_indptr / kv_indices
  bool plan_ragged_causal = false, plan_ragged_full = false;
  std::vector<int32_t> qo_len, qo_indptr, mask_indptr;
  PrefillPlan ragged_causal, ragged_full;
};

struct FlashKVBackend::State {
  struct WrapperBuffers {
    Tensor d_kv_len, d_kv_start, d_kv_indptr, d_kv_indices, d_last_page_len;
    TensorView indptr, indices;  // what the kernels read: the buffers above, or the caller's
    Workspace ws_decode, ws_paged;
  };
  HostPlan plan;  // what forward runs (when planned)
  HostPlan next;  // prepare's output, swapped in by commit (so planning reuses its vectors)
  bool planned = false;
  std::vector<WrapperBuffers> wrappers;
  // Batch-level: query rows, the ragged passes, the tree mask, scratch and output buffers.
  Tensor d_qo_indptr, d_mask_indptr, d_swa_out_cache_loc;
  Workspace ws_ragged_causal, ws_ragged_full;
  Tensor out, lse_a;  // [T, Hq, Dv], [T, Hq]: the new tokens' own state (extend on a prefix)
  // CUDA graphs.
  bool graph_ready = false, in_graph = false;
  int graph_max_bs = 0, graph_max_tokens = 0;
};

namespace backend_detail {

// A pool the backend reads and writes must match the model it was built for.
void check_pool(const KVPool& pool, const BackendOptions& o, const char* name) {
  FLASHKV_CHECK(pool.device() == o.device, name, ": expected device ", o.device.str(), ", got ",
                pool.device().str());
  FLASHKV_CHECK(pool.num_kv_heads() == o.num_kv_heads && pool.head_dim_qk() == o.head_dim_qk &&
                    pool.head_dim_v() == o.head_dim_v,
                name, ": num_kv_heads/head_dim_qk/head_dim_v ", pool.num_kv_heads(), "/",
                pool.head_dim_qk(), "/", pool.head_dim_v(), " differ from the backend's ",
                o.num_kv_heads, "/", o.head_dim_qk, "/", o.head_dim_v);
  FLASHKV_CHECK(pool.dtype() == o.q_dtype || is_fp8(pool.dtype()), name, ": KV dtype ",
                dtype_name(pool.dtype()), ": expected q_dtype (", dtype_name(o.q_dtype),
                ") or an fp8 type");
}

// Prefix sums that must fit the i32 index arrays the kernels read.
void prefix_sums_into(const std::vector<int32_t>& lens, const char* what,
                      std::vector<int32_t>* out) {
  out->assign(lens.size() + 1, 0);
  int64_t sum = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    sum += lens[i];
    FLASHKV_CHECK(sum <= INT32_MAX, what, ": the batch's total (", sum, " after request ", i,
                  ") exceeds int32");
    (*out)[i + 1] = static_cast<int32_t>(sum);
  }
}

// Host index tensors are read before anything is planned: each entry must lie in [0, limit).
void check_host_entries(const TensorView& t, int64_t limit, const char* name, const char* what) {
  if (!t.device.is_cpu()) return;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t v = index_at(t, i);
    FLASHKV_CHECK(v >= 0 && v < limit, name, "[", i, "] = ", v, ": expected ", what, " in [0, ",
                  limit, ")");
  }
}

}  // namespace backend_detail

FlashKVBackend::FlashKVBackend(const BackendOptions& options)
    : options_(options), eager_(std::make_unique<State>()), graph_(std::make_unique<State>()) {
  BackendOptions& o = options_;
  FLASHKV_CHECK(o.num_qo_heads > 0 && o.num_kv_heads > 0 && o.num_qo_heads % o.num_kv_heads == 0,
                "BackendOptions: num_qo_heads (", o.num_qo_heads,
                ") must be a positive multiple of num_kv_heads (", o.num_kv_heads, ")");
  FLASHKV_CHECK(o.head_dim_qk > 0, "BackendOptions: head_dim_qk must be > 0, got ", o.head_dim_qk);
  if (o.head_dim_v <= 0) o.head_dim_v = o.head_dim_qk;
  FLASHKV_CHECK(o.q_dtype == DType::f32 || o.q_dtype == DType::f16 || o.q_dtype == DType::bf16,
                "BackendOptions: q_dtype must be f32, f16 or bf16, got ", dtype_name(o.q_dtype));
  FLASHKV_CHECK(!(o.sliding_window_size >= 0 && o.is_encoder_decoder),
                "BackendOptions: a model cannot be both sliding-window and encoder-decoder");
  FLASHKV_CHECK((o.swa_kv_pool == nullptr) == (o.swa_allocator == nullptr),
                "BackendOptions: swa_kv_pool and swa_allocator go together");
  FLASHKV_CHECK(o.swa_kv_pool == nullptr || o.sliding_window_size >= 0,
                "BackendOptions: an SWA pool needs sliding_window_size >= 0");
  if (o.swa_kv_pool) check_pool(*o.swa_kv_pool, o, "BackendOptions.swa_kv_pool");
  FLASHKV_CHECK(o.decode_split_size > 0 && o.prefill_split_size > 0,
                "BackendOptions: split sizes must be > 0");
  if (o.device.is_cuda()) device_info(o.device);  // fails clearly without a GPU
  if (o.cp_comm != nullptr) {
    const char* what = "BackendOptions.cp_comm: context parallelism in FlashKVBackend ";
    FLASHKV_CHECK(o.cp_comm->device() == o.device, what, "needs a communicator on ", o.device.str(),
                  ", got one on ", o.cp_comm->device().str());
    FLASHKV_CHECK(!o.is_encoder_decoder, what, "does not support cross attention");
    FLASHKV_CHECK(o.swa_kv_pool == nullptr, what, "does not support a sliding-window pool");
    FLASHKV_CHECK(!o.is_multimodal && !o.has_encoder_only_layers, what,
                  "does not support multimodal or encoder-only layers");
    cp_ = std::make_unique<CpState>(*o.cp_comm, o.cp, o.sliding_window_size >= 0);
  }
  for (State* st : {eager_.get(), graph_.get()}) {
    st->wrappers.resize(num_wrappers());
    for (HostPlan* hp : {&st->plan, &st->next}) {
      hp->wrappers.resize(num_wrappers());
      if (o.sliding_window_size >= 0) {
        hp->wrappers[0].kind = WrapperKind::window;
        hp->wrappers[1].kind = WrapperKind::full;
      } else if (o.is_encoder_decoder) {
        hp->wrappers[0].kind = WrapperKind::full;
        hp->wrappers[1].kind = WrapperKind::cross;
      }
    }
  }
}

FlashKVBackend::~FlashKVBackend() = default;

int FlashKVBackend::num_wrappers() const {
  return (options_.sliding_window_size >= 0 || options_.is_encoder_decoder) ? 2 : 1;
}

bool FlashKVBackend::uses_ragged() const { return active_ && active_->plan.use_ragged; }
bool FlashKVBackend::extend_without_prefix() const {
  return active_ && active_->plan.extend_no_prefix;
}

void FlashKVBackend::init_forward_metadata(const ForwardBatch& batch) {
  if (cp_)
    cp_plan(batch);
  else
    plan_batch(batch, /*graph=*/false);
}

void FlashKVBackend::init_cuda_graph_state(int max_bs, int max_num_tokens) {
  FLASHKV_CHECK(max_bs > 0 && max_num_tokens >= max_bs,
                "init_cuda_graph_state: expected max_bs > 0 and ", "max_num_tokens >= max_bs, got ",
                max_bs, " and ", max_num_tokens);
  FLASHKV_CHECK(cp_ == nullptr, "init_cuda_graph_state: CUDA graphs are not supported with ",
                "context parallelism (BackendOptions::cp_comm)");
  State& s = *graph_;
  FLASHKV_CHECK(
      !s.graph_ready,
      "init_cuda_graph_state: already initialized (buffers a captured graph uses must not move)");
  s.graph_max_bs = max_bs;
  s.graph_max_tokens = max_num_tokens;
  s.graph_ready = true;
}

void FlashKVBackend::init_forward_metadata_capture_cuda_graph(const ForwardBatch& batch) {
  FLASHKV_CHECK(graph_->graph_ready,
                "init_forward_metadata_capture_cuda_graph: call init_cuda_graph_state first");
  plan_batch(batch, /*graph=*/true);
}

void FlashKVBackend::init_forward_metadata_replay_cuda_graph(const ForwardBatch& batch) {
  FLASHKV_CHECK(graph_->graph_ready,
                "init_forward_metadata_replay_cuda_graph: call init_cuda_graph_state first");
  plan_batch(batch, /*graph=*/true);
}

void FlashKVBackend::plan_batch(const ForwardBatch& b, bool graph) {
  prepare(b, graph);
  commit(b, graph);
}

void FlashKVBackend::prepare(const ForwardBatch& b, bool graph, bool check_index_contents) {
  State& s = state(graph);
  HostPlan& n = s.next;
  const BackendOptions& o = options_;
  const Device dev = o.device;
  FLASHKV_CHECK(b.batch_size >= 0, "batch.batch_size: expected >= 0, got ", b.batch_size);
  n.mode = b.mode;
  n.batch_size = 0;
  n.num_tokens = 0;
  n.use_ragged = n.extend_no_prefix = n.decode_via_prefill = n.external_indices = false;
  n.plan_ragged_causal = n.plan_ragged_full = false;
  if (b.mode == ForwardMode::IDLE) return;

  // --- the batch against its mode, the pools and the capacities ---
  const int32_t B = b.batch_size;
  FLASHKV_CHECK(b.req_to_token_pool != nullptr,
                "batch.req_to_token_pool: expected a pool, got null");
  FLASHKV_CHECK(b.token_to_kv_pool != nullptr, "batch.token_to_kv_pool: expected a pool, got null");
  FLASHKV_CHECK(b.req_to_token_pool->device() == dev, "batch.req_to_token_pool: expected device ",
                dev.str(), ", got ", b.req_to_token_pool->device().str());
  // Any page size: the backend indexes KV by token slot (rows of the pool), as the seed does.
  check_pool(*b.token_to_kv_pool, o, "batch.token_to_kv_pool");
  FLASHKV_CHECK_EQ("batch.seq_lens_cpu size", static_cast<int64_t>(b.seq_lens_cpu.size()),
                   int64_t{B});
  Expect(b.req_pool_indices, "batch.req_pool_indices")
      .ndim(1)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, B, "batch_size");
  const int64_t max_reqs = b.req_to_token_pool->max_reqs();
  if (check_index_contents)
    check_host_entries(b.req_pool_indices, max_reqs, "batch.req_pool_indices",
                       "a row of req_to_token");
  const bool decode = b.mode == ForwardMode::DECODE;
  const bool extend = b.mode == ForwardMode::EXTEND || b.mode == ForwardMode::MIXED;
  if (extend) {
    FLASHKV_CHECK_EQ("batch.extend_seq_lens_cpu size",
                     static_cast<int64_t>(b.extend_seq_lens_cpu.size()), int64_t{B});
    FLASHKV_CHECK_EQ("batch.extend_prefix_lens_cpu size",
                     static_cast<int64_t>(b.extend_prefix_lens_cpu.size()), int64_t{B});
  }
  if (b.mode == ForwardMode::TARGET_VERIFY) {
    FLASHKV_CHECK(b.spec.draft_token_num > 0, "batch.spec.draft_token_num: expected > 0, got ",
                  b.spec.draft_token_num);
    Expect(b.spec.custom_mask, "batch.spec.custom_mask").ndim(1).device(dev).dtype(DType::u8);
  }
  if (b.mode == ForwardMode::DRAFT_EXTEND)
    FLASHKV_CHECK_EQ("batch.spec.accept_length_cpu size",
                     static_cast<int64_t>(b.spec.accept_length_cpu.size()), int64_t{B});
  if (o.is_encoder_decoder) {
    FLASHKV_CHECK_EQ("batch.encoder_lens_cpu size", static_cast<int64_t>(b.encoder_lens_cpu.size()),
                     int64_t{B});
    if (b.encoder_out_cache_loc.defined()) {
      Expect(b.encoder_out_cache_loc, "batch.encoder_out_cache_loc")
          .ndim(1)
          .device(dev)
          .dtype(DType::i32)
          .contiguous();
      check_host_entries(b.encoder_out_cache_loc, b.token_to_kv_pool->num_rows(),
                         "batch.encoder_out_cache_loc", "a slot of the pool");
    }
  }
  const int64_t max_ctx = b.req_to_token_pool->max_context_len();
  n.qo_len.assign(B, 0);
  for (int32_t i = 0; i < B; ++i) {
    const int32_t seq = b.seq_lens_cpu[i];
    const int32_t enc = o.is_encoder_decoder ? b.encoder_lens_cpu[i] : 0;
    FLASHKV_CHECK(enc >= 0, "batch.encoder_lens_cpu[", i, "]: expected >= 0, got ", enc);
    FLASHKV_CHECK(seq >= 0 && int64_t{seq} + enc <= max_ctx, "batch.seq_lens_cpu[", i, "] = ", seq,
                  (enc ? " (after the encoder's tokens)" : ""), ": expected 0..", max_ctx - enc,
                  " (the pool's max_context_len)");
    n.qo_len[i] = b.extend_len(i);
    FLASHKV_CHECK(n.qo_len[i] >= 0 && n.qo_len[i] <= seq, "request ", i, ": ", n.qo_len[i],
                  " new tokens but seq_len ", seq, " (", mode_name(b.mode), ")");
    if (extend)
      FLASHKV_CHECK(int64_t{b.extend_prefix_lens_cpu[i]} + b.extend_seq_lens_cpu[i] == seq,
                    "request ", i, ": extend_prefix_len ", b.extend_prefix_lens_cpu[i],
                    " + extend_seq_len ", b.extend_seq_lens_cpu[i], " != seq_len ", seq);
  }
  prefix_sums_into(n.qo_len, "query rows", &n.qo_indptr);
  n.num_tokens = n.qo_indptr.back();
  Expect(b.out_cache_loc, "batch.out_cache_loc")
      .ndim(1)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, n.num_tokens, "num_tokens");
  const int64_t swa_table_size = o.swa_allocator ? o.swa_allocator->host_table().numel() : 0;
  if (check_index_contents) {
    check_host_entries(b.out_cache_loc, b.token_to_kv_pool->num_rows(), "batch.out_cache_loc",
                       "a slot of the pool");
    if (o.swa_allocator)
      check_host_entries(b.out_cache_loc, swa_table_size, "batch.out_cache_loc",
                         "a slot of the SWA allocator's table");
  }
  if (graph)
    FLASHKV_CHECK(B <= s.graph_max_bs && n.num_tokens <= s.graph_max_tokens, "CUDA-graph batch of ",
                  B, " requests / ", n.num_tokens, " tokens exceeds the capacity ", s.graph_max_bs,
                  " / ", s.graph_max_tokens, " (init_cuda_graph_state)");
  n.batch_size = B;
  bool no_prefix = extend;
  if (extend)
    for (int32_t i = 0; i < B; ++i)
      if (b.extend_prefix_lens_cpu[i] > 0) no_prefix = false;
  n.use_ragged = extend && !o.is_multimodal && !o.deterministic &&
                 (no_prefix || !extend_in_one_pass(o, b.token_to_kv_pool->dtype()));
  n.extend_no_prefix = n.use_ragged && no_prefix;
  n.decode_via_prefill = decode && decode_uses_prefill_kernel();
  if (b.mode == ForwardMode::TARGET_VERIFY) {
    n.mask_indptr.assign(B + 1, 0);
    int64_t total = 0;
    for (int32_t i = 0; i < B; ++i) {
      total += int64_t{n.qo_len[i]} * b.seq_lens_cpu[i];
      FLASHKV_CHECK(total <= INT32_MAX, "batch.spec.custom_mask: more than 2^31 - 1 entries");
      n.mask_indptr[i + 1] = static_cast<int32_t>(total);
    }
    FLASHKV_CHECK(b.spec.custom_mask.numel() >= total, "batch.spec.custom_mask: expected ", total,
                  " entries (draft_token_num x seq_len per request), got ",
                  b.spec.custom_mask.numel());
  }

  // --- plans, and room in the buffers a captured graph fixed ---
  const bool fixed = graph && s.in_graph;
  const int64_t cap_b = graph ? s.graph_max_bs : B;
  const DeviceInfo info = device_info(dev);
  PlanOptions po;
  po.enable_split_kv = !o.disable_split_kv;
  if (o.deterministic) po.fixed_split_size = decode ? o.decode_split_size : o.prefill_split_size;
  if (graph) {
    po.cuda_graph = true;
    po.max_batch_size = s.graph_max_bs;
    po.max_num_tokens = s.graph_max_tokens;
    po.max_kv_len = static_cast<int32_t>(max_ctx);
  }
  BatchShape shape;
  shape.batch_size = B;
  shape.qo_indptr = n.qo_indptr.data();
  shape.num_qo_heads = o.num_qo_heads;
  shape.num_kv_heads = o.num_kv_heads;
  shape.head_dim_qk = o.head_dim_qk;
  shape.head_dim_v = o.head_dim_v;
  shape.page_size = 1;
  // Buffers a captured graph may read must not move; one never allocated is in no graph yet.
  auto check_workspace = [&](const Plan& plan, const Workspace& ws, const char* what) {
    FLASHKV_CHECK(!fixed || ws.bytes() == 0 || ws.bytes() >= plan.layout.total_bytes, what,
                  ": the plan needs ", plan.layout.total_bytes,
                  " bytes of workspace, past the CUDA-graph workspace ", ws.bytes());
  };

  const int w = o.sliding_window_size;
  n.external_indices = decode && b.spec.kv_indices.defined();
  if (n.external_indices) {
    FLASHKV_CHECK(n.wrappers.size() == 1, "batch.spec.kv_indices: precomputed indices need a",
                  " model without sliding-window or cross-attention layers");
    FLASHKV_CHECK_EQ("batch.spec.kv_indptr_cpu size",
                     static_cast<int64_t>(b.spec.kv_indptr_cpu.size()), int64_t{B} + 1);
    Expect(b.spec.kv_indptr, "batch.spec.kv_indptr")
        .ndim(1)
        .device(dev)
        .dtype(DType::i32)
        .contiguous()
        .dim(0, B + 1, "batch + 1");
    Expect(b.spec.kv_indices, "batch.spec.kv_indices")
        .ndim(1)
        .device(dev)
        .dtype(DType::i32)
        .contiguous();
    for (int32_t i = 0; i < B; ++i)
      FLASHKV_CHECK(b.spec.kv_indptr_cpu[i + 1] - b.spec.kv_indptr_cpu[i] == b.seq_lens_cpu[i],
                    "batch.spec.kv_indptr_cpu: row ", i, " spans ",
                    b.spec.kv_indptr_cpu[i + 1] - b.spec.kv_indptr_cpu[i],
                    " entries, seq_lens_cpu says ", b.seq_lens_cpu[i]);
    FLASHKV_CHECK(
        b.spec.kv_indptr_cpu[0] >= 0 && b.spec.kv_indptr_cpu[B] <= b.spec.kv_indices.numel(),
        "batch.spec.kv_indices: expected at least ", b.spec.kv_indptr_cpu[B], " entries, got ",
        b.spec.kv_indices.numel());
  }
  for (size_t wi = 0; wi < n.wrappers.size(); ++wi) {
    HostPlan::Wrapper& wr = n.wrappers[wi];
    const State::WrapperBuffers& buf = s.wrappers[wi];
    if (n.external_indices) {
      wr.kv_len = b.seq_lens_cpu;
      wr.kv_start.assign(B, 0);
      wr.kv_indptr = b.spec.kv_indptr_cpu;
    } else {
      wr.kv_len.assign(B, 0);
      wr.kv_start.assign(B, 0);
      for (int32_t i = 0; i < B; ++i) {
        const int32_t seq = b.seq_lens_cpu[i], qo = n.qo_len[i];
        const int32_t enc = o.is_encoder_decoder ? b.encoder_lens_cpu[i] : 0;
        switch (wr.kind) {
          case WrapperKind::full:
            wr.kv_len[i] = n.use_ragged ? seq - qo : seq;
            wr.kv_start[i] = enc;
            break;
          case WrapperKind::window: {
            // Decode sees the last w + 1 tokens, extend the last w + new ones; a tree-mask verify
            // keeps the whole sequence so the mask's columns line up (the kernel applies the
            // window).
            const int64_t keep = decode                                 ? int64_t{w} + 1
                                 : b.mode == ForwardMode::TARGET_VERIFY ? int64_t{seq}
                                                                        : int64_t{w} + qo;
            wr.kv_len[i] = static_cast<int32_t>(std::min<int64_t>(seq, keep));
            wr.kv_start[i] = seq - wr.kv_len[i];
            break;
          }
          case WrapperKind::cross:
            wr.kv_len[i] = enc;
            wr.kv_start[i] = 0;
            break;
        }
      }
      prefix_sums_into(wr.kv_len, "KV entries", &wr.kv_indptr);
      check_index_room(buf.d_kv_len, cap_b, fixed, "kv_len");
      check_index_room(buf.d_kv_start, cap_b, fixed, "kv_start");
      check_index_room(buf.d_kv_indptr, cap_b + 1, fixed, "kv_indptr");
      check_index_room(buf.d_kv_indices,
                       graph ? int64_t{s.graph_max_bs} * max_ctx : wr.kv_indptr.back(), fixed,
                       "kv_indices");
      // The window's slots go through the SWA table: host entries must lie inside it.
      const TensorView& r2t = b.req_to_token_pool->req_to_token();
      if (check_index_contents && wr.kind == WrapperKind::window && o.swa_allocator &&
          r2t.device.is_cpu())
        for (int32_t i = 0; i < B; ++i) {
          const int32_t* row = r2t.ptr<int32_t>() + index_at(b.req_pool_indices, i) * r2t.stride[0];
          for (int32_t j = wr.kv_start[i]; j < wr.kv_start[i] + wr.kv_len[i]; ++j)
            FLASHKV_CHECK(row[j] >= 0 && row[j] < swa_table_size, "req_to_token[",
                          index_at(b.req_pool_indices, i), ", ", j, "] = ", row[j],
                          ": expected a slot of the SWA allocator's table, [0, ", swa_table_size,
                          ")");
        }
    }
    check_index_room(buf.d_last_page_len, cap_b, fixed, "last_page_len");
    shape.kv_len = wr.kv_len.data();
    shape.window_left = wr.kind == WrapperKind::window ? w : -1;
    if (decode && !n.decode_via_prefill) {
      shape.causal = false;
      plan_decode(shape, info, po, &wr.decode);
      check_workspace(wr.decode, buf.ws_decode, "decode workspace");
    } else {
      // The prefix-only pass of a ragged extend sees the whole prefix; everything else is
      // causal, except cross attention and a tree-masked verify. (A decode row is the last
      // position of its request: causal hides nothing from it.)
      wr.paged_causal = !(n.use_ragged && wr.kind == WrapperKind::full) &&
                        wr.kind != WrapperKind::cross && b.mode != ForwardMode::TARGET_VERIFY;
      shape.causal = wr.paged_causal;
      plan_prefill(shape, info, po, &wr.paged);
      check_workspace(wr.paged, buf.ws_paged, "paged workspace");
    }
  }
  if (!decode || n.decode_via_prefill)
    check_index_room(s.d_qo_indptr, cap_b + 1, fixed, "qo_indptr");
  if (!decode) {
    n.plan_ragged_causal = n.use_ragged || o.has_encoder_only_layers;
    n.plan_ragged_full = o.has_encoder_only_layers;
    shape.kv_len = n.qo_len.data();
    shape.window_left = -1;
    if (n.plan_ragged_causal) {
      shape.causal = true;
      plan_prefill(shape, info, po, &n.ragged_causal);
      check_workspace(n.ragged_causal, s.ws_ragged_causal, "ragged workspace");
    }
    if (n.plan_ragged_full) {
      shape.causal = false;
      plan_prefill(shape, info, po, &n.ragged_full);
      check_workspace(n.ragged_full, s.ws_ragged_full, "ragged workspace");
    }
    if (b.mode == ForwardMode::TARGET_VERIFY)
      check_index_room(s.d_mask_indptr, cap_b + 1, fixed, "mask_indptr");
  }
  if (o.swa_allocator)
    check_index_room(s.d_swa_out_cache_loc, graph ? s.graph_max_tokens : n.num_tokens, fixed,
                     "swa_out_cache_loc");
  const int64_t rows = graph ? s.graph_max_tokens : std::max<int64_t>(n.num_tokens, 1);
  FLASHKV_CHECK(!fixed || !s.out.defined() || s.out.size(0) >= rows,
                "output buffer: past the CUDA-graph capacity");
}

void FlashKVBackend::commit(const ForwardBatch& b, bool graph) {
  State& s = state(graph);
  active_ = &s;
  s.planned = false;  // a device failure below leaves the state unplanned, never half-planned
  std::swap(s.plan, s.next);
  const HostPlan& n = s.plan;
  if (n.mode == ForwardMode::IDLE) {
    s.planned = true;
    return;
  }
  const BackendOptions& o = options_;
  const Device dev = o.device;
  const int32_t B = n.batch_size;
  const bool decode = n.mode == ForwardMode::DECODE;
  const bool fixed = graph && s.in_graph;
  const int64_t cap_b = graph ? s.graph_max_bs : B;
  const int64_t max_ctx = b.req_to_token_pool->max_context_len();
  auto upload_plan = [&](const Plan& plan, Workspace& ws) {
    ws.reserve(std::max<size_t>(plan.layout.total_bytes, 1), dev);
    ws.upload(plan, o.stream);
  };
  for (size_t wi = 0; wi < n.wrappers.size(); ++wi) {
    const HostPlan::Wrapper& wr = n.wrappers[wi];
    State::WrapperBuffers& buf = s.wrappers[wi];
    if (!buf.d_last_page_len.defined() || buf.d_last_page_len.numel() < std::max<int64_t>(cap_b, 1))
      buf.d_last_page_len =
          Tensor::from_i32(std::vector<int32_t>(std::max<int64_t>(cap_b, 1), 1), dev);
    if (n.external_indices) {
      // The caller built the index set; only plan over it.
      buf.indptr = b.spec.kv_indptr;
      buf.indices = b.spec.kv_indices;
    } else {
      const int64_t entries = wr.kv_indptr.back();
      buf.d_kv_len = with_index_room(buf.d_kv_len, cap_b, dev, fixed, "kv_len");
      buf.d_kv_start = with_index_room(buf.d_kv_start, cap_b, dev, fixed, "kv_start");
      buf.d_kv_indptr = with_index_room(buf.d_kv_indptr, cap_b + 1, dev, fixed, "kv_indptr");
      buf.d_kv_indices =
          with_index_room(buf.d_kv_indices, graph ? int64_t{s.graph_max_bs} * max_ctx : entries,
                          dev, fixed, "kv_indices");
      upload_indices(buf.d_kv_len, wr.kv_len, o.stream);
      upload_indices(buf.d_kv_start, wr.kv_start, o.stream);
      upload_indices(buf.d_kv_indptr, wr.kv_indptr, o.stream);
      const TensorView lens = buf.d_kv_len.view().rows(0, B);
      const TensorView starts = buf.d_kv_start.view().rows(0, B);
      buf.indptr = buf.d_kv_indptr.view().rows(0, B + 1);
      buf.indices = buf.d_kv_indices;
      build_kv_indices(b.req_to_token_pool->req_to_token(), b.req_pool_indices, lens, starts,
                       buf.indptr, buf.d_kv_indices, o.stream);
      if (wr.kind == WrapperKind::window && o.swa_allocator && entries > 0) {
        const TensorView idx = buf.d_kv_indices.view().rows(0, entries);
        translate_slots(idx, o.swa_allocator->full_to_swa_table(o.stream), idx, o.stream);
      }
    }
    if (decode && !n.decode_via_prefill)
      upload_plan(wr.decode, buf.ws_decode);
    else
      upload_plan(wr.paged, buf.ws_paged);
  }
  if (!decode || n.decode_via_prefill) {
    s.d_qo_indptr = with_index_room(s.d_qo_indptr, cap_b + 1, dev, fixed, "qo_indptr");
    upload_indices(s.d_qo_indptr, n.qo_indptr, o.stream);
  }
  if (n.plan_ragged_causal) upload_plan(n.ragged_causal, s.ws_ragged_causal);
  if (n.plan_ragged_full) upload_plan(n.ragged_full, s.ws_ragged_full);
  if (n.mode == ForwardMode::TARGET_VERIFY) {
    s.d_mask_indptr = with_index_room(s.d_mask_indptr, cap_b + 1, dev, fixed, "mask_indptr");
    upload_indices(s.d_mask_indptr, n.mask_indptr, o.stream);
  }
  if (o.swa_allocator) {
    s.d_swa_out_cache_loc =
        with_index_room(s.d_swa_out_cache_loc, graph ? s.graph_max_tokens : n.num_tokens, dev,
                        fixed, "swa_out_cache_loc");
    if (n.num_tokens > 0)
      translate_slots(b.out_cache_loc, o.swa_allocator->full_to_swa_table(o.stream),
                      s.d_swa_out_cache_loc.view().rows(0, n.num_tokens), o.stream);
  }
  // Output and scratch.
  const int64_t rows = graph ? s.graph_max_tokens : std::max<int64_t>(n.num_tokens, 1);
  if (!s.out.defined() || s.out.size(0) < rows) {
    s.out = Tensor::empty({rows, o.num_qo_heads, o.head_dim_v}, o.q_dtype, dev);
    s.lse_a = Tensor::empty({rows, o.num_qo_heads}, DType::f32, dev);
  }
  if (graph) s.in_graph = true;
  s.planned = true;
}

namespace backend_detail {
// The decode operator's options: the layer's, plus layout_ready. The request layout of a
// decode batch (kv_indptr, kv_indices, last page lengths) is built in init_forward_metadata*
// by copies and by kernels that never let a successor start early, before any layer runs; the
// kernel just ahead of the decode call is this layer's K/V append, which writes the pool only.
AttentionOptions decode_options(AttentionOptions opt) {
  opt.layout_ready = true;
  return opt;
}

// Resolves everything a layer call needs, validating before anything is written.
LayerIO layer_io(const BackendOptions& o, const LayerSpec& layer, const ForwardBatch& b,
                 const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& out, const TensorView& own_out, int64_t T,
                 const TensorView& swa_loc) {
  FLASHKV_CHECK(layer.num_qo_heads == o.num_qo_heads && layer.num_kv_heads == o.num_kv_heads &&
                    layer.head_dim_qk == o.head_dim_qk && layer.v_dim() == o.head_dim_v,
                "layer ", layer.layer_id, ": heads/dims ", layer.num_qo_heads, "/",
                layer.num_kv_heads, "/", layer.head_dim_qk, "/", layer.v_dim(),
                " differ from the backend's ", o.num_qo_heads, "/", o.num_kv_heads, "/",
                o.head_dim_qk, "/", o.head_dim_v);
  FLASHKV_CHECK((layer.sliding_window_size >= 0) ==
                    (o.sliding_window_size >= 0 && layer.sliding_window_size >= 0),
                "layer ", layer.layer_id, ": sliding window ", layer.sliding_window_size,
                " but the backend was built without one");
  FLASHKV_CHECK(layer.sliding_window_size < 0 || layer.sliding_window_size == o.sliding_window_size,
                "layer ", layer.layer_id, ": sliding window ", layer.sliding_window_size,
                " differs from the backend's ", o.sliding_window_size);
  FLASHKV_CHECK(!layer.is_cross_attention || o.is_encoder_decoder, "layer ", layer.layer_id,
                ": cross attention needs a backend built with is_encoder_decoder");
  LayerIO io;
  io.q = as_heads(q, o.num_qo_heads, o.head_dim_qk, "q");
  Expect(io.q, "q").device(o.device).dtype(o.q_dtype).dim(0, T, "num_tokens");
  io.out = as_heads(out.defined() ? out : own_out.rows(0, T), o.num_qo_heads, o.head_dim_v, "out");
  if (out.defined())
    Expect(io.out, "out").device(o.device).dtype(o.q_dtype).dim(0, T, "num_tokens");
  FLASHKV_CHECK(k.defined() == v.defined(), "k/v: give both or neither, got k ",
                k.defined() ? "defined" : "undefined", " and v ",
                v.defined() ? "defined" : "undefined");
  if (k.defined()) {
    io.k = as_heads(k, o.num_kv_heads, o.head_dim_qk, "k");
    io.v = as_heads(v, o.num_kv_heads, o.head_dim_v, "v");
    Expect(io.k, "k").device(o.device).dtype(o.q_dtype);
    Expect(io.v, "v").device(o.device).dtype(o.q_dtype).dim(0, io.k.shape[0], "rows of k");
    if (!layer.is_cross_attention) Expect(io.k, "k").dim(0, T, "num_tokens");
  }
  const bool window = layer.sliding_window_size >= 0;
  io.pool = (window && o.swa_kv_pool) ? o.swa_kv_pool : b.token_to_kv_pool;
  FLASHKV_CHECK(io.pool != nullptr, "batch.token_to_kv_pool: expected a pool, got null");
  FLASHKV_CHECK(layer.layer_id >= 0 && layer.layer_id < io.pool->num_layers(),
                "layer.layer_id: expected 0..", io.pool->num_layers() - 1, ", got ",
                layer.layer_id);
  if (layer.is_cross_attention) {
    io.cache_loc = b.encoder_out_cache_loc;
    io.cache_loc_name = "batch.encoder_out_cache_loc";
  } else if (window && o.swa_kv_pool) {
    io.cache_loc = swa_loc;
    io.cache_loc_name = "batch.out_cache_loc (translated to the SWA pool)";
  } else {
    io.cache_loc = b.out_cache_loc;
  }
  io.opt.sm_scale = layer.scaling;
  io.opt.logits_soft_cap = layer.logit_cap;
  io.opt.window_left = layer.sliding_window_size;  // negative: none (the operators normalise)
  io.opt.sinks = layer.sinks;                      // checked by the operators ("sinks: ...")
  return io;
}

// The layer's K/V append, validated; run it once the attention calls are validated too.
PreparedAppendKV prepare_save(const LayerIO& io, const LayerSpec& layer) {
  FLASHKV_CHECK(io.cache_loc.defined(), io.cache_loc_name,
                ": k/v given with save_kv_cache, but no cache locations");
  FLASHKV_CHECK(io.k.shape[0] == io.cache_loc.numel(), "k: ", io.k.shape[0], " rows but ",
                io.cache_loc_name, " lists ", io.cache_loc.numel(), " slots");
  return prepare_append_kv(io.k, io.v, io.cache_loc, io.pool->k(layer.layer_id),
                           io.pool->v(layer.layer_id), io.pool->k_scale(layer.layer_id),
                           io.pool->v_scale(layer.layer_id));
}

PagedKV paged_view(const KVPool& pool, int layer, const TensorView& indptr,
                   const TensorView& indices, const Tensor& last_page_len, int32_t B) {
  PagedKV kv;
  kv.k = pool.k(layer);
  kv.v = pool.v(layer);
  kv.indptr = indptr;
  kv.indices = indices;
  kv.last_page_len = last_page_len.view().rows(0, std::max(B, 1));
  kv.page_size = 1;  // token slots, whatever the pool's page size
  kv.k_scale = pool.k_scale(layer);
  kv.v_scale = pool.v_scale(layer);
  return kv;
}

TensorView flat_output(const TensorView& out3) {
  TensorView r = out3;
  r.ndim = 2;
  r.shape[1] = out3.shape[1] * out3.shape[2];
  r.stride[1] = 1;
  return r;
}

}  // namespace backend_detail

namespace {

// The batch's new tokens' slots in the SWA pool (empty without one).
TensorView swa_loc_of(const Tensor& t, int64_t T) {
  return t.defined() ? t.view().rows(0, T) : TensorView();
}

// Which wrapper (index set + plans) serves a layer.
int wrapper_index(const BackendOptions& o, const LayerSpec& layer) {
  if (o.sliding_window_size >= 0) return layer.sliding_window_size >= 0 ? 0 : 1;
  if (o.is_encoder_decoder) return layer.is_cross_attention ? 1 : 0;
  return 0;
}
}  // namespace

bool FlashKVBackend::reads_new_kv_from_input(const LayerSpec& layer) const {
  // The sharded extend passes read the new tokens from the ranks' k / v, gathered.
  if (cp_) return cp_->planned && !is_decode_or_idle(cp_->mode) && !layer.is_cross_attention;
  if (active_ == nullptr) return false;
  const HostPlan& n = active_->plan;
  const int wi = wrapper_index(options_, layer);
  return wi < static_cast<int>(n.wrappers.size()) &&
         ragged_layer(n.use_ragged, n.wrappers[wi].kind, layer);
}

TensorView FlashKVBackend::forward_decode(const TensorView& q, const TensorView& k,
                                          const TensorView& v, const LayerSpec& layer,
                                          const ForwardBatch& b, bool save_kv_cache,
                                          const TensorView& out) {
  if (cp_) return cp_forward(q, k, v, layer, b, save_kv_cache, out);
  FLASHKV_CHECK(active_ != nullptr, "forward: call init_forward_metadata first");
  State& s = *active_;
  const HostPlan& n = s.plan;
  FLASHKV_CHECK(s.planned && n.mode == ForwardMode::DECODE && n.batch_size == b.batch_size,
                "forward_decode: call init_forward_metadata with this DECODE batch first");
  LayerIO io = layer_io(options_, layer, b, q, k, v, out, s.out, n.num_tokens,
                        swa_loc_of(s.d_swa_out_cache_loc, n.num_tokens));
  const int wi = wrapper_index(options_, layer);
  const HostPlan::Wrapper& wr = n.wrappers[wi];
  State::WrapperBuffers& buf = s.wrappers[wi];
  const PagedKV kv = paged_view(*io.pool, layer.layer_id, buf.indptr, buf.indices,
                                buf.d_last_page_len, n.batch_size);
  // Everything is validated before the pool changes: attention first, then the append.
  const PreparedAttention attention =
      n.decode_via_prefill
          ? prepare_paged_prefill(wr.paged, io.q, s.d_qo_indptr.view().rows(0, n.batch_size + 1),
                                  kv, io.opt, io.out, TensorView(), buf.ws_paged)
          : prepare_paged_decode(wr.decode, io.q, kv, decode_options(io.opt), io.out, TensorView(),
                                 buf.ws_decode);
  if (save_kv_cache && io.k.defined()) prepare_save(io, layer).run(options_.stream);
  attention.run(options_.stream);
  return flat_output(io.out);
}

TensorView FlashKVBackend::forward_extend(const TensorView& q, const TensorView& k,
                                          const TensorView& v, const LayerSpec& layer,
                                          const ForwardBatch& b, bool save_kv_cache,
                                          const TensorView& out) {
  if (cp_) return cp_forward(q, k, v, layer, b, save_kv_cache, out);
  FLASHKV_CHECK(active_ != nullptr, "forward: call init_forward_metadata first");
  State& s = *active_;
  const HostPlan& n = s.plan;
  FLASHKV_CHECK(s.planned && n.mode == b.mode && n.mode != ForwardMode::DECODE &&
                    n.batch_size == b.batch_size,
                "forward_extend: call init_forward_metadata with this ", mode_name(b.mode),
                " batch first");
  LayerIO io = layer_io(options_, layer, b, q, k, v, out, s.out, n.num_tokens,
                        swa_loc_of(s.d_swa_out_cache_loc, n.num_tokens));
  const int wi = wrapper_index(options_, layer);
  const HostPlan::Wrapper& wr = n.wrappers[wi];
  State::WrapperBuffers& buf = s.wrappers[wi];
  const TensorView qo = s.d_qo_indptr.view().rows(0, n.batch_size + 1);
  const PagedKV kv = paged_view(*io.pool, layer.layer_id, buf.indptr, buf.indices,
                                buf.d_last_page_len, n.batch_size);
  const Stream stream = options_.stream;
  if (layer.attn_type == AttentionType::ENCODER_ONLY) {
    // Encoder-only layers: bidirectional over the new tokens; nothing is cached.
    FLASHKV_CHECK(options_.has_encoder_only_layers, "layer ", layer.layer_id,
                  ": ENCODER_ONLY needs BackendOptions.has_encoder_only_layers");
    FLASHKV_CHECK(io.k.defined(), "k: an encoder-only layer needs the new tokens' k and v");
    io.opt.causal = false;
    prepare_ragged_prefill(n.ragged_full, io.q, io.k, io.v, qo, qo, io.opt, io.out, TensorView(),
                           s.ws_ragged_full)
        .run(stream);
    return flat_output(io.out);
  }
  const bool save = save_kv_cache && io.k.defined();
  const bool ragged = ragged_layer(n.use_ragged, wr.kind, layer);
  if (!ragged) {
    // One paged pass over everything the wrapper indexes; the new K/V must be in the pool first.
    io.opt.causal = wr.paged_causal;
    if (n.mode == ForwardMode::TARGET_VERIFY && !layer.is_cross_attention) {
      io.opt.custom_mask = b.spec.custom_mask;
      io.opt.mask_indptr = s.d_mask_indptr.view().rows(0, n.batch_size + 1);
    }
    const PreparedAttention attention =
        prepare_paged_prefill(wr.paged, io.q, qo, kv, io.opt, io.out, TensorView(), buf.ws_paged);
    if (save) prepare_save(io, layer).run(stream);
    attention.run(stream);
    return flat_output(io.out);
  }
  FLASHKV_CHECK(io.k.defined(), "k: the ragged extend path needs the new tokens' k and v");
  io.opt.causal = true;
  std::optional<PreparedAppendKV> append;
  if (s.plan.extend_no_prefix) {
    const PreparedAttention attention =
        prepare_ragged_prefill(n.ragged_causal, io.q, io.k, io.v, qo, qo, io.opt, io.out,
                               TensorView(), s.ws_ragged_causal);
    if (save) append = prepare_save(io, layer);
    attention.run(stream);
  } else {
    // New tokens among themselves (causal) into out, then the cached prefix (all visible),
    // whose pass merges its result with that state by LSE as it writes out. The prefix pass
    // may start while the ragged pass still runs (it writes only out and lse_a, which the
    // prefix pass reads after waiting for it).
    // The sinks count once: the prefix pass adds them to the merged rows, the ragged pass
    // leaves them out.
    const TensorView lse_a = s.lse_a.view().rows(0, n.num_tokens);
    AttentionOptions new_opt = io.opt;
    new_opt.sinks = TensorView();
    AttentionOptions prefix_opt = io.opt;
    prefix_opt.causal = false;
    prefix_opt.merge_o = io.out;
    prefix_opt.merge_lse = lse_a;
    prefix_opt.overlap_previous = true;
    const PreparedAttention new_tokens = prepare_ragged_prefill(
        n.ragged_causal, io.q, io.k, io.v, qo, qo, new_opt, io.out, lse_a, s.ws_ragged_causal);
    const PreparedAttention prefix = prepare_paged_prefill(wr.paged, io.q, qo, kv, prefix_opt,
                                                           io.out, TensorView(), buf.ws_paged);
    if (save) append = prepare_save(io, layer);
    new_tokens.run(stream);
    prefix.run(stream);
  }
  // The ragged path reads the new K/V from k/v, so (as the seed does) it caches them afterwards.
  if (append) append->run(stream);
  return flat_output(io.out);
}

}  // namespace flashkv
