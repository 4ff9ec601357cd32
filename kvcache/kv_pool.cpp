#include "flashkv/kvcache/kv_pool.h"

#include <cmath>
#include <limits>

namespace flashkv {

KVPool::KVPool(const KVPoolConfig& config) : config_(config) {
  KVPoolConfig& c = config_;
  if (c.head_dim_v == 0) c.head_dim_v = c.head_dim_qk;
  FLASHKV_CHECK(c.page_size >= 1, "KVPool: page_size: expected >= 1, got ", c.page_size);
  FLASHKV_CHECK(c.num_slots > 0 && c.num_slots % c.page_size == 0,
                "KVPool: num_slots: expected a positive multiple of page_size ", c.page_size,
                ", got ", c.num_slots);
  FLASHKV_CHECK(c.num_slots + c.page_size <= int64_t{std::numeric_limits<int32_t>::max()},
                "KVPool: num_slots: slot ids are int32, got ", c.num_slots, " slots");
  FLASHKV_CHECK(c.num_layers >= 1, "KVPool: num_layers: expected >= 1, got ", c.num_layers);
  FLASHKV_CHECK(c.num_kv_heads >= 1, "KVPool: num_kv_heads: expected >= 1, got ", c.num_kv_heads);
  FLASHKV_CHECK(c.head_dim_qk >= 1 && c.head_dim_v >= 1,
                "KVPool: head_dim_qk/head_dim_v: expected >= 1, got ", c.head_dim_qk, "/",
                c.head_dim_v);
  FLASHKV_CHECK(is_float(c.dtype), "KVPool: dtype: expected f32/f16/bf16/fp8_e4m3/fp8_e5m2, got ",
                dtype_name(c.dtype));
  for (int layer = 0; layer < c.num_layers; ++layer) {
    k_.push_back(Tensor::empty({num_rows(), c.num_kv_heads, c.head_dim_qk}, c.dtype, c.device));
    v_.push_back(Tensor::empty({num_rows(), c.num_kv_heads, c.head_dim_v}, c.dtype, c.device));
    fill_bytes(k_.back().data(), c.device, 0, k_.back().view().nbytes());
    fill_bytes(v_.back().data(), c.device, 0, v_.back().view().nbytes());
  }
  if (c.device.is_cuda()) synchronize(c.device);
  k_scale_.assign(c.num_layers, 1.0f);
  v_scale_.assign(c.num_layers, 1.0f);
}

size_t KVPool::bytes() const {
  size_t total = 0;
  for (int layer = 0; layer < num_layers(); ++layer)
    total += k_[layer].view().nbytes() + v_[layer].view().nbytes();
  return total;
}

void KVPool::check_layer(int layer) const {
  FLASHKV_CHECK(layer >= 0 && layer < num_layers(), "KVPool: layer: expected 0..", num_layers() - 1,
                ", got ", layer);
}

const TensorView& KVPool::k(int layer) const {
  check_layer(layer);
  return k_[layer].view();
}

const TensorView& KVPool::v(int layer) const {
  check_layer(layer);
  return v_[layer].view();
}

float KVPool::k_scale(int layer) const {
  check_layer(layer);
  return k_scale_[layer];
}

float KVPool::v_scale(int layer) const {
  check_layer(layer);
  return v_scale_[layer];
}

void KVPool::set_scales(int layer, float k_scale, float v_scale) {
  check_layer(layer);
  FLASHKV_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
                "KVPool::set_scales: k_scale/v_scale: expected finite values > 0, got ", k_scale,
                "/", v_scale);
  k_scale_[layer] = k_scale;
  v_scale_[layer] = v_scale;
}

}  // namespace flashkv
