// FlashKVBackend: SGLang's FlashInfer attention backend, rule for rule, over flashkv's pools,
// planner and operators. Per forward batch it turns req_to_token rows into kv_indptr /
// kv_indices, plans every kernel it will run and uploads the plans; per layer it writes the new
// K/V into the pool and runs attention:
//   DECODE        paged decode over each request's KV;
//   EXTEND/MIXED  ragged causal attention over the new tokens merged (by LSE) with paged
//                 attention over the cached prefix; ragged only when no request has a prefix;
//                 one paged pass over everything for multimodal models and deterministic mode;
//   TARGET_VERIFY one paged pass with the per-request tree mask;
//   DRAFT_EXTEND  one causal paged pass over the accepted tokens.
// Two "wrappers" (index sets + plans) when the model mixes sliding-window and full layers
// (window layers read at most w + 1 tokens in decode and w + extend_len in extend, through the
// SWA pool's slot translation when there is one) or is an encoder-decoder (self attention over
// the decoder tokens after the encoder's, cross attention over the encoder tokens).
#pragma once

#include <memory>
#include <vector>

#include "flashkv/backend/attention_backend.h"
#include "flashkv/core/buffer.h"
#include "flashkv/ops/attention.h"

namespace flashkv {

struct BackendOptions {
  Device device;
  DType q_dtype = DType::bf16;  // activations (q, k, v, output)
  int num_qo_heads = 0, num_kv_heads = 0, head_dim_qk = 0, head_dim_v = 0;  // head_dim_v 0: = qk

  // Model structure.
  int sliding_window_size = -1;  // >= 0: window and full layers mix (two wrappers)
  bool is_encoder_decoder = false;  // self + cross attention wrappers
  bool is_multimodal = false;    // extend runs one paged pass over everything
  bool has_encoder_only_layers = false;  // plan the non-causal ragged pass they need
  // Sliding-window layers keep their KV in this pool, addressed through the allocator's
  // full-to-SWA table (both or neither).
  KVPool* swa_kv_pool = nullptr;
  SWAAllocator* swa_allocator = nullptr;

  // Kernels and planning.
  bool deterministic = false;     // fixed split sizes; no ragged/paged split in extend
  int decode_split_size = 2048;   // deterministic mode
  int prefill_split_size = 4096;  // deterministic mode
  bool disable_split_kv = false;
  // Tensor-core decode: -1 auto (GQA group >= 4 or fp8 KV, as the seed decides), 0 off, 1 on.
  int use_tensor_cores = -1;
};

class FlashKVBackend : public AttentionBackend {
 public:
  explicit FlashKVBackend(const BackendOptions& options);
  ~FlashKVBackend() override;

  void init_forward_metadata(const ForwardBatch& batch) override;
  void init_cuda_graph_state(int max_bs, int max_num_tokens) override;
  void init_forward_metadata_capture_cuda_graph(const ForwardBatch& batch) override;
  void init_forward_metadata_replay_cuda_graph(const ForwardBatch& batch) override;

  const BackendOptions& options() const { return options_; }
  int num_wrappers() const;
  // Whether decode uses the tensor-core kernel for this KV dtype (the seed's rule).
  bool decode_uses_tensor_cores(DType kv_dtype) const;
  // What the last init_forward_metadata decided (for tests and tracing).
  bool uses_ragged() const;
  bool extend_without_prefix() const;

 protected:
  TensorView forward_decode(const TensorView& q, const TensorView& k, const TensorView& v,
                            const LayerSpec& layer, const ForwardBatch& batch, bool save_kv_cache,
                            const TensorView& out) override;
  TensorView forward_extend(const TensorView& q, const TensorView& k, const TensorView& v,
                            const LayerSpec& layer, const ForwardBatch& batch, bool save_kv_cache,
                            const TensorView& out) override;

 private:
  struct State;
  void plan_batch(const ForwardBatch& batch, bool graph);

  BackendOptions options_;
  // Eager batches and CUDA-graph batches keep separate buffers, so an eager batch never moves
  // memory a captured graph points at.
  std::unique_ptr<State> eager_, graph_;
  State* active_ = nullptr;  // the state the last init_forward_metadata* planned
};

}  // namespace flashkv
