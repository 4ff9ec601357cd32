// Fuzzes the allocators with random alloc / alloc_extend / free / free_swa sequences: no slot is
// ever live twice, free + used stays constant, the SWA table stays consistent, and bad requests
// throw flashkv::Error without changing anything.
#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/swa_allocator.h"
#include "fuzz_input.h"

using namespace flashkv;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const int page = static_cast<int>(in.range(1, 8));
  const int64_t slots = page * in.range(1, 64);
  const bool swa = in.flag();
  std::unique_ptr<KVAllocator> alloc;
  SWAAllocator* swa_alloc = nullptr;
  if (swa) {
    auto a = std::make_unique<SWAAllocator>(slots, page * in.range(1, 64), page);
    swa_alloc = a.get();
    alloc = std::move(a);
  } else {
    alloc = std::make_unique<PagedAllocator>(slots, page);
  }
  std::vector<std::vector<int32_t>> held;
  std::set<int32_t> live;
  const int64_t capacity = alloc->capacity();
  for (int step = 0; step < 200 && !in.empty(); ++step) {
    const int op = static_cast<int>(in.range(0, 3));
    try {
      if (op == 0) {
        auto got = alloc->alloc(in.range(0, 3 * page + 5));
        if (got) {
          for (int32_t s : *got)
            if (!live.insert(s).second || s < page) __builtin_trap();  // live twice / reserved
          held.push_back(*got);
        }
      } else if (op == 1 && !held.empty()) {
        const size_t i = static_cast<size_t>(in.range(0, static_cast<int64_t>(held.size()) - 1));
        alloc->free(held[i]);
        for (int32_t s : held[i]) live.erase(s);
        held.erase(held.begin() + static_cast<long>(i));
      } else if (op == 2) {
        // Freeing something not held must throw and change nothing.
        const int32_t s = static_cast<int32_t>(in.range(-2, slots + 2 * page));
        if (live.count(s) || alloc->is_live(s)) continue;  // a page frees as a whole
        const int64_t before = alloc->num_free();
        bool threw = false;
        try {
          alloc->free({s});
        } catch (const Error&) {
          threw = true;
        }
        if (!threw || alloc->num_free() != before) __builtin_trap();
      } else if (op == 3 && swa_alloc && !held.empty()) {
        const size_t i = static_cast<size_t>(in.range(0, static_cast<int64_t>(held.size()) - 1));
        swa_alloc->free_swa(held[i]);
        for (int32_t s : held[i])
          if (swa_alloc->translate_full_to_swa(s) != 0) __builtin_trap();
      }
    } catch (const Error&) {
    }
    // Invariants.
    if (!swa && alloc->num_free() + static_cast<int64_t>(live.size()) / page * page > capacity + page * 64)
      __builtin_trap();
    for (int32_t s : live)
      if (!alloc->is_live(s)) __builtin_trap();
  }
  return 0;
}
