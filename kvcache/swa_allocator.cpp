#include "flashkv/kvcache/swa_allocator.h"

#include <algorithm>
#include <cstring>

namespace flashkv {
namespace {

int64_t pages_of(int64_t num_slots, int page_size, const char* name) {
  FLASHKV_CHECK(page_size >= 1, "SWAAllocator: page_size: expected >= 1, got ", page_size);
  FLASHKV_CHECK(num_slots > 0 && num_slots % page_size == 0, "SWAAllocator: ", name,
                ": expected a positive multiple of page_size ", page_size, ", got ", num_slots);
  return num_slots / page_size;
}

}  // namespace

SWAAllocator::SWAAllocator(int64_t num_full_slots, int64_t num_swa_slots, int page_size,
                           Device device)
    : page_size_(page_size),
      full_pages_(1, pages_of(num_full_slots, page_size, "num_full_slots"), "full page"),
      swa_pages_(1, pages_of(num_swa_slots, page_size, "num_swa_slots"), "SWA page") {
  FLASHKV_CHECK((full_pages_.capacity() + 1) * page_size <= int64_t{INT32_MAX} &&
                    (swa_pages_.capacity() + 1) * page_size <= int64_t{INT32_MAX},
                "SWAAllocator: slot ids are int32, got ", num_full_slots, " full and ",
                num_swa_slots, " SWA slots");
  const int64_t full_rows = (full_pages_.capacity() + 1) * page_size;
  swa_page_of_.assign(static_cast<size_t>(full_pages_.capacity() + 1), 0);
  host_table_ = Tensor::empty({full_rows}, DType::i32);
  std::memset(host_table_.data(), 0, host_table_.view().nbytes());
  if (device.is_cuda()) {
    device_table_ = Tensor::empty({full_rows}, DType::i32, device);
    mark_dirty(0, full_rows);
  }
}

int64_t SWAAllocator::num_free() const { return std::min(num_free_full(), num_free_swa()); }

bool SWAAllocator::is_live(int32_t full_slot) const {
  return full_slot >= 0 && full_pages_.is_live(full_slot / page_size_);
}

bool SWAAllocator::is_swa_live(int32_t swa_slot) const {
  return swa_slot >= 0 && swa_pages_.is_live(swa_slot / page_size_);
}

void SWAAllocator::mark_dirty(int64_t begin, int64_t end) {
  if (!device_table_.defined()) return;
  if (dirty_begin_ == dirty_end_) {
    dirty_begin_ = begin;
    dirty_end_ = end;
  } else {
    dirty_begin_ = std::min(dirty_begin_, begin);
    dirty_end_ = std::max(dirty_end_, end);
  }
}

// Points the P table entries of full page `full_page` at SWA page `swa_page` (0: none).
void SWAAllocator::pair_pages(int32_t full_page, int32_t swa_page) {
  swa_page_of_[full_page] = swa_page;
  int32_t* table = host_table_.ptr<int32_t>();
  const int64_t base = int64_t{full_page} * page_size_;
  for (int o = 0; o < page_size_; ++o)
    table[base + o] = swa_page == 0 ? 0 : static_cast<int32_t>(int64_t{swa_page} * page_size_ + o);
  mark_dirty(base, base + page_size_);
}

std::optional<std::vector<int32_t>> SWAAllocator::alloc(int64_t n) {
  FLASHKV_CHECK(n >= 0, "alloc: expected a token count >= 0, got ", n);
  return alloc_extend({ExtendRequest{0, 0, n}});
}

std::optional<std::vector<int32_t>> SWAAllocator::alloc_extend(
    const std::vector<ExtendRequest>& requests) {
  const int64_t fresh = kv_alloc_detail::check_extend(
      requests, page_size_, [this](int64_t page) { return full_pages_.is_live(page); });
  for (size_t i = 0; i < requests.size(); ++i) {
    const ExtendRequest& r = requests[i];
    if (r.num_new == 0 || r.prefix_len % page_size_ == 0) continue;
    FLASHKV_CHECK(swa_page_of_[r.last_slot / page_size_] != 0, "alloc_extend: request ", i,
                  ": the SWA page of last_slot ", r.last_slot,
                  " was released (free_swa) while the request still writes to it");
  }
  if (fresh > full_pages_.num_free() || fresh > swa_pages_.num_free()) return std::nullopt;
  const std::vector<int32_t> full = *full_pages_.alloc(fresh);
  const std::vector<int32_t> swa = *swa_pages_.alloc(fresh);
  for (int64_t i = 0; i < fresh; ++i) pair_pages(full[i], swa[i]);
  return kv_alloc_detail::extend_slots(requests, page_size_, full);
}

void SWAAllocator::free(const std::vector<int32_t>& slots) {
  const std::vector<int32_t> pages =
      kv_alloc_detail::pages_of_slots(slots, page_size_, full_pages_.capacity());
  full_pages_.check_live_distinct(pages);
  std::vector<int32_t> swa;
  for (int32_t page : pages)
    if (swa_page_of_[page] != 0) swa.push_back(swa_page_of_[page]);
  swa_pages_.check_live_distinct(swa);  // holds unless the pairing is broken
  full_pages_.free(pages);
  swa_pages_.free(swa);
  for (int32_t page : pages) pair_pages(page, 0);
}

void SWAAllocator::free_swa(const std::vector<int32_t>& full_slots) {
  const std::vector<int32_t> pages =
      kv_alloc_detail::pages_of_slots(full_slots, page_size_, full_pages_.capacity());
  full_pages_.check_live_distinct(pages);
  std::vector<int32_t> swa;
  for (int32_t page : pages) {
    FLASHKV_CHECK(swa_page_of_[page] != 0, "free_swa: the SWA page of full page ", page,
                  " was already released");
    swa.push_back(swa_page_of_[page]);
  }
  swa_pages_.free(swa);
  for (int32_t page : pages) pair_pages(page, 0);
}

void SWAAllocator::reset() {
  full_pages_.reset();
  swa_pages_.reset();
  std::fill(swa_page_of_.begin(), swa_page_of_.end(), 0);
  std::memset(host_table_.data(), 0, host_table_.view().nbytes());
  mark_dirty(0, host_table_.numel());
}

int32_t SWAAllocator::translate_full_to_swa(int32_t full_slot) const {
  FLASHKV_CHECK(full_slot >= 0 && full_slot < host_table_.numel(),
                "translate_full_to_swa: full slot ", full_slot, " out of range [0, ",
                host_table_.numel(), ")");
  return host_table_.ptr<int32_t>()[full_slot];
}

std::vector<int32_t> SWAAllocator::translate_full_to_swa(
    const std::vector<int32_t>& full_slots) const {
  std::vector<int32_t> out(full_slots.size());
  for (size_t i = 0; i < full_slots.size(); ++i) out[i] = translate_full_to_swa(full_slots[i]);
  return out;
}

const TensorView& SWAAllocator::full_to_swa_table(Stream stream) {
  if (!device_table_.defined()) return host_table_.view();
  if (dirty_end_ > dirty_begin_) {
    copy_bytes(device_table_.ptr<int32_t>() + dirty_begin_, device_table_.device(),
               host_table_.ptr<int32_t>() + dirty_begin_, Device::cpu(),
               static_cast<size_t>(dirty_end_ - dirty_begin_) * 4, stream);
    dirty_begin_ = dirty_end_ = 0;
  }
  return device_table_.view();
}

}  // namespace flashkv
