#include "flashkv/kvcache/free_list.h"

#include <algorithm>
#include <limits>

#include "flashkv/core/error.h"

namespace flashkv {

IdFreeList::IdFreeList(int64_t first, int64_t count, const char* what)
    : first_(first), what_(what) {
  FLASHKV_CHECK(
      first >= 0 && count >= 0 && first + count <= int64_t{std::numeric_limits<int32_t>::max()} + 1,
      what, " ids: expected a range inside int32 [0, 2^31), got first ", first, ", count ", count);
  live_.assign(static_cast<size_t>(count), 0);
  reset();
}

void IdFreeList::reset() {
  const int64_t count = capacity();
  free_.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) free_[i] = static_cast<int32_t>(first_ + count - 1 - i);
  std::fill(live_.begin(), live_.end(), 0);
}

std::optional<std::vector<int32_t>> IdFreeList::alloc(int64_t n) {
  FLASHKV_CHECK(n >= 0, what_, " alloc: expected a count >= 0, got ", n);
  if (n > num_free()) return std::nullopt;
  std::vector<int32_t> ids(free_.rbegin(), free_.rbegin() + n);
  free_.resize(free_.size() - static_cast<size_t>(n));
  for (int32_t id : ids) live_[id - first_] = 1;
  return ids;
}

void IdFreeList::check_live_distinct(const std::vector<int32_t>& ids) const {
  for (int32_t id : ids) {
    FLASHKV_CHECK(contains(id), what_, " ", id, ": out of range [", first_, ", ",
                  first_ + capacity(), ")");
    FLASHKV_CHECK(live_[id - first_] != 0, what_, " ", id, ": freeing one that is not allocated");
  }
  std::vector<int32_t> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  FLASHKV_CHECK(dup == sorted.end(), what_, " ", dup == sorted.end() ? 0 : *dup,
                ": listed twice in one free");
}

void IdFreeList::free(const std::vector<int32_t>& ids) {
  check_live_distinct(ids);
  for (int32_t id : ids) {
    live_[id - first_] = 0;
    free_.push_back(id);
  }
}

}  // namespace flashkv
