// What a model runner hands the attention backend: the forward batch (once per forward pass)
// and the layer being run (once per layer). Field names follow SGLang's ForwardBatch and
// RadixAttention so a port reads one to one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashkv/core/tensor.h"

namespace flashkv {

class ReqToTokenPool;
class KVPool;
class SWAAllocator;

enum class ForwardMode {
  EXTEND,         // prefill of new tokens on top of each request's cached prefix
  DECODE,         // one new token per request
  MIXED,          // extend and decode requests in one batch (run as an extend)
  IDLE,           // nothing to run on this rank (data parallel padding)
  TARGET_VERIFY,  // speculative decoding: score draft_token_num draft tokens per request
  DRAFT_EXTEND,   // speculative decoding: extend the draft model by the accepted tokens
};
const char* mode_name(ForwardMode m);
inline bool is_decode_or_idle(ForwardMode m) {
  return m == ForwardMode::DECODE || m == ForwardMode::IDLE;
}

enum class AttentionType { DECODER, ENCODER_ONLY };

// One attention layer as the model declares it (SGLang's RadixAttention).
struct LayerSpec {
  int layer_id = 0;
  int num_qo_heads = 0;  // tp_q_head_num
  int num_kv_heads = 0;  // tp_k_head_num
  int head_dim_qk = 0;
  int head_dim_v = 0;   // 0: head_dim_qk
  float scaling = 0;    // sm_scale; 0: 1 / sqrt(head_dim_qk)
  float logit_cap = 0;  // logits soft cap; 0: off
  // Sliding window in tokens, exclusive of the current one as SGLang counts it (a query at
  // position p sees keys p - w .. p); -1: full attention.
  int sliding_window_size = -1;
  bool is_cross_attention = false;
  AttentionType attn_type = AttentionType::DECODER;
  // Attention sinks (SEMANTICS.md "Attention sinks"), as SGLang passes RadixAttention's `sinks`:
  // f32 [num_qo_heads] on the backend's device, one natural-log logit per query head; undefined:
  // none. The backend adds them once to every output row of the layer (an extend on a cached
  // prefix: in the prefix pass, which writes the merged rows).
  TensorView sinks;

  int v_dim() const { return head_dim_v > 0 ? head_dim_v : head_dim_qk; }
};

// Speculative-decoding inputs (EAGLE-style verify and draft extend).
struct SpecInfo {
  // TARGET_VERIFY: draft tokens per request, and the tree mask: u8 on the batch's device,
  // request i's [draft_token_num, seq_lens[i]] row-major matrix at offset
  // sum_{j<i} draft_token_num * seq_lens[j] (seq_lens include the draft tokens).
  int32_t draft_token_num = 0;
  TensorView custom_mask;
  // DRAFT_EXTEND: new (accepted) tokens per request, on the host.
  std::vector<int32_t> accept_length_cpu;
  // Draft DECODE (multi-step drafting): each row's KV index set, built by the caller (see
  // MultiStepDraftBackend); when kv_indices is given, DECODE reads it instead of gathering
  // req_to_token rows. kv_indptr: i32 [B + 1] on the device, kv_indptr_cpu its host copy.
  TensorView kv_indptr, kv_indices;
  std::vector<int32_t> kv_indptr_cpu;
};

// Context parallelism (a backend built with BackendOptions::cp_comm; docs/PARALLEL.md): every
// rank gets the same batch shape and the same lengths (seq_lens_cpu, extend_*_cpu,
// spec.draft_token_num, spec.accept_length_cpu and the tree mask are global), and its own share
// of the KV:
//   req_to_token_pool, token_to_kv_pool  the rank's own pools;
//   req_pool_indices  rows of the rank's req_to_token pool; row r lists the slots of the positions
//                     of the request the rank holds (parallel::CpShard), in increasing position,
//                     CpShard::local_len(rank, seq_len) of them;
//   out_cache_loc     [num_tokens()]: for each new token (global order), its slot in the rank's
//                     pool when the rank holds its position, else 0 (the dummy slot).
// forward() takes the queries (and new k / v) of DECODE for every request, on every rank; of the
// extend modes only the rank's own new tokens, zigzag_rows(extend_len, P, rank) of each request
// (FlashKVBackend::cp_query_rows()), and returns their rows.
struct ForwardBatch {
  ForwardMode mode = ForwardMode::DECODE;
  int32_t batch_size = 0;
  // i32 [B] on the device: each request's row of req_to_token.
  TensorView req_pool_indices;
  // KV length of each request after this pass (prefix + new tokens), on the host.
  std::vector<int32_t> seq_lens_cpu;
  // EXTEND / MIXED: cached prefix and new tokens per request (host). seq = prefix + new.
  std::vector<int32_t> extend_prefix_lens_cpu;
  std::vector<int32_t> extend_seq_lens_cpu;
  // i32 [num_tokens] on the device: the KV slot of each new token (the pass writes K/V there).
  TensorView out_cache_loc;
  // Encoder-decoder models: encoder tokens per request (host) and their KV slots (device, i32
  // [sum encoder_lens]); req_to_token row r holds the encoder tokens first, then the decoder's.
  std::vector<int32_t> encoder_lens_cpu;
  TensorView encoder_out_cache_loc;
  SpecInfo spec;

  ReqToTokenPool* req_to_token_pool = nullptr;
  KVPool* token_to_kv_pool = nullptr;  // full-attention layers (all layers without an SWA pool)

  // Query rows of this pass: sum of new tokens (decode: batch_size).
  int64_t num_tokens() const;
  // New tokens of request i in this pass.
  int32_t extend_len(int32_t i) const;
};

}  // namespace flashkv
