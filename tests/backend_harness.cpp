#include "backend_harness.h"

#include <algorithm>

#include "flashkv/ops/kv_ops.h"
#include "flashkv/reference/layer_reference.h"

namespace flashkv::test {

Harness::Harness(const ModelShape& shape, BackendOptions extra)
    : shape_(shape), rng_(test_seed(777)) {
  const Device d = shape.device;
  r2t_ = std::make_unique<ReqToTokenPool>(shape.max_reqs, shape.max_context, d);
  KVPoolConfig pc;
  pc.num_slots = shape.slots;
  pc.num_layers = shape.num_layers;
  pc.num_kv_heads = shape.hkv;
  pc.head_dim_qk = shape.head_dim;
  pc.head_dim_v = shape.head_dim_v ? shape.head_dim_v : shape.head_dim;
  pc.dtype = shape.kv_dtype;
  pc.page_size = shape.page_size;
  pc.device = d;
  pool_ = std::make_unique<KVPool>(pc);
  if (is_fp8(shape.kv_dtype))
    for (int l = 0; l < shape.num_layers; ++l) pool_->set_scales(l, 0.5f, 2.0f);
  BackendOptions o = extra;
  o.device = d;
  o.q_dtype = shape.dtype;
  o.num_qo_heads = shape.hq;
  o.num_kv_heads = shape.hkv;
  o.head_dim_qk = shape.head_dim;
  o.head_dim_v = pc.head_dim_v;
  o.sliding_window_size = shape.sliding_window;
  o.is_encoder_decoder = shape.encoder_decoder;
  o.has_encoder_only_layers = shape.encoder_only;
  if (shape.swa_pool) {
    swa_pool_ = std::make_unique<KVPool>(pc);
    if (is_fp8(shape.kv_dtype))
      for (int l = 0; l < shape.num_layers; ++l) swa_pool_->set_scales(l, 0.5f, 2.0f);
    auto swa = std::make_unique<SWAAllocator>(shape.slots, shape.slots, shape.page_size, d);
    swa_alloc_ = swa.get();
    alloc_ = std::move(swa);
    o.swa_kv_pool = swa_pool_.get();
    o.swa_allocator = swa_alloc_;
  } else {
    alloc_ = std::make_unique<PagedAllocator>(shape.slots, shape.page_size);
  }
  if (shape.shuffle_pages) shuffle_free_pages();
  backend_ = std::make_unique<FlashKVBackend>(o);
  if (shape.sinks)
    for (int l = 0; l < shape.num_layers; ++l) {
      // Wide enough that a sink sometimes dominates a row and sometimes vanishes.
      Tensor host = random_tensor(rng_, {shape.hq}, DType::f32, 3.0);
      Tensor dev = Tensor::empty({shape.hq}, DType::f32, d);
      copy_bytes(dev.data(), d, host.data(), Device::cpu(), sizeof(float) * shape.hq);
      synchronize(d);
      sinks_.push_back(std::move(dev));
    }
}

void Harness::shuffle_free_pages() {
  // The allocator hands out the most recently freed page first: free every page in a random
  // order, and later requests get their pages in that (reversed) order.
  std::vector<std::vector<int32_t>> pages;
  while (auto page = alloc_->alloc(shape_.page_size)) pages.push_back(*page);
  std::shuffle(pages.begin(), pages.end(), rng_.gen());
  for (const auto& page : pages) alloc_->free(page);
}

LayerSpec Harness::layer(int i) const {
  LayerSpec l;
  l.layer_id = i;
  l.num_qo_heads = shape_.hq;
  l.num_kv_heads = shape_.hkv;
  l.head_dim_qk = shape_.head_dim;
  l.head_dim_v = shape_.head_dim_v;
  l.logit_cap = shape_.logit_cap;
  l.scaling = 0.9f / std::sqrt(static_cast<float>(shape_.head_dim));
  if (shape_.sliding_window >= 0 && i % 2 == 0) l.sliding_window_size = shape_.sliding_window;
  if (shape_.encoder_decoder && i % 2 == 1) l.is_cross_attention = true;
  if (shape_.encoder_only) l.attn_type = AttentionType::ENCODER_ONLY;
  if (shape_.sinks) l.sinks = sinks_[i];
  return l;
}

void Harness::fill_random_kv(const std::vector<int32_t>& slots, bool encoder) {
  if (slots.empty()) return;
  const int64_t n = static_cast<int64_t>(slots.size());
  const int dv = shape_.head_dim_v ? shape_.head_dim_v : shape_.head_dim;
  Tensor loc = Tensor::from_i32(slots, shape_.device);
  for (int l = 0; l < shape_.num_layers; ++l) {
    const LayerSpec spec = layer(l);
    // Encoder tokens live in cross layers; decoder tokens in the others.
    if (shape_.encoder_decoder && spec.is_cross_attention != encoder) continue;
    Tensor k =
        random_tensor(rng_, {n, shape_.hkv, shape_.head_dim}, shape_.dtype).to(shape_.device);
    Tensor v = random_tensor(rng_, {n, shape_.hkv, dv}, shape_.dtype).to(shape_.device);
    append_kv(k, v, loc, pool_->k(l), pool_->v(l), pool_->k_scale(l), pool_->v_scale(l));
    if (swa_pool_ && spec.sliding_window_size >= 0) {
      Tensor swa_loc = Tensor::from_i32(swa_alloc_->translate_full_to_swa(slots), shape_.device);
      append_kv(k, v, swa_loc, swa_pool_->k(l), swa_pool_->v(l), swa_pool_->k_scale(l),
                swa_pool_->v_scale(l));
    }
  }
}

Request Harness::add_request(int32_t cached, int32_t encoder) {
  Request r;
  auto rows = r2t_->alloc(1);
  EXPECT_TRUE(rows.has_value());
  r.row = (*rows)[0];
  r.encoder_len = encoder;
  auto slots = alloc_->alloc(int64_t{cached} + encoder);
  EXPECT_TRUE(slots.has_value());
  r.slots = *slots;
  r.seq_len = cached;
  r2t_->write(r.row, 0, r.slots);
  fill_random_kv(std::vector<int32_t>(r.slots.begin(), r.slots.begin() + encoder), true);
  fill_random_kv(std::vector<int32_t>(r.slots.begin() + encoder, r.slots.end()), false);
  return r;
}

void Harness::finish(Request& r) {
  alloc_->free(r.slots);
  r2t_->free({r.row});
  r.slots.clear();
}

void Harness::rollback(Request& r, int32_t seq_len) {
  const size_t keep = static_cast<size_t>(r.encoder_len) + static_cast<size_t>(seq_len);
  // Free whole pages only: a page that still holds a kept token stays with the request (its
  // later slots are what the next alloc_extend continues with).
  const int P = shape_.page_size;
  std::vector<int32_t> drop;
  for (size_t i = keep; i < r.slots.size(); ++i)
    if (keep == 0 || r.slots[i] / P != r.slots[keep - 1] / P) drop.push_back(r.slots[i]);
  alloc_->free(drop);
  r.slots.resize(keep);
  r.seq_len = seq_len;
}

ForwardBatch Harness::make_batch(ForwardMode mode, std::vector<Request*> reqs,
                                 const std::vector<int32_t>& new_lens) {
  ForwardBatch b;
  b.mode = mode;
  b.batch_size = static_cast<int32_t>(reqs.size());
  b.req_to_token_pool = r2t_.get();
  b.token_to_kv_pool = pool_.get();
  std::vector<int32_t> rows, locs, enc_locs;
  for (size_t i = 0; i < reqs.size(); ++i) {
    Request& r = *reqs[i];
    const int32_t n = new_lens[i];
    // The new tokens continue the request's last page, as a paged scheduler allocates them.
    ExtendRequest er;
    er.prefix_len = static_cast<int64_t>(r.slots.size());
    er.last_slot = r.slots.empty() ? 0 : r.slots.back();
    er.num_new = n;
    auto slots = alloc_->alloc_extend({er});
    EXPECT_TRUE(slots.has_value());
    r2t_->write(r.row, r.encoder_len + r.seq_len, *slots);
    r.slots.insert(r.slots.end(), slots->begin(), slots->end());
    locs.insert(locs.end(), slots->begin(), slots->end());
    rows.push_back(r.row);
    b.extend_prefix_lens_cpu.push_back(r.seq_len);
    b.extend_seq_lens_cpu.push_back(n);
    r.seq_len += n;
    b.seq_lens_cpu.push_back(r.seq_len);
    b.encoder_lens_cpu.push_back(r.encoder_len);
    for (int32_t e = 0; e < r.encoder_len; ++e) enc_locs.push_back(r.slots[e]);
  }
  if (mode == ForwardMode::TARGET_VERIFY) {
    b.spec.draft_token_num = new_lens.empty() ? 1 : new_lens[0];
    // A random draft tree per request (each draft token's parent is an earlier draft token or
    // the prefix): a draft row sees the whole prefix, its ancestors and itself.
    std::vector<uint8_t> m;
    for (size_t i = 0; i < reqs.size(); ++i) {
      const int32_t seq = reqs[i]->seq_len, d = b.spec.draft_token_num, prefix = seq - d;
      std::vector<std::vector<uint8_t>> sees(d, std::vector<uint8_t>(d, 0));
      for (int32_t qi = 0; qi < d; ++qi) {
        const int32_t parent = qi == 0 ? -1 : rng_.uniform_int(-1, qi - 1);
        if (parent >= 0) sees[qi] = sees[parent];
        sees[qi][qi] = 1;
      }
      for (int32_t qi = 0; qi < d; ++qi)
        for (int32_t j = 0; j < seq; ++j) m.push_back(j < prefix || sees[qi][j - prefix]);
    }
    mask_host_ = Tensor::empty({std::max<int64_t>(static_cast<int64_t>(m.size()), 1)}, DType::u8);
    std::copy(m.begin(), m.end(), mask_host_.ptr<uint8_t>());
    mask_ = mask_host_.to(shape_.device);
    b.spec.custom_mask = mask_;
  }
  if (mode == ForwardMode::DRAFT_EXTEND) b.spec.accept_length_cpu = new_lens;
  if (!shape_.encoder_decoder) b.encoder_lens_cpu.clear();
  rpi_ = Tensor::from_i32(rows, shape_.device);
  loc_ = Tensor::from_i32(locs, shape_.device);
  enc_loc_ = Tensor::from_i32(enc_locs, shape_.device);
  b.req_pool_indices = rpi_;
  b.out_cache_loc = loc_.view().rows(0, static_cast<int64_t>(locs.size()));
  b.encoder_out_cache_loc = enc_loc_.view().rows(0, static_cast<int64_t>(enc_locs.size()));
  batch_reqs_ = reqs;
  batch_new_ = new_lens;
  return b;
}

reference::Result Harness::reference_for(const ForwardBatch& b, int l, const Tensor& q_host,
                                         const Tensor* k_host, const Tensor* v_host) {
  // The tree mask of a verify pass is packed request after request, [qo_len, seq_len] each.
  std::vector<ReferenceRequest> reqs;
  int64_t mask_offset = 0, new_row = 0;
  const bool fresh = k_host != nullptr && backend_->reads_new_kv_from_input(layer(l));
  for (size_t i = 0; i < batch_reqs_.size(); ++i) {
    const Request& r = *batch_reqs_[i];
    ReferenceRequest rr;
    rr.slots = r.slots.data();
    rr.encoder_len = r.encoder_len;
    rr.seq_len = r.seq_len;
    rr.qo_len = b.extend_len(static_cast<int32_t>(i));
    rr.new_len = rr.qo_len;
    rr.new_row = new_row;
    new_row += rr.qo_len;
    if (b.mode == ForwardMode::TARGET_VERIFY) {
      rr.mask = mask_host_.ptr<uint8_t>() + mask_offset;
      mask_offset += int64_t{rr.qo_len} * rr.seq_len;
    }
    reqs.push_back(rr);
  }
  return layer_reference(layer(l), reqs, q_host, *pool_, swa_pool_.get(),
                         swa_pool_ ? swa_alloc_ : nullptr, fresh ? k_host->view() : TensorView(),
                         fresh ? v_host->view() : TensorView());
}

void Harness::check_layer(const ForwardBatch& b, int l, const Tensor& q_host,
                          const TensorView& out) {
  const int dv = shape_.head_dim_v ? shape_.head_dim_v : shape_.head_dim;
  Tensor host = Tensor::empty({out.shape[0], int64_t{shape_.hq}, dv}, shape_.dtype);
  copy_bytes(host.data(), Device::cpu(), out.data, out.device, host.view().nbytes());
  SCOPED_TRACE(::testing::Message() << "layer " << l << " mode " << mode_name(b.mode));
  expect_close(host, TensorView(), reference_for(b, l, q_host), shape_.dtype,
               is_fp8(shape_.kv_dtype));
}

std::vector<Tensor> Harness::run_and_check(const ForwardBatch& b, bool use_graph_state,
                                           uint64_t qkv_seed, bool check_reference) {
  if (use_graph_state)
    backend_->init_forward_metadata_replay_cuda_graph(b);
  else
    backend_->init_forward_metadata(b);
  return forward_and_check(b, qkv_seed, /*save_kv_cache=*/true, check_reference);
}

Harness::LayerInputs Harness::layer_inputs(int64_t T) {
  const int dv = shape_.head_dim_v ? shape_.head_dim_v : shape_.head_dim;
  LayerInputs in;
  in.q = random_tensor(rng_, {T, shape_.hq, shape_.head_dim}, shape_.dtype).to(shape_.device);
  in.k = random_tensor(rng_, {T, shape_.hkv, shape_.head_dim}, shape_.dtype).to(shape_.device);
  in.v = random_tensor(rng_, {T, shape_.hkv, dv}, shape_.dtype).to(shape_.device);
  Tensor out = Tensor::empty({T, int64_t{shape_.hq} * dv}, shape_.dtype);
  poison(out);
  in.out = out.to(shape_.device);
  return in;
}

namespace {
std::vector<uint8_t> bytes_of(const TensorView& t) {
  std::vector<uint8_t> bytes(t.nbytes());
  copy_bytes(bytes.data(), Device::cpu(), t.data, t.device, bytes.size());
  return bytes;
}
}  // namespace

PoolSnapshot Harness::snapshot() const {
  PoolSnapshot s;
  for (const KVPool* pool : {pool_.get(), swa_pool_.get()}) {
    if (!pool) continue;
    for (int l = 0; l < pool->num_layers(); ++l) {
      s.kv.push_back(bytes_of(pool->k(l)));
      s.kv.push_back(bytes_of(pool->v(l)));
    }
  }
  s.req_to_token = bytes_of(r2t_->req_to_token());
  for (int64_t slot = 0; slot < pool_->num_rows(); ++slot)
    s.live_slots.push_back(alloc_->is_live(static_cast<int32_t>(slot)));
  s.free_slots = alloc_->num_free();
  for (int64_t row = 0; row < r2t_->max_reqs(); ++row)
    s.live_rows.push_back(r2t_->is_live(static_cast<int32_t>(row)));
  s.free_rows = r2t_->num_free();
  if (swa_alloc_) {
    s.free_swa_slots = swa_alloc_->num_free_swa();
    s.swa_table = bytes_of(swa_alloc_->host_table());
  }
  return s;
}

void Harness::expect_unchanged(const PoolSnapshot& before) const {
  const PoolSnapshot now = snapshot();
  ASSERT_EQ(now.kv.size(), before.kv.size());
  for (size_t i = 0; i < now.kv.size(); ++i)
    EXPECT_TRUE(now.kv[i] == before.kv[i])
        << (i % 2 ? "V" : "K") << " bytes of pool tensor " << i / 2 << " changed";
  EXPECT_TRUE(now.req_to_token == before.req_to_token) << "req_to_token changed";
  EXPECT_TRUE(now.live_slots == before.live_slots) << "the allocator's live slots changed";
  EXPECT_EQ(now.free_slots, before.free_slots) << "the allocator's free count changed";
  EXPECT_TRUE(now.live_rows == before.live_rows) << "req_to_token's live rows changed";
  EXPECT_EQ(now.free_rows, before.free_rows);
  EXPECT_EQ(now.free_swa_slots, before.free_swa_slots);
  EXPECT_TRUE(now.swa_table == before.swa_table) << "the full-to-SWA table changed";
}

std::vector<Tensor> Harness::forward_and_check(const ForwardBatch& b, uint64_t qkv_seed,
                                               bool save_kv_cache, bool check_reference) {
  const int64_t T = b.num_tokens();
  const int dv = shape_.head_dim_v ? shape_.head_dim_v : shape_.head_dim;
  const uint64_t base_seed = qkv_seed ? qkv_seed : rng_.gen()();
  std::vector<Tensor> outs;
  for (int l = 0; l < shape_.num_layers; ++l) {
    const LayerSpec spec = layer(l);
    // Row t of q/k/v depends only on (seed, layer, t): a request placed first in two batches
    // gets the same activations whatever follows it.
    auto rows = [&](int64_t heads, int64_t dim, uint64_t salt) {
      Tensor t = Tensor::empty({T, heads, dim}, shape_.dtype);
      for (int64_t r = 0; r < T; ++r) {
        Rng row_rng(base_seed * 7919 + (uint64_t(l) * 3 + salt) * 1000003 + r);
        for (int64_t e = 0; e < heads * dim; ++e)
          store_from_double(t.data(), shape_.dtype, r * heads * dim + e, row_rng.normal());
      }
      return t;
    };
    Tensor q = rows(shape_.hq, shape_.head_dim, 0);
    Tensor k = rows(shape_.hkv, shape_.head_dim, 1);
    Tensor v = rows(shape_.hkv, dv, 2);
    Tensor out = Tensor::empty({T, int64_t{shape_.hq} * dv}, shape_.dtype);
    poison(out);
    Tensor out_d = out.to(shape_.device);
    const bool cross = spec.is_cross_attention;
    TensorView result = backend_->forward(
        q.to(shape_.device), cross ? TensorView() : k.to(shape_.device).view(),
        cross ? TensorView() : v.to(shape_.device).view(), spec, b, save_kv_cache, out_d);
    EXPECT_EQ(result.data, out_d.data());
    Tensor host = out_d.to(Device::cpu());
    TensorView h3 = host.view();
    h3.ndim = 3;
    h3.shape[1] = shape_.hq;
    h3.shape[2] = dv;
    h3.stride[0] = int64_t{shape_.hq} * dv;
    h3.stride[1] = dv;
    h3.stride[2] = 1;
    if (!check_reference) {
      outs.push_back(host);
      continue;
    }
    if (spec.attn_type == AttentionType::ENCODER_ONLY) {
      // Encoder-only layers attend to the new tokens' own k/v.
      Tensor qo_t = Tensor::from_i32(indptr_of(batch_new_));
      AttentionOptions opt;
      opt.causal = false;
      opt.sm_scale = spec.scaling;
      opt.logits_soft_cap = spec.logit_cap;
      auto ref = reference::ragged_attention(q, k, v, qo_t, qo_t, opt);
      SCOPED_TRACE(::testing::Message() << "layer " << l << " (encoder-only)");
      expect_close(h3, TensorView(), ref, shape_.dtype, false);
    } else {
      auto ref = reference_for(b, l, q, &k, &v);
      SCOPED_TRACE(::testing::Message() << "layer " << l << " mode " << mode_name(b.mode));
      expect_close(h3, TensorView(), ref, shape_.dtype, is_fp8(shape_.kv_dtype));
    }
    outs.push_back(host);
  }
  return outs;
}

}  // namespace flashkv::test
