#include "flashkv/backend/attention_backend.h"
#include "flashkv/core/error.h"

namespace flashkv {

const char* mode_name(ForwardMode m) {
  switch (m) {
    case ForwardMode::EXTEND:
      return "EXTEND";
    case ForwardMode::DECODE:
      return "DECODE";
    case ForwardMode::MIXED:
      return "MIXED";
    case ForwardMode::IDLE:
      return "IDLE";
    case ForwardMode::TARGET_VERIFY:
      return "TARGET_VERIFY";
    case ForwardMode::DRAFT_EXTEND:
      return "DRAFT_EXTEND";
  }
  return "?";
}

int32_t ForwardBatch::extend_len(int32_t i) const {
  FLASHKV_CHECK(i >= 0 && i < batch_size, "ForwardBatch::extend_len: request ", i,
                " outside the batch of ", batch_size);
  auto entry = [&](const std::vector<int32_t>& lens, const char* name) {
    FLASHKV_CHECK(static_cast<size_t>(i) < lens.size(), "batch.", name, ": expected ", batch_size,
                  " entries (batch_size), got ", lens.size());
    return lens[i];
  };
  switch (mode) {
    case ForwardMode::DECODE:
      return 1;
    case ForwardMode::IDLE:
      return 0;
    case ForwardMode::TARGET_VERIFY:
      return spec.draft_token_num;
    case ForwardMode::DRAFT_EXTEND:
      return entry(spec.accept_length_cpu, "spec.accept_length_cpu");
    case ForwardMode::EXTEND:
    case ForwardMode::MIXED:
      return entry(extend_seq_lens_cpu, "extend_seq_lens_cpu");
  }
  return 0;
}

int64_t ForwardBatch::num_tokens() const {
  int64_t n = 0;
  for (int32_t i = 0; i < batch_size; ++i) n += extend_len(i);
  return n;
}

TensorView AttentionBackend::forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                     const LayerSpec& layer, const ForwardBatch& batch,
                                     bool save_kv_cache, const TensorView& out) {
  if (batch.mode == ForwardMode::IDLE) return TensorView();
  if (batch.mode == ForwardMode::DECODE)
    return forward_decode(q, k, v, layer, batch, save_kv_cache, out);
  return forward_extend(q, k, v, layer, batch, save_kv_cache, out);
}

}  // namespace flashkv
