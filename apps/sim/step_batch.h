// What a model runner hands the backend each forward pass: the requests' token slots
// (Sequence, mirrored into their req_to_token rows) and a StepBatch that assembles a
// ForwardBatch of any mode over them, owning the device tensors the batch points at.
#pragma once

#include <cstdint>
#include <vector>

#include "flashkv/backend/forward_batch.h"
#include "flashkv/core/buffer.h"

namespace flashkv {
class ReqToTokenPool;
}

namespace flashkv::app {

// A request's tokens in the KV cache: its req_to_token row and, on the host, the same slots.
struct Sequence {
  int32_t row = -1;
  int32_t encoder_len = 0;     // encoder tokens (encoder-decoder models), first in the row
  std::vector<int32_t> slots;  // full-pool slots: the encoder tokens, then the decoder tokens
  int32_t seq_len() const { return static_cast<int32_t>(slots.size()) - encoder_len; }
};

// Gives a sequence with no tokens yet its encoder tokens, held in `slots`: they become the first
// entries of the sequence and of its req_to_token row (SGLang's layout for encoder-decoder
// models), and the decoder tokens follow them.
void set_encoder_tokens(Sequence& seq, const std::vector<int32_t>& slots, ReqToTokenPool& pool);
// Appends decoder tokens held in `slots` to the sequence and to its req_to_token row.
void append_tokens(Sequence& seq, const std::vector<int32_t>& slots, ReqToTokenPool& pool);
// Rewrites decoder token positions [start, start + slots.size()) with `slots` (host and row).
void rewrite_tokens(Sequence& seq, int32_t start, const std::vector<int32_t>& slots,
                    ReqToTokenPool& pool);

// One request of a forward pass.
struct BatchEntry {
  Sequence* seq = nullptr;
  int32_t seq_len = 0;  // decoder tokens the pass sees (<= seq->seq_len())
  int32_t num_new = 0;  // of which the last num_new are this pass's new tokens
  // TARGET_VERIFY: the draft tree over the new tokens: parent[j] < j of node j, -1 for the root
  // (node 0). Node j sees the prefix, its ancestors and itself.
  std::vector<int32_t> tree_parents;
};

class StepBatch {
 public:
  // Builds the ForwardBatch of `mode` (DECODE: num_new 1 each; TARGET_VERIFY: the same num_new
  // for all, with tree_parents; EXTEND / MIXED / DRAFT_EXTEND: any num_new) on `device`.
  // write_encoder_kv: cross-attention layers write the encoder tokens' K/V in this pass.
  StepBatch(ForwardMode mode, std::vector<BatchEntry> entries, ReqToTokenPool& pool, Device device,
            bool write_encoder_kv = false);
  StepBatch(const StepBatch&) = delete;
  StepBatch& operator=(const StepBatch&) = delete;

  ForwardBatch& batch() { return batch_; }
  const ForwardBatch& batch() const { return batch_; }
  const std::vector<BatchEntry>& entries() const { return entries_; }
  int64_t num_tokens() const { return static_cast<int64_t>(qo_indptr_.back()); }
  int64_t num_encoder_tokens() const { return num_encoder_tokens_; }
  bool write_encoder_kv() const { return write_encoder_kv_; }
  // First query row of entry i.
  int32_t qo_begin(size_t i) const { return qo_indptr_[i]; }
  // TARGET_VERIFY: entry i's [num_new, seq_len] tree mask on the host; null otherwise.
  const uint8_t* mask(size_t i) const;

 private:
  ForwardBatch batch_;
  std::vector<BatchEntry> entries_;
  std::vector<int32_t> qo_indptr_;
  std::vector<int64_t> mask_offset_;
  std::vector<uint8_t> mask_host_;
  int64_t num_encoder_tokens_ = 0;
  bool write_encoder_kv_ = false;
  Tensor req_pool_indices_, out_cache_loc_, encoder_out_cache_loc_, mask_;
};

}  // namespace flashkv::app
