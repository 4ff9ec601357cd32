// FlashKVBackend: SGLang's FlashInfer attention backend, rule for rule, over flashkv's pools,
// planner and operators. Per forward batch it turns req_to_token rows into kv_indptr /
// kv_indices, plans every kernel it will run and uploads the plans; per layer it writes the new
// K/V into the pool and runs attention:
//   DECODE        paged decode over each request's KV (or, with use_tensor_cores, the paged
//                 prefill kernel with one query row per request);
//   EXTEND/MIXED  ragged causal attention over the new tokens merged (by LSE) with paged
//                 attention over the cached prefix, or one causal paged pass over prefix and
//                 new tokens (BackendOptions::extend_path; always for multimodal models and in
//                 deterministic mode); ragged only when no request has a prefix;
//   TARGET_VERIFY one paged pass with the per-request tree mask;
//   DRAFT_EXTEND  one causal paged pass over the accepted tokens.
// Two "wrappers" (index sets + plans) when the model mixes sliding-window and full layers
// (window layers read at most w + 1 tokens in decode and w + extend_len in extend, through the
// SWA pool's slot translation when there is one) or is an encoder-decoder (self attention over
// the decoder tokens after the encoder's, cross attention over the encoder tokens).
//
// Context parallelism (BackendOptions::cp_comm, docs/PARALLEL.md): each request's KV is sharded
// across the ranks of a communicator. The backend learns the rank's share from the batch
// (ForwardBatch, "Context parallelism"): its kv_indices gather only the rank's entries, decode runs
// parallel::CpDecode over them, every extend mode parallel::CpExtend, and each new token's K/V is
// written by the rank that holds its position.
//
// Errors: every call validates its arguments and throws flashkv::Error before it writes anything
// (docs/ERRORS.md). A failed init_forward_metadata* leaves the pools and the plan in use as they
// were (forward keeps running the previous batch); a failed forward leaves the pools unchanged
// (K/V are appended only after the layer's attention calls were validated).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flashkv/backend/attention_backend.h"
#include "flashkv/core/buffer.h"
#include "flashkv/ops/attention.h"
#include "flashkv/parallel/context_parallel.h"

namespace flashkv {

// How an EXTEND / MIXED batch in which some request has a cached prefix attends (a batch with no
// prefix anywhere takes the ragged pass alone, either way).
enum class ExtendPath {
  // One paged pass with a 16-bit or f32 pool, where it measured faster on every shape tried on
  // the CPU and on an H100 (docs/perf/cpu.md, docs/perf/prefill.md); the ragged path with an
  // fp8 pool.
  automatic,
  // The seed's: a causal ragged pass over the new tokens as given, then a paged pass over the
  // prefix that merges into its result by LSE; the new K/V go into the pool after. Two plans,
  // two launches.
  ragged,
  // The new K/V go into the pool first, then one causal paged pass over prefix and new tokens.
  // One plan, one launch, no merge; the new tokens are read back from the pool, so with an fp8
  // pool they are attended to as the pool rounds them.
  one_paged_pass,
};
const char* extend_path_name(ExtendPath path);  // "auto", "ragged", "one_paged_pass"
// Throws flashkv::Error naming the argument unless `name` is one of extend_path_name's.
ExtendPath parse_extend_path(const std::string& name);

struct BackendOptions {
  Device device;
  DType q_dtype = DType::bf16;  // activations (q, k, v, output)
  int num_qo_heads = 0, num_kv_heads = 0, head_dim_qk = 0, head_dim_v = 0;  // head_dim_v 0: = qk

  // Model structure.
  int sliding_window_size = -1;          // >= 0: window and full layers mix (two wrappers)
  bool is_encoder_decoder = false;       // self + cross attention wrappers
  bool is_multimodal = false;            // extend runs one paged pass over everything
  bool has_encoder_only_layers = false;  // plan the non-causal ragged pass they need
  // Sliding-window layers keep their KV in this pool, addressed through the allocator's
  // full-to-SWA table (both or neither).
  KVPool* swa_kv_pool = nullptr;
  SWAAllocator* swa_allocator = nullptr;

  // Kernels and planning.
  bool deterministic = false;                      // fixed split sizes; extend in one paged pass
  ExtendPath extend_path = ExtendPath::automatic;  // extend on cached prefixes (ExtendPath)
  int decode_split_size = 2048;                    // deterministic mode
  int prefill_split_size = 4096;                   // deterministic mode
  bool disable_split_kv = false;
  // FlashInfer's use_tensor_cores for decode batches: true runs them through the paged prefill
  // (q-tile, tensor-core) kernel with one query row per request; false through the decode
  // operator. Unset: the decode operator. The seed turns tensor cores on for GQA groups >= 4 and
  // fp8 KV because FlashInfer's decode kernel runs on CUDA cores; flashkv's CUDA decode kernel
  // already packs a KV head's query heads into tensor-core tiles for every group size and KV
  // dtype, so it is the faster choice everywhere and the seed's rule holds with it.
  std::optional<bool> use_tensor_cores;
  // The CUDA stream every launch and copy of the backend is ordered on (null: the default
  // stream). A CUDA graph is captured on a stream of its own: pass it here (or set_stream).
  Stream stream;

  // Context parallelism: each request's KV is sharded across the ranks of cp_comm (not owned;
  // it must outlive the backend) by cp's layout, and each batch carries this rank's share
  // (ForwardBatch, "Context parallelism"). Null: no sharding, the backend's ordinary path. With a
  // communicator (of any size, one rank included; its buffers on `device`: MPI or one rank on the
  // CPU, NCCL or one rank on a GPU), the backend runs without CUDA graphs, a sliding-window pool,
  // cross attention, multimodal or encoder-only layers, or precomputed decode indices (each is
  // refused with one line).
  parallel::Communicator* cp_comm = nullptr;
  parallel::CpOptions cp;
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
  void set_stream(Stream stream) { options_.stream = stream; }
  int num_wrappers() const;
  // Whether decode batches run through the paged prefill kernel (use_tensor_cores == true).
  bool decode_uses_prefill_kernel() const { return options_.use_tensor_cores.value_or(false); }
  // What the last init_forward_metadata decided (for tests and tracing).
  bool uses_ragged() const;
  bool extend_without_prefix() const;
  // Whether this pass of `layer` reads the new tokens' K/V from the k/v it is given (the ragged
  // extend path), not back from the pool. They differ where the pool rounds them (fp8 KV), so a
  // reference of the pass must read them where the pass did (layer_reference's new_k / new_v).
  bool reads_new_kv_from_input(const LayerSpec& layer) const;
  // Context parallelism: the query rows forward() takes for the planned batch (decode: one per
  // request; the extend modes: this rank's new tokens, CpExtend::num_own_rows()).
  int64_t cp_query_rows() const;

 protected:
  TensorView forward_decode(const TensorView& q, const TensorView& k, const TensorView& v,
                            const LayerSpec& layer, const ForwardBatch& batch, bool save_kv_cache,
                            const TensorView& out) override;
  TensorView forward_extend(const TensorView& q, const TensorView& k, const TensorView& v,
                            const LayerSpec& layer, const ForwardBatch& batch, bool save_kv_cache,
                            const TensorView& out) override;

 private:
  friend class MultiStepDraftBackend;  // plans its steps as one unit (prepare all, then commit)
  struct HostPlan;
  struct State;
  State& state(bool graph) const { return graph ? *graph_ : *eager_; }
  // init_forward_metadata* in two halves. prepare validates the batch and plans it on the host
  // into the state's spare HostPlan, changing nothing in use; it throws flashkv::Error for bad
  // input. commit installs that plan: device buffers, uploads, index building (only a device
  // failure, such as running out of memory, can stop it; the backend is then unplanned).
  // check_index_contents: read host index tensors (rows, slots) entry by entry; a caller that
  // fills them only at its own commit, from inputs it checked, passes false.
  void prepare(const ForwardBatch& batch, bool graph, bool check_index_contents = true);
  void commit(const ForwardBatch& batch, bool graph);
  void plan_batch(const ForwardBatch& batch, bool graph);
  // The context-parallel path (backend/context_parallel.cpp).
  struct CpState;
  void cp_plan(const ForwardBatch& batch);
  TensorView cp_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const LayerSpec& layer, const ForwardBatch& batch, bool save_kv_cache,
                        const TensorView& out);

  BackendOptions options_;
  // Eager batches and CUDA-graph batches keep separate buffers, so an eager batch never moves
  // memory a captured graph points at.
  std::unique_ptr<State> eager_, graph_;
  State* active_ = nullptr;      // the state the last init_forward_metadata* planned
  std::unique_ptr<CpState> cp_;  // with BackendOptions::cp_comm
};

}  // namespace flashkv
