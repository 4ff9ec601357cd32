// Model: a stack of attention layers over FlashKVBackend, the way a model runner drives it, with
// random activations in place of weights. Per pass it calls init_forward_metadata once and
// forward once per layer, feeding each layer q/k/v drawn from a bank of random values on the
// device (so making activations costs nothing per step), and times the pass. With checking on,
// it compares sampled layer outputs with the float64 reference computed from the KV pool.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flashkv/backend/flashkv_backend.h"
#include "flashkv/backend/multi_step_draft.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/reference/layer_reference.h"
#include "rank_share.h"
#include "step_batch.h"

namespace flashkv::app {

struct ModelConfig {
  int num_layers = 4;
  int num_qo_heads = 8, num_kv_heads = 2, head_dim = 64;
  DType dtype = DType::bf16;     // activations and outputs
  DType kv_dtype = DType::bf16;  // the KV pool (fp8 pools get per-layer scales 0.5 / 2)
  // >= 0: windowed layers attend within this window (SGLang's sliding_window_size: a query at
  // position p sees keys p - w .. p); which layers are windowed, full_every says.
  int sliding_window = -1;
  // With a window: 0 windows every layer; N >= 1 makes every N-th layer (layers N-1, 2N-1, ...)
  // attend fully and windows the others (2: even layers windowed, as Gemma 2 and gpt-oss; 6:
  // five of six, as Gemma 3; 1: no layer windowed).
  int full_every = 2;
  float logit_cap = 0;           // logit soft cap of every layer (0: none)
  float sm_scale = 0;            // 0: 1 / sqrt(head_dim)
  bool sinks = false;            // learned per-head sink logits (random ones, seeded, per layer)
  bool encoder_decoder = false;  // odd layers cross-attend to the encoder tokens

  bool windowed(int layer) const {
    return sliding_window >= 0 && (full_every == 0 || (layer + 1) % full_every != 0);
  }

  LayerSpec layer(int i) const;
  std::string str() const;  // e.g. "4 layers, 8/2 heads, head dim 64, bf16, kv bf16"
};

// Which layer outputs a pass compares with the reference: `layers` random layers, and in each
// up to `requests` random requests, the last `rows` query rows of each (rows 0: all; with
// rows > 0, fewer on long contexts, which bounds the float64 reference's work per check).
// Independently of `enabled`, the last layer's output of every pass is scanned for NaN and Inf;
// scan_every_layer scans every layer's (the soak test's setting).
struct CheckOptions {
  bool enabled = false;
  int layers = 1;
  int requests = 2;
  int rows = 8;
  bool scan_every_layer = false;
};

struct PassResult {
  double ms = 0;           // init_forward_metadata + every layer's forward, device synchronized
  int checked = 0;         // layer outputs compared with the reference
  int failures = 0;        // ... outside the tolerance of docs/SEMANTICS.md
  double worst_rel = 0;    // largest relative error seen
  bool nonfinite = false;  // a NaN or Inf in a scanned or checked output
  std::string nonfinite_where;  // the first one: layer, row and value
  std::string failure;          // the first failure, described
  double check_ms = 0;          // time spent after the pass on the NaN scan and the reference
};

class Model {
 public:
  // With context parallelism (cp.enabled()), the pool is this rank's and the backend shards each
  // pass (ForwardBatch, "Context parallelism"): forward() takes batches a RankShare localized.
  // Every rank draws the same activations (same seed, same passes); an extend pass gives the
  // backend the rank's own rows of them, and checks gather what the reference needs.
  Model(const ModelConfig& config, Device device, int64_t kv_slots, uint64_t seed,
        const CpConfig& cp = {});

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  KVPool& pool() { return *pool_; }
  FlashKVBackend& backend() { return *backend_; }

  // Runs every layer over the batch (which must reference this model's req_to_token pool; the
  // pass points it at this model's KV pool).
  PassResult forward(StepBatch& step, const CheckOptions& check = {});

  // Multi-step drafting (a MultiStepDraftBackend of topk branches x num_steps over this model):
  // every step runs every layer over bs * topk rows. seqs[r] has seq_lens[r] tokens in the cache
  // (its req_to_token row); draft_slots [bs, topk, num_steps] (row-major) are the draft tokens'
  // slots, where the steps write their K/V. One result for all steps.
  void enable_multi_step_draft(int topk, int num_steps);
  PassResult forward_draft_steps(const std::vector<Sequence*>& seqs,
                                 const std::vector<int32_t>& seq_lens,
                                 const std::vector<int32_t>& draft_slots, ReqToTokenPool& pool,
                                 const CheckOptions& check = {});

 private:
  // A [rows, heads, dim] slice of the activation bank at a random offset.
  TensorView activations(int64_t rows, int heads, int dim);
  void reserve_bank(int64_t elements);
  // Layer i as the backend gets it: the config's shape, and this model's sinks when it has them.
  LayerSpec layer(int i) const;
  // Rows of the checked outputs, described for the reference: request i of `reqs` owns rows
  // [first, first + count) of the pass. encoder_rows[i] (a pass that writes the encoder K/V):
  // where request i's encoder tokens start in the cross-attention layers' k / v.
  struct CheckedRows {
    std::vector<ReferenceRequest> reqs;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    std::vector<int64_t> encoder_rows;
  };
  // What a checked layer was given: q, and the new tokens' k / v (undefined where none).
  struct LayerInputs {
    TensorView q, k, v;
  };
  // Compares one checked layer's output rows with the reference (which reads the new tokens'
  // K/V from `in` where the pass did, and a cross-attention layer's encoder K/V from `in` in the
  // pass that writes them; everything else from the pool, or from ref_pool's layer 0 when given).
  void compare_layer(const LayerSpec& layer, const CheckedRows& rows, const LayerInputs& in,
                     const TensorView& out, const char* what, PassResult& r,
                     const KVPool* ref_pool = nullptr);
  // The checked rows of a pass: the last `check.rows` new tokens of each checked request.
  CheckedRows checked_rows(const StepBatch& step, const CheckOptions& check,
                           const std::vector<size_t>& check_entries) const;

  // --- context parallelism (model_cp.cpp) ---
  using RowRuns = std::vector<std::pair<int64_t, int64_t>>;  // (first row, rows)
  // The pass's rows rank `rank` gives the backend, in its order: every row of a DECODE pass; of
  // an extend, each request's zigzag_rows chunks.
  RowRuns cp_rows(const StepBatch& step, int rank) const;
  // Copies `runs` of src's rows into dst (contiguous), one after the other.
  static void gather_runs(const TensorView& src, const RowRuns& runs, const Tensor& dst);
  // Every rank's own output rows of a layer, put together in the pass's row order on every rank.
  Tensor cp_all_outputs(const StepBatch& step, const TensorView& own_out);
  // The checked requests' K/V of one layer gathered from every rank's pool into a one-layer pool
  // on every rank; slots[j]: request j's tokens in it, in position order.
  std::unique_ptr<KVPool> cp_gather_kv(int layer, const StepBatch& step,
                                       const std::vector<size_t>& entries,
                                       std::vector<std::vector<int32_t>>& slots);
  // Copies `rows` rows of a layer's output to the host and notes its first NaN or Inf in `r`.
  void scan_for_nonfinite(const TensorView& out, int64_t rows, const std::string& what,
                          PassResult& r);
  // The same within a pass (scan_every_layer): synchronizes, and counts as check time.
  void scan_between_layers(const TensorView& out, int64_t rows, const std::string& what,
                           PassResult& r);
  // After a pass: scans the last output for NaN / Inf and compares the checked layers' outputs.
  void verify_pass(const StepBatch& step, const CheckOptions& check,
                   const std::vector<int>& check_layers, const std::vector<size_t>& check_entries,
                   const std::vector<LayerInputs>& check_in, const std::vector<Tensor>& check_out,
                   const TensorView& last_out, PassResult& r);

  ModelConfig config_;
  Device device_;
  CpConfig cp_;
  Tensor cp_q_, cp_k_, cp_v_;  // an extend's own rows of q / k / v (context parallelism)
  std::unique_ptr<KVPool> pool_;
  std::unique_ptr<FlashKVBackend> backend_;
  std::unique_ptr<MultiStepDraftBackend> multi_step_;
  Tensor bank_;                // unit-normal values of the activation dtype on the device
  std::vector<Tensor> sinks_;  // per layer: f32 [num_qo_heads] on the device (config.sinks)
  std::mt19937_64 gen_;
};

}  // namespace flashkv::app
