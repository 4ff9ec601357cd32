// MultiStepDraftBackend: the draft model of EAGLE-style speculative decoding runs num_steps decode
// passes, each over topk branches per request, back to back. One call plans all of them: step i's
// batch has bs * topk rows (row r * topk + b is branch b of request r), and its KV index set
// covers the request's cached tokens plus the first i + 1 draft tokens of the branch (the draft
// tokens' slots come from draft_loc [bs, topk, num_steps]). Each step then runs like a DECODE
// batch of FlashKVBackend, with CUDA-graph capture and replay as that backend has them.
#pragma once

#include <memory>
#include <vector>

#include "flashkv/backend/flashkv_backend.h"

namespace flashkv {

class MultiStepDraftBackend {
 public:
  MultiStepDraftBackend(const BackendOptions& options, int topk, int num_steps);
  ~MultiStepDraftBackend();

  int topk() const { return topk_; }
  int num_steps() const { return num_steps_; }

  // `batch`: the bs requests (req_pool_indices, seq_lens_cpu = tokens already cached, pools; its
  // mode is ignored). draft_loc: i32 [bs, topk, num_steps] on the device, the slot of every draft
  // token (the steps write their K/V there). Every step is validated and planned before any is
  // installed: on bad input (a flashkv::Error) the steps keep their previous plans and buffers.
  void init_forward_metadata(const ForwardBatch& batch, const TensorView& draft_loc);
  void init_cuda_graph_state(int max_bs);
  void init_forward_metadata_capture_cuda_graph(const ForwardBatch& batch,
                                                const TensorView& draft_loc);
  void init_forward_metadata_replay_cuda_graph(const ForwardBatch& batch,
                                               const TensorView& draft_loc);

  // Step i's batch (bs * topk rows; out_cache_loc = the step's draft slots) and its layer call:
  // q [bs * topk, Hq, D]; k/v the step's new tokens; returns [bs * topk, Hq * D_v].
  const ForwardBatch& step_batch(int step) const;
  TensorView forward(int step, const TensorView& q, const TensorView& k, const TensorView& v,
                     const LayerSpec& layer, bool save_kv_cache = true,
                     const TensorView& out = TensorView());

 private:
  struct Buffers;
  void plan(const ForwardBatch& batch, const TensorView& draft_loc, bool graph, int phase);

  BackendOptions options_;
  int topk_, num_steps_;
  std::vector<std::unique_ptr<FlashKVBackend>> steps_;
  std::vector<ForwardBatch> step_batches_;
  std::unique_ptr<Buffers> eager_, graph_;
  int graph_max_bs_ = 0;
};

}  // namespace flashkv
