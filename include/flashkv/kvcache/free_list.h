// IdFreeList: the host-side bookkeeping behind every pool and allocator of the KV cache. It hands
// out ids of a fixed range [first, first + count) and takes them back, refusing to hand out a
// live id or to take back one that is not live.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace flashkv {

class IdFreeList {
 public:
  // `what` names an id in error messages ("slot", "page", "request row").
  IdFreeList(int64_t first, int64_t count, const char* what);

  int64_t first() const { return first_; }
  int64_t capacity() const { return static_cast<int64_t>(live_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_used() const { return capacity() - num_free(); }
  bool contains(int64_t id) const { return id >= first_ && id < first_ + capacity(); }
  bool is_live(int64_t id) const { return contains(id) && live_[id - first_] != 0; }

  // `n` free ids, or nullopt (and no change) when fewer than `n` are free. Ids come out in
  // ascending order from a fresh list; afterwards the most recently freed come first, so a
  // steady-state workload keeps reusing the same (cache-warm) memory.
  std::optional<std::vector<int32_t>> alloc(int64_t n);
  // Throws flashkv::Error unless every id is live and listed once; changes nothing.
  void check_live_distinct(const std::vector<int32_t>& ids) const;
  // Returns the ids to the free list after check_live_distinct.
  void free(const std::vector<int32_t>& ids);
  // Every id free again (ascending order, as when fresh).
  void reset();

 private:
  int64_t first_;
  const char* what_;
  std::vector<int32_t> free_;  // a stack: the next id handed out is free_.back()
  std::vector<uint8_t> live_;  // live_[id - first]
};

}  // namespace flashkv
