// The pieces of `flashkv serve`: the JSON reader, workloads, the prefix cache, step batches and
// the scheduler's end-of-run invariants; encoder-decoder serving (encoder K/V written once at
// admission, read by the cross-attention layers, freed with the request) and the check that
// catches cross attention reading or writing the wrong slots; and layer_reference's argument
// checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <random>
#include <set>

#include "flashkv/kvcache/kv_pool.h"
#include "flashkv/kvcache/req_to_token_pool.h"
#include "flashkv/reference/layer_reference.h"
#include "json.h"
#include "prefix_cache.h"
#include "scheduler.h"
#include "step_batch.h"
#include "test_util.h"
#include "workload.h"

namespace flashkv::app {
namespace {

using test::error_of;

// ---- JSON ----------------------------------------------------------------------------------

TEST(Json, ParsesEveryKindOfValue) {
  const JsonValue v = parse_json(R"( {"a": [1, -2.5e3, 0, true, false, null],
    "s": "q\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00", "o": {}, "e": []} )");
  ASSERT_TRUE(v.is_object());
  const auto& a = v.find("a")->items();
  ASSERT_EQ(a.size(), 6u);
  EXPECT_EQ(a[0].number(), 1);
  EXPECT_EQ(a[1].number(), -2500);
  EXPECT_TRUE(a[3].is_bool() && a[3].boolean());
  EXPECT_TRUE(a[4].is_bool() && !a[4].boolean());
  EXPECT_TRUE(a[5].is_null());
  EXPECT_EQ(v.find("s")->string(), "q\"\\/\b\f\n\r\t\xC3\xA9\xF0\x9F\x98\x80");
  EXPECT_TRUE(v.find("o")->is_object() && v.find("o")->members().empty());
  EXPECT_TRUE(v.find("e")->is_array() && v.find("e")->items().empty());
  EXPECT_EQ(v.find("missing"), nullptr);
  EXPECT_EQ(v.members()[0].first, "a");  // file order
  EXPECT_EQ(a[1].line(), 1);
  EXPECT_EQ(a[1].column(), 12);
}

TEST(Json, RejectsMalformedTextWithItsPosition) {
  struct Bad {
    const char* text;
    const char* says;
  };
  const Bad bad[] = {
      {"", "line 1, column 1: unexpected end"},
      {"{\"a\": 1,}", "line 1, column 9: expected a member name"},
      {"{\"a\" 1}", "expected ':'"},
      {"[1 2]", "expected ',' or ']'"},
      {"{\n  \"a\": tru}", "line 2, column 8: invalid literal"},
      {"01", "leading zero"},
      {"1.", "expected a digit"},
      {"-", "expected a digit"},
      {"1e999", "out of range"},
      {"\"abc", "unterminated string"},
      {"\"a\tb\"", "control character"},
      {"\"\\x\"", "invalid escape"},
      {"\"\\ud800\"", "unpaired UTF-16 surrogate"},
      {"\"\\u12g4\"", "four hex digits"},
      {"{\"k\": 1, \"k\": 2}", "line 1, column 10: duplicate key \"k\""},
      {"[1] [2]", "unexpected text after"},
      {"'single'", "unexpected character"},
  };
  for (const Bad& b : bad) {
    const std::string e = error_of([&] { parse_json(b.text); });
    EXPECT_NE(e.find(b.says), std::string::npos) << b.text << " -> " << e;
  }
  EXPECT_NE(error_of([] {
              parse_json(std::string(300, '[') + std::string(300, ']'));
            }).find("deeper than 200"),
            std::string::npos);
  EXPECT_EQ(error_of([] { parse_json(std::string(150, '[') + std::string(150, ']')); }), "");
}

TEST(Json, ReadFileNamesThePath) {
  const std::string path = test::temp_file("json_test.json");
  std::ofstream(path) << "{\"a\": [1,\n 2,, 3]}";
  const std::string e = error_of([&] { read_json_file(path); });
  EXPECT_EQ(e.rfind(path + ": line 2, column 4:", 0), 0u) << e;
  EXPECT_NE(error_of([] { read_json_file("/nonexistent/file.json"); }).find("no such file"),
            std::string::npos);
  EXPECT_NE(error_of([] { read_json_file("/"); }).find("not a regular file"), std::string::npos);
}

// ---- workloads -----------------------------------------------------------------------------

TEST(Workload, BuiltinsAreSeededAndShareTheirPrefixes) {
  for (const char* name : {"chat", "long", "spec"}) {
    SCOPED_TRACE(name);
    const Workload a = builtin_workload(name, 0, false, 7), b = builtin_workload(name, 0, false, 7);
    const Workload c = builtin_workload(name, 0, false, 8);
    ASSERT_FALSE(a.requests.empty());
    EXPECT_EQ(a.spec.enabled, std::string(name) == "spec");
    bool same = true, differs = false;
    std::set<std::vector<int32_t>> prefixes;
    for (size_t i = 0; i < a.requests.size(); ++i) {
      same = same && a.requests[i].prompt == b.requests[i].prompt &&
             a.requests[i].arrival == b.requests[i].arrival;
      differs = differs || i >= c.requests.size() || a.requests[i].prompt != c.requests[i].prompt;
      if (i) EXPECT_GE(a.requests[i].arrival, a.requests[i - 1].arrival);
      EXPECT_GE(a.requests[i].output_len, 1);
      const RequestSpec& r = a.requests[i];
      if (r.prefix_len > 0)
        prefixes.insert(std::vector<int32_t>(r.prompt.begin(), r.prompt.begin() + r.prefix_len));
    }
    EXPECT_TRUE(same);
    EXPECT_TRUE(differs);
    EXPECT_GE(prefixes.size(), 1u);
    EXPECT_LE(static_cast<int>(prefixes.size()), a.num_prefixes);
    EXPECT_EQ(builtin_workload(name, 5, false, 7).requests.size(), 5u);
    // Sized up for a GPU.
    EXPECT_GT(builtin_workload(name, 0, true, 7).prompt_tokens(), a.prompt_tokens());
  }
  EXPECT_NE(error_of([] { builtin_workload("chats", 0, false, 1); }).find("chat, long, spec"),
            std::string::npos);
}

TEST(Workload, EncoderLensAreSeededAndInRange) {
  Workload a = builtin_workload("chat", 40, false, 7), b = a, c = a;
  EXPECT_EQ(a.encoder_tokens(), 0);
  draw_encoder_lens(a, 100, 5);
  draw_encoder_lens(b, 100, 5);
  draw_encoder_lens(c, 100, 6);
  bool differs = false;
  std::set<int32_t> lens;
  int64_t total = 0;
  for (size_t i = 0; i < a.requests.size(); ++i) {
    EXPECT_GE(a.requests[i].encoder_len, 50);
    EXPECT_LE(a.requests[i].encoder_len, 100);
    EXPECT_EQ(a.requests[i].encoder_len, b.requests[i].encoder_len);
    differs = differs || a.requests[i].encoder_len != c.requests[i].encoder_len;
    lens.insert(a.requests[i].encoder_len);
    total += a.requests[i].encoder_len;
  }
  EXPECT_TRUE(differs);
  EXPECT_GT(lens.size(), 10u);
  EXPECT_EQ(a.encoder_tokens(), total);
  // Counted in what a request needs of the pool.
  EXPECT_EQ(Scheduler::slots_needed(a.requests[0], a.spec),
            a.requests[0].encoder_len + static_cast<int64_t>(a.requests[0].prompt.size()) +
                a.requests[0].output_len);
  Workload one = a;
  draw_encoder_lens(one, 1, 5);
  EXPECT_EQ(one.requests[0].encoder_len, 1);
  EXPECT_NE(error_of([&] { draw_encoder_lens(a, 0, 5); }).find("encoder length: expected 1.."),
            std::string::npos);
  EXPECT_THROW(draw_encoder_lens(a, kMaxEncoderTokens + 1, 5), Error);
}

TEST(Workload, FileFormat) {
  const std::string path = test::temp_file("workload_test.json");
  std::ofstream(path) << R"({"name": "t", "prefixes": {"p": [9, 8, 7]},
      "speculative": {"topk": 3, "steps": 1, "accept_rate": 0.5},
      "requests": [{"arrival": 5, "prefix": "p", "prompt": [1, 2], "output": 2},
                   {"prompt": 4, "output": 1}, {"arrival": 5, "prefix": "p", "output": 9}]})";
  const Workload w = load_workload_file(path, 0, 1);
  EXPECT_EQ(w.name, "t");
  EXPECT_TRUE(w.spec.enabled);
  EXPECT_EQ(w.spec.topk, 3);
  EXPECT_EQ(w.spec.num_steps, 1);
  EXPECT_EQ(w.spec.draft_tokens(), 4);
  EXPECT_EQ(w.spec.accept_rate, 0.5);
  ASSERT_EQ(w.requests.size(), 3u);
  // Sorted by arrival, stable among equal arrivals.
  EXPECT_EQ(w.requests[0].arrival, 0);
  EXPECT_EQ(w.requests[0].prompt.size(), 4u);
  EXPECT_EQ(w.requests[1].prompt, (std::vector<int32_t>{9, 8, 7, 1, 2}));
  EXPECT_EQ(w.requests[1].prefix_len, 3);
  EXPECT_EQ(w.requests[2].prompt, (std::vector<int32_t>{9, 8, 7}));
  EXPECT_EQ(w.requests[2].output_len, 9);
  EXPECT_EQ(w.max_sequence_len(), 12);
  EXPECT_EQ(load_workload_file(path, 2, 1).requests.size(), 2u);
  std::ofstream(path)
      << R"({"speculative": {"steps": 0}, "requests": [{"prompt": 1, "output": 1}]})";
  EXPECT_NE(error_of([&] { load_workload_file(path, 0, 1); }).find("speculative.steps"),
            std::string::npos);

  std::ofstream(path) << R"({"requests": [{"prompt": 4, "output": 1}], "speculative": true})";
  EXPECT_TRUE(load_workload_file(path, 0, 1).spec.enabled);
  std::ofstream(path) << R"({"requests": [{"prompt": 0, "output": 1}]})";
  EXPECT_NE(error_of([&] {
              load_workload_file(path, 0, 1);
            }).find("requests[0].prompt: expected an integer in 1.."),
            std::string::npos);
  std::ofstream(path) << R"({"requests": [{"prompt": [1, -2], "output": 1}]})";
  EXPECT_NE(error_of([&] { load_workload_file(path, 0, 1); }).find("requests[0].prompt[1]"),
            std::string::npos);
  std::ofstream(path) << R"({"requests": [{"output": 1}]})";
  EXPECT_NE(error_of([&] { load_workload_file(path, 0, 1); }).find("requests[0].prompt: missing"),
            std::string::npos);
  std::ofstream(path) << R"({"requests": [{"prompt": 1}]})";
  EXPECT_NE(error_of([&] { load_workload_file(path, 0, 1); }).find("requests[0].output: missing"),
            std::string::npos);
  std::ofstream(path) << R"({"requests": [{"prompt": 1, "output": 1.5}]})";
  EXPECT_NE(error_of([&] { load_workload_file(path, 0, 1); }).find("got 1.5"), std::string::npos);
  std::ofstream(path)
      << R"({"speculative": {"accept_rate": 2}, "requests": [{"prompt": 1, "output": 1}]})";
  EXPECT_NE(error_of([&] { load_workload_file(path, 0, 1); }).find("speculative.accept_rate"),
            std::string::npos);
  std::ofstream(path) << R"({"requests": [{"prompt": 1000000, "output": 1000000}]})";
  EXPECT_NE(error_of([&] { load_workload_file(path, 0, 1); }).find("more than the"),
            std::string::npos);
  std::ofstream(path) << R"({"requests": [{"prompt": 1, "output": 1}], "extra": 1})";
  EXPECT_NE(error_of([&] { load_workload_file(path, 0, 1); }).find("extra: unknown key"),
            std::string::npos);
}

void expect_same_requests(const Workload& a, const Workload& b) {
  ASSERT_EQ(a.requests.size(), b.requests.size());
  for (size_t i = 0; i < a.requests.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(a.requests[i].arrival, b.requests[i].arrival);
    EXPECT_EQ(a.requests[i].prompt, b.requests[i].prompt);
    EXPECT_EQ(a.requests[i].prefix_len, b.requests[i].prefix_len);
    EXPECT_EQ(a.requests[i].output_len, b.requests[i].output_len);
  }
}

TEST(Workload, SavedFileReadsBackTheSame) {
  for (const char* name : {"chat", "long", "spec"}) {
    SCOPED_TRACE(name);
    const Workload w = builtin_workload(name, 12, false, 5);
    const std::string text = workload_to_json(w);
    const Workload back = parse_workload(text, "saved.json", 0, 99);  // no random tokens left
    EXPECT_EQ(back.name, name);
    EXPECT_EQ(back.spec.enabled, w.spec.enabled);
    EXPECT_LE(back.num_prefixes, w.num_prefixes);  // the prefixes some request uses
    expect_same_requests(w, back);
    EXPECT_EQ(workload_to_json(back), text);
  }
  // Prompts that are exactly a prefix, a prefix shared by two requests, speculative settings
  // with a rate that is not a short decimal.
  const Workload w = parse_workload(R"({"name": "q\"\u0001", "prefixes": {"a": 20, "b": [4, 5]},
      "speculative": {"topk": 3, "steps": 4, "accept_rate": 0.1},
      "requests": [{"prefix": "a", "output": 2}, {"prefix": "b", "prompt": [0, 2147483647],
      "output": 7}, {"arrival": 9, "prefix": "a", "prompt": 3, "output": 1}]})",
                                    "x.json", 0, 3);
  const Workload back = parse_workload(workload_to_json(w), "y.json", 0, 4);
  EXPECT_EQ(back.name, "q\"\x01");
  EXPECT_EQ(back.num_prefixes, 2);
  EXPECT_EQ(back.spec.topk, 3);
  EXPECT_EQ(back.spec.num_steps, 4);
  EXPECT_EQ(back.spec.accept_rate, 0.1);
  expect_same_requests(w, back);
  EXPECT_EQ(back.requests[2].prefix_len, 20);
}

TEST(Workload, ParseErrorsNameTheSourceAndPosition) {
  EXPECT_EQ(error_of([] { parse_workload("{\"requests\": [}", "mem.json", 0, 1); }),
            "mem.json: line 1, column 15: unexpected character '}' (expected a value)");
  EXPECT_EQ(error_of([] { parse_workload("{\"requests\": [{\"prompt\": 1}]}", "mem.json", 0, 1); }),
            "mem.json: line 1, column 15: requests[0].output: missing (expected the number of "
            "tokens to generate)");
  // Without a "name", the workload is named after its source.
  EXPECT_EQ(
      parse_workload("{\"requests\": [{\"prompt\": 1, \"output\": 1}]}", "mem.json", 0, 1).name,
      "mem.json");
}

// ---- prefix cache --------------------------------------------------------------------------

std::vector<int32_t> iota_slots(int32_t first, int n) {
  std::vector<int32_t> s(n);
  for (int i = 0; i < n; ++i) s[i] = first + i;
  return s;
}

TEST(PrefixCache, MatchInsertShareAndRelease) {
  PrefixCache c(4);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 2 whole blocks + 2
  EXPECT_TRUE(c.match(a).empty());
  std::vector<int32_t> slots_a = iota_slots(100, 10), chain_a, released;
  c.insert(a, slots_a, chain_a, released);
  EXPECT_EQ(chain_a.size(), 2u);
  EXPECT_TRUE(released.empty());
  EXPECT_EQ(c.num_nodes(), 2);
  EXPECT_EQ(c.evictable_slots(), 0);  // the inserting request references both blocks
  EXPECT_EQ(c.slots(chain_a[1]), (std::vector<int32_t>{104, 105, 106, 107}));

  // A prompt sharing the first block only, then diverging.
  const std::vector<int32_t> b = {1, 2, 3, 4, 5, 6, 0, 8, 9};
  std::vector<int32_t> chain_b = c.match(b);
  ASSERT_EQ(chain_b.size(), 1u);
  EXPECT_EQ(chain_b[0], chain_a[0]);
  c.acquire(chain_b);
  std::vector<int32_t> slots_b = {100, 101, 102, 103, 200, 201, 202, 203, 204};
  c.insert(b, slots_b, chain_b, released);
  EXPECT_EQ(chain_b.size(), 2u);
  EXPECT_EQ(c.num_nodes(), 3);

  // A request that prefilled the same prompt as `a` meanwhile shares a's blocks and hands back
  // its own slots.
  std::vector<int32_t> slots_d = iota_slots(300, 10), chain_d;
  c.insert(a, slots_d, chain_d, released);
  EXPECT_EQ(chain_d, chain_a);
  EXPECT_EQ(released, iota_slots(300, 8));
  EXPECT_EQ(std::vector<int32_t>(slots_d.begin(), slots_d.begin() + 8), iota_slots(100, 8));
  EXPECT_EQ(slots_d[8], 308);
  c.check_invariants();

  // Nothing is evictable while referenced.
  EXPECT_TRUE(c.evict(100).empty());
  c.release(chain_a);
  c.release(chain_d);
  EXPECT_EQ(c.evictable_slots(), 4);  // a's second block; the first is still b's
  EXPECT_EQ(c.evict(100), iota_slots(104, 4));
  c.release(chain_b);
  // Leaves first: b's second block, then the shared root block.
  const std::vector<int32_t> out = c.evict(100);
  EXPECT_EQ(out, (std::vector<int32_t>{200, 201, 202, 203, 100, 101, 102, 103}));
  EXPECT_EQ(c.num_nodes(), 0);
  EXPECT_EQ(c.evicted_nodes(), 3);
  c.check_invariants();
}

TEST(PrefixCache, EvictsLeastRecentlyUsedAndStopsWhenEnough) {
  PrefixCache c(2);
  std::vector<std::vector<int32_t>> chains(3);
  std::vector<int32_t> released;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> tokens = {i, i}, slots = {10 * i + 1, 10 * i + 2};
    c.insert(tokens, slots, chains[i], released);
  }
  c.release(chains[1]);
  c.release(chains[0]);
  c.release(chains[2]);
  // Touch block 1 again: 0 is now the least recently used, then 2.
  c.acquire(chains[1]);
  c.release(chains[1]);
  EXPECT_EQ(c.evict(1), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(c.evict(2), (std::vector<int32_t>{21, 22}));
  EXPECT_EQ(c.num_nodes(), 1);
}

TEST(PrefixCache, BadUseThrows) {
  EXPECT_THROW(PrefixCache(0), Error);
  PrefixCache c(2);
  EXPECT_THROW(c.slots(0), Error);
  EXPECT_THROW(c.acquire({3}), Error);
  std::vector<int32_t> tokens = {1, 2}, slots = {5, 6}, chain, released;
  c.insert(tokens, slots, chain, released);
  c.release(chain);
  EXPECT_NE(error_of([&] { c.release(chain); }).find("without a reference"), std::string::npos);
  std::vector<int32_t> few = {5};
  EXPECT_THROW(c.insert(tokens, few, chain, released), Error);
}

// A random mix of requests against the cache, checking its bookkeeping every step and that
// every slot it hands back is one it took and holds no more.
TEST(PrefixCache, RandomScheduleKeepsInvariants) {
  FLASHKV_SEEDED_RNG(rng, 91);
  PrefixCache c(4);
  std::set<int32_t> held;  // slots the cache owns
  int32_t next_slot = 1;
  std::vector<std::vector<int32_t>> live;
  for (int step = 0; step < 400; ++step) {
    if (rng.uniform() < 0.6 || live.empty()) {
      std::vector<int32_t> tokens;
      const int shared = rng.uniform_int(0, 3), own = rng.uniform_int(0, 9);
      for (int i = 0; i < shared * 4; ++i) tokens.push_back(i % 7);  // common prefixes
      for (int i = 0; i < own; ++i) tokens.push_back(rng.uniform_int(0, 3));
      std::vector<int32_t> chain = c.match(tokens);
      c.acquire(chain);
      std::vector<int32_t> slots;
      for (int32_t n : chain) slots.insert(slots.end(), c.slots(n).begin(), c.slots(n).end());
      while (slots.size() < tokens.size()) slots.push_back(next_slot++);
      std::vector<int32_t> released;
      const size_t before = chain.size();
      c.insert(tokens, slots, chain, released);
      for (size_t b = before; b < chain.size(); ++b)
        for (int32_t s : c.slots(chain[b])) held.insert(s);
      for (int32_t s : released) EXPECT_EQ(held.count(s), 0u) << "released a cached slot";
      live.push_back(chain);
    } else {
      const size_t i = static_cast<size_t>(rng.uniform_int(0, static_cast<int>(live.size()) - 1));
      c.release(live[i]);
      live.erase(live.begin() + i);
    }
    if (step % 7 == 0)
      for (int32_t s : c.evict(rng.uniform_int(1, 12))) {
        EXPECT_EQ(held.count(s), 1u) << "evicted a slot it did not hold";
        held.erase(s);
      }
    c.check_invariants();
    EXPECT_EQ(c.cached_slots(), static_cast<int64_t>(held.size()));
  }
}

// ---- step batches --------------------------------------------------------------------------

TEST(StepBatch, VerifyTreeMaskAndFields) {
  ReqToTokenPool pool(4, 64);
  Sequence s;
  s.row = (*pool.alloc(1))[0];
  append_tokens(s, iota_slots(10, 7), pool);  // 4 cached tokens + 3 drafts
  EXPECT_EQ(pool.read(s.row, 0, 7), iota_slots(10, 7));
  StepBatch b(ForwardMode::TARGET_VERIFY, {{&s, 7, 3, {-1, 0, 0}}}, pool, Device::cpu());
  EXPECT_EQ(b.batch().spec.draft_token_num, 3);
  EXPECT_EQ(b.batch().seq_lens_cpu, (std::vector<int32_t>{7}));
  EXPECT_EQ(b.num_tokens(), 3);
  // Node 2's parent is the root: it sees the prefix, the root and itself, not node 1.
  const uint8_t* m = b.mask(0);
  const std::vector<uint8_t> row2(m + 14, m + 21);
  EXPECT_EQ(row2, (std::vector<uint8_t>{1, 1, 1, 1, 1, 0, 1}));
  EXPECT_EQ(b.batch().out_cache_loc.at({0}), 14);
  rewrite_tokens(s, 4, {16}, pool);
  EXPECT_EQ(pool.read(s.row, 4, 1), (std::vector<int32_t>{16}));
  EXPECT_THROW(rewrite_tokens(s, 6, {1, 2}, pool), Error);
  EXPECT_THROW(StepBatch(ForwardMode::TARGET_VERIFY, {{&s, 7, 3, {-1, 2, 0}}}, pool, Device::cpu()),
               Error);
  EXPECT_THROW(StepBatch(ForwardMode::DECODE, {{&s, 7, 2, {}}}, pool, Device::cpu()), Error);
  EXPECT_THROW(StepBatch(ForwardMode::EXTEND, {{&s, 8, 2, {}}}, pool, Device::cpu()), Error);
}

TEST(StepBatch, EncoderTokensComeFirst) {
  ReqToTokenPool pool(4, 64);
  Sequence a, b;
  a.row = (*pool.alloc(1))[0];
  b.row = (*pool.alloc(1))[0];
  set_encoder_tokens(a, iota_slots(40, 5), pool);
  append_tokens(a, iota_slots(10, 3), pool);
  set_encoder_tokens(b, iota_slots(50, 2), pool);
  append_tokens(b, iota_slots(20, 4), pool);
  EXPECT_EQ(a.encoder_len, 5);
  EXPECT_EQ(a.seq_len(), 3);
  EXPECT_EQ(pool.read(a.row, 0, 8), (std::vector<int32_t>{40, 41, 42, 43, 44, 10, 11, 12}));
  EXPECT_THROW(set_encoder_tokens(a, {60}, pool), Error);
  rewrite_tokens(a, 1, {30}, pool);  // decoder positions: after the encoder tokens
  EXPECT_EQ(pool.read(a.row, 6, 1), (std::vector<int32_t>{30}));

  StepBatch e(ForwardMode::EXTEND, {{&a, 3, 2, {}}, {&b, 4, 4, {}}}, pool, Device::cpu(),
              /*write_encoder_kv=*/true);
  const ForwardBatch& f = e.batch();
  EXPECT_EQ(f.encoder_lens_cpu, (std::vector<int32_t>{5, 2}));
  EXPECT_EQ(f.seq_lens_cpu, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(f.extend_prefix_lens_cpu, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(e.num_encoder_tokens(), 7);
  EXPECT_TRUE(e.write_encoder_kv());
  ASSERT_EQ(f.encoder_out_cache_loc.numel(), 7);
  ASSERT_EQ(f.out_cache_loc.numel(), 6);
  const std::vector<int32_t> enc = {40, 41, 42, 43, 44, 50, 51}, out = {30, 12, 20, 21, 22, 23};
  for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(f.encoder_out_cache_loc.at({i}), enc[i]) << i;
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(f.out_cache_loc.at({i}), out[i]) << i;
  EXPECT_FALSE(
      StepBatch(ForwardMode::DECODE, {{&a, 3, 1, {}}}, pool, Device::cpu()).write_encoder_kv());
}

// ---- encoder-decoder passes ----------------------------------------------------------------

// Two self-attention layers and two cross-attention ones, in T5's order. The scale stays
// 1 / sqrt(head_dim): with T5's 1 and unit-normal activations the softmax is nearly one-hot, so a
// key the layer wrongly leaves out or takes in would change few outputs past the tolerance.
ModelConfig small_encoder_decoder() {
  ModelConfig m;
  m.num_layers = 4;
  m.num_qo_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  m.encoder_decoder = true;
  return m;
}

CheckOptions check_everything(const ModelConfig& m) {
  CheckOptions c;
  c.enabled = true;
  c.layers = m.num_layers;
  c.requests = 1 << 20;
  c.rows = 0;
  return c;
}

// The cross-attention layers' K and V rows of `slots`, as bytes.
std::vector<char> cross_kv_rows(KVPool& pool, const ModelConfig& m,
                                const std::vector<int32_t>& slots) {
  std::vector<char> bytes;
  for (int l = 0; l < m.num_layers; ++l) {
    if (!m.layer(l).is_cross_attention) continue;
    for (const TensorView* t : {&pool.k(l), &pool.v(l)}) {
      const size_t row = t->nbytes() / static_cast<size_t>(t->shape[0]);
      for (int32_t s : slots) {
        const char* p = static_cast<const char*>(t->data) + static_cast<size_t>(s) * row;
        bytes.insert(bytes.end(), p, p + row);
      }
    }
  }
  return bytes;
}

// The first failure a check reports names a cross-attention layer of small_encoder_decoder().
bool names_a_cross_layer(const std::string& failure) {
  return failure.find("layer 1:") != std::string::npos ||
         failure.find("layer 3:") != std::string::npos;
}

// The admitting EXTEND pass writes the encoder K/V once; decode passes read them unchanged; the
// check compares every layer with the reference. Then the mutants a cross-attention bug would
// make, each of which the check must catch: a request's row listing another request's encoder
// slots (cross attention reads the wrong K/V), encoder lengths off by one (the self-attention
// layers read an encoder token, the cross-attention ones miss one), and encoder K/V written to
// slots the request's row does not list.
TEST(EncoderDecoder, CheckCatchesCrossAttentionOnTheWrongSlots) {
  const ModelConfig m = small_encoder_decoder();
  EXPECT_FALSE(m.layer(0).is_cross_attention);
  EXPECT_TRUE(m.layer(1).is_cross_attention);
  Model model(m, Device::cpu(), 512, 11);
  ReqToTokenPool pool(4, 128);
  const CheckOptions check = check_everything(m);
  Sequence a, b;
  a.row = (*pool.alloc(1))[0];
  b.row = (*pool.alloc(1))[0];
  set_encoder_tokens(a, iota_slots(100, 20), pool);
  append_tokens(a, iota_slots(10, 9), pool);
  set_encoder_tokens(b, iota_slots(200, 13), pool);
  append_tokens(b, iota_slots(30, 5), pool);
  std::vector<int32_t> encoder_slots = iota_slots(100, 20);
  const std::vector<int32_t> b_encoder = iota_slots(200, 13);
  encoder_slots.insert(encoder_slots.end(), b_encoder.begin(), b_encoder.end());
  const std::vector<char> before = cross_kv_rows(model.pool(), m, encoder_slots);
  {
    StepBatch e(ForwardMode::EXTEND, {{&a, 9, 9, {}}, {&b, 5, 5, {}}}, pool, Device::cpu(),
                /*write_encoder_kv=*/true);
    const PassResult r = model.forward(e, check);
    EXPECT_EQ(r.checked, 4);
    EXPECT_EQ(r.failures, 0) << r.failure;
  }
  const std::vector<char> written = cross_kv_rows(model.pool(), m, encoder_slots);
  EXPECT_NE(written, before);
  int32_t next_slot = 40;
  auto decode = [&](const std::function<void(StepBatch&)>& mutate) {
    append_tokens(a, {next_slot++}, pool);
    append_tokens(b, {next_slot++}, pool);
    StepBatch d(ForwardMode::DECODE, {{&a, a.seq_len(), 1, {}}, {&b, b.seq_len(), 1, {}}}, pool,
                Device::cpu());
    if (mutate) mutate(d);
    return model.forward(d, check);
  };
  for (int i = 0; i < 3; ++i) {
    const PassResult r = decode({});
    EXPECT_EQ(r.checked, 4);
    EXPECT_EQ(r.failures, 0) << r.failure;
  }
  EXPECT_EQ(cross_kv_rows(model.pool(), m, encoder_slots), written);  // written once

  // Request a's row lists b's encoder slots: only the cross-attention layers read them.
  pool.write(a.row, 0, b_encoder);
  PassResult r = decode({});
  EXPECT_EQ(r.failures, 2) << r.failure;
  EXPECT_TRUE(names_a_cross_layer(r.failure)) << r.failure;
  pool.write(a.row, 0, iota_slots(100, 13));
  EXPECT_EQ(decode({}).failures, 0);

  // Encoder lengths one short.
  r = decode([](StepBatch& d) { --d.batch().encoder_lens_cpu[0]; });
  EXPECT_EQ(r.failures, 4) << r.failure;
  EXPECT_EQ(decode({}).failures, 0);

  // A new request whose encoder K/V go to slots its row does not list.
  Sequence c;
  c.row = (*pool.alloc(1))[0];
  set_encoder_tokens(c, iota_slots(300, 11), pool);
  append_tokens(c, iota_slots(60, 4), pool);
  StepBatch e(ForwardMode::EXTEND, {{&c, 4, 4, {}}}, pool, Device::cpu(),
              /*write_encoder_kv=*/true);
  int32_t* loc = static_cast<int32_t*>(e.batch().encoder_out_cache_loc.data);
  for (int i = 0; i < 11; ++i) loc[i] = 400 + i;
  r = model.forward(e, check);
  EXPECT_EQ(r.failures, 2) << r.failure;
  EXPECT_TRUE(names_a_cross_layer(r.failure)) << r.failure;
}

// ---- the scheduler -------------------------------------------------------------------------

// A tight pool forces waiting and eviction; the run still finishes with every invariant held
// and every sampled output matching the reference.
TEST(Scheduler, TightPoolEvictsWaitsAndFinishesClean) {
  for (const char* name : {"chat", "spec"}) {
    SCOPED_TRACE(name);
    Workload w = builtin_workload(name, 8, false, 3);
    ModelConfig m;
    m.num_layers = 1;
    SchedulerOptions o;
    o.kv_slots = 768;
    o.max_running = 6;
    o.token_budget = 256;
    o.check.enabled = true;
    Scheduler s(w, m, Device::cpu(), o);
    const ServeStats st = s.run();
    EXPECT_EQ(st.requests_done, 8);
    EXPECT_TRUE(st.invariant_failures.empty()) << st.invariant_failures[0];
    EXPECT_GT(st.checked, 0);
    EXPECT_EQ(st.check_failures, 0) << st.first_failure;
    EXPECT_LE(st.peak_kv_slots, 768);
    EXPECT_GT(st.evicted_blocks + st.admission_waits, 0);
    int64_t out = 0;
    for (const RequestSpec& r : w.requests) out += r.output_len;
    EXPECT_EQ(st.generated_tokens, out);
    EXPECT_GT(st.cached_prompt_tokens, 0);
  }
}

// An encoder-decoder model: every request's encoder K/V are written as it is admitted (several
// requests per EXTEND pass), every pass matches the reference on every layer, the invariants
// hold after every step, and every slot (the encoder tokens' included) is free at the end.
TEST(Scheduler, EncoderDecoderServesCleanAndFreesEncoderSlots) {
  Workload w = builtin_workload("chat", 10, false, 4);
  draw_encoder_lens(w, 96, 4);
  const ModelConfig m = small_encoder_decoder();
  SchedulerOptions o;
  o.kv_slots = 2048;
  o.max_running = 6;
  o.token_budget = 1024;
  o.check = check_everything(m);
  o.check.rows = 4;
  Scheduler s(w, m, Device::cpu(), o);
  int64_t steps = 0;
  while (s.step()) {
    ++steps;
    ASSERT_EQ(s.check_step_invariants(), "") << "step " << steps;
  }
  const ServeStats& st = s.stats();
  EXPECT_EQ(st.requests_done, 10);
  EXPECT_EQ(st.encoder_tokens, w.encoder_tokens());
  EXPECT_EQ(st.cached_prompt_tokens, 0);
  EXPECT_EQ(s.prefix_cache_slots(), 0);
  EXPECT_EQ(s.kv_in_use(), 0);
  EXPECT_GT(st.peak_kv_slots, 0);
  EXPECT_LT(st.by_mode.at("EXTEND").passes, 10);  // some pass admitted several requests
  EXPECT_GT(st.by_mode.at("DECODE").passes, 0);
  EXPECT_EQ(st.checked, 4 * static_cast<int64_t>(st.pass_ms.size()));
  EXPECT_EQ(st.check_failures, 0) << st.first_failure;
  EXPECT_EQ(st.nonfinite_passes, 0) << st.first_nonfinite;
}

TEST(Scheduler, EncoderInputsOnlyWithCrossAttention) {
  Workload w = builtin_workload("chat", 3, false, 4);
  SchedulerOptions o;
  o.kv_slots = 2048;
  // A model with cross attention needs every request's encoder input ...
  EXPECT_NE(error_of([&] {
              Scheduler(w, small_encoder_decoder(), Device::cpu(), o);
            }).find("request 0: encoder_len: expected >= 1"),
            std::string::npos);
  // ... and a model without has none.
  draw_encoder_lens(w, 8, 4);
  EXPECT_NE(error_of([&] {
              Scheduler(w, ModelConfig(), Device::cpu(), o);
            }).find("request 0: encoder_len: expected 0"),
            std::string::npos);
  // The draft model of speculative decoding is decoder-only.
  Workload spec = builtin_workload("spec", 3, false, 4);
  draw_encoder_lens(spec, 8, 4);
  EXPECT_NE(error_of([&] {
              Scheduler(spec, small_encoder_decoder(), Device::cpu(), o);
            }).find("speculative decoding needs a decoder-only model"),
            std::string::npos);
  // The encoder input counts in what a request needs of the pool: a pool that holds every
  // request's prompt and output, and no more, is too small.
  o.kv_slots = 0;
  for (const RequestSpec& r : w.requests)
    o.kv_slots =
        std::max<int64_t>(o.kv_slots, static_cast<int64_t>(r.prompt.size()) + r.output_len);
  EXPECT_NE(
      error_of([&] { Scheduler(w, small_encoder_decoder(), Device::cpu(), o); }).find("KV slots"),
      std::string::npos);
}

TEST(Scheduler, RejectsARequestLargerThanThePool) {
  Workload w;
  w.name = "one";
  RequestSpec r;
  r.prompt.assign(100, 5);
  r.output_len = 30;
  w.requests.push_back(r);
  SchedulerOptions o;
  o.kv_slots = 128;
  EXPECT_NE(
      error_of([&] { Scheduler(w, ModelConfig(), Device::cpu(), o); }).find("needs 130 KV slots"),
      std::string::npos);
}

// ---- layer_reference -----------------------------------------------------------------------

TEST(LayerReference, BadInput) {
  KVPoolConfig pc;
  pc.num_slots = 32;
  pc.num_kv_heads = 2;
  pc.head_dim_qk = 64;
  KVPool pool(pc);
  LayerSpec l;
  l.num_qo_heads = 4;
  l.num_kv_heads = 2;
  l.head_dim_qk = 64;
  std::vector<int32_t> slots = {1, 2, 3};
  Tensor q = Tensor::empty({2, 4, 64}, DType::bf16);
  ReferenceRequest r{slots.data(), 0, 3, 2, nullptr};
  EXPECT_EQ(error_of([&] { layer_reference(l, {r}, q, pool); }), "");
  ReferenceRequest more = r;
  more.qo_len = 4;
  EXPECT_NE(error_of([&] { layer_reference(l, {more}, q, pool); }).find("qo_len <= seq_len"),
            std::string::npos);
  ReferenceRequest one = r;
  one.qo_len = 1;
  EXPECT_NE(error_of([&] { layer_reference(l, {one}, q, pool); }).find("q rows"),
            std::string::npos);
  std::vector<int32_t> far = {1, 2, 99};
  ReferenceRequest out_of_pool{far.data(), 0, 3, 2, nullptr};
  EXPECT_NE(error_of([&] { layer_reference(l, {out_of_pool}, q, pool); }).find("slot 99 outside"),
            std::string::npos);
  LayerSpec enc = l;
  enc.attn_type = AttentionType::ENCODER_ONLY;
  EXPECT_NE(error_of([&] { layer_reference(enc, {r}, q, pool); }).find("ENCODER_ONLY"),
            std::string::npos);
  Tensor wrong_heads = Tensor::empty({2, 8, 64}, DType::bf16);
  EXPECT_THROW(layer_reference(l, {r}, wrong_heads, pool), Error);
  std::vector<uint8_t> mask(6, 1);
  ReferenceRequest masked = r;
  masked.mask = mask.data();
  EXPECT_NE(error_of([&] {
              layer_reference(l, {masked, r}, q, pool);
            }).find("tree mask"),
            std::string::npos);
}

// A pass that read its new tokens' K/V from its input: those rows come from new_k / new_v as
// they are, the others from the pool times its scales.
TEST(LayerReference, NewTokensFromTheGivenKv) {
  using test::random_tensor;
  using test::Rng;
  KVPoolConfig pc;
  pc.num_slots = 8;
  pc.num_kv_heads = 2;
  pc.head_dim_qk = 64;
  pc.dtype = DType::fp8_e5m2;
  KVPool pool(pc);
  pool.set_scales(0, 0.5f, 2.0f);
  Rng rng(7);
  for (const TensorView& t : {pool.k(0), pool.v(0)}) {
    const Tensor x = random_tensor(rng, {t.shape[0], t.shape[1], t.shape[2]}, DType::f32);
    for (int64_t i = 0; i < t.numel(); ++i)
      store_from_double(t.data, t.dtype, i, load_as_double(x.data(), DType::f32, i));
  }
  LayerSpec l;
  l.num_qo_heads = 4;
  l.num_kv_heads = 2;
  l.head_dim_qk = 64;
  const Tensor q = random_tensor(rng, {2, 4, 64}, DType::bf16);
  const Tensor nk = random_tensor(rng, {4, 2, 64}, DType::bf16);
  const Tensor nv = random_tensor(rng, {4, 2, 64}, DType::bf16);
  // Three tokens in slots 5, 2, 6; the last two are new, rows 1 and 2 of nk / nv.
  std::vector<int32_t> slots = {5, 2, 6};
  ReferenceRequest r{slots.data(), 0, 3, 2, nullptr};
  r.new_len = 2;
  r.new_row = 1;
  const reference::Result got = layer_reference(l, {r}, q, pool, nullptr, nullptr, nk, nv);

  Tensor k = Tensor::empty({3, 2, 64}, DType::f32), v = Tensor::empty({3, 2, 64}, DType::f32);
  for (int64_t e = 0; e < 128; ++e) {
    k.ptr<float>()[e] = float(load_as_double(pool.k(0).data, pc.dtype, 5 * 128 + e) * 0.5);
    v.ptr<float>()[e] = float(load_as_double(pool.v(0).data, pc.dtype, 5 * 128 + e) * 2.0);
    for (int j = 1; j < 3; ++j) {
      k.ptr<float>()[j * 128 + e] = float(load_as_double(nk.data(), DType::bf16, j * 128 + e));
      v.ptr<float>()[j * 128 + e] = float(load_as_double(nv.data(), DType::bf16, j * 128 + e));
    }
  }
  AttentionOptions opt;
  opt.causal = true;
  const reference::Result want =
      reference::ragged_attention(q, k, v, Tensor::from_i32({0, 2}), Tensor::from_i32({0, 3}), opt);
  ASSERT_EQ(got.o.size(), want.o.size());
  for (size_t i = 0; i < want.o.size(); ++i) EXPECT_NEAR(got.o[i], want.o[i], 1e-6) << i;
  for (size_t i = 0; i < want.lse.size(); ++i) EXPECT_NEAR(got.lse[i], want.lse[i], 1e-6) << i;
  // Read from the pool, the new tokens differ (e5m2 rounds them).
  const reference::Result pooled = layer_reference(l, {r}, q, pool);
  double diff = 0;
  for (size_t i = 0; i < want.o.size(); ++i)
    diff = std::max(diff, std::abs(pooled.o[i] - want.o[i]));
  EXPECT_GT(diff, 1e-3);

  EXPECT_NE(error_of([&] {
              layer_reference(l, {r}, q, pool, nullptr, nullptr, nk);
            }).find("new_k and new_v go together"),
            std::string::npos);
  ReferenceRequest past = r;
  past.new_row = 3;
  EXPECT_NE(error_of([&] {
              layer_reference(l, {past}, q, pool, nullptr, nullptr, nk, nv);
            }).find("new tokens [3, 5)"),
            std::string::npos);
  ReferenceRequest longer = r;
  longer.new_len = 4;
  EXPECT_THROW(layer_reference(l, {longer}, q, pool, nullptr, nullptr, nk, nv), Error);
  const Tensor wrong = random_tensor(rng, {4, 1, 64}, DType::bf16);
  EXPECT_THROW(layer_reference(l, {r}, q, pool, nullptr, nullptr, wrong, wrong), Error);
}

}  // namespace
}  // namespace flashkv::app
