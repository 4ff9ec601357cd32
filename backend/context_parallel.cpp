// FlashKVBackend's context-parallel path (BackendOptions::cp_comm, docs/PARALLEL.md). The batch
// carries this rank's share of each request (ForwardBatch, "Context parallelism"): its
// req_to_token rows list the rank's positions only, so build_kv_indices gathers the rank's
// entries, and decode runs parallel::CpDecode over them, every extend mode parallel::CpExtend over
// the rank's prefix entries and the ranks' new tokens. The new tokens' K/V go into the pool of the
// rank that holds their positions: decode appends the batch's rows with the other ranks' tokens
// sent to the dummy slot 0, an extend keeps its tokens with CpExtend::append_local_kv.
// On a GPU the batch's index tensors live on the device: the few the plan reads on the host (the
// new tokens' slots, and target verify's tree mask, from which CpExtend derives its local masks)
// are copied to the host once per batch; req_to_token is read on the device (build_kv_indices).
#include <algorithm>
#include <climits>
#include <optional>

#include "backend_detail.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "index_buffer.h"

namespace flashkv {

using backend_detail::check_host_entries;
using backend_detail::check_pool;
using backend_detail::flat_output;
using backend_detail::layer_io;
using backend_detail::LayerIO;
using backend_detail::paged_view;
using backend_detail::prefix_sums_into;
using backend_detail::prepare_save;
using backend_detail::upload_indices;
using backend_detail::with_index_room;

namespace {

// `t` itself when it is on the host, else its contents copied into `host` (grown as needed) and a
// view of them. Waits for the copy (the caller reads it at once).
TensorView host_copy(const TensorView& t, Tensor& host, Stream stream) {
  if (t.device.is_cpu()) return t;
  const int64_t n = t.numel();
  if (!host.defined() || host.dtype() != t.dtype || host.numel() < std::max<int64_t>(n, 1))
    host = Tensor::empty({std::max<int64_t>(n, 1)}, t.dtype, Device::cpu());
  copy_bytes(host.data(), Device::cpu(), t.data, t.device, t.nbytes(), stream);
  return host.view().rows(0, n);
}

}  // namespace

FlashKVBackend::CpState::CpState(parallel::Communicator& c, const parallel::CpOptions& options,
                                 bool has_window)
    : comm(c), shard(options, c.size()) {
  for (int kind = 0; kind < (has_window ? 2 : 1); ++kind) {
    decode.push_back(std::make_unique<parallel::CpDecode>(c, options));
    extend.push_back(std::make_unique<parallel::CpExtend>(c, options));
  }
}

int64_t FlashKVBackend::cp_query_rows() const {
  FLASHKV_CHECK(cp_ != nullptr, "cp_query_rows: the backend was built without context ",
                "parallelism (BackendOptions::cp_comm)");
  FLASHKV_CHECK(cp_->planned, "cp_query_rows: call init_forward_metadata first");
  return cp_->query_rows;
}

void FlashKVBackend::cp_plan(const ForwardBatch& b) {
  CpState& c = *cp_;
  const BackendOptions& o = options_;
  const Device dev = o.device;
  c.planned = false;
  FLASHKV_CHECK(b.batch_size >= 0, "batch.batch_size: expected >= 0, got ", b.batch_size);
  c.mode = b.mode;
  c.batch_size = 0;
  c.query_rows = 0;
  if (b.mode == ForwardMode::IDLE) {
    c.planned = true;
    return;
  }

  // --- the batch against its mode and this rank's pools ---
  const int32_t B = b.batch_size;
  const int rank = c.comm.rank();
  const bool decode = b.mode == ForwardMode::DECODE;
  const bool verify = b.mode == ForwardMode::TARGET_VERIFY;
  FLASHKV_CHECK(b.req_to_token_pool != nullptr,
                "batch.req_to_token_pool: expected a pool, got null");
  FLASHKV_CHECK(b.token_to_kv_pool != nullptr, "batch.token_to_kv_pool: expected a pool, got null");
  FLASHKV_CHECK(b.req_to_token_pool->device() == dev, "batch.req_to_token_pool: expected device ",
                dev.str(), ", got ", b.req_to_token_pool->device().str());
  check_pool(*b.token_to_kv_pool, o, "batch.token_to_kv_pool");
  FLASHKV_CHECK(!b.spec.kv_indices.defined(), "batch.spec.kv_indices: precomputed decode indices ",
                "are not supported with context parallelism");
  FLASHKV_CHECK_EQ("batch.seq_lens_cpu size", static_cast<int64_t>(b.seq_lens_cpu.size()),
                   int64_t{B});
  Expect(b.req_pool_indices, "batch.req_pool_indices")
      .ndim(1)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, B, "batch_size");
  check_host_entries(b.req_pool_indices, b.req_to_token_pool->max_reqs(), "batch.req_pool_indices",
                     "a row of req_to_token");
  if (b.mode == ForwardMode::EXTEND || b.mode == ForwardMode::MIXED) {
    FLASHKV_CHECK_EQ("batch.extend_seq_lens_cpu size",
                     static_cast<int64_t>(b.extend_seq_lens_cpu.size()), int64_t{B});
    FLASHKV_CHECK_EQ("batch.extend_prefix_lens_cpu size",
                     static_cast<int64_t>(b.extend_prefix_lens_cpu.size()), int64_t{B});
  }
  if (verify) {
    FLASHKV_CHECK(b.spec.draft_token_num > 0, "batch.spec.draft_token_num: expected > 0, got ",
                  b.spec.draft_token_num);
    Expect(b.spec.custom_mask, "batch.spec.custom_mask")
        .ndim(1)
        .device(dev)
        .dtype(DType::u8)
        .contiguous();
  }
  if (b.mode == ForwardMode::DRAFT_EXTEND)
    FLASHKV_CHECK_EQ("batch.spec.accept_length_cpu size",
                     static_cast<int64_t>(b.spec.accept_length_cpu.size()), int64_t{B});
  const int64_t max_ctx = b.req_to_token_pool->max_context_len();
  std::vector<int32_t> prefix(B), qo(B);
  c.kv_len.assign(B, 0);
  int64_t tokens = 0;
  for (int32_t i = 0; i < B; ++i) {
    const int32_t seq = b.seq_lens_cpu[i];
    FLASHKV_CHECK(seq >= 0, "batch.seq_lens_cpu[", i, "] = ", seq, ": expected >= 0");
    qo[i] = b.extend_len(i);
    FLASHKV_CHECK(qo[i] >= 0 && qo[i] <= seq, "request ", i, ": ", qo[i],
                  " new tokens but seq_len ", seq, " (", mode_name(b.mode), ")");
    if (b.mode == ForwardMode::EXTEND || b.mode == ForwardMode::MIXED)
      FLASHKV_CHECK(int64_t{b.extend_prefix_lens_cpu[i]} + b.extend_seq_lens_cpu[i] == seq,
                    "request ", i, ": extend_prefix_len ", b.extend_prefix_lens_cpu[i],
                    " + extend_seq_len ", b.extend_seq_lens_cpu[i], " != seq_len ", seq);
    prefix[i] = seq - qo[i];
    const int64_t local = c.shard.local_len(rank, seq);
    FLASHKV_CHECK(local <= max_ctx, "batch.seq_lens_cpu[", i, "] = ", seq, ": rank ", rank,
                  " holds ", local, " of its positions, more than a row of its req_to_token pool (",
                  max_ctx, ")");
    c.kv_len[i] = static_cast<int32_t>(decode ? local : c.shard.local_len(rank, prefix[i]));
    tokens += qo[i];
  }
  prefix_sums_into(c.kv_len, "KV entries", &c.kv_indptr);
  // Each new token's slot: in this rank's pool where the rank holds its position, else the dummy
  // slot 0 (a token written there by decode's append is never read).
  Expect(b.out_cache_loc, "batch.out_cache_loc")
      .ndim(1)
      .device(dev)
      .dtype(DType::i32)
      .contiguous()
      .dim(0, tokens, "num_tokens");
  const int32_t* loc = host_copy(b.out_cache_loc, c.h_out_cache_loc, o.stream).ptr<int32_t>();
  const int64_t first_slot = b.token_to_kv_pool->page_size();
  const int64_t num_rows = b.token_to_kv_pool->num_rows();
  c.kept_loc.clear();
  int64_t row = 0;
  for (int32_t i = 0; i < B; ++i)
    for (int32_t t = 0; t < qo[i]; ++t, ++row) {
      const int64_t pos = int64_t{prefix[i]} + t;
      const int owner = c.shard.owner(pos);
      if (owner == rank) {
        FLASHKV_CHECK(loc[row] >= first_slot && loc[row] < num_rows, "batch.out_cache_loc[", row,
                      "] = ", loc[row], ": this rank holds position ", pos, " of request ", i,
                      ", expected a slot of its pool in [", first_slot, ", ", num_rows, ")");
        c.kept_loc.push_back(loc[row]);
      } else {
        FLASHKV_CHECK(loc[row] == 0, "batch.out_cache_loc[", row, "] = ", loc[row], ": rank ",
                      owner, " holds position ", pos, " of request ", i,
                      ", expected the dummy slot 0 on rank ", rank);
      }
    }
  if (verify) {
    c.mask_indptr.assign(B + 1, 0);
    int64_t total = 0;
    for (int32_t i = 0; i < B; ++i) {
      total += int64_t{qo[i]} * b.seq_lens_cpu[i];
      FLASHKV_CHECK(total <= INT32_MAX, "batch.spec.custom_mask: more than 2^31 - 1 entries");
      c.mask_indptr[i + 1] = static_cast<int32_t>(total);
    }
    FLASHKV_CHECK(b.spec.custom_mask.numel() >= total, "batch.spec.custom_mask: expected ", total,
                  " entries (draft_token_num x seq_len per request), got ",
                  b.spec.custom_mask.numel());
    c.h_mask_indptr = Tensor::from_i32(c.mask_indptr, Device::cpu());
    // CpExtend derives its local masks from the tree mask on the host.
    c.h_custom_mask_view = host_copy(b.spec.custom_mask.rows(0, total), c.h_custom_mask, o.stream);
  }

  // --- the sharded operators' plans (host), one per kind of layer ---
  PlanOptions po;
  po.enable_split_kv = !o.disable_split_kv;
  if (o.deterministic) po.fixed_split_size = decode ? o.decode_split_size : o.prefill_split_size;
  for (size_t kind = 0; kind < c.decode.size(); ++kind) {
    const int32_t window = kind == 1 ? o.sliding_window_size : -1;
    if (decode) {
      parallel::CpDecodeShape shape;
      shape.kv_len = b.seq_lens_cpu;
      shape.num_qo_heads = o.num_qo_heads;
      shape.num_kv_heads = o.num_kv_heads;
      shape.head_dim_qk = o.head_dim_qk;
      shape.head_dim_v = o.head_dim_v;
      shape.dtype = o.q_dtype;
      shape.window_left = window;
      c.decode[kind]->plan(shape, po, o.stream);
    } else {
      parallel::CpExtendShape shape;
      shape.prefix_len = prefix;
      shape.extend_len = qo;
      shape.num_qo_heads = o.num_qo_heads;
      shape.num_kv_heads = o.num_kv_heads;
      shape.head_dim_qk = o.head_dim_qk;
      shape.head_dim_v = o.head_dim_v;
      shape.dtype = o.q_dtype;
      shape.causal = !verify;
      shape.window_left = window;
      if (verify) {
        shape.custom_mask = c.h_custom_mask_view;
        shape.mask_indptr = c.h_mask_indptr;
      }
      c.extend[kind]->plan(shape, po, o.stream);
      FLASHKV_CHECK(static_cast<int64_t>(c.kept_loc.size()) == c.extend[kind]->num_local_new(),
                    "context parallelism: rank ", rank, " keeps ", c.kept_loc.size(),
                    " new tokens by the batch's slots, CpExtend says ",
                    c.extend[kind]->num_local_new());
    }
  }
  c.query_rows = decode ? B : c.extend[0]->num_own_rows();

  // --- the rank's index set, and buffers ---
  const int64_t entries = c.kv_indptr.back();
  c.d_kv_len = with_index_room(c.d_kv_len, B, dev, false, "kv_len");
  c.d_kv_indptr = with_index_room(c.d_kv_indptr, int64_t{B} + 1, dev, false, "kv_indptr");
  c.d_kv_indices = with_index_room(c.d_kv_indices, entries, dev, false, "kv_indices");
  if (!c.d_last_page_len.defined() || c.d_last_page_len.numel() < std::max(B, 1))
    c.d_last_page_len = Tensor::from_i32(std::vector<int32_t>(std::max(B, 1), 1), dev);
  upload_indices(c.d_kv_len, c.kv_len, o.stream);
  upload_indices(c.d_kv_indptr, c.kv_indptr, o.stream);
  build_kv_indices(b.req_to_token_pool->req_to_token(), b.req_pool_indices,
                   c.d_kv_len.view().rows(0, B), TensorView(), c.d_kv_indptr.view().rows(0, B + 1),
                   c.d_kv_indices, o.stream);
  c.d_kept_loc = with_index_room(c.d_kept_loc, static_cast<int64_t>(c.kept_loc.size()), dev, false,
                                 "kept_loc");
  upload_indices(c.d_kept_loc, c.kept_loc, o.stream);
  const int64_t rows = std::max<int64_t>(c.query_rows, 1);
  if (!c.out.defined() || c.out.size(0) < rows)
    c.out = Tensor::empty({rows, o.num_qo_heads, o.head_dim_v}, o.q_dtype, dev);
  c.batch_size = B;
  c.planned = true;
}

TensorView FlashKVBackend::cp_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const LayerSpec& layer, const ForwardBatch& b,
                                      bool save_kv_cache, const TensorView& out) {
  CpState& c = *cp_;
  FLASHKV_CHECK(c.planned && c.mode == b.mode && c.batch_size == b.batch_size,
                "forward: call init_forward_metadata with this ", mode_name(b.mode),
                " batch first");
  FLASHKV_CHECK(layer.attn_type == AttentionType::DECODER, "layer ", layer.layer_id,
                ": encoder-only layers are not supported with context parallelism");
  const LayerIO io =
      layer_io(options_, layer, b, q, k, v, out, c.out.view(), c.query_rows, TensorView());
  const int32_t B = c.batch_size;
  const size_t kind = layer.sliding_window_size >= 0 ? 1 : 0;
  const PagedKV kv = paged_view(*io.pool, layer.layer_id, c.d_kv_indptr.view().rows(0, B + 1),
                                c.d_kv_indices, c.d_last_page_len, B);
  const Stream stream = options_.stream;
  if (c.mode == ForwardMode::DECODE) {
    // The new token goes into the pool first: the local decode reads it where this rank holds it.
    if (save_kv_cache && io.k.defined()) prepare_save(io, layer).run(stream);
    c.decode[kind]->run(io.q, kv, io.opt, io.out, TensorView(), stream);
    return flat_output(io.out);
  }
  FLASHKV_CHECK(io.k.defined(), "k: a context-parallel extend needs the new tokens' k and v");
  AttentionOptions opt = io.opt;
  opt.causal = c.mode != ForwardMode::TARGET_VERIFY;
  parallel::CpExtend& extend = *c.extend[kind];
  extend.run(io.q, io.k, io.v, kv, opt, io.out, TensorView(), stream);
  if (save_kv_cache) {
    const int32_t id = layer.layer_id;
    extend.append_local_kv(
        io.k, io.v, c.d_kept_loc.view().rows(0, static_cast<int64_t>(c.kept_loc.size())),
        io.pool->k(id), io.pool->v(id), io.pool->k_scale(id), io.pool->v_scale(id), stream);
  }
  return flat_output(io.out);
}

}  // namespace flashkv
