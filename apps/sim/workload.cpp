#include "workload.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>

#include "flashkv/core/error.h"
#include "json.h"

namespace flashkv::app {

int64_t Workload::prompt_tokens() const {
  int64_t n = 0;
  for (const RequestSpec& r : requests) n += static_cast<int64_t>(r.prompt.size());
  return n;
}

int64_t Workload::output_tokens() const {
  int64_t n = 0;
  for (const RequestSpec& r : requests) n += r.output_len;
  return n;
}

int64_t Workload::encoder_tokens() const {
  int64_t n = 0;
  for (const RequestSpec& r : requests) n += r.encoder_len;
  return n;
}

int32_t Workload::max_prompt_len() const {
  int32_t n = 0;
  for (const RequestSpec& r : requests) n = std::max(n, static_cast<int32_t>(r.prompt.size()));
  return n;
}

int32_t Workload::max_sequence_len() const {
  int32_t n = 0;
  for (const RequestSpec& r : requests)
    n = std::max(n, static_cast<int32_t>(r.prompt.size()) + r.output_len);
  return n;
}

namespace {

// Token ids the generators draw from (a Llama-sized vocabulary, skipping a few special ids).
constexpr int32_t kFirstToken = 3, kVocab = 128000;

std::vector<int32_t> random_tokens(std::mt19937_64& gen, int64_t n) {
  std::uniform_int_distribution<int32_t> tok(kFirstToken, kVocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = tok(gen);
  return t;
}

struct Range {
  int lo, hi;
  int draw(std::mt19937_64& gen) const { return std::uniform_int_distribution<int>(lo, hi)(gen); }
};

// The knobs of a generated trace.
struct GeneratorSpec {
  int default_requests;
  int num_prefixes;
  Range prefix_len;    // tokens of each shared prefix
  double share;        // fraction of requests that start with a shared prefix
  Range suffix_len;    // tokens after the prefix (with one) ...
  Range unshared_len;  // ... or of the whole prompt (without)
  Range output_len;
  double mean_gap;  // mean steps between arrivals (exponential gaps: a Poisson process)
  bool speculative;
};

GeneratorSpec generator_spec(const std::string& name, bool large) {
  if (name == "chat" || name == "spec") {
    // A chat service: a few system prompts shared by most requests, short user turns.
    GeneratorSpec g{48, 4, {96, 256}, 0.85, {16, 96}, {32, 192}, {8, 48}, 1.5, name == "spec"};
    if (name == "spec") g.default_requests = 32;
    if (large) {
      g.default_requests = name == "spec" ? 256 : 512;
      g.prefix_len = {512, 2048};
      g.suffix_len = {64, 512};
      g.unshared_len = {128, 1024};
      g.output_len = {64, 512};
      g.mean_gap = 0.25;
    }
    return g;
  }
  // long: long documents shared by several questions, and some long unshared prompts.
  GeneratorSpec g{8, 2, {1024, 2048}, 0.6, {16, 64}, {512, 1536}, {8, 32}, 4.0, false};
  if (large) {
    g.default_requests = 64;
    g.prefix_len = {8192, 16384};
    g.suffix_len = {32, 256};
    g.unshared_len = {4096, 8192};
    g.output_len = {32, 128};
    g.mean_gap = 1.0;
  }
  return g;
}

}  // namespace

bool is_builtin_workload(const std::string& name) {
  return name == "chat" || name == "long" || name == "spec";
}

Workload builtin_workload(const std::string& name, int num_requests, bool large, uint64_t seed) {
  FLASHKV_CHECK(is_builtin_workload(name), "workload: expected chat, long, spec or a file, got '",
                name, "'");
  FLASHKV_CHECK(num_requests >= 0 && num_requests <= kMaxWorkloadRequests,
                "--requests: expected 0..", kMaxWorkloadRequests, ", got ", num_requests);
  const GeneratorSpec g = generator_spec(name, large);
  std::mt19937_64 gen(seed * 0x9E3779B97F4A7C15ull + std::hash<std::string>()(name));
  Workload w;
  w.name = name;
  w.num_prefixes = g.num_prefixes;
  w.spec.enabled = g.speculative;
  std::vector<std::vector<int32_t>> prefixes;
  prefixes.reserve(g.num_prefixes);
  for (int p = 0; p < g.num_prefixes; ++p)
    prefixes.push_back(random_tokens(gen, g.prefix_len.draw(gen)));
  // Popular prefixes first: prefix p is chosen with weight 1 / (p + 1).
  std::vector<double> weights;
  weights.reserve(g.num_prefixes);
  for (int p = 0; p < g.num_prefixes; ++p) weights.push_back(1.0 / (p + 1));
  std::discrete_distribution<int> pick_prefix(weights.begin(), weights.end());
  std::exponential_distribution<double> gap(1.0 / g.mean_gap);
  std::bernoulli_distribution shared(g.share);
  double clock = 0;
  const int n = num_requests > 0 ? num_requests : g.default_requests;
  for (int i = 0; i < n; ++i) {
    RequestSpec r;
    r.arrival = static_cast<int64_t>(clock);
    clock += gap(gen);
    if (shared(gen)) {
      r.prompt = prefixes[pick_prefix(gen)];
      r.prefix_len = static_cast<int32_t>(r.prompt.size());
      const auto suffix = random_tokens(gen, g.suffix_len.draw(gen));
      r.prompt.insert(r.prompt.end(), suffix.begin(), suffix.end());
    } else {
      r.prompt = random_tokens(gen, g.unshared_len.draw(gen));
    }
    r.output_len = g.output_len.draw(gen);
    w.requests.push_back(std::move(r));
  }
  return w;
}

namespace {

// Reading a workload file: every error names the JSON path and the position of the bad value.
class FileReader {
 public:
  FileReader(std::string path, uint64_t seed) : path_(std::move(path)), gen_(seed) {}

  [[noreturn]] void fail(const JsonValue& v, const std::string& at, const std::string& what) const {
    throw Error(str_cat(path_, ": ", v.where(), ": ", at, ": ", what));
  }

  int64_t integer(const JsonValue& v, const std::string& at, int64_t lo, int64_t hi) const {
    if (!v.is_number() || v.number() != std::floor(v.number()) || v.number() < double(lo) ||
        v.number() > double(hi)) {
      const std::string got = v.is_number() ? str_cat(v.number()) : JsonValue::type_name(v.type());
      fail(v, at, str_cat("expected an integer in ", lo, "..", hi, ", got ", got));
    }
    return static_cast<int64_t>(v.number());
  }

  // A member that must be an object / may be absent.
  void check_keys(const JsonValue& v, const std::string& at,
                  std::initializer_list<const char*> keys) const {
    if (!v.is_object())
      fail(v, at, str_cat("expected an object, got ", JsonValue::type_name(v.type())));
    for (const auto& m : v.members()) {
      bool known = false;
      for (const char* k : keys) known = known || m.first == k;
      if (!known) {
        std::string list;
        for (const char* k : keys) list += std::string(list.empty() ? "" : ", ") + k;
        fail(m.second, at.empty() ? m.first : at + "." + m.first,
             str_cat("unknown key (expected one of: ", list, ")"));
      }
    }
  }

  // A token list: a count of random tokens, or the ids themselves.
  std::vector<int32_t> tokens(const JsonValue& v, const std::string& at, int64_t min_count) {
    if (v.is_number()) return random_tokens(gen_, integer(v, at, min_count, kMaxRequestTokens));
    if (!v.is_array())
      fail(v, at,
           str_cat("expected a token count or an array of token ids, got ",
                   JsonValue::type_name(v.type())));
    if (static_cast<int64_t>(v.items().size()) < min_count ||
        v.items().size() > size_t(kMaxRequestTokens))
      fail(v, at,
           str_cat("expected ", min_count, "..", kMaxRequestTokens, " token ids, got ",
                   v.items().size()));
    std::vector<int32_t> t;
    for (size_t i = 0; i < v.items().size(); ++i)
      t.push_back(
          static_cast<int32_t>(integer(v.items()[i], str_cat(at, "[", i, "]"), 0, 2147483647)));
    return t;
  }

  Workload read(const JsonValue& doc, int num_requests) {
    check_keys(doc, "", {"name", "prefixes", "speculative", "requests"});
    Workload w;
    w.name = path_;
    if (const JsonValue* name = doc.find("name")) {
      if (!name->is_string() || name->string().empty())
        fail(*name, "name", "expected a non-empty string");
      w.name = name->string();
    }
    std::map<std::string, std::vector<int32_t>> prefixes;
    if (const JsonValue* p = doc.find("prefixes")) {
      if (!p->is_object())
        fail(*p, "prefixes", "expected an object of name: token count or token ids");
      for (const auto& m : p->members())
        prefixes[m.first] = tokens(m.second, "prefixes." + m.first, 1);
      w.num_prefixes = static_cast<int>(prefixes.size());
    }
    if (const JsonValue* s = doc.find("speculative")) {
      if (s->is_bool()) {
        w.spec.enabled = s->boolean();
      } else {
        check_keys(*s, "speculative", {"topk", "steps", "accept_rate"});
        w.spec.enabled = true;
        if (const JsonValue* k = s->find("topk"))
          w.spec.topk = static_cast<int>(integer(*k, "speculative.topk", 1, 8));
        if (const JsonValue* n = s->find("steps"))
          w.spec.num_steps = static_cast<int>(integer(*n, "speculative.steps", 1, 8));
        if (const JsonValue* a = s->find("accept_rate")) {
          if (!a->is_number() || !(a->number() >= 0 && a->number() <= 1))
            fail(*a, "speculative.accept_rate", "expected a number in 0..1");
          w.spec.accept_rate = a->number();
        }
      }
    }
    const JsonValue* reqs = doc.find("requests");
    if (!reqs) fail(doc, "requests", "missing (expected an array of requests)");
    if (!reqs->is_array() || reqs->items().empty())
      fail(*reqs, "requests", "expected a non-empty array of requests");
    if (reqs->items().size() > size_t(kMaxWorkloadRequests))
      fail(*reqs, "requests", str_cat("at most ", kMaxWorkloadRequests, " requests"));
    for (size_t i = 0; i < reqs->items().size(); ++i) {
      const JsonValue& r = reqs->items()[i];
      const std::string at = str_cat("requests[", i, "]");
      check_keys(r, at, {"arrival", "prefix", "prompt", "output"});
      RequestSpec spec;
      if (const JsonValue* a = r.find("arrival"))
        spec.arrival = integer(*a, at + ".arrival", 0, 1LL << 40);
      if (const JsonValue* p = r.find("prefix")) {
        if (!p->is_string()) fail(*p, at + ".prefix", "expected the name of one of \"prefixes\"");
        auto it = prefixes.find(p->string());
        if (it == prefixes.end())
          fail(*p, at + ".prefix", "no prefix named \"" + p->string() + "\" in \"prefixes\"");
        spec.prompt = it->second;
        spec.prefix_len = static_cast<int32_t>(spec.prompt.size());
      }
      const JsonValue* prompt = r.find("prompt");
      if (!prompt && spec.prefix_len == 0)
        fail(r, at + ".prompt", "missing (expected a token count or token ids)");
      if (prompt) {
        const auto own = tokens(*prompt, at + ".prompt", spec.prefix_len > 0 ? 0 : 1);
        spec.prompt.insert(spec.prompt.end(), own.begin(), own.end());
      }
      const JsonValue* out = r.find("output");
      if (!out) fail(r, at + ".output", "missing (expected the number of tokens to generate)");
      spec.output_len = static_cast<int32_t>(integer(*out, at + ".output", 1, kMaxRequestTokens));
      if (static_cast<int64_t>(spec.prompt.size()) + spec.output_len > kMaxRequestTokens)
        fail(r, at,
             str_cat("prompt + output = ", spec.prompt.size() + spec.output_len,
                     " tokens, more than the ", kMaxRequestTokens, " a request may have"));
      w.requests.push_back(std::move(spec));
    }
    std::stable_sort(
        w.requests.begin(), w.requests.end(),
        [](const RequestSpec& a, const RequestSpec& b) { return a.arrival < b.arrival; });
    if (num_requests > 0 && static_cast<size_t>(num_requests) < w.requests.size())
      w.requests.resize(num_requests);
    return w;
  }

 private:
  std::string path_;
  std::mt19937_64 gen_;
};

}  // namespace

Workload load_workload_file(const std::string& path, int num_requests, uint64_t seed) {
  const JsonValue doc = read_json_file(path);
  return FileReader(path, seed).read(doc, num_requests);
}

Workload parse_workload(const std::string& text, const std::string& source, int num_requests,
                        uint64_t seed) {
  JsonValue doc;
  try {
    doc = parse_json(text);
  } catch (const Error& e) {
    throw Error(str_cat(source, ": ", e.what()));
  }
  return FileReader(source, seed).read(doc, num_requests);
}

int32_t random_encoder_len(std::mt19937_64& gen, int32_t max_len) {
  FLASHKV_CHECK(max_len >= 1 && max_len <= kMaxEncoderTokens, "encoder length: expected 1..",
                kMaxEncoderTokens, ", got ", max_len);
  return std::uniform_int_distribution<int32_t>((max_len + 1) / 2, max_len)(gen);
}

void draw_encoder_lens(Workload& w, int32_t max_len, uint64_t seed) {
  std::mt19937_64 gen(seed * 0x9E3779B97F4A7C15ull + 0xE2C0DE);
  for (RequestSpec& r : w.requests) r.encoder_len = random_encoder_len(gen, max_len);
}

namespace {

std::string token_list(std::vector<int32_t>::const_iterator begin,
                       std::vector<int32_t>::const_iterator end) {
  std::string s = "[";
  for (auto it = begin; it != end; ++it) s += str_cat(it == begin ? "" : ", ", *it);
  return s + "]";
}

}  // namespace

std::string workload_to_json(const Workload& w) {
  std::map<std::vector<int32_t>, int> prefix_ids;  // prefix tokens -> index, in first use order
  std::string prefixes, requests;
  for (const RequestSpec& r : w.requests) {
    std::string req = str_cat("    {\"arrival\": ", r.arrival);
    if (r.prefix_len > 0) {
      const std::vector<int32_t> prefix(r.prompt.begin(), r.prompt.begin() + r.prefix_len);
      auto it = prefix_ids.find(prefix);
      if (it == prefix_ids.end()) {
        it = prefix_ids.emplace(prefix, static_cast<int>(prefix_ids.size())).first;
        prefixes += str_cat(prefixes.empty() ? "" : ",\n", "    \"p", it->second,
                            "\": ", token_list(prefix.begin(), prefix.end()));
      }
      req += str_cat(", \"prefix\": \"p", it->second, "\"");
    }
    if (r.prompt.size() > static_cast<size_t>(r.prefix_len))
      req += ", \"prompt\": " + token_list(r.prompt.begin() + r.prefix_len, r.prompt.end());
    req += str_cat(", \"output\": ", r.output_len, "}");
    requests += (requests.empty() ? "" : ",\n") + req;
  }
  std::string out = "{\n";
  if (!w.name.empty()) out += "  \"name\": " + json_string(w.name) + ",\n";
  if (!prefixes.empty()) out += "  \"prefixes\": {\n" + prefixes + "\n  },\n";
  if (w.spec.enabled) {
    // 17 significant digits: the rate reads back as the same double.
    char rate[32];
    std::snprintf(rate, sizeof rate, "%.17g", w.spec.accept_rate);
    out += str_cat("  \"speculative\": {\"topk\": ", w.spec.topk, ", \"steps\": ", w.spec.num_steps,
                   ", \"accept_rate\": ", rate, "},\n");
  }
  return out + "  \"requests\": [\n" + requests + "\n  ]\n}\n";
}

}  // namespace flashkv::app
