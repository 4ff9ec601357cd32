// Slot allocators of the KV pool (host-side free lists; the pool memory itself is in KVPool).
// Slot ids are rows of the pool's K/V tensors: slot s lives on page s / page_size, and page 0
// (which holds the dummy slot 0) is never handed out. Every allocator
//   - never hands out a live slot,
//   - throws flashkv::Error, changing nothing, when asked to free a slot that is not live, a
//     reserved slot, or the same slot twice,
//   - reports running out of memory as an empty result (std::nullopt), changing nothing, so the
//     caller can evict and retry.
// Allocators are not thread-safe: one scheduler thread owns one.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "flashkv/kvcache/free_list.h"

namespace flashkv {

// Room for the new tokens of one request: it holds `prefix_len` tokens in the cache already,
// the last of them in slot `last_slot`, and needs slots for `num_new` more. With page_size > 1
// the new tokens first fill the rest of the last page (slots last_slot + 1, ...), then fresh
// pages; `last_slot` is read only when prefix_len is not a multiple of page_size.
// Decode is num_new = 1; a new request is prefix_len = 0.
struct ExtendRequest {
  int64_t prefix_len = 0;
  int32_t last_slot = 0;
  int64_t num_new = 0;
};

// What a scheduler needs from any allocator.
class KVAllocator {
 public:
  virtual ~KVAllocator() = default;
  virtual int page_size() const = 0;
  virtual int64_t capacity() const = 0;  // slots managed (page 0 excluded)
  virtual int64_t num_free() const = 0;  // slots that can be handed out now (whole free pages)
  virtual bool is_live(int32_t slot) const = 0;

  // Slots for a new request of `n` tokens (ceil(n / page_size) fresh pages, the first n of
  // their slots in order), or nullopt when out of memory.
  virtual std::optional<std::vector<int32_t>> alloc(int64_t n) = 0;
  // Slots for the new tokens of every request of a batch, all or nothing: request i's slots in
  // token order, requests one after another (the batch's out_cache_loc), or nullopt (nothing
  // allocated) when out of memory. Throws flashkv::Error on an inconsistent request (negative
  // counts; with page_size > 1, a last_slot that is not live or not at offset
  // (prefix_len - 1) % page_size of its page).
  virtual std::optional<std::vector<int32_t>> alloc_extend(
      const std::vector<ExtendRequest>& requests) = 0;
  // Frees the pages holding `slots` (a request returns its token slots; with page_size > 1 a
  // page is freed when any of its slots is listed). Throws, freeing nothing, when a slot is
  // reserved, out of range, not live, or listed twice.
  virtual void free(const std::vector<int32_t>& slots) = 0;
  // Everything free again.
  virtual void reset() = 0;
};

// Page-granular allocator: hands out slots in page-aligned runs (page_size >= 1).
class PagedAllocator : public KVAllocator {
 public:
  // Manages num_slots slots (a multiple of page_size): pages 1..num_slots / page_size, i.e.
  // slots page_size .. page_size + num_slots - 1, matching a KVPool of the same geometry.
  PagedAllocator(int64_t num_slots, int page_size);

  int page_size() const override { return page_size_; }
  int64_t capacity() const override { return pages_.capacity() * page_size_; }
  int64_t num_free() const override { return pages_.num_free() * page_size_; }
  bool is_live(int32_t slot) const override;
  int64_t num_pages() const { return pages_.capacity(); }
  int64_t num_free_pages() const { return pages_.num_free(); }

  std::optional<std::vector<int32_t>> alloc(int64_t n) override;
  std::optional<std::vector<int32_t>> alloc_extend(
      const std::vector<ExtendRequest>& requests) override;
  void free(const std::vector<int32_t>& slots) override;
  void reset() override { pages_.reset(); }

  // Fresh pages alloc_extend would take for `requests` (validating them the same way).
  int64_t pages_needed(const std::vector<ExtendRequest>& requests) const;
  // Whole pages (ids >= 1), or nullopt; freed with free_pages.
  std::optional<std::vector<int32_t>> alloc_pages(int64_t n) { return pages_.alloc(n); }
  void free_pages(const std::vector<int32_t>& pages) { pages_.free(pages); }

 private:
  int page_size_;
  IdFreeList pages_;
};

// Token-granular allocator: the page_size 1 case (slots 1..num_slots).
class TokenAllocator : public PagedAllocator {
 public:
  explicit TokenAllocator(int64_t num_slots) : PagedAllocator(num_slots, 1) {}
};

namespace kv_alloc_detail {
// Shared by the allocators: the page of each slot after checking that it is not in the
// reserved page 0, lies below `num_pages`, and is listed once (duplicate pages are dropped).
std::vector<int32_t> pages_of_slots(const std::vector<int32_t>& slots, int page_size,
                                    int64_t num_pages);
// Checks `requests` (see KVAllocator::alloc_extend) against a live-page predicate and returns
// the number of fresh pages they need.
template <typename IsPageLive>
int64_t check_extend(const std::vector<ExtendRequest>& requests, int page_size,
                     const IsPageLive& is_page_live);
// The slots of `requests` in order, continuing partial last pages and then taking
// `fresh_pages` front to back (exactly as many as check_extend counted).
std::vector<int32_t> extend_slots(const std::vector<ExtendRequest>& requests, int page_size,
                                  const std::vector<int32_t>& fresh_pages);
}  // namespace kv_alloc_detail

}  // namespace flashkv

#include "flashkv/kvcache/allocator_inl.h"
