// The soak test's invariant checks: each catches a deliberately broken state (a leaked slot, a
// slot live twice, a slot held but free, a stale req_to_token row, a NaN or Inf output), and a
// short soak run stays clean (an encoder-decoder one too) and stops, naming the step and the
// invariant, when the state is broken under it.
#include "soak.h"

#include <gtest/gtest.h>

#include <limits>
#include <set>

#include "flashkv/core/dtype.h"
#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "invariants.h"
#include "test_util.h"

namespace flashkv::app {
namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ---- slot ownership ------------------------------------------------------------------------

TEST(SoakInvariants, SlotOwnershipHoldsForAConsistentState) {
  TokenAllocator a(32);
  const std::vector<int32_t> slots = *a.alloc(7);
  const std::vector<SlotOwner> owners = {
      {"the prefix cache", {slots[0], slots[1], slots[2]}},
      {"request 0", {slots[3], slots[4]}},
      {"request 1", {slots[5], slots[6]}},
  };
  EXPECT_EQ(check_slot_ownership(a, owners), "");
  EXPECT_EQ(check_slot_ownership(a, {}),
            "7 allocated slots are held by no request and not by the "
            "prefix cache (leaked), the first is slot 1");
  a.free(slots);
  EXPECT_EQ(check_slot_ownership(a, {{"the prefix cache", {}}}), "");
}

TEST(SoakInvariants, SlotOwnershipCatchesALeakedSlot) {
  TokenAllocator a(32);
  const std::vector<int32_t> slots = *a.alloc(5);
  // Slot slots[3] was allocated, but its request forgot it (and will never free it).
  const std::string bad =
      check_slot_ownership(a, {{"request 0", {slots[0], slots[1], slots[2], slots[4]}}});
  EXPECT_TRUE(has(bad, "1 allocated slots are held by no request")) << bad;
  EXPECT_TRUE(has(bad, "leaked")) << bad;
  EXPECT_TRUE(has(bad, str_cat("slot ", slots[3]))) << bad;
}

TEST(SoakInvariants, SlotOwnershipCatchesASlotLiveTwice) {
  TokenAllocator a(32);
  const std::vector<int32_t> s = *a.alloc(4);
  // Two requests writing the same slot: one would overwrite the other's K/V.
  const std::string bad = check_slot_ownership(
      a, {{"the prefix cache", {s[0], s[1]}}, {"request 3", {s[2]}}, {"request 5", {s[3], s[2]}}});
  EXPECT_EQ(bad, str_cat("slot ", s[2], " is held by request 3 and by request 5 (live twice)"));
  // A request holding one slot at two positions.
  EXPECT_EQ(check_slot_ownership(a, {{"request 0", {s[0], s[1], s[2], s[3], s[1]}}}),
            str_cat("slot ", s[1], " is held twice by request 0 (live twice)"));
  // The prefix cache and a request both claiming a block's slot (a shared block counted as the
  // request's own).
  EXPECT_TRUE(has(check_slot_ownership(
                      a, {{"the prefix cache", {s[0], s[1]}}, {"request 1", {s[1], s[2], s[3]}}}),
                  "held by the prefix cache and by request 1 (live twice)"));
}

TEST(SoakInvariants, SlotOwnershipCatchesAHeldSlotThatIsFree) {
  TokenAllocator a(32);
  const std::vector<int32_t> s = *a.alloc(3);
  a.free({s[1]});  // freed while its request still uses it: the next alloc hands it out again
  EXPECT_EQ(check_slot_ownership(a, {{"request 2", s}}),
            str_cat("slot ", s[1], " is held by request 2 but free in the allocator (it may be ",
                    "handed out again)"));
  EXPECT_TRUE(has(check_slot_ownership(a, {{"request 2", {0}}}), "outside the pool's slots 1..32"));
  EXPECT_TRUE(has(check_slot_ownership(a, {{"request 2", {33}}}), "outside"));
  EXPECT_TRUE(has(check_slot_ownership(a, {{"request 2", {-4}}}), "outside"));
}

TEST(SoakInvariants, SlotOwnershipOnPagesCountsAPageHeldByAnySlot) {
  PagedAllocator a(64, 4);
  const std::vector<int32_t> s = *a.alloc(6);  // two pages, the second half used
  EXPECT_EQ(check_slot_ownership(a, {{"request 0", s}}), "");
  // A request holding only its first page's slots leaks the second page.
  const std::string bad = check_slot_ownership(a, {{"request 0", {s[0], s[1], s[2], s[3]}}});
  EXPECT_TRUE(has(bad, str_cat("4 allocated slots are held by no request"))) << bad;
  EXPECT_TRUE(has(bad, str_cat("the first is slot ", s[4]))) << bad;
}

// ---- request rows --------------------------------------------------------------------------

TEST(SoakInvariants, RequestRowsCatchAStaleRowAndALeakedRow) {
  ReqToTokenPool pool(4, 16);
  const int32_t r0 = (*pool.alloc(1))[0], r1 = (*pool.alloc(1))[0];
  std::vector<int32_t> a = {5, 6, 7}, b = {9, 10};
  pool.write(r0, 0, a);
  pool.write(r1, 0, b);
  EXPECT_EQ(check_request_rows(pool, {{"request 0", r0, &a}, {"request 1", r1, &b}}), "");
  // The host moved on (a rewritten draft token) but the device row was not updated.
  std::vector<int32_t> moved = {5, 6, 8};
  EXPECT_EQ(check_request_rows(pool, {{"request 0", r0, &moved}, {"request 1", r1, &b}}),
            str_cat("request 0: req_to_token row ", r0,
                    " lists slot 7 at token 2, the request holds slot 8"));
  // A finished request whose row was never returned.
  EXPECT_EQ(check_request_rows(pool, {{"request 0", r0, &a}}),
            "2 req_to_token rows in use, but 1 requests are running (the rest leaked)");
  EXPECT_TRUE(has(check_request_rows(pool, {{"request 0", r0, &a}, {"request 1", r0, &a}}),
                  "held by request 0 and by request 1"));
  pool.free({r1});
  EXPECT_TRUE(has(check_request_rows(pool, {{"request 0", r0, &a}, {"request 1", r1, &b}}),
                  "is not allocated"));
}

// ---- finite outputs ------------------------------------------------------------------------

TEST(SoakInvariants, FirstNonfiniteFindsNanAndInfInEveryDtype) {
  FLASHKV_SEEDED_RNG(rng, 4101);
  for (DType t : {DType::bf16, DType::f16, DType::f32}) {
    SCOPED_TRACE(dtype_name(t));
    // Longer than the bit scan's chunk, so the hit may sit in any chunk.
    Tensor x = test::random_tensor(rng, {3, 4100}, t);
    EXPECT_EQ(first_nonfinite(x), -1);
    for (const double bad :
         {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
          -std::numeric_limits<double>::infinity()}) {
      Tensor y = test::random_tensor(rng, {3, 4100}, t);
      const int64_t at = rng.uniform_int(0, 3 * 4100 - 1);
      store_from_double(y.data(), t, at, bad);
      if (at + 9 < y.numel()) store_from_double(y.data(), t, at + 9, bad);  // the first counts
      EXPECT_EQ(first_nonfinite(y), at);
    }
  }
  // Large finite values are finite.
  Tensor big = Tensor::empty({2}, DType::bf16);
  store_from_double(big.data(), DType::bf16, 0, 3.0e38);
  store_from_double(big.data(), DType::bf16, 1, -3.0e38);
  EXPECT_EQ(first_nonfinite(big), -1);
  EXPECT_THROW(first_nonfinite(TensorView(big.data(), DType::bf16, {2}, Device::cuda(0))), Error);
}

// ---- soak runs -----------------------------------------------------------------------------

SoakOptions small_soak(int64_t steps, bool speculative) {
  SoakOptions o;
  o.steps = steps;
  o.seed = 3;
  o.speculative = speculative;
  o.check_every = 2;
  o.flush_every = 1;
  o.model.num_layers = 2;
  o.model.num_qo_heads = 4;
  o.model.num_kv_heads = 2;
  o.model.sliding_window = 48;
  o.scheduler.kv_slots = 640;  // tight: admissions wait and cached blocks are evicted
  o.scheduler.max_running = 8;
  o.scheduler.token_budget = 256;
  return o;
}

TEST(Soak, RequestStreamIsSeededAndVaried) {
  SoakWorkload a(5), b(5), c(6);
  int64_t last = 0, shared = 0, single = 0, repeats = 0, aligned = 0;
  std::set<std::vector<int32_t>> seen;
  bool differs = false;
  for (int i = 0; i < 2000; ++i) {
    const RequestSpec x = a.next(), y = b.next(), z = c.next();
    ASSERT_EQ(x.prompt, y.prompt);
    ASSERT_EQ(x.arrival, y.arrival);
    differs = differs || x.prompt != z.prompt;
    ASSERT_GE(x.arrival, last);
    last = x.arrival;
    ASSERT_GE(x.prompt.size(), 1u);
    ASSERT_LE(x.prompt.size(), static_cast<size_t>(SoakWorkload::kMaxPrompt));
    ASSERT_GE(x.output_len, 1);
    ASSERT_LE(x.output_len, SoakWorkload::kMaxOutput);
    shared += x.prefix_len > 0;
    single += x.output_len == 1;
    aligned += x.prefix_len > 0 && x.prefix_len % 16 == 0;
    repeats += !seen.insert(x.prompt).second;
  }
  EXPECT_TRUE(differs);
  EXPECT_GT(shared, 800);
  EXPECT_GT(single, 100);
  EXPECT_GT(repeats, 300);  // prompts equal to a prefix, or repeated verbatim
  EXPECT_GT(aligned, 50);
}

TEST(Soak, ShortRunsStayClean) {
  for (const bool speculative : {false, true}) {
    SCOPED_TRACE(speculative ? "speculative" : "decode");
    const SoakResult r = run_soak(small_soak(400, speculative));
    EXPECT_EQ(r.failure, "");
    EXPECT_EQ(r.steps, 400);
    EXPECT_GT(r.drain_steps, 0);
    EXPECT_EQ(r.stats.requests_done, r.stats.requests);
    EXPECT_GT(r.stats.checked, 100);
    EXPECT_EQ(r.stats.check_failures, 0) << r.stats.first_failure;
    EXPECT_GT(r.stats.evicted_blocks + r.stats.admission_waits, 0);
    EXPECT_GT(r.stats.cached_prompt_tokens, 0);
    EXPECT_GE(r.flushes, 1);
    EXPECT_EQ(r.stats.spec_steps > 0, speculative);
  }
}

// Cross attention: each request's encoder K/V are written as it is admitted and its slots are
// freed with it, so the pool is empty at every flushed idle point and at the end.
TEST(Soak, EncoderDecoderRunStaysClean) {
  SoakOptions o = small_soak(300, false);
  o.model.sliding_window = -1;
  o.model.num_layers = 4;
  o.model.encoder_decoder = true;
  o.encoder_len = 48;
  const SoakResult r = run_soak(o);
  EXPECT_EQ(r.failure, "");
  EXPECT_EQ(r.stats.requests_done, r.stats.requests);
  EXPECT_GE(r.stats.encoder_tokens, 24 * r.stats.requests);
  EXPECT_LE(r.stats.encoder_tokens, 48 * r.stats.requests);
  EXPECT_GT(r.stats.checked, 50);
  EXPECT_EQ(r.stats.check_failures, 0) << r.stats.first_failure;
  EXPECT_GT(r.stats.admission_waits, 0);
  EXPECT_GE(r.idle_points, 1);
}

// Encoder slots freed while the request holds them: the next step's ownership check names one.
TEST(Soak, StopsAtAnEncoderSlotFreedWhileHeld) {
  SoakOptions o = small_soak(200, false);
  o.model.sliding_window = -1;
  o.model.encoder_decoder = true;
  o.encoder_len = 32;
  // A request's first req_to_token entries are its encoder tokens' slots.
  const SoakResult r = run_soak(o, {}, [](Scheduler& s, int64_t step) {
    if (step != 30) return;
    const ReqToTokenPool& rows = s.req_to_token();
    for (int32_t row = 0; row < rows.max_reqs(); ++row)
      if (rows.is_live(row)) {
        s.allocator().free(rows.read(row, 0, 1));
        return;
      }
  });
  EXPECT_EQ(r.failed_step, 30);
  EXPECT_TRUE(has(r.failure, "but free in the allocator")) << r.failure;
}

TEST(Soak, StopsAtALeakedSlot) {
  const SoakResult r = run_soak(small_soak(400, false), {}, [](Scheduler& s, int64_t step) {
    if (step == 37) s.allocator().alloc(1);  // allocated, and held by nobody
  });
  EXPECT_EQ(r.failed_step, 37);
  EXPECT_TRUE(has(r.failure, "step 37: slot ownership: 1 allocated slots are held by no request"))
      << r.failure;
}

TEST(Soak, StopsAtASlotFreedWhileHeld) {
  const SoakResult r = run_soak(small_soak(400, true), {}, [](Scheduler& s, int64_t step) {
    if (step != 50) return;
    // Free a slot some request or the cache still holds: it could be handed out again.
    for (int32_t slot = 1; slot <= s.allocator().capacity(); ++slot)
      if (s.allocator().is_live(slot)) {
        s.allocator().free({slot});
        return;
      }
  });
  EXPECT_EQ(r.failed_step, 50);
  EXPECT_TRUE(has(r.failure, "step 50: slot ownership: slot ")) << r.failure;
  EXPECT_TRUE(has(r.failure, "but free in the allocator")) << r.failure;
}

TEST(Soak, StopsAtANanOutput) {
  const SoakResult r = run_soak(small_soak(400, false), {}, [](Scheduler& s, int64_t step) {
    if (step != 20) return;
    // NaN values in layer 0: every later pass of layer 0 attends to some.
    const TensorView& v = s.model().pool().v(0);
    fill_bytes(v.data, v.device, 0xFF, v.nbytes());
  });
  // The first pass after it that reads an old token of layer 0 (not a fresh prefill alone).
  EXPECT_GT(r.failed_step, 20);
  EXPECT_LT(r.failed_step, 40);
  EXPECT_TRUE(has(r.failure, str_cat("step ", r.failed_step, ": finite outputs: "))) << r.failure;
  EXPECT_TRUE(has(r.failure, "layer 0, output row")) << r.failure;
}

TEST(Soak, BadOptionsThrow) {
  SoakOptions o = small_soak(10, false);
  o.flush_every = 0;
  EXPECT_THROW(run_soak(o), Error);
  o = small_soak(10, false);
  o.scheduler.kv_slots = 100;  // less than the longest soak request
  EXPECT_THROW(run_soak(o), Error);
  // Encoder inputs go with cross attention, and cross attention without speculative decoding.
  const auto error = [](const SoakOptions& x) { return test::error_of([&] { run_soak(x); }); };
  o = small_soak(10, false);
  o.encoder_len = 16;
  EXPECT_TRUE(has(error(o), "encoder_len: expected 0 for a model without cross")) << error(o);
  o.model.sliding_window = -1;
  o.model.encoder_decoder = true;
  o.encoder_len = 0;
  EXPECT_TRUE(has(error(o), "encoder_len: expected 1..")) << error(o);
  o.encoder_len = 16;
  o.speculative = true;
  EXPECT_TRUE(has(error(o), "needs a decoder-only model")) << error(o);
  o.speculative = false;
  EXPECT_EQ(error(o), "");
  o.scheduler.kv_slots = SoakWorkload::kMaxPrompt + SoakWorkload::kMaxOutput;  // no room for it
  EXPECT_TRUE(has(error(o), "soak kv_slots: expected >= 304")) << error(o);
}

}  // namespace
}  // namespace flashkv::app
