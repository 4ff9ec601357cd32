#include <algorithm>

#include "flashkv/kvcache/allocator.h"

namespace flashkv {
namespace kv_alloc_detail {

std::vector<int32_t> pages_of_slots(const std::vector<int32_t>& slots, int page_size,
                                    int64_t num_pages) {
  std::vector<int32_t> sorted = slots;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int32_t> pages;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int32_t slot = sorted[i];
    FLASHKV_CHECK(slot >= page_size, "free: slot ", slot,
                  page_size == 1 ? " is the reserved dummy slot"
                                 : " lies in the reserved page 0 (slot 0 is the dummy)");
    FLASHKV_CHECK(slot / page_size <= num_pages, "free: slot ", slot, " out of range [", page_size,
                  ", ", (num_pages + 1) * page_size, ")");
    FLASHKV_CHECK(i == 0 || sorted[i - 1] != slot, "free: slot ", slot, " listed twice");
    const int32_t page = slot / page_size;
    if (pages.empty() || pages.back() != page) pages.push_back(page);
  }
  return pages;
}

std::vector<int32_t> extend_slots(const std::vector<ExtendRequest>& requests, int page_size,
                                  const std::vector<int32_t>& fresh_pages) {
  std::vector<int32_t> slots;
  size_t next_page = 0;
  for (const ExtendRequest& r : requests) {
    int64_t remaining = r.num_new;
    const int64_t used_in_last = r.prefix_len % page_size;
    if (used_in_last != 0) {
      const int64_t n = std::min(remaining, page_size - used_in_last);
      for (int64_t j = 1; j <= n; ++j) slots.push_back(static_cast<int32_t>(r.last_slot + j));
      remaining -= n;
    }
    while (remaining > 0) {
      FLASHKV_CHECK(next_page < fresh_pages.size(), "extend_slots: ran out of fresh pages");
      const int64_t base = int64_t{fresh_pages[next_page++]} * page_size;
      const int64_t n = std::min<int64_t>(remaining, page_size);
      for (int64_t j = 0; j < n; ++j) slots.push_back(static_cast<int32_t>(base + j));
      remaining -= n;
    }
  }
  FLASHKV_CHECK(next_page == fresh_pages.size(), "extend_slots: ", fresh_pages.size() - next_page,
                " fresh pages left over");
  return slots;
}

}  // namespace kv_alloc_detail

PagedAllocator::PagedAllocator(int64_t num_slots, int page_size)
    : page_size_(page_size),
      pages_(
          1,
          page_size >= 1 && num_slots > 0 && num_slots % page_size == 0 ? num_slots / page_size : 0,
          "page") {
  FLASHKV_CHECK(page_size >= 1, "PagedAllocator: page_size: expected >= 1, got ", page_size);
  FLASHKV_CHECK(num_slots > 0 && num_slots % page_size == 0,
                "PagedAllocator: num_slots: expected a positive multiple of page_size ", page_size,
                ", got ", num_slots);
  FLASHKV_CHECK((num_slots / page_size + 1) * page_size - 1 <= int64_t{INT32_MAX},
                "PagedAllocator: num_slots: slot ids are int32, got ", num_slots, " slots");
}

bool PagedAllocator::is_live(int32_t slot) const {
  return slot >= 0 && pages_.is_live(slot / page_size_);
}

int64_t PagedAllocator::pages_needed(const std::vector<ExtendRequest>& requests) const {
  return kv_alloc_detail::check_extend(requests, page_size_,
                                       [this](int64_t page) { return pages_.is_live(page); });
}

std::optional<std::vector<int32_t>> PagedAllocator::alloc(int64_t n) {
  FLASHKV_CHECK(n >= 0, "alloc: expected a token count >= 0, got ", n);
  return alloc_extend({ExtendRequest{0, 0, n}});
}

std::optional<std::vector<int32_t>> PagedAllocator::alloc_extend(
    const std::vector<ExtendRequest>& requests) {
  const int64_t fresh = pages_needed(requests);
  std::optional<std::vector<int32_t>> pages = pages_.alloc(fresh);
  if (!pages) return std::nullopt;
  return kv_alloc_detail::extend_slots(requests, page_size_, *pages);
}

void PagedAllocator::free(const std::vector<int32_t>& slots) {
  pages_.free(kv_alloc_detail::pages_of_slots(slots, page_size_, pages_.capacity()));
}

}  // namespace flashkv
