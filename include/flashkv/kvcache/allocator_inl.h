// Template definitions of allocator.h (included at its end).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "flashkv/core/error.h"
#include "flashkv/kvcache/allocator.h"  // the declarations; it includes this file at its end

namespace flashkv::kv_alloc_detail {

template <typename IsPageLive>
int64_t check_extend(const std::vector<ExtendRequest>& requests, int page_size,
                     const IsPageLive& is_page_live) {
  int64_t fresh = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const ExtendRequest& r = requests[i];
    FLASHKV_CHECK(r.prefix_len >= 0 && r.num_new >= 0, "alloc_extend: request ", i,
                  ": expected prefix_len >= 0 and num_new >= 0, got ", r.prefix_len, " and ",
                  r.num_new);
    if (r.num_new == 0) continue;
    const int64_t used_in_last = r.prefix_len % page_size;
    if (used_in_last != 0) {
      FLASHKV_CHECK(r.last_slot >= 0 && is_page_live(r.last_slot / page_size),
                    "alloc_extend: request ", i, ": last_slot ", r.last_slot,
                    " is not an allocated slot");
      FLASHKV_CHECK(r.last_slot % page_size == used_in_last - 1, "alloc_extend: request ", i,
                    ": last_slot ", r.last_slot, " sits at page offset ", r.last_slot % page_size,
                    ", expected (prefix_len - 1) % page_size = ", used_in_last - 1);
    }
    const int64_t pages_before = (r.prefix_len + page_size - 1) / page_size;
    const int64_t pages_after = (r.prefix_len + r.num_new + page_size - 1) / page_size;
    fresh += pages_after - pages_before;
  }
  return fresh;
}

}  // namespace flashkv::kv_alloc_detail
