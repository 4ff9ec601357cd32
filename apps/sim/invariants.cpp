#include "invariants.h"

#include <algorithm>
#include <cmath>

#include "flashkv/core/error.h"

namespace flashkv::app {

std::string check_slot_ownership(const KVAllocator& allocator,
                                 const std::vector<SlotOwner>& owners) {
  // Pages 1..num_pages hold slots [page_size, page_size + capacity); page 0 is never handed out.
  const int64_t page = allocator.page_size();
  const int64_t end = page + allocator.capacity();
  std::vector<int32_t> owner_of(static_cast<size_t>(end), -1);
  for (size_t i = 0; i < owners.size(); ++i) {
    for (const int32_t s : owners[i].slots) {
      if (s < page || s >= end)
        return str_cat("slot ", s, " held by ", owners[i].name, " is outside the pool's slots ",
                       page, "..", end - 1);
      const int32_t other = owner_of[s];
      if (other == static_cast<int32_t>(i))
        return str_cat("slot ", s, " is held twice by ", owners[i].name, " (live twice)");
      if (other >= 0)
        return str_cat("slot ", s, " is held by ", owners[other].name, " and by ", owners[i].name,
                       " (live twice)");
      owner_of[s] = static_cast<int32_t>(i);
      if (!allocator.is_live(s))
        return str_cat("slot ", s, " is held by ", owners[i].name,
                       " but free in the allocator (it may be handed out again)");
    }
  }
  int64_t leaked = 0;
  int64_t first = -1;
  for (int64_t p = page; p < end; p += page) {
    if (!allocator.is_live(static_cast<int32_t>(p))) continue;
    bool held = false;
    for (int64_t s = p; s < p + page && !held; ++s) held = owner_of[s] >= 0;
    if (!held && leaked++ == 0) first = p;
  }
  if (leaked > 0)
    return str_cat(leaked * page, " allocated slots are held by no request and not by the prefix ",
                   "cache (leaked), the first is slot ", first);
  return "";
}

std::string check_request_rows(const ReqToTokenPool& pool, const std::vector<RequestRow>& rows) {
  std::vector<int32_t> user(static_cast<size_t>(pool.max_reqs()), -1);
  for (size_t i = 0; i < rows.size(); ++i) {
    const RequestRow& r = rows[i];
    if (r.row < 0 || r.row >= pool.max_reqs() || !pool.is_live(r.row))
      return str_cat(r.name, ": its req_to_token row ", r.row, " is not allocated");
    if (user[r.row] >= 0)
      return str_cat("req_to_token row ", r.row, " is held by ", rows[user[r.row]].name, " and by ",
                     r.name);
    user[r.row] = static_cast<int32_t>(i);
    const int64_t n = static_cast<int64_t>(r.slots->size());
    if (n > pool.max_context_len())
      return str_cat(r.name, " holds ", n, " tokens, more than a row's ", pool.max_context_len());
    const std::vector<int32_t> listed = pool.read(r.row, 0, n);
    for (int64_t t = 0; t < n; ++t)
      if (listed[t] != (*r.slots)[t])
        return str_cat(r.name, ": req_to_token row ", r.row, " lists slot ", listed[t],
                       " at token ", t, ", the request holds slot ", (*r.slots)[t]);
  }
  if (pool.num_used() != static_cast<int64_t>(rows.size()))
    return str_cat(pool.num_used(), " req_to_token rows in use, but ", rows.size(),
                   " requests are running (the rest leaked)");
  return "";
}

int64_t first_nonfinite(const TensorView& t) {
  FLASHKV_CHECK(t.device.is_cpu() && t.is_contiguous(),
                "first_nonfinite: expected a contiguous host tensor, got ", t.str());
  const int64_t n = t.numel();
  if (t.dtype == DType::bf16 || t.dtype == DType::f16) {
    // Exponent all ones: Inf or NaN. The bits are read in branch-free chunks, so that a scan
    // of a large prefill's output stays cheap; only a chunk with a hit is searched.
    const uint16_t exponent = t.dtype == DType::bf16 ? 0x7F80 : 0x7C00;
    const auto* p = static_cast<const uint16_t*>(t.data);
    constexpr int64_t kChunk = 4096;
    for (int64_t begin = 0; begin < n; begin += kChunk) {
      const int64_t end = std::min(n, begin + kChunk);
      bool any = false;
      for (int64_t i = begin; i < end; ++i) any |= (p[i] & exponent) == exponent;
      if (!any) continue;
      for (int64_t i = begin; i < end; ++i)
        if ((p[i] & exponent) == exponent) return i;
    }
    return -1;
  }
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(load_as_double(t.data, t.dtype, i))) return i;
  return -1;
}

}  // namespace flashkv::app
