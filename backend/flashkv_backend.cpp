#include "flashkv/backend/flashkv_backend.h"

#include <algorithm>

#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/kvcache/swa_allocator.h"
#include "flashkv/ops/kv_ops.h"

namespace flashkv {
namespace {

// What a wrapper's KV index set covers for each request.
enum class WrapperKind {
  full,    // every token of the request (decoder self attention)
  window,  // the sliding window's tokens
  cross,   // the encoder's tokens (cross attention)
};

// A grow-only i32 device buffer; in graph mode it must not move.
void ensure_i32(Tensor& t, int64_t n, Device d, bool fixed, const char* what) {
  n = std::max<int64_t>(n, 1);
  if (t.defined() && t.numel() >= n) return;
  FLASHKV_CHECK(!fixed, what, ": the batch needs ", n, " entries, past the CUDA-graph capacity ",
                t.defined() ? t.numel() : 0, " (init_cuda_graph_state)");
  t = Tensor::empty({n}, DType::i32, d);
}

void upload_i32(const Tensor& dst, const std::vector<int32_t>& src) {
  copy_bytes(dst.data(), dst.device(), src.data(), Device::cpu(), src.size() * sizeof(int32_t));
}

std::vector<int32_t> prefix_sums(const std::vector<int32_t>& lens) {
  std::vector<int32_t> p(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) p[i + 1] = p[i] + lens[i];
  return p;
}

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

}  // namespace

struct FlashKVBackend::State {
  struct Wrapper {
    WrapperKind kind = WrapperKind::full;
    std::vector<int32_t> kv_len, kv_start, kv_indptr;
    Tensor d_kv_len, d_kv_start, d_kv_indptr, d_kv_indices, d_last_page_len;
    TensorView indptr, indices;  // what the kernels read: the buffers above, or the caller's
    DecodePlan decode;
    PrefillPlan paged;
    Workspace ws_decode, ws_paged;
    bool paged_causal = true;
  };
  std::vector<Wrapper> wrappers;
  // Batch-level: query rows, the ragged passes, the tree mask, scratch and output buffers.
  ForwardMode mode = ForwardMode::IDLE;
  int32_t batch_size = 0;
  int64_t num_tokens = 0;
  bool use_ragged = false, extend_no_prefix = false, planned = false;
  std::vector<int32_t> qo_len, qo_indptr, mask_indptr;
  Tensor d_qo_indptr, d_mask_indptr, d_swa_out_cache_loc;
  PrefillPlan ragged_causal, ragged_full;
  Workspace ws_ragged_causal, ws_ragged_full;
  Tensor out, tmp_o, lse_a, lse_b;  // [T, Hq, Dv], [T, Hq, Dv], [T, Hq] x2
  // CUDA graphs.
  bool graph_ready = false, in_graph = false;
  int graph_max_bs = 0, graph_max_tokens = 0;
};

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
  FLASHKV_CHECK(o.decode_split_size > 0 && o.prefill_split_size > 0,
                "BackendOptions: split sizes must be > 0");
  if (o.device.is_cuda()) device_info(o.device);  // fails clearly without a GPU
  for (State* st : {eager_.get(), graph_.get()}) {
    st->wrappers.resize(num_wrappers());
    if (o.sliding_window_size >= 0) {
      st->wrappers[0].kind = WrapperKind::window;
      st->wrappers[1].kind = WrapperKind::full;
    } else if (o.is_encoder_decoder) {
      st->wrappers[0].kind = WrapperKind::full;
      st->wrappers[1].kind = WrapperKind::cross;
    }
  }
}

FlashKVBackend::~FlashKVBackend() = default;

int FlashKVBackend::num_wrappers() const {
  return (options_.sliding_window_size >= 0 || options_.is_encoder_decoder) ? 2 : 1;
}

bool FlashKVBackend::decode_uses_tensor_cores(DType kv_dtype) const {
  if (options_.use_tensor_cores >= 0) return options_.use_tensor_cores == 1;
  return options_.num_qo_heads / options_.num_kv_heads >= 4 || is_fp8(kv_dtype);
}

bool FlashKVBackend::uses_ragged() const { return active_ && active_->use_ragged; }
bool FlashKVBackend::extend_without_prefix() const { return active_ && active_->extend_no_prefix; }

void FlashKVBackend::init_forward_metadata(const ForwardBatch& batch) {
  plan_batch(batch, /*graph=*/false);
}

void FlashKVBackend::init_cuda_graph_state(int max_bs, int max_num_tokens) {
  FLASHKV_CHECK(max_bs > 0 && max_num_tokens >= max_bs, "init_cuda_graph_state: expected max_bs > 0 and ",
                "max_num_tokens >= max_bs, got ", max_bs, " and ", max_num_tokens);
  State& s = *graph_;
  FLASHKV_CHECK(!s.graph_ready, "init_cuda_graph_state: already initialized (buffers a captured graph uses must not move)");
  s.graph_max_bs = max_bs;
  s.graph_max_tokens = max_num_tokens;
  s.graph_ready = true;
}

void FlashKVBackend::init_forward_metadata_capture_cuda_graph(const ForwardBatch& batch) {
  FLASHKV_CHECK(graph_->graph_ready, "init_forward_metadata_capture_cuda_graph: call init_cuda_graph_state first");
  plan_batch(batch, /*graph=*/true);
}

void FlashKVBackend::init_forward_metadata_replay_cuda_graph(const ForwardBatch& batch) {
  FLASHKV_CHECK(graph_->graph_ready, "init_forward_metadata_replay_cuda_graph: call init_cuda_graph_state first");
  plan_batch(batch, /*graph=*/true);
}

void FlashKVBackend::plan_batch(const ForwardBatch& b, bool graph) {
  State& s = graph ? *graph_ : *eager_;
  active_ = &s;
  const BackendOptions& o = options_;
  const Device dev = o.device;
  s.planned = false;
  s.mode = b.mode;
  // --- validation (nothing is written before it passes) ---
  FLASHKV_CHECK(b.batch_size >= 0, "batch.batch_size: expected >= 0, got ", b.batch_size);
  if (b.mode == ForwardMode::IDLE) {
    s.batch_size = 0;
    s.num_tokens = 0;
    s.planned = true;
    return;
  }
  const int32_t B = b.batch_size;
  FLASHKV_CHECK(b.req_to_token_pool != nullptr, "batch.req_to_token_pool: expected a pool, got null");
  FLASHKV_CHECK(b.token_to_kv_pool != nullptr, "batch.token_to_kv_pool: expected a pool, got null");
  FLASHKV_CHECK(b.token_to_kv_pool->page_size() == 1,
                "batch.token_to_kv_pool: the backend indexes KV by token (page_size 1), got page_size ",
                b.token_to_kv_pool->page_size());
  FLASHKV_CHECK(b.req_to_token_pool->device() == dev && b.token_to_kv_pool->device() == dev,
                "batch pools: expected device ", dev.str());
  FLASHKV_CHECK_EQ("batch.seq_lens_cpu size", static_cast<int64_t>(b.seq_lens_cpu.size()), int64_t{B});
  Expect(b.req_pool_indices, "batch.req_pool_indices").ndim(1).device(dev).dtype(DType::i32).dim(0, B, "batch_size");
  const bool decode = b.mode == ForwardMode::DECODE;
  const bool extend = b.mode == ForwardMode::EXTEND || b.mode == ForwardMode::MIXED;
  if (extend) {
    FLASHKV_CHECK_EQ("batch.extend_seq_lens_cpu size", static_cast<int64_t>(b.extend_seq_lens_cpu.size()), int64_t{B});
    FLASHKV_CHECK_EQ("batch.extend_prefix_lens_cpu size", static_cast<int64_t>(b.extend_prefix_lens_cpu.size()), int64_t{B});
  }
  if (b.mode == ForwardMode::TARGET_VERIFY) {
    FLASHKV_CHECK(b.spec.draft_token_num > 0, "batch.spec.draft_token_num: expected > 0, got ",
                  b.spec.draft_token_num);
    Expect(b.spec.custom_mask, "batch.spec.custom_mask").ndim(1).device(dev).dtype(DType::u8);
  }
  if (b.mode == ForwardMode::DRAFT_EXTEND)
    FLASHKV_CHECK_EQ("batch.spec.accept_length_cpu size", static_cast<int64_t>(b.spec.accept_length_cpu.size()), int64_t{B});
  if (o.is_encoder_decoder)
    FLASHKV_CHECK_EQ("batch.encoder_lens_cpu size", static_cast<int64_t>(b.encoder_lens_cpu.size()), int64_t{B});
  const int64_t max_ctx = b.req_to_token_pool->max_context_len();
  s.qo_len.assign(B, 0);
  for (int32_t i = 0; i < B; ++i) {
    const int32_t seq = b.seq_lens_cpu[i];
    const int32_t enc = o.is_encoder_decoder ? b.encoder_lens_cpu[i] : 0;
    FLASHKV_CHECK(enc >= 0, "batch.encoder_lens_cpu[", i, "]: expected >= 0, got ", enc);
    FLASHKV_CHECK(seq >= 0 && int64_t{seq} + enc <= max_ctx, "batch.seq_lens_cpu[", i, "] = ", seq,
                  (enc ? " (after the encoder's tokens)" : ""), ": expected 0..", max_ctx - enc,
                  " (the pool's max_context_len)");
    s.qo_len[i] = b.extend_len(i);
    FLASHKV_CHECK(s.qo_len[i] >= 0 && s.qo_len[i] <= seq, "request ", i, ": ", s.qo_len[i],
                  " new tokens but seq_len ", seq, " (", mode_name(b.mode), ")");
    if (extend)
      FLASHKV_CHECK(b.extend_prefix_lens_cpu[i] + b.extend_seq_lens_cpu[i] == seq, "request ", i,
                    ": extend_prefix_len ", b.extend_prefix_lens_cpu[i], " + extend_seq_len ",
                    b.extend_seq_lens_cpu[i], " != seq_len ", seq);
  }
  s.qo_indptr = prefix_sums(s.qo_len);
  s.num_tokens = s.qo_indptr.back();
  Expect(b.out_cache_loc, "batch.out_cache_loc").ndim(1).device(dev).dtype(DType::i32)
      .dim(0, s.num_tokens, "num_tokens");
  if (graph) {
    FLASHKV_CHECK(B <= s.graph_max_bs && s.num_tokens <= s.graph_max_tokens, "CUDA-graph batch of ", B,
                  " requests / ", s.num_tokens, " tokens exceeds the capacity ", s.graph_max_bs, " / ",
                  s.graph_max_tokens);
  }
  s.batch_size = B;
  s.use_ragged = extend && !o.is_multimodal && !o.deterministic;
  s.extend_no_prefix = extend;
  if (extend)
    for (int32_t i = 0; i < B; ++i)
      if (b.extend_prefix_lens_cpu[i] > 0) s.extend_no_prefix = false;
  if (!s.use_ragged) s.extend_no_prefix = false;

  // --- plans and index sets ---
  // In graph mode buffers are sized for the capacities at the first capture and never move.
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
  shape.qo_indptr = s.qo_indptr.data();
  shape.num_qo_heads = o.num_qo_heads;
  shape.num_kv_heads = o.num_kv_heads;
  shape.head_dim_qk = o.head_dim_qk;
  shape.head_dim_v = o.head_dim_v;
  shape.page_size = 1;
  auto upload_plan = [&](const Plan& plan, Workspace& ws) {
    FLASHKV_CHECK(!fixed || ws.bytes() >= plan.layout.total_bytes, "workspace moved in graph mode");
    ws.reserve(std::max<size_t>(plan.layout.total_bytes, 1), dev);
    ws.upload(plan);
  };

  const int w = o.sliding_window_size;
  const bool external = decode && b.spec.kv_indices.defined();
  if (external) {
    FLASHKV_CHECK(s.wrappers.size() == 1, "batch.spec.kv_indices: precomputed indices need a model",
                  " without sliding-window or cross-attention layers");
    FLASHKV_CHECK_EQ("batch.spec.kv_indptr_cpu size", static_cast<int64_t>(b.spec.kv_indptr_cpu.size()), int64_t{B} + 1);
    Expect(b.spec.kv_indptr, "batch.spec.kv_indptr").ndim(1).device(dev).dtype(DType::i32).dim(0, B + 1, "batch + 1");
    Expect(b.spec.kv_indices, "batch.spec.kv_indices").ndim(1).device(dev).dtype(DType::i32);
    for (int32_t i = 0; i < B; ++i)
      FLASHKV_CHECK(b.spec.kv_indptr_cpu[i + 1] - b.spec.kv_indptr_cpu[i] == b.seq_lens_cpu[i],
                    "batch.spec.kv_indptr_cpu: row ", i, " spans ", b.spec.kv_indptr_cpu[i + 1] - b.spec.kv_indptr_cpu[i],
                    " entries, seq_lens_cpu says ", b.seq_lens_cpu[i]);
    FLASHKV_CHECK(b.spec.kv_indptr_cpu[0] >= 0 && b.spec.kv_indptr_cpu[B] <= b.spec.kv_indices.numel(),
                  "batch.spec.kv_indices: expected at least ", b.spec.kv_indptr_cpu[B], " entries, got ",
                  b.spec.kv_indices.numel());
  }
  for (State::Wrapper& wr : s.wrappers) {
    if (external) {
      // The caller built the index set; only plan over it.
      wr.kv_len = b.seq_lens_cpu;
      wr.indptr = b.spec.kv_indptr;
      wr.indices = b.spec.kv_indices;
      if (!wr.d_last_page_len.defined() || wr.d_last_page_len.numel() < std::max<int64_t>(cap_b, 1)) {
        FLASHKV_CHECK(!fixed, "last_page_len: past the CUDA-graph capacity");
        wr.d_last_page_len = Tensor::from_i32(std::vector<int32_t>(std::max<int64_t>(cap_b, 1), 1), dev);
      }
      shape.kv_len = wr.kv_len.data();
      shape.window_left = -1;
      shape.causal = false;
      plan_decode(shape, info, po, &wr.decode);
      upload_plan(wr.decode, wr.ws_decode);
      continue;
    }
    wr.kv_len.assign(B, 0);
    wr.kv_start.assign(B, 0);
    for (int32_t i = 0; i < B; ++i) {
      const int32_t seq = b.seq_lens_cpu[i], qo = s.qo_len[i];
      const int32_t enc = o.is_encoder_decoder ? b.encoder_lens_cpu[i] : 0;
      switch (wr.kind) {
        case WrapperKind::full:
          wr.kv_len[i] = (s.use_ragged) ? seq - qo : seq;
          wr.kv_start[i] = enc;
          break;
        case WrapperKind::window: {
          // Decode sees the last w + 1 tokens, extend the last w + new ones; a tree-mask verify
          // keeps the whole sequence so the mask's columns line up (the kernel applies the window).
          const int64_t keep = decode ? int64_t{w} + 1
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
    wr.kv_indptr = prefix_sums(wr.kv_len);
    const int64_t entries = wr.kv_indptr.back();
    ensure_i32(wr.d_kv_len, cap_b, dev, fixed, "kv_len");
    ensure_i32(wr.d_kv_start, cap_b, dev, fixed, "kv_start");
    ensure_i32(wr.d_kv_indptr, cap_b + 1, dev, fixed, "kv_indptr");
    ensure_i32(wr.d_kv_indices, graph ? int64_t{s.graph_max_bs} * max_ctx : entries, dev, fixed, "kv_indices");
    if (!wr.d_last_page_len.defined() || wr.d_last_page_len.numel() < std::max<int64_t>(cap_b, 1)) {
      FLASHKV_CHECK(!fixed, "last_page_len: past the CUDA-graph capacity");
      wr.d_last_page_len = Tensor::from_i32(std::vector<int32_t>(std::max<int64_t>(cap_b, 1), 1), dev);
    }
    upload_i32(wr.d_kv_len, wr.kv_len);
    upload_i32(wr.d_kv_start, wr.kv_start);
    upload_i32(wr.d_kv_indptr, wr.kv_indptr);
    TensorView lens = wr.d_kv_len.view().rows(0, B), starts = wr.d_kv_start.view().rows(0, B);
    TensorView indptr = wr.d_kv_indptr.view().rows(0, B + 1);
    wr.indptr = indptr;
    wr.indices = wr.d_kv_indices;
    build_kv_indices(b.req_to_token_pool->req_to_token(), b.req_pool_indices, lens, starts, indptr,
                     wr.d_kv_indices);
    if (wr.kind == WrapperKind::window && o.swa_allocator) {
      TensorView idx = wr.d_kv_indices.view().rows(0, std::max<int64_t>(entries, 0));
      if (entries > 0) translate_slots(idx, o.swa_allocator->full_to_swa_table(), idx);
    }
    // Plans.
    shape.kv_len = wr.kv_len.data();
    shape.window_left = wr.kind == WrapperKind::window ? w : -1;
    if (decode) {
      shape.causal = false;
      plan_decode(shape, info, po, &wr.decode);
      upload_plan(wr.decode, wr.ws_decode);
    } else {
      // The prefix-only pass of a ragged extend sees the whole prefix; everything else is
      // causal, except cross attention and a tree-masked verify.
      wr.paged_causal = !(s.use_ragged && wr.kind == WrapperKind::full) && wr.kind != WrapperKind::cross &&
                        b.mode != ForwardMode::TARGET_VERIFY;
      shape.causal = wr.paged_causal;
      plan_prefill(shape, info, po, &wr.paged);
      upload_plan(wr.paged, wr.ws_paged);
    }
  }
  if (!decode) {
    ensure_i32(s.d_qo_indptr, cap_b + 1, dev, fixed, "qo_indptr");
    upload_i32(s.d_qo_indptr, s.qo_indptr);
    if (s.use_ragged || o.has_encoder_only_layers) {
      shape.kv_len = s.qo_len.data();
      shape.window_left = -1;
      shape.causal = true;
      plan_prefill(shape, info, po, &s.ragged_causal);
      upload_plan(s.ragged_causal, s.ws_ragged_causal);
      if (o.has_encoder_only_layers) {
        shape.causal = false;
        plan_prefill(shape, info, po, &s.ragged_full);
        upload_plan(s.ragged_full, s.ws_ragged_full);
      }
    }
    if (b.mode == ForwardMode::TARGET_VERIFY) {
      s.mask_indptr.assign(B + 1, 0);
      for (int32_t i = 0; i < B; ++i)
        s.mask_indptr[i + 1] = s.mask_indptr[i] + s.qo_len[i] * b.seq_lens_cpu[i];
      FLASHKV_CHECK(b.spec.custom_mask.numel() >= s.mask_indptr.back(), "batch.spec.custom_mask: expected ",
                    s.mask_indptr.back(), " entries (draft_token_num x seq_len per request), got ",
                    b.spec.custom_mask.numel());
      ensure_i32(s.d_mask_indptr, cap_b + 1, dev, fixed, "mask_indptr");
      upload_i32(s.d_mask_indptr, s.mask_indptr);
    }
  }
  if (o.swa_allocator && s.num_tokens > 0) {
    ensure_i32(s.d_swa_out_cache_loc, graph ? s.graph_max_tokens : s.num_tokens, dev, fixed, "swa_out_cache_loc");
    translate_slots(b.out_cache_loc, o.swa_allocator->full_to_swa_table(),
                    s.d_swa_out_cache_loc.view().rows(0, s.num_tokens));
  }
  // Output and scratch.
  const int64_t rows = graph ? s.graph_max_tokens : std::max<int64_t>(s.num_tokens, 1);
  if (!s.out.defined() || s.out.size(0) < rows) {
    FLASHKV_CHECK(!fixed, "output buffer: past the CUDA-graph capacity");
    s.out = Tensor::empty({rows, o.num_qo_heads, o.head_dim_v}, o.q_dtype, dev);
    s.tmp_o = Tensor::empty({rows, o.num_qo_heads, o.head_dim_v}, o.q_dtype, dev);
    s.lse_a = Tensor::empty({rows, o.num_qo_heads}, DType::f32, dev);
    s.lse_b = Tensor::empty({rows, o.num_qo_heads}, DType::f32, dev);
  }
  if (graph) s.in_graph = true;
  s.planned = true;
}

namespace {
struct LayerIO {
  TensorView q, k, v, out;  // 3-D views
  KVPool* pool = nullptr;
  TensorView cache_loc;
  AttentionOptions opt;
};
}  // namespace

// Resolves everything a layer call needs, validating before anything is written.
static LayerIO layer_io(const BackendOptions& o, const LayerSpec& layer, const ForwardBatch& b,
                        const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& own_out, int64_t T,
                        const TensorView& swa_loc) {
  FLASHKV_CHECK(layer.num_qo_heads == o.num_qo_heads && layer.num_kv_heads == o.num_kv_heads &&
                    layer.head_dim_qk == o.head_dim_qk && layer.v_dim() == o.head_dim_v,
                "layer ", layer.layer_id, ": heads/dims ", layer.num_qo_heads, "/", layer.num_kv_heads,
                "/", layer.head_dim_qk, "/", layer.v_dim(), " differ from the backend's ", o.num_qo_heads,
                "/", o.num_kv_heads, "/", o.head_dim_qk, "/", o.head_dim_v);
  FLASHKV_CHECK((layer.sliding_window_size >= 0) == (o.sliding_window_size >= 0 && layer.sliding_window_size >= 0),
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
  if (out.defined()) Expect(io.out, "out").device(o.device).dtype(o.q_dtype).dim(0, T, "num_tokens");
  if (k.defined()) {
    io.k = as_heads(k, o.num_kv_heads, o.head_dim_qk, "k");
    io.v = as_heads(v, o.num_kv_heads, o.head_dim_v, "v");
    Expect(io.k, "k").device(o.device).dtype(o.q_dtype);
    Expect(io.v, "v").device(o.device).dtype(o.q_dtype).dim(0, io.k.shape[0], "rows of k");
  }
  const bool window = layer.sliding_window_size >= 0;
  io.pool = (window && o.swa_kv_pool) ? o.swa_kv_pool : b.token_to_kv_pool;
  FLASHKV_CHECK(layer.layer_id >= 0 && layer.layer_id < io.pool->num_layers(), "layer.layer_id: expected 0..",
                io.pool->num_layers() - 1, ", got ", layer.layer_id);
  io.cache_loc = layer.is_cross_attention ? b.encoder_out_cache_loc
                 : (window && o.swa_kv_pool) ? swa_loc
                                             : b.out_cache_loc;
  io.opt.sm_scale = layer.scaling;
  io.opt.logits_soft_cap = layer.logit_cap;
  io.opt.window_left = window ? layer.sliding_window_size : -1;
  return io;
}

static void save_kv(const LayerIO& io, const LayerSpec& layer) {
  FLASHKV_CHECK(io.k.shape[0] == io.cache_loc.numel(), "k: ", io.k.shape[0], " rows but the cache location",
                " list has ", io.cache_loc.numel(), " (", layer.is_cross_attention ? "encoder_out_cache_loc" : "out_cache_loc", ")");
  append_kv(io.k, io.v, io.cache_loc, io.pool->k(layer.layer_id), io.pool->v(layer.layer_id),
            io.pool->k_scale(layer.layer_id), io.pool->v_scale(layer.layer_id));
}

static PagedKV paged_view(const KVPool& pool, int layer, const TensorView& indptr,
                          const TensorView& indices, const Tensor& last_page_len, int32_t B) {
  PagedKV kv;
  kv.k = pool.k(layer);
  kv.v = pool.v(layer);
  kv.indptr = indptr;
  kv.indices = indices;
  kv.last_page_len = last_page_len.view().rows(0, std::max(B, 1));
  kv.page_size = 1;
  kv.k_scale = pool.k_scale(layer);
  kv.v_scale = pool.v_scale(layer);
  return kv;
}

static TensorView flat_output(const TensorView& out3) {
  TensorView r = out3;
  r.ndim = 2;
  r.shape[1] = out3.shape[1] * out3.shape[2];
  r.stride[1] = 1;
  return r;
}

// The batch's new tokens' slots in the SWA pool (empty without one).
static TensorView swa_loc_of(const Tensor& t, int64_t T) {
  return t.defined() ? t.view().rows(0, T) : TensorView();
}

// Which wrapper (index set + plans) serves a layer.
static int wrapper_index(const BackendOptions& o, const LayerSpec& layer) {
  if (o.sliding_window_size >= 0) return layer.sliding_window_size >= 0 ? 0 : 1;
  if (o.is_encoder_decoder) return layer.is_cross_attention ? 1 : 0;
  return 0;
}

TensorView FlashKVBackend::forward_decode(const TensorView& q, const TensorView& k,
                                          const TensorView& v, const LayerSpec& layer,
                                          const ForwardBatch& b, bool save_kv_cache,
                                          const TensorView& out) {
  FLASHKV_CHECK(active_ != nullptr, "forward: call init_forward_metadata first");
  State& s = *active_;
  FLASHKV_CHECK(s.planned && s.mode == ForwardMode::DECODE && s.batch_size == b.batch_size,
                "forward_decode: call init_forward_metadata with this DECODE batch first");
  LayerIO io = layer_io(options_, layer, b, q, k, v, out, s.out, s.num_tokens, swa_loc_of(s.d_swa_out_cache_loc, s.num_tokens));
  State::Wrapper& wr = s.wrappers[wrapper_index(options_, layer)];
  if (save_kv_cache && k.defined()) save_kv(io, layer);
  const PagedKV kv = paged_view(*io.pool, layer.layer_id, wr.indptr, wr.indices,
                                wr.d_last_page_len, s.batch_size);
  paged_decode(wr.decode, io.q, kv, io.opt, io.out, TensorView(), wr.ws_decode);
  return flat_output(io.out);
}

TensorView FlashKVBackend::forward_extend(const TensorView& q, const TensorView& k,
                                          const TensorView& v, const LayerSpec& layer,
                                          const ForwardBatch& b, bool save_kv_cache,
                                          const TensorView& out) {
  FLASHKV_CHECK(active_ != nullptr, "forward: call init_forward_metadata first");
  State& s = *active_;
  FLASHKV_CHECK(s.planned && s.mode == b.mode && s.mode != ForwardMode::DECODE && s.batch_size == b.batch_size,
                "forward_extend: call init_forward_metadata with this ", mode_name(b.mode), " batch first");
  LayerIO io = layer_io(options_, layer, b, q, k, v, out, s.out, s.num_tokens, swa_loc_of(s.d_swa_out_cache_loc, s.num_tokens));
  State::Wrapper& wr = s.wrappers[wrapper_index(options_, layer)];
  const TensorView qo = s.d_qo_indptr.view().rows(0, s.batch_size + 1);
  const PagedKV kv = paged_view(*io.pool, layer.layer_id, wr.indptr, wr.indices,
                                wr.d_last_page_len, s.batch_size);
  const int64_t T = s.num_tokens;
  if (layer.attn_type == AttentionType::ENCODER_ONLY) {
    // Encoder-only layers: bidirectional over the new tokens; nothing is cached.
    FLASHKV_CHECK(options_.has_encoder_only_layers, "layer ", layer.layer_id,
                  ": ENCODER_ONLY needs BackendOptions.has_encoder_only_layers");
    FLASHKV_CHECK(k.defined(), "k: an encoder-only layer needs the new tokens' k and v");
    io.opt.causal = false;
    ragged_prefill(s.ragged_full, io.q, io.k, io.v, qo, qo, io.opt, io.out, TensorView(), s.ws_ragged_full);
    return flat_output(io.out);
  }
  const bool ragged = s.use_ragged && wr.kind == WrapperKind::full && !layer.is_cross_attention;
  if (!ragged) {
    // One paged pass over everything the wrapper indexes; the new K/V must be in the pool first.
    if (save_kv_cache && k.defined()) save_kv(io, layer);
    io.opt.causal = wr.paged_causal;
    if (b.mode == ForwardMode::TARGET_VERIFY && !layer.is_cross_attention) {
      io.opt.custom_mask = b.spec.custom_mask;
      io.opt.mask_indptr = s.d_mask_indptr.view().rows(0, s.batch_size + 1);
    }
    paged_prefill(wr.paged, io.q, qo, kv, io.opt, io.out, TensorView(), wr.ws_paged);
    return flat_output(io.out);
  }
  FLASHKV_CHECK(k.defined(), "k: the ragged extend path needs the new tokens' k and v");
  io.opt.causal = true;
  if (s.extend_no_prefix) {
    ragged_prefill(s.ragged_causal, io.q, io.k, io.v, qo, qo, io.opt, io.out, TensorView(),
                   s.ws_ragged_causal);
  } else {
    // New tokens among themselves (causal), then the cached prefix (all visible), merged by LSE.
    const TensorView lse_a = s.lse_a.view().rows(0, T), lse_b = s.lse_b.view().rows(0, T);
    const TensorView tmp = s.tmp_o.view().rows(0, T);
    ragged_prefill(s.ragged_causal, io.q, io.k, io.v, qo, qo, io.opt, io.out, lse_a, s.ws_ragged_causal);
    io.opt.causal = false;
    paged_prefill(wr.paged, io.q, qo, kv, io.opt, tmp, lse_b, wr.ws_paged);
    merge_state(io.out, lse_a, tmp, lse_b, io.out, TensorView());
  }
  if (save_kv_cache) save_kv(io, layer);
  return flat_output(io.out);
}

}  // namespace flashkv
