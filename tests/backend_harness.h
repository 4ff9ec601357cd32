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
  int64_t slots = 4096;
  int max_reqs = 64, max_context = 1024;
};

struct Request {
  int32_t row = 0;
  int32_t seq_len = 0;        // decoder tokens in the cache (after the last pass)
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
  // Runs every layer on random q/k/v and checks each output against the reference (gtest
  // expectations). Returns the layer outputs (host copies).
  std::vector<Tensor> run_and_check(const ForwardBatch& batch, bool use_graph_state = false,
                                    uint64_t qkv_seed = 0);
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
  KVAllocator& allocator() { return *alloc_; }

 private:
  void fill_random_kv(const std::vector<int32_t>& slots, bool encoder);
  reference::Result reference_for(const ForwardBatch& b, int layer, const Tensor& q_host);

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
};

}  // namespace flashkv::test
