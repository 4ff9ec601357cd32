// KVPool: the K and V memory of every attention layer. Per layer, K is
// [num_slots + page_size, Hkv, D_qk] and V [num_slots + page_size, Hkv, D_v] ("NHD"); token slot
// s sits on page s / page_size. Page 0 (slot 0 and, for page_size > 1, the rest of its page) is
// reserved: padded rows of a CUDA-graph batch write to the dummy slot 0, and no allocator ever
// hands it out. Usable slots are page_size .. page_size + num_slots - 1 (pages 1..num_pages);
// for page_size 1 that is 1..num_slots.
#pragma once

#include <cstdint>
#include <vector>

#include "flashkv/core/buffer.h"

namespace flashkv {

struct KVPoolConfig {
  int64_t num_slots = 0;  // usable token slots; a multiple of page_size
  int page_size = 1;
  int num_layers = 1;
  int num_kv_heads = 1;
  int head_dim_qk = 128;
  int head_dim_v = 0;         // 0: the same as head_dim_qk
  DType dtype = DType::bf16;  // f32 / f16 / bf16 / fp8_e4m3 / fp8_e5m2
  Device device;
};

class KVPool {
 public:
  // Allocates and zeroes every layer's K and V; scales start at 1.
  explicit KVPool(const KVPoolConfig& config);

  const KVPoolConfig& config() const { return config_; }
  int page_size() const { return config_.page_size; }
  int num_layers() const { return config_.num_layers; }
  int num_kv_heads() const { return config_.num_kv_heads; }
  int head_dim_qk() const { return config_.head_dim_qk; }
  int head_dim_v() const { return config_.head_dim_v; }
  DType dtype() const { return config_.dtype; }
  Device device() const { return config_.device; }
  int64_t num_slots() const { return config_.num_slots; }                      // usable slots
  int64_t num_rows() const { return config_.num_slots + config_.page_size; }   // rows per tensor
  int64_t num_pages() const { return config_.num_slots / config_.page_size; }  // usable pages
  size_t bytes() const;  // memory of all layers' K and V

  // Layer `layer`'s K [num_rows, Hkv, D_qk] and V [num_rows, Hkv, D_v].
  const TensorView& k(int layer) const;
  const TensorView& v(int layer) const;
  // The value a stored element stands for is float(stored) * scale (docs/SEMANTICS.md, "fp8 KV
  // cache").
  float k_scale(int layer) const;
  float v_scale(int layer) const;
  // Throws unless both scales are finite and > 0.
  void set_scales(int layer, float k_scale, float v_scale);

 private:
  void check_layer(int layer) const;

  KVPoolConfig config_;
  std::vector<Tensor> k_, v_;
  std::vector<float> k_scale_, v_scale_;
};

}  // namespace flashkv
