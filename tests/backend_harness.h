// A mock model runner for backend tests: real pools and allocators, random requests, and the
// float64 reference of every layer computed from the pool contents after the pass.
#pragma once

#include <memory>
#include <vector>

#include "flashkv/backend/flashkv_backend.h"
#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/kvcache/swa_allocator.h"
#include "test_util.h"

namespace flashkv::test {

// The devices the backend tests run on: the CPU always, CUDA when a GPU is visible.
inline std::vector<Device> backend_test_devices() {
  std::vector<Device> d = {Device::cpu()};
  if (cuda_available()) d.push_back(Device::cuda(0));
  return d;
}

struct ModelShape {
  Device device;
  int num_layers = 2;
  int hq = 8, hkv = 2, head_dim = 64, head_dim_v = 0;
  DType dtype = DType::bf16, kv_dtype = DType::bf16;
  int sliding_window = -1;  // >= 0: even layers use the window, odd ones are full
  bool swa_pool = false;
  bool encoder_decoder = false;  // odd layers are cross attention
  bool encoder_only = false;     // every layer is ENCODER_ONLY
  float logit_cap = 0;
  int64_t slots = 4096;  // a multiple of page_size
  int max_reqs = 64, max_context = 1024;
  // The allocator's page size (the pool's too); the backend indexes KV by token whatever it is.
  int page_size = 1;
  // Hand out pages in a random order (requests' slots then jump around the pool), instead of the
  // fresh allocator's ascending one.
  bool shuffle_pages = false;
  // Every layer has its own random attention sinks (LayerSpec::sinks, f32 [hq] on the device).
  bool sinks = false;
};

// Everything a backend call could write outside its own buffers: the K/V bytes of every pool,
// the request-to-token table, and the allocators' bookkeeping.
struct PoolSnapshot {
  std::vector<std::vector<uint8_t>> kv;  // per pool and layer: K bytes, then V bytes
  std::vector<uint8_t> req_to_token;
  std::vector<uint8_t> live_slots, live_rows;
  int64_t free_slots = 0, free_rows = 0, free_swa_slots = 0;
  std::vector<uint8_t> swa_table;
};

struct Request {
  int32_t row = 0;
  int32_t seq_len = 0;  // decoder tokens in the cache (after the last pass)
  int32_t encoder_len = 0;
  std::vector<int32_t> slots;  // full-pool slots of the encoder tokens then the decoder tokens
};

class Harness {
 public:
  Harness(const ModelShape& shape, BackendOptions extra = {});

  // A request with `cached` decoder tokens (and `encoder` encoder tokens) already in the cache,
  // their K/V random in every layer.
  Request add_request(int32_t cached, int32_t encoder = 0);
  // A batch in `mode` adding new_lens[i] tokens to reqs[i] (slots allocated, req_to_token
  // written); TARGET_VERIFY also gets a random tree mask.
  ForwardBatch make_batch(ForwardMode mode, std::vector<Request*> reqs,
                          const std::vector<int32_t>& new_lens);
  // Plans the batch (init_forward_metadata, or the CUDA-graph replay), runs every layer on random
  // q/k/v and checks each output against the reference (gtest expectations). Returns the layer
  // outputs (host copies).
  std::vector<Tensor> run_and_check(const ForwardBatch& batch, bool use_graph_state = false,
                                    uint64_t qkv_seed = 0, bool check_reference = true);
  // The layer calls of run_and_check on the batch planned last. Row t of layer l's q/k/v depends
  // only on (qkv_seed, l, t) (0: a fresh seed): running a batch twice with one seed writes the
  // same K/V bytes. check_reference false: only run (a caller comparing bits across runs).
  std::vector<Tensor> forward_and_check(const ForwardBatch& batch, uint64_t qkv_seed = 0,
                                        bool save_kv_cache = true, bool check_reference = true);
  // Fresh q, k, v and out ([T, Hq, D], [T, Hkv, D] x2, [T, Hq * D_v]) on the device, for calls
  // that are expected to fail.
  struct LayerInputs {
    Tensor q, k, v, out;
  };
  LayerInputs layer_inputs(int64_t num_tokens);

  PoolSnapshot snapshot() const;
  // gtest expectations that nothing in `before` changed, naming what did.
  void expect_unchanged(const PoolSnapshot& before) const;
  // Checks one layer's output (`out`: [T, Hq * D_v] on the device, computed from `q_host` after
  // the batch's K/V are in the pool) against the reference.
  void check_layer(const ForwardBatch& batch, int layer, const Tensor& q_host,
                   const TensorView& out);
  // Releases a request's rows and slots.
  void finish(Request& r);
  // Drops the request's tokens past `seq_len` (their slots are freed).
  void rollback(Request& r, int32_t seq_len);

  FlashKVBackend& backend() { return *backend_; }
  const ModelShape& shape() const { return shape_; }
  LayerSpec layer(int i) const;
  Rng& rng() { return rng_; }
  ReqToTokenPool& req_to_token() { return *r2t_; }
  KVPool& pool() { return *pool_; }
  KVPool* swa_pool() { return swa_pool_.get(); }
  KVAllocator& allocator() { return *alloc_; }

 private:
  void fill_random_kv(const std::vector<int32_t>& slots, bool encoder);
  void shuffle_free_pages();
  // k_host / v_host: the layer's new K/V, read by the reference where the pass read them from
  // its input (FlashKVBackend::reads_new_kv_from_input) instead of from the pool.
  reference::Result reference_for(const ForwardBatch& b, int layer, const Tensor& q_host,
                                  const Tensor* k_host = nullptr, const Tensor* v_host = nullptr);

  ModelShape shape_;
  Rng rng_;
  std::unique_ptr<ReqToTokenPool> r2t_;
  std::unique_ptr<KVPool> pool_, swa_pool_;
  std::unique_ptr<KVAllocator> alloc_;
  SWAAllocator* swa_alloc_ = nullptr;
  std::unique_ptr<FlashKVBackend> backend_;
  // Batch-owned device tensors (kept alive for the batch's lifetime).
  std::vector<Request*> batch_reqs_;
  std::vector<int32_t> batch_new_;
  Tensor rpi_, loc_, enc_loc_, mask_;
  Tensor mask_host_;
  std::vector<Tensor> sinks_;  // per layer, on the device (ModelShape::sinks)
};

}  // namespace flashkv::test
