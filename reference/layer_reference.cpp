#include "flashkv/reference/layer_reference.h"

#include <algorithm>
#include <cstring>

#include "flashkv/core/buffer.h"
#include "flashkv/core/thread_pool.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/swa_allocator.h"

namespace flashkv {
namespace {

// Rows `rows` of a pool tensor [num_rows, Hkv, D] copied into a host tensor [rows.size(), Hkv, D]
// of the pool's dtype. A device pool is read in runs of consecutive slots (the allocators hand
// out ascending runs), so a long sequence costs a few copies, not one per token.
Tensor gather_rows(const TensorView& src, const std::vector<int64_t>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  Tensor out = Tensor::empty({std::max<int64_t>(n, 1), src.shape[1], src.shape[2]}, src.dtype);
  const size_t row_bytes = static_cast<size_t>(src.shape[1] * src.shape[2]) * dtype_size(src.dtype);
  auto* dst = static_cast<char*>(out.data());
  const auto* base = static_cast<const char*>(src.data);
  for (int64_t j = 0; j < n;) {
    int64_t run = 1;
    while (j + run < n && rows[j + run] == rows[j] + run) ++run;
    copy_bytes(dst + j * row_bytes, Device::cpu(), base + rows[j] * row_bytes, src.device,
               run * row_bytes);
    j += run;
  }
  return out;
}

// K or V rows of the requests as float, each `pool_row` >= 0 from the pool (times its scale),
// each other one row -1 - pool_row of `fresh`: [rows.size(), Hkv, D].
Tensor mixed_rows(const TensorView& pool, float scale, const TensorView& fresh,
                  const std::vector<int64_t>& rows) {
  std::vector<int64_t> from_pool, from_fresh;
  for (int64_t r : rows) (r >= 0 ? from_pool : from_fresh).push_back(r >= 0 ? r : -1 - r);
  const Tensor a = gather_rows(pool, from_pool), b = gather_rows(fresh, from_fresh);
  const int64_t width = pool.shape[1] * pool.shape[2];
  Tensor out = Tensor::empty(
      {std::max<int64_t>(static_cast<int64_t>(rows.size()), 1), pool.shape[1], pool.shape[2]},
      DType::f32);
  // Row i's place in a (rows[i] >= 0) or in b; then runs of rows on the thread pool.
  std::vector<int64_t> place(rows.size());
  int64_t ia = 0, ib = 0;
  for (size_t i = 0; i < rows.size(); ++i) place[i] = rows[i] >= 0 ? ia++ : ib++;
  float* dst = out.ptr<float>();
  constexpr int64_t kRowsPerItem = 256;
  const int64_t n = static_cast<int64_t>(rows.size());
  ThreadPool::global().parallel_for((n + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item, int) {
    for (int64_t i = item * kRowsPerItem; i < std::min(n, (item + 1) * kRowsPerItem); ++i) {
      const bool p = rows[i] >= 0;
      const int64_t at = place[i] * width;
      float* o = dst + i * width;
      for (int64_t e = 0; e < width; ++e)
        o[e] = p ? static_cast<float>(load_as_double(a.data(), pool.dtype, at + e) * scale)
                 : static_cast<float>(load_as_double(b.data(), fresh.dtype, at + e));
    }
  });
  return out;
}

}  // namespace

reference::Result layer_reference(const LayerSpec& layer, const std::vector<ReferenceRequest>& reqs,
                                  const TensorView& q, const KVPool& full_pool,
                                  const KVPool* swa_pool, const SWAAllocator* swa_allocator,
                                  const TensorView& new_k, const TensorView& new_v) {
  FLASHKV_CHECK(layer.attn_type != AttentionType::ENCODER_ONLY, "layer_reference: layer ",
                layer.layer_id, " is ENCODER_ONLY (it attends to its own k/v, not the pool)");
  FLASHKV_CHECK((swa_pool == nullptr) == (swa_allocator == nullptr),
                "layer_reference: swa_pool and swa_allocator go together");
  const bool window_pool = swa_pool != nullptr && layer.sliding_window_size >= 0;
  const KVPool& pool = window_pool ? *swa_pool : full_pool;
  const bool cross = layer.is_cross_attention;
  Expect(q, "q")
      .ndim(3)
      .on_host()
      .dim(1, layer.num_qo_heads, "num_qo_heads")
      .dim(2, layer.head_dim_qk, "head_dim_qk");

  const bool fresh = new_k.defined();
  FLASHKV_CHECK(fresh == new_v.defined(), "layer_reference: new_k and new_v go together");
  const TensorView pk = pool.k(layer.layer_id), pv = pool.v(layer.layer_id);
  if (fresh) {
    for (const TensorView* t : {&new_k, &new_v})
      Expect(*t, t == &new_k ? "new_k" : "new_v")
          .ndim(3)
          .contiguous()
          .float_dtype()
          .dim(1, pk.shape[1], "the pool's KV heads")
          .dim(2, pk.shape[2], "the pool's head dim");
    FLASHKV_CHECK_EQ("layer_reference: new_v rows", new_v.shape[0], new_k.shape[0]);
  }

  std::vector<int32_t> qo_len, kv_len;
  std::vector<int64_t> kv_rows;  // >= 0: a pool row; else row -1 - x of new_k / new_v
  std::vector<uint8_t> mask;
  bool any_mask = false;
  for (const ReferenceRequest& r : reqs) any_mask = any_mask || (r.mask != nullptr && !cross);
  int64_t q_rows = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const ReferenceRequest& r = reqs[i];
    FLASHKV_CHECK(r.encoder_len >= 0 && r.seq_len >= 0 && r.qo_len >= 0 && r.qo_len <= r.seq_len,
                  "layer_reference: request ", i,
                  ": expected 0 <= qo_len <= seq_len and "
                  "encoder_len >= 0, got qo_len ",
                  r.qo_len, ", seq_len ", r.seq_len, ", encoder_len ", r.encoder_len);
    FLASHKV_CHECK(r.slots != nullptr || r.encoder_len + r.seq_len == 0, "layer_reference: request ",
                  i, ": slots is null");
    const int32_t begin = cross ? 0 : r.encoder_len, n = cross ? r.encoder_len : r.seq_len;
    const int32_t new_len = fresh ? r.new_len : 0;
    if (fresh)
      FLASHKV_CHECK(
          new_len >= 0 && new_len <= n && r.new_row >= 0 && r.new_row + new_len <= new_k.shape[0],
          "layer_reference: request ", i, ": new tokens [", r.new_row, ", ", r.new_row + new_len,
          ") expected within the ", n, " KV tokens and new_k's ", new_k.shape[0], " rows");
    for (int32_t j = 0; j < n; ++j) {
      if (j >= n - new_len) {
        kv_rows.push_back(-1 - (r.new_row + (j - (n - new_len))));
        continue;
      }
      int32_t slot = r.slots[begin + j];
      FLASHKV_CHECK(slot >= 0 && slot < full_pool.num_rows(), "layer_reference: request ", i,
                    ": slot ", slot, " outside the pool [0, ", full_pool.num_rows(), ")");
      if (window_pool) slot = swa_allocator->translate_full_to_swa(slot);
      kv_rows.push_back(slot);
    }
    if (any_mask) {
      FLASHKV_CHECK(r.mask != nullptr, "layer_reference: request ", i,
                    ": a tree mask is needed for every request once one has one");
      mask.insert(mask.end(), r.mask, r.mask + int64_t{r.qo_len} * r.seq_len);
    }
    qo_len.push_back(r.qo_len);
    kv_len.push_back(n);
    q_rows += r.qo_len;
  }
  FLASHKV_CHECK_EQ("layer_reference: q rows (sum of qo_len)", q.shape[0], q_rows);

  float k_scale = pool.k_scale(layer.layer_id), v_scale = pool.v_scale(layer.layer_id);
  Tensor k, v;
  if (fresh) {
    k = mixed_rows(pk, k_scale, new_k, kv_rows);
    v = mixed_rows(pv, v_scale, new_v, kv_rows);
    k_scale = v_scale = 1.0f;
  } else {
    k = gather_rows(pk, kv_rows);
    v = gather_rows(pv, kv_rows);
  }
  AttentionOptions opt;
  opt.causal = !cross;
  opt.window_left = layer.sliding_window_size;
  opt.logits_soft_cap = layer.logit_cap;
  opt.sm_scale = layer.scaling;
  Tensor sinks;
  if (layer.sinks.defined()) {  // read on the host, wherever the layer keeps them
    Expect(layer.sinks, "layer.sinks")
        .ndim(1)
        .dtype(DType::f32)
        .contiguous()
        .dim(0, layer.num_qo_heads, "num_qo_heads");
    sinks = Tensor::empty({layer.num_qo_heads}, DType::f32);
    copy_bytes(sinks.data(), Device::cpu(), layer.sinks.data, layer.sinks.device,
               sizeof(float) * layer.num_qo_heads);
    synchronize(layer.sinks.device);
    opt.sinks = sinks;
  }
  Tensor mask_t;
  if (any_mask) {
    mask_t = Tensor::empty({std::max<int64_t>(static_cast<int64_t>(mask.size()), 1)}, DType::u8);
    std::copy(mask.begin(), mask.end(), mask_t.ptr<uint8_t>());
    opt.custom_mask = mask_t;
  }
  std::vector<int32_t> qo_indptr(reqs.size() + 1, 0), kv_indptr(reqs.size() + 1, 0);
  for (size_t i = 0; i < reqs.size(); ++i) {
    qo_indptr[i + 1] = qo_indptr[i] + qo_len[i];
    kv_indptr[i + 1] = kv_indptr[i] + kv_len[i];
  }
  return reference::ragged_attention(q, k, v, Tensor::from_i32(qo_indptr),
                                     Tensor::from_i32(kv_indptr), opt, k_scale, v_scale);
}

}  // namespace flashkv
