// Fuzzes the workload-file reader (apps/json.*, apps/workload.*) with arbitrary text:
//   - reading either gives a workload or throws flashkv::Error whose message names the source
//     and a position ("fuzz.json: line L, column C: ..."); nothing else is ever thrown;
//   - a JSON document written back (by an encoder independent of the reader) reads as the same
//     value;
//   - a workload read is well formed (requests in arrival order, prompts of at least one token,
//     outputs >= 1, within the request limit), reading is deterministic for a seed, and keeping
//     the first k requests gives the first k of the whole;
//   - workload_to_json of it reads back as the same workload, and writes the same text again.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "flashkv/core/error.h"
#include "json.h"
#include "workload.h"

using namespace flashkv;
using namespace flashkv::app;

namespace {

constexpr const char* kSource = "fuzz.json";
constexpr uint64_t kSeed = 7;
// Token ids a workload may ask for before an input is too slow to be worth reading: a 30-byte
// file can ask for a million random tokens, and every request naming a prefix copies it.
constexpr double kTokenBudget = double(1 << 21);

[[noreturn]] void finding(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "fuzz_workload: %s %s\n", what, detail.c_str());
  __builtin_trap();
}

// JSON text for a value: strings escape only what JSON requires (the inputs exercise the
// reader's other escapes), numbers with 17 significant digits (exact for doubles).
void write_string(const std::string& s, std::string& out) {
  out += '"';
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  out += '"';
}

void write_json(const JsonValue& v, std::string& out) {
  switch (v.type()) {
    case JsonValue::Type::null:
      out += "null";
      return;
    case JsonValue::Type::boolean:
      out += v.boolean() ? "true" : "false";
      return;
    case JsonValue::Type::number: {
      char buf[40];
      std::snprintf(buf, sizeof buf, "%.17g", v.number());
      out += buf;
      return;
    }
    case JsonValue::Type::string:
      write_string(v.string(), out);
      return;
    case JsonValue::Type::array:
      out += '[';
      for (size_t i = 0; i < v.items().size(); ++i) {
        if (i) out += ", ";
        write_json(v.items()[i], out);
      }
      out += ']';
      return;
    case JsonValue::Type::object:
      out += '{';
      for (size_t i = 0; i < v.members().size(); ++i) {
        if (i) out += ",\n";
        write_string(v.members()[i].first, out);
        out += ": ";
        write_json(v.members()[i].second, out);
      }
      out += '}';
      return;
  }
}

// Bit for bit: -0 must stay -0.
bool same_bits(double a, double b) {
  uint64_t a_bits = 0, b_bits = 0;
  std::memcpy(&a_bits, &a, sizeof a);
  std::memcpy(&b_bits, &b, sizeof b);
  return a_bits == b_bits;
}

bool same_json(const JsonValue& a, const JsonValue& b) {
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case JsonValue::Type::null:
      return true;
    case JsonValue::Type::boolean:
      return a.boolean() == b.boolean();
    case JsonValue::Type::number:
      return same_bits(a.number(), b.number());
    case JsonValue::Type::string:
      return a.string() == b.string();
    case JsonValue::Type::array:
      if (a.items().size() != b.items().size()) return false;
      for (size_t i = 0; i < a.items().size(); ++i)
        if (!same_json(a.items()[i], b.items()[i])) return false;
      return true;
    case JsonValue::Type::object:
      if (a.members().size() != b.members().size()) return false;
      for (size_t i = 0; i < a.members().size(); ++i)
        if (a.members()[i].first != b.members()[i].first ||
            !same_json(a.members()[i].second, b.members()[i].second))
          return false;
      return true;
  }
  return false;
}

bool same_request(const RequestSpec& a, const RequestSpec& b) {
  return a.arrival == b.arrival && a.prompt == b.prompt && a.prefix_len == b.prefix_len &&
         a.output_len == b.output_len;
}

bool same_workload(const Workload& a, const Workload& b) {
  if (a.name != b.name || a.spec.enabled != b.spec.enabled || a.spec.topk != b.spec.topk ||
      a.spec.num_steps != b.spec.num_steps || !same_bits(a.spec.accept_rate, b.spec.accept_rate) ||
      a.requests.size() != b.requests.size())
    return false;
  for (size_t i = 0; i < a.requests.size(); ++i)
    if (!same_request(a.requests[i], b.requests[i])) return false;
  return true;
}

// Tokens of a count or an id list (0 for anything else: the reader rejects it cheaply).
double token_cost(const JsonValue* v) {
  if (!v) return 0;
  if (v->is_number()) return v->number() > 0 ? v->number() : 0;
  if (v->is_array()) return static_cast<double>(v->items().size());
  return 0;
}

// The random token ids reading `doc` would make, counted before reading it.
double tokens_asked(const JsonValue& doc) {
  if (!doc.is_object()) return 0;
  const JsonValue* prefixes = doc.find("prefixes");
  const JsonValue* requests = doc.find("requests");
  double total = 0;
  if (prefixes && prefixes->is_object())
    for (const auto& m : prefixes->members()) total += token_cost(&m.second);
  if (requests && requests->is_array())
    for (const JsonValue& r : requests->items()) {
      if (!r.is_object()) continue;
      total += token_cost(r.find("prompt"));
      const JsonValue* p = r.find("prefix");
      if (p && p->is_string() && prefixes && prefixes->is_object())
        total += token_cost(prefixes->find(p->string()));
    }
  return total;
}

// Reads `text`, checking that an error is a flashkv::Error naming the source and a position.
bool read(const std::string& text, int num_requests, Workload& w) {
  try {
    w = parse_workload(text, kSource, num_requests, kSeed);
    return true;
  } catch (const Error& e) {
    const std::string prefix = std::string(kSource) + ": line ";
    if (std::strncmp(e.what(), prefix.c_str(), prefix.size()) != 0)
      finding("an error without a position:", e.what());
    return false;
  } catch (const std::exception& e) {
    finding("an exception other than flashkv::Error:", e.what());
  } catch (...) {
    finding("a non-standard exception");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  JsonValue doc;
  try {
    doc = parse_json(text);
  } catch (const Error&) {
    Workload w;
    if (read(text, 0, w)) finding("a workload from text that is not JSON");
    return 0;
  }
  std::string again;
  write_json(doc, again);
  try {
    if (!same_json(doc, parse_json(again))) finding("JSON changed on a round trip:", again);
  } catch (const Error& e) {
    finding("JSON written back does not read:", e.what());
  }
  if (tokens_asked(doc) > kTokenBudget) return 0;

  Workload w;
  if (!read(text, 0, w)) return 0;
  if (w.requests.empty()) finding("a workload without requests");
  for (size_t i = 0; i < w.requests.size(); ++i) {
    const RequestSpec& r = w.requests[i];
    if (r.prompt.empty() || r.output_len < 1 || r.prefix_len < 0 ||
        static_cast<size_t>(r.prefix_len) > r.prompt.size() ||
        static_cast<int64_t>(r.prompt.size()) + r.output_len > kMaxRequestTokens ||
        (i > 0 && r.arrival < w.requests[i - 1].arrival))
      finding("a malformed request read");
  }
  Workload w_again;
  if (!read(text, 0, w_again) || !same_workload(w, w_again)) finding("reading is not repeatable");
  if (w.requests.size() >= 2) {
    const size_t k = w.requests.size() / 2;
    Workload first;
    if (!read(text, static_cast<int>(k), first) || first.requests.size() != k)
      finding("keeping the first requests failed");
    for (size_t i = 0; i < k; ++i)
      if (!same_request(first.requests[i], w.requests[i])) finding("the first requests differ");
  }

  const std::string saved = workload_to_json(w);
  Workload back;
  if (!read(saved, 0, back)) finding("a saved workload does not read back:", saved);
  if (!same_workload(w, back)) finding("a saved workload reads back differently:", saved);
  if (workload_to_json(back) != saved) finding("saving is not a fixed point:", saved);
  return 0;
}
