#include "flashkv/backend/layer_reference.h"

#include <algorithm>
#include <cstring>

#include "flashkv/core/buffer.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/swa_allocator.h"

namespace flashkv {
namespace {

// Rows `rows` of a pool tensor [num_rows, Hkv, D] copied into a host tensor [rows.size(), Hkv, D]
// of the pool's dtype. A device pool is read in runs of consecutive slots (the allocators hand
// out ascending runs), so a long sequence costs a few copies, not one per token.
Tensor gather_rows(const TensorView& src, const std::vector<int32_t>& rows) {
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

}  // namespace

reference::Result layer_reference(const LayerSpec& layer, const std::vector<ReferenceRequest>& reqs,
                                  const TensorView& q, const KVPool& full_pool,
                                  const KVPool* swa_pool, const SWAAllocator* swa_allocator) {
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

  std::vector<int32_t> kv_rows, qo_len, kv_len;
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
    for (int32_t j = 0; j < n; ++j) {
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

  Tensor k = gather_rows(pool.k(layer.layer_id), kv_rows);
  Tensor v = gather_rows(pool.v(layer.layer_id), kv_rows);
  AttentionOptions opt;
  opt.causal = !cross;
  opt.window_left = layer.sliding_window_size;
  opt.logits_soft_cap = layer.logit_cap;
  opt.sm_scale = layer.scaling;
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
                                     Tensor::from_i32(kv_indptr), opt, pool.k_scale(layer.layer_id),
                                     pool.v_scale(layer.layer_id));
}

}  // namespace flashkv
