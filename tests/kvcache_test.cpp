// The KV cache layer: pools and allocators, driven through long random schedules with every
// invariant checked after every step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/kvcache/swa_allocator.h"
#include "test_util.h"

namespace flashkv {
namespace {

using test::Rng;

TEST(IdFreeList, HandsOutAscendingThenMostRecentlyFreed) {
  IdFreeList list(1, 5, "slot");
  EXPECT_EQ(*list.alloc(3), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_FALSE(list.alloc(3).has_value());  // only 2 left: nothing changes
  EXPECT_EQ(list.num_free(), 2);
  list.free({2});
  EXPECT_EQ(*list.alloc(2), (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(list.num_used(), 4);
  EXPECT_THROW(list.free({5}), Error);     // never handed out
  EXPECT_THROW(list.free({0}), Error);     // below the range
  EXPECT_THROW(list.free({6}), Error);     // above the range
  EXPECT_THROW(list.free({1, 1}), Error);  // twice in one call
  EXPECT_THROW(list.free({1, 5}), Error);  // one bad id: none freed
  EXPECT_EQ(list.num_used(), 4);
  EXPECT_TRUE(list.is_live(1));
  EXPECT_THROW(list.alloc(-1), Error);
  EXPECT_EQ(*list.alloc(0), std::vector<int32_t>{});
  list.reset();
  EXPECT_EQ(list.num_free(), 5);
  EXPECT_EQ(*list.alloc(1), std::vector<int32_t>{1});
}

TEST(ReqToTokenPool, RowsComeAndGoAndWritesLandInTheirRow) {
  ReqToTokenPool pool(4, 16);
  EXPECT_EQ(pool.req_to_token().dtype, DType::i32);
  EXPECT_EQ(pool.req_to_token().shape[0], 4);
  EXPECT_EQ(pool.req_to_token().shape[1], 16);
  for (int64_t i = 0; i < 4 * 16; ++i) EXPECT_EQ(pool.req_to_token().ptr<int32_t>()[i], 0);

  const std::vector<int32_t> rows = *pool.alloc(3);
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FALSE(pool.alloc(2).has_value());  // out of rows: recoverable
  EXPECT_EQ(pool.num_free(), 1);

  pool.write(rows[1], 3, std::vector<int32_t>{7, 8, 9});
  EXPECT_EQ(pool.read(rows[1], 2, 5), (std::vector<int32_t>{0, 7, 8, 9, 0}));
  EXPECT_EQ(pool.req_to_token().at({1, 4}), 8);
  pool.write(rows[1], 14, std::vector<int32_t>{5, 6});  // ends exactly at max_context_len
  EXPECT_EQ(pool.read(rows[1], 15, 1), std::vector<int32_t>{6});

  // Bad writes change nothing.
  EXPECT_THROW(pool.write(rows[1], 15, std::vector<int32_t>{1, 2}), Error);  // past the end
  EXPECT_THROW(pool.write(rows[1], -1, std::vector<int32_t>{1}), Error);
  EXPECT_THROW(pool.write(3, 0, std::vector<int32_t>{1}), Error);  // row not allocated
  EXPECT_THROW(pool.write(4, 0, std::vector<int32_t>{1}), Error);  // row out of range
  EXPECT_THROW(pool.write(-1, 0, std::vector<int32_t>{1}), Error);
  Tensor wrong_dtype = Tensor::empty({2}, DType::i64);
  EXPECT_THROW(pool.write(rows[0], 0, wrong_dtype), Error);
  EXPECT_THROW(pool.read(rows[0], 10, 7), Error);
  EXPECT_EQ(pool.read(rows[1], 0, 16),
            (std::vector<int32_t>{0, 0, 0, 7, 8, 9, 0, 0, 0, 0, 0, 0, 0, 0, 5, 6}));

  EXPECT_THROW(pool.free({3}), Error);     // not allocated
  EXPECT_THROW(pool.free({0, 0}), Error);  // twice
  EXPECT_THROW(pool.free({0, 9}), Error);  // one bad row: none freed
  EXPECT_EQ(pool.num_used(), 3);
  pool.free({rows[0], rows[2]});
  EXPECT_FALSE(pool.is_live(rows[0]));
  EXPECT_TRUE(pool.is_live(rows[1]));
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_THROW(pool.free({rows[0]}), Error);  // already free

  EXPECT_THROW(ReqToTokenPool(0, 16), Error);
  EXPECT_THROW(ReqToTokenPool(4, 0), Error);
}

TEST(KVPool, LayoutScalesAndZeroedMemory) {
  KVPoolConfig c;
  c.num_slots = 32;
  c.page_size = 8;
  c.num_layers = 3;
  c.num_kv_heads = 2;
  c.head_dim_qk = 16;
  c.head_dim_v = 8;
  c.dtype = DType::fp8_e4m3;
  KVPool pool(c);
  EXPECT_EQ(pool.num_rows(), 40);
  EXPECT_EQ(pool.num_pages(), 4);
  EXPECT_EQ(pool.bytes(), size_t{3} * 40 * 2 * (16 + 8));
  for (int layer = 0; layer < 3; ++layer) {
    const TensorView& k = pool.k(layer);
    const TensorView& v = pool.v(layer);
    EXPECT_EQ(k.str(), "fp8_e4m3[40, 2, 16] on cpu");
    EXPECT_EQ(v.str(), "fp8_e4m3[40, 2, 8] on cpu");
    EXPECT_NE(k.data, v.data);
    for (int64_t i = 0; i < k.numel(); ++i) EXPECT_EQ(static_cast<uint8_t*>(k.data)[i], 0);
    EXPECT_EQ(pool.k_scale(layer), 1.0f);
  }
  EXPECT_NE(pool.k(0).data, pool.k(1).data);
  pool.set_scales(1, 0.5f, 2.0f);
  EXPECT_EQ(pool.k_scale(1), 0.5f);
  EXPECT_EQ(pool.v_scale(1), 2.0f);
  EXPECT_THROW(pool.set_scales(1, 0.0f, 1.0f), Error);
  EXPECT_THROW(pool.set_scales(1, 1.0f, NAN), Error);
  EXPECT_THROW(pool.set_scales(1, INFINITY, 1.0f), Error);
  EXPECT_EQ(pool.k_scale(1), 0.5f);  // unchanged by the failed calls
  EXPECT_THROW(pool.k(3), Error);
  EXPECT_THROW(pool.v(-1), Error);

  KVPoolConfig same_dims = c;
  same_dims.head_dim_v = 0;
  same_dims.dtype = DType::bf16;
  EXPECT_EQ(KVPool(same_dims).v(0).shape[2], 16);

  auto bad = [&](auto mutate) {
    KVPoolConfig b = c;
    mutate(b);
    EXPECT_THROW(KVPool{b}, Error);
  };
  bad([](KVPoolConfig& b) { b.num_slots = 30; });  // not a multiple of page_size
  bad([](KVPoolConfig& b) { b.num_slots = 0; });
  bad([](KVPoolConfig& b) { b.page_size = 0; });
  bad([](KVPoolConfig& b) { b.num_layers = 0; });
  bad([](KVPoolConfig& b) { b.num_kv_heads = 0; });
  bad([](KVPoolConfig& b) { b.head_dim_qk = -1; });
  bad([](KVPoolConfig& b) { b.dtype = DType::i32; });
  bad([](KVPoolConfig& b) { b.num_slots = int64_t{1} << 31; });
}

TEST(PagedAllocator, ExtendFillsTheLastPageThenFreshPages) {
  PagedAllocator alloc(64, 4);  // pages 1..16, slots 4..67
  EXPECT_EQ(alloc.capacity(), 64);
  const std::vector<int32_t> a = *alloc.alloc(6);  // pages 1, 2
  EXPECT_EQ(a, (std::vector<int32_t>{4, 5, 6, 7, 8, 9}));
  // Continue from token 6 (last slot 9, page offset 1): slots 10, 11, then a fresh page.
  const std::vector<int32_t> b = *alloc.alloc_extend({{6, 9, 3}});
  EXPECT_EQ(b, (std::vector<int32_t>{10, 11, 12}));
  EXPECT_EQ(alloc.num_free_pages(), 13);
  // A batch: decode of the first request (prefix 9, last slot 12) and a new request of 5.
  const std::vector<int32_t> c = *alloc.alloc_extend({{9, 12, 1}, {0, 0, 5}});
  EXPECT_EQ(c, (std::vector<int32_t>{13, 16, 17, 18, 19, 20}));
  EXPECT_EQ(alloc.pages_needed({{12, 15, 1}, {4, 7, 4}, {3, 6, 1}}), 2);
  // Inconsistent requests throw.
  EXPECT_THROW(alloc.alloc_extend({{9, 11, 1}}), Error);  // offset 3, expected 0
  EXPECT_THROW(alloc.alloc_extend({{9, 60, 1}}), Error);  // page of slot 60 is free
  EXPECT_THROW(alloc.alloc_extend({{9, 2, 1}}), Error);   // reserved page 0
  EXPECT_THROW(alloc.alloc_extend({{-1, 0, 1}}), Error);
  EXPECT_THROW(alloc.alloc_extend({{0, 0, -1}}), Error);
  EXPECT_EQ(alloc.num_free_pages(), 11);
  // Out of memory: nullopt, nothing taken.
  EXPECT_FALSE(alloc.alloc(45).has_value());
  EXPECT_FALSE(alloc.alloc_extend({{0, 0, 40}, {0, 0, 5}}).has_value());
  EXPECT_EQ(alloc.num_free_pages(), 11);
  EXPECT_TRUE(alloc.alloc(44).has_value());
  EXPECT_EQ(alloc.num_free(), 0);
  // A freed page frees all of its slots; freeing it again (through any slot) throws.
  alloc.free({16, 17, 18, 19, 20});
  EXPECT_FALSE(alloc.is_live(21));
  EXPECT_THROW(alloc.free({23}), Error);
  EXPECT_THROW(alloc.free({0}), Error);
  EXPECT_THROW(alloc.free({3}), Error);   // page 0
  EXPECT_THROW(alloc.free({68}), Error);  // past the end
  EXPECT_THROW(alloc.free({-4}), Error);
  EXPECT_THROW(alloc.free({4, 4}), Error);   // the same slot twice
  EXPECT_THROW(alloc.free({4, 16}), Error);  // one bad slot: none freed
  EXPECT_TRUE(alloc.is_live(4));
  EXPECT_THROW(PagedAllocator(63, 4), Error);
  EXPECT_THROW(PagedAllocator(64, 0), Error);
}

// A request of the random schedules: its token slots in order, and (SWA) how many of its first
// tokens have had their sliding-window slots released.
struct ModelRequest {
  std::vector<int32_t> slots;
  int64_t swa_released = 0;
};

int64_t fresh_pages(int64_t prefix_len, int64_t num_new, int page_size) {
  return (prefix_len + num_new + page_size - 1) / page_size -
         (prefix_len + page_size - 1) / page_size;
}

// Every invariant of a paged allocator against the model of what the requests hold.
::testing::AssertionResult check_allocator(const KVAllocator& alloc,
                                           const std::vector<ModelRequest>& reqs) {
  const int p = alloc.page_size();
  const int64_t num_pages = alloc.capacity() / p;
  std::vector<int> owner(static_cast<size_t>(num_pages + 1), -1);
  std::set<int32_t> seen;
  for (size_t r = 0; r < reqs.size(); ++r) {
    const std::vector<int32_t>& s = reqs[r].slots;
    for (size_t t = 0; t < s.size(); ++t) {
      const int64_t page = s[t] / p;
      if (page < 1 || page > num_pages)
        return ::testing::AssertionFailure() << "slot " << s[t] << " outside the pool";
      if (!seen.insert(s[t]).second)
        return ::testing::AssertionFailure() << "slot " << s[t] << " held twice";
      if (!alloc.is_live(s[t]))
        return ::testing::AssertionFailure() << "held slot " << s[t] << " not live";
      if (s[t] % p != static_cast<int64_t>(t % p))
        return ::testing::AssertionFailure() << "token " << t << " at page offset " << s[t] % p;
      if (t % p != 0 && s[t] != s[t - 1] + 1)
        return ::testing::AssertionFailure() << "token " << t << " breaks its page run";
      if (owner[page] != -1 && (owner[page] != static_cast<int>(r) || t % p == 0))
        return ::testing::AssertionFailure() << "page " << page << " shared";
      owner[page] = static_cast<int>(r);
    }
  }
  int64_t used_pages = 0;
  for (int64_t page = 1; page <= num_pages; ++page) {
    // A page a request holds is live; a page no request holds is free, unless the request
    // that took it has no token on it yet (impossible here: pages are taken on demand).
    const bool live = alloc.is_live(static_cast<int32_t>(page * p));
    if (live != (owner[page] != -1))
      return ::testing::AssertionFailure() << "page " << page << " live=" << live;
    used_pages += live;
  }
  if (alloc.is_live(0)) return ::testing::AssertionFailure() << "slot 0 live";
  const auto* swa = dynamic_cast<const SWAAllocator*>(&alloc);
  const int64_t free_slots = swa ? swa->num_free_full() : alloc.num_free();
  if (used_pages * p + free_slots != alloc.capacity())
    return ::testing::AssertionFailure()
           << "used " << used_pages * p << " + free " << free_slots << " != capacity";
  return ::testing::AssertionSuccess();
}

// The SWA invariants: every token whose window slot was not released maps to a live SWA slot
// at the same page offset, one page per full page, no SWA slot twice; released and unused
// full slots map to 0; the device table equals the host table.
::testing::AssertionResult check_swa(SWAAllocator& alloc, const std::vector<ModelRequest>& reqs) {
  const int p = alloc.page_size();
  const TensorView& table = alloc.host_table();
  const int32_t* entries = table.ptr<int32_t>();
  std::set<int64_t> swa_pages;
  for (const ModelRequest& r : reqs) {
    for (size_t t = 0; t < r.slots.size(); ++t) {
      const int32_t full = r.slots[t];
      const int32_t swa = alloc.translate_full_to_swa(full);
      if (swa != entries[full]) return ::testing::AssertionFailure() << "translate != table";
      if (static_cast<int64_t>(t) < r.swa_released) {
        if (swa != 0)
          return ::testing::AssertionFailure() << "released token maps to SWA slot " << swa;
        continue;
      }
      if (swa == 0 || !alloc.is_swa_live(swa))
        return ::testing::AssertionFailure() << "full slot " << full << " -> dead SWA " << swa;
      if (swa % p != full % p)
        return ::testing::AssertionFailure()
               << "full slot " << full << " -> SWA " << swa << ": page offsets differ";
      if (t % p == 0 || t == static_cast<size_t>(r.swa_released)) {
        if (!swa_pages.insert(swa / p).second)
          return ::testing::AssertionFailure() << "SWA page " << swa / p << " mapped twice";
      } else if (swa != alloc.translate_full_to_swa(r.slots[t - 1]) + 1) {
        return ::testing::AssertionFailure() << "token " << t << " breaks its SWA page run";
      }
    }
  }
  // Slots past a request's last token on its last page are mapped too (the page is paired).
  for (int64_t s = 0; s < table.numel(); ++s) {
    const bool page_mapped = entries[s] != 0;
    if (page_mapped && !alloc.is_live(static_cast<int32_t>(s)))
      return ::testing::AssertionFailure() << "free full slot " << s << " maps to " << entries[s];
  }
  const int64_t used_swa_pages = (alloc.swa_capacity() - alloc.num_free_swa()) / p;
  if (used_swa_pages != static_cast<int64_t>(swa_pages.size()))
    return ::testing::AssertionFailure()
           << used_swa_pages << " SWA pages used, " << swa_pages.size() << " mapped";
  const TensorView& device_table = alloc.full_to_swa_table();
  if (device_table.data != table.data) return ::testing::AssertionFailure() << "CPU table copy";
  if (alloc.num_free() != std::min(alloc.num_free_full(), alloc.num_free_swa()))
    return ::testing::AssertionFailure() << "num_free";
  return ::testing::AssertionSuccess();
}

// Drives `alloc` through `steps` random scheduler actions (new requests, batched extends and
// decodes, frees, SWA window releases, and invalid calls that must throw and change nothing),
// checking every invariant after every step.
void run_random_schedule(KVAllocator& alloc, SWAAllocator* swa, Rng& rng, int steps) {
  const int p = alloc.page_size();
  const int64_t window = 2 * p + 1;  // SWA: tokens older than this release their window slots
  std::vector<ModelRequest> reqs;
  int64_t ooms = 0, allocs = 0;
  auto expect_unchanged_after_throw = [&](auto&& call) {
    const int64_t free_before = alloc.num_free();
    EXPECT_THROW(call(), Error);
    EXPECT_EQ(alloc.num_free(), free_before);
  };
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const int action = rng.uniform_int(0, 99);
    if (action < 25) {  // a new request
      const int64_t n = rng.uniform_int(0, 3 * p + 5);
      const int64_t free_before = alloc.num_free();
      std::optional<std::vector<int32_t>> slots = alloc.alloc(n);
      const bool fits = fresh_pages(0, n, p) * p <= free_before;
      ASSERT_EQ(slots.has_value(), fits) << "need " << n << ", free " << free_before;
      if (slots) {
        ASSERT_EQ(static_cast<int64_t>(slots->size()), n);
        reqs.push_back({*slots, 0});
        ++allocs;
      } else {
        ASSERT_EQ(alloc.num_free(), free_before);
        ++ooms;
      }
    } else if (action < 55 && !reqs.empty()) {  // extend / decode a few requests at once
      std::vector<size_t> picked;
      const int k = rng.uniform_int(1, std::min<int>(4, static_cast<int>(reqs.size())));
      while (static_cast<int>(picked.size()) < k) {
        const size_t r = rng.uniform_int(0, static_cast<int>(reqs.size()) - 1);
        if (std::find(picked.begin(), picked.end(), r) == picked.end()) picked.push_back(r);
      }
      std::vector<ExtendRequest> batch;
      int64_t need = 0, total = 0;
      for (size_t r : picked) {
        const std::vector<int32_t>& s = reqs[r].slots;
        const int64_t n = rng.uniform_int(0, 3) == 0 ? rng.uniform_int(0, 2 * p + 3) : 1;
        batch.push_back({static_cast<int64_t>(s.size()), s.empty() ? 0 : s.back(), n});
        need += fresh_pages(static_cast<int64_t>(s.size()), n, p);
        total += n;
      }
      const int64_t free_before = alloc.num_free();
      std::optional<std::vector<int32_t>> slots = alloc.alloc_extend(batch);
      ASSERT_EQ(slots.has_value(), need * p <= free_before);
      if (slots) {
        ASSERT_EQ(static_cast<int64_t>(slots->size()), total);
        size_t at = 0;
        for (size_t i = 0; i < picked.size(); ++i)
          for (int64_t j = 0; j < batch[i].num_new; ++j)
            reqs[picked[i]].slots.push_back((*slots)[at++]);
        ++allocs;
      } else {
        ASSERT_EQ(alloc.num_free(), free_before);
        ++ooms;
      }
    } else if (action < 75 && !reqs.empty()) {  // a request finishes
      const size_t r = rng.uniform_int(0, static_cast<int>(reqs.size()) - 1);
      alloc.free(reqs[r].slots);
      reqs.erase(reqs.begin() + static_cast<std::ptrdiff_t>(r));
    } else if (action < 85 && swa != nullptr && !reqs.empty()) {  // slide windows
      ModelRequest& r = reqs[rng.uniform_int(0, static_cast<int>(reqs.size()) - 1)];
      const int64_t len = static_cast<int64_t>(r.slots.size());
      const int64_t release_to = std::max<int64_t>(0, (len - window) / p * p);
      if (release_to > r.swa_released) {
        const std::vector<int32_t> old(r.slots.begin() + r.swa_released,
                                       r.slots.begin() + release_to);
        swa->free_swa(old);
        r.swa_released = release_to;
        // Releasing them again throws.
        expect_unchanged_after_throw([&] { swa->free_swa({old.front()}); });
      }
    } else if (action < 95) {  // invalid frees: nothing changes
      expect_unchanged_after_throw([&] { alloc.free({0}); });
      expect_unchanged_after_throw(
          [&] { alloc.free({static_cast<int32_t>(alloc.capacity() + p)}); });
      for (size_t r = 0; r < reqs.size(); ++r) {
        if (reqs[r].slots.empty()) continue;
        const int32_t s = reqs[r].slots.front();
        expect_unchanged_after_throw([&] { alloc.free({s, s}); });
        break;
      }
      // A slot of a free page, together with a live one.
      for (int64_t page = 1; page <= alloc.capacity() / p; ++page) {
        const int32_t s = static_cast<int32_t>(page * p + rng.uniform_int(0, p - 1));
        if (alloc.is_live(s) || reqs.empty() || reqs[0].slots.empty()) continue;
        expect_unchanged_after_throw([&] { alloc.free({reqs[0].slots[0], s}); });
        break;
      }
    } else if (!reqs.empty()) {  // an extend with an inconsistent last slot
      const ModelRequest& r = reqs[rng.uniform_int(0, static_cast<int>(reqs.size()) - 1)];
      const int64_t len = static_cast<int64_t>(r.slots.size());
      if (p > 1 && len % p != 0) {
        expect_unchanged_after_throw([&] { alloc.alloc_extend({{len, r.slots.back() + 1, 1}}); });
      }
    }
    ASSERT_TRUE(check_allocator(alloc, reqs));
    if (swa != nullptr) ASSERT_TRUE(check_swa(*swa, reqs));
  }
  // The schedule should have hit both outcomes many times.
  EXPECT_GT(ooms, steps / 100);
  EXPECT_GT(allocs, steps / 10);
  for (const ModelRequest& r : reqs) alloc.free(r.slots);
  EXPECT_EQ(swa ? swa->num_free_full() : alloc.num_free(), alloc.capacity());
}

TEST(TokenAllocator, RandomScheduleKeepsInvariants) {
  FLASHKV_SEEDED_RNG(rng, 301);
  TokenAllocator alloc(96);
  EXPECT_EQ(*alloc.alloc(3), (std::vector<int32_t>{1, 2, 3}));  // slots from 1
  alloc.reset();
  run_random_schedule(alloc, nullptr, rng, 4000);
}

TEST(PagedAllocator, RandomScheduleKeepsInvariants) {
  for (int page_size : {2, 4, 16}) {
    SCOPED_TRACE(::testing::Message() << "page_size " << page_size);
    FLASHKV_SEEDED_RNG(rng, 302 + page_size);
    PagedAllocator alloc(int64_t{40} * page_size, page_size);
    run_random_schedule(alloc, nullptr, rng, 3000);
  }
}

TEST(SWAAllocator, RandomScheduleKeepsTranslationConsistent) {
  for (int page_size : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "page_size " << page_size);
    FLASHKV_SEEDED_RNG(rng, 310 + page_size);
    // A smaller window pool than full pool: either can run out first.
    SWAAllocator alloc(int64_t{64} * page_size, int64_t{40} * page_size, page_size);
    run_random_schedule(alloc, &alloc, rng, 3000);
    EXPECT_EQ(alloc.num_free_swa(), alloc.swa_capacity());
  }
}

TEST(SWAAllocator, PairsSlotsAndReleasesWindowSlotsEarly) {
  SWAAllocator alloc(16, 8, 2);                    // full pages 1..8, SWA pages 1..4
  const std::vector<int32_t> a = *alloc.alloc(5);  // full pages 1, 2, 3
  EXPECT_EQ(a, (std::vector<int32_t>{2, 3, 4, 5, 6}));
  EXPECT_EQ(alloc.translate_full_to_swa(a), (std::vector<int32_t>{2, 3, 4, 5, 6}));
  EXPECT_EQ(alloc.translate_full_to_swa(7), 7);  // the rest of the last page is paired too
  EXPECT_EQ(alloc.translate_full_to_swa(0), 0);
  EXPECT_EQ(alloc.num_free(), 2);  // one SWA page left
  EXPECT_FALSE(alloc.alloc(3).has_value());
  alloc.free_swa({2, 3});  // the first page left the window
  EXPECT_EQ(alloc.translate_full_to_swa(2), 0);
  EXPECT_EQ(alloc.num_free_swa(), 4);
  EXPECT_THROW(alloc.free_swa({3}), Error);   // already released
  EXPECT_THROW(alloc.free_swa({10}), Error);  // full slot not live
  // Continue the request: fills slot 7, then a fresh full page paired with a free SWA page.
  const std::vector<int32_t> b = *alloc.alloc_extend({{5, 6, 2}});
  EXPECT_EQ(b, (std::vector<int32_t>{7, 8}));
  EXPECT_TRUE(alloc.is_swa_live(alloc.translate_full_to_swa(8)));
  EXPECT_EQ(alloc.translate_full_to_swa(8) % 2, 0);
  // Extending from a page whose window slots were released is a caller error.
  SWAAllocator small(8, 8, 4);
  const std::vector<int32_t> c = *small.alloc(3);
  small.free_swa({c[0]});
  EXPECT_THROW(small.alloc_extend({{3, c[2], 1}}), Error);
  // Freeing returns both (the SWA pages not released already); the table forgets them.
  alloc.free(a);  // pages 1..3, including slot 7 of the extend
  EXPECT_EQ(alloc.translate_full_to_swa(4), 0);
  EXPECT_EQ(alloc.translate_full_to_swa(7), 0);
  EXPECT_EQ(alloc.num_free_swa(), 6);
  EXPECT_THROW(alloc.free({7}), Error);
  alloc.free({8});
  EXPECT_EQ(alloc.num_free_swa(), 8);
  EXPECT_EQ(alloc.num_free_full(), 16);
  EXPECT_THROW(alloc.free({8}), Error);
  EXPECT_THROW(SWAAllocator(16, 6, 4), Error);
  EXPECT_THROW(SWAAllocator(0, 8, 1), Error);
}

}  // namespace
}  // namespace flashkv
