// The interface a model runner holds: plan once per forward batch, run once per layer.
#pragma once

#include "flashkv/backend/forward_batch.h"

namespace flashkv {

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  // Builds the batch's KV indices and plans (host work, one upload); called before the layers.
  virtual void init_forward_metadata(const ForwardBatch& batch) = 0;

  // One layer: writes k/v (new tokens, [T, Hkv, D]) into the pool at out_cache_loc when
  // save_kv_cache, then attends. q [T, Hq, D_qk] (or [T, Hq * D_qk]); returns [T, Hq * D_v]:
  // `out` when given (same dtype as q), else a view of the backend's output buffer, valid
  // until the next forward call. IDLE returns an empty view. Allocates nothing and never
  // synchronizes (CUDA-graph capturable).
  TensorView forward(const TensorView& q, const TensorView& k, const TensorView& v,
                     const LayerSpec& layer, const ForwardBatch& batch, bool save_kv_cache = true,
                     const TensorView& out = TensorView());

  // CUDA graphs: fixed buffers for batches of up to max_bs requests / max_num_tokens tokens;
  // capture plans a batch of bs requests into them; replay re-plans another batch of the same
  // shape into the same buffers, so a graph captured over forward() replays correctly.
  virtual void init_cuda_graph_state(int max_bs, int max_num_tokens) = 0;
  virtual void init_forward_metadata_capture_cuda_graph(const ForwardBatch& batch) = 0;
  virtual void init_forward_metadata_replay_cuda_graph(const ForwardBatch& batch) = 0;
  // seq_len that padded requests of a graph batch carry.
  virtual int cuda_graph_seq_len_fill_value() const { return 1; }

 protected:
  virtual TensorView forward_decode(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const LayerSpec& layer, const ForwardBatch& batch,
                                    bool save_kv_cache, const TensorView& out) = 0;
  virtual TensorView forward_extend(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const LayerSpec& layer, const ForwardBatch& batch,
                                    bool save_kv_cache, const TensorView& out) = 0;
};

}  // namespace flashkv
