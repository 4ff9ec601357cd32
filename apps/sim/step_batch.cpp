#include "step_batch.h"

#include <algorithm>

#include "flashkv/kvcache/req_to_token_pool.h"

namespace flashkv::app {

void set_encoder_tokens(Sequence& seq, const std::vector<int32_t>& slots, ReqToTokenPool& pool) {
  FLASHKV_CHECK(seq.slots.empty() && seq.encoder_len == 0,
                "set_encoder_tokens: expected a sequence with no tokens, got ", seq.slots.size(),
                " (", seq.encoder_len, " of them encoder tokens)");
  append_tokens(seq, slots, pool);
  seq.encoder_len = static_cast<int32_t>(slots.size());
}

void append_tokens(Sequence& seq, const std::vector<int32_t>& slots, ReqToTokenPool& pool) {
  if (slots.empty()) return;
  pool.write(seq.row, static_cast<int64_t>(seq.slots.size()), slots);
  seq.slots.insert(seq.slots.end(), slots.begin(), slots.end());
}

void rewrite_tokens(Sequence& seq, int32_t start, const std::vector<int32_t>& slots,
                    ReqToTokenPool& pool) {
  FLASHKV_CHECK(start >= 0 && int64_t{start} + static_cast<int64_t>(slots.size()) <= seq.seq_len(),
                "rewrite_tokens: positions [", start, ", ", start + slots.size(),
                ") outside the sequence of ", seq.seq_len(), " tokens");
  if (slots.empty()) return;
  const int64_t at = int64_t{seq.encoder_len} + start;
  pool.write(seq.row, at, slots);
  std::copy(slots.begin(), slots.end(), seq.slots.begin() + at);
}

StepBatch::StepBatch(ForwardMode mode, std::vector<BatchEntry> entries, ReqToTokenPool& pool,
                     Device device, bool write_encoder_kv)
    : entries_(std::move(entries)), write_encoder_kv_(write_encoder_kv) {
  ForwardBatch& b = batch_;
  b.mode = mode;
  b.batch_size = static_cast<int32_t>(entries_.size());
  b.req_to_token_pool = &pool;
  std::vector<int32_t> rows, locs, enc_locs;
  qo_indptr_.assign(1, 0);
  for (size_t i = 0; i < entries_.size(); ++i) {
    const BatchEntry& e = entries_[i];
    FLASHKV_CHECK(e.seq != nullptr, "StepBatch: entry ", i, " has no sequence");
    const Sequence& s = *e.seq;
    FLASHKV_CHECK(e.num_new >= 0 && e.num_new <= e.seq_len && e.seq_len <= s.seq_len(),
                  "StepBatch: entry ", i, ": expected 0 <= num_new <= seq_len <= ", s.seq_len(),
                  ", got num_new ", e.num_new, ", seq_len ", e.seq_len);
    if (mode == ForwardMode::DECODE)
      FLASHKV_CHECK(e.num_new == 1, "StepBatch: a DECODE entry has one new token, got ", e.num_new);
    if (mode == ForwardMode::TARGET_VERIFY) {
      FLASHKV_CHECK(
          e.num_new == entries_[0].num_new && e.num_new > 0 &&
              static_cast<int32_t>(e.tree_parents.size()) == e.num_new,
          "StepBatch: TARGET_VERIFY entries need the same draft count and a parent per draft");
      for (int32_t j = 0; j < e.num_new; ++j)
        FLASHKV_CHECK(
            j == 0 ? e.tree_parents[j] == -1 : (e.tree_parents[j] >= 0 && e.tree_parents[j] < j),
            "StepBatch: entry ", i, ": tree_parents[", j, "] = ", e.tree_parents[j]);
    }
    rows.push_back(s.row);
    const int32_t first_new = s.encoder_len + e.seq_len - e.num_new;
    locs.insert(locs.end(), s.slots.begin() + first_new, s.slots.begin() + first_new + e.num_new);
    enc_locs.insert(enc_locs.end(), s.slots.begin(), s.slots.begin() + s.encoder_len);
    b.seq_lens_cpu.push_back(e.seq_len);
    b.extend_prefix_lens_cpu.push_back(e.seq_len - e.num_new);
    b.extend_seq_lens_cpu.push_back(e.num_new);
    b.encoder_lens_cpu.push_back(s.encoder_len);
    b.spec.accept_length_cpu.push_back(e.num_new);
    qo_indptr_.push_back(qo_indptr_.back() + e.num_new);
    num_encoder_tokens_ += s.encoder_len;
  }
  if (mode != ForwardMode::DRAFT_EXTEND) b.spec.accept_length_cpu.clear();
  if (mode == ForwardMode::TARGET_VERIFY) {
    b.spec.draft_token_num = entries_.empty() ? 1 : entries_[0].num_new;
    for (const BatchEntry& e : entries_) {
      mask_offset_.push_back(static_cast<int64_t>(mask_host_.size()));
      const int32_t prefix = e.seq_len - e.num_new;
      for (int32_t j = 0; j < e.num_new; ++j) {
        std::vector<uint8_t> row(static_cast<size_t>(e.seq_len), 0);
        std::fill(row.begin(), row.begin() + prefix, 1);
        for (int32_t a = j; a >= 0; a = e.tree_parents[a]) row[prefix + a] = 1;
        mask_host_.insert(mask_host_.end(), row.begin(), row.end());
      }
    }
    Tensor host =
        Tensor::empty({std::max<int64_t>(static_cast<int64_t>(mask_host_.size()), 1)}, DType::u8);
    std::copy(mask_host_.begin(), mask_host_.end(), host.ptr<uint8_t>());
    mask_ = host.to(device);
    b.spec.custom_mask = mask_;
  }
  req_pool_indices_ = Tensor::from_i32(rows, device);
  out_cache_loc_ = Tensor::from_i32(locs.empty() ? std::vector<int32_t>{0} : locs, device);
  encoder_out_cache_loc_ =
      Tensor::from_i32(enc_locs.empty() ? std::vector<int32_t>{0} : enc_locs, device);
  b.req_pool_indices = req_pool_indices_.view().rows(0, static_cast<int64_t>(rows.size()));
  b.out_cache_loc = out_cache_loc_.view().rows(0, static_cast<int64_t>(locs.size()));
  b.encoder_out_cache_loc =
      encoder_out_cache_loc_.view().rows(0, static_cast<int64_t>(enc_locs.size()));
}

const uint8_t* StepBatch::mask(size_t i) const {
  if (batch_.mode != ForwardMode::TARGET_VERIFY) return nullptr;
  return mask_host_.data() + mask_offset_.at(i);
}

}  // namespace flashkv::app
