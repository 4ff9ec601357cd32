// SWAAllocator: slots for a model that mixes full-attention and sliding-window (SWA) layers,
// each kind with its own KVPool. Every token gets a full-attention slot and an SWA slot
// together; the scheduler only sees the full slot, and the SWA layers find theirs through the
// full-to-SWA translation table (`translate_full_to_swa`, or the `translate_slots` op on the
// device copy of the table). When tokens leave the window, free_swa releases their SWA slots
// early (the table then maps them to the dummy slot 0) while the full slots stay live.
// Pages pair up: each full page has at most one SWA page, and slot offsets within the pages
// match, so the table maps full slot p * P + o to SWA slot q * P + o.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/kvcache/allocator.h"

namespace flashkv {

class SWAAllocator : public KVAllocator {
 public:
  // num_full_slots / num_swa_slots: usable slots of the full and SWA pools (multiples of
  // page_size); the translation table lives on `device` (and, always, on the host).
  SWAAllocator(int64_t num_full_slots, int64_t num_swa_slots, int page_size = 1,
               Device device = Device::cpu());

  // KVAllocator, in full slots. num_free() is what can be handed out now: the smaller of the
  // free full and free SWA slots.
  int page_size() const override { return page_size_; }
  int64_t capacity() const override { return full_pages_.capacity() * page_size_; }
  int64_t num_free() const override;
  bool is_live(int32_t full_slot) const override;
  std::optional<std::vector<int32_t>> alloc(int64_t n) override;
  // Needs the SWA page of each partially filled last page to be still held (not free_swa'd).
  std::optional<std::vector<int32_t>> alloc_extend(
      const std::vector<ExtendRequest>& requests) override;
  // Frees the full pages of `slots` and the SWA pages still paired with them.
  void free(const std::vector<int32_t>& slots) override;
  void reset() override;

  // Releases the SWA pages of the pages of `full_slots` (tokens that left the window; with
  // page_size > 1 pass only tokens whose whole page left it), keeping the full slots. Throws,
  // changing nothing, when a full slot is not live or its SWA page was already released.
  void free_swa(const std::vector<int32_t>& full_slots);

  int64_t full_capacity() const { return capacity(); }
  int64_t num_free_full() const { return full_pages_.num_free() * page_size_; }
  int64_t swa_capacity() const { return swa_pages_.capacity() * page_size_; }
  int64_t num_free_swa() const { return swa_pages_.num_free() * page_size_; }
  bool is_swa_live(int32_t swa_slot) const;

  // The SWA slot of each full slot (0 for a full slot with no SWA slot); throws when a slot is
  // outside the full pool [0, num_full_slots + page_size).
  std::vector<int32_t> translate_full_to_swa(const std::vector<int32_t>& full_slots) const;
  int32_t translate_full_to_swa(int32_t full_slot) const;
  // int32 [num_full_slots + page_size] on the host: the authoritative table.
  const TensorView& host_table() const { return host_table_.view(); }
  // The same table on the allocator's device, after uploading the entries changed since the
  // last call (one copy of the changed span, ordered on `stream`). The view stays valid for the
  // allocator's lifetime; call this again after alloc/free before the device reads it. With
  // changes pending it issues a host-to-device copy, so call it outside CUDA-graph capture (the
  // backend does so when it prepares a batch); with none pending it only returns the view.
  const TensorView& full_to_swa_table(Stream stream = {});

 private:
  void pair_pages(int32_t full_page, int32_t swa_page);
  void mark_dirty(int64_t begin, int64_t end);

  int page_size_;
  IdFreeList full_pages_, swa_pages_;
  std::vector<int32_t> swa_page_of_;  // [full pages + 1]: the SWA page paired with a full page
  Tensor host_table_;                 // i32 [full rows]
  Tensor device_table_;               // i32 [full rows] on the device (CUDA only)
  int64_t dirty_begin_ = 0, dirty_end_ = 0;  // host entries not yet uploaded
};

}  // namespace flashkv
