// Serving workloads for `flashkv serve`: requests that arrive over time, with prompts that share
// prefixes (system prompts, documents) and a number of tokens to generate. Built-in generators
// (chat, long, spec) are seeded, so a run is reproducible; a JSON file describes any other trace
// (format in the README, "Workload files").
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace flashkv::app {

struct RequestSpec {
  int64_t arrival = 0;          // scheduler step at which the request arrives
  std::vector<int32_t> prompt;  // token ids; a shared prefix's tokens come first
  int32_t prefix_len = 0;       // tokens of the prompt that come from a shared prefix
  int32_t output_len = 1;       // tokens to generate (the first one comes out of the prefill)
  // Encoder-decoder models: the request's encoder input in tokens. Their K/V take the first
  // slots of the request's req_to_token row, written by the pass that admits it and freed with
  // it; 0 for a decoder-only model.
  int32_t encoder_len = 0;
};

// Speculative decoding (EAGLE-style): each step, the draft model drafts `topk` branches of
// `num_steps` tokens each after the last generated token (the root), the target model verifies
// the tree they form, a root-to-node path is accepted, and the draft model is extended by it.
struct SpeculativeConfig {
  bool enabled = false;
  int topk = 2;               // branches
  int num_steps = 2;          // draft tokens per branch (draft decode steps)
  double accept_rate = 0.75;  // chance the walk down the tree goes one node further
  // Tree nodes per verify: the root and every draft token.
  int draft_tokens() const { return 1 + topk * num_steps; }
};

struct Workload {
  std::string name;
  std::vector<RequestSpec> requests;  // in arrival order
  int num_prefixes = 0;               // distinct shared prefixes
  SpeculativeConfig spec;

  int64_t prompt_tokens() const;
  int64_t output_tokens() const;
  int64_t encoder_tokens() const;
  int32_t max_prompt_len() const;
  // Longest prompt + output of any request (the KV a request needs at its end).
  int32_t max_sequence_len() const;
};

// Lengths are bounded so that one request fits a KV pool the command can allocate.
constexpr int32_t kMaxRequestTokens = 1 << 20;
constexpr int kMaxWorkloadRequests = 1 << 20;

bool is_builtin_workload(const std::string& name);  // chat | long | spec
// A built-in workload. num_requests 0: the generator's default count. large: sized for a GPU
// (longer prompts and outputs, more requests) instead of a small CPU run.
Workload builtin_workload(const std::string& name, int num_requests, bool large, uint64_t seed);
// Reads a workload file (JSON). Throws flashkv::Error with one line naming the file and, for a
// bad value, its position and JSON path ("requests[2].output: expected an integer >= 1, got 0").
// num_requests > 0 keeps only the first num_requests requests (in arrival order).
Workload load_workload_file(const std::string& path, int num_requests, uint64_t seed);
// The same from the file's text; errors read "<source>: line L, column C: ...", and a file
// without "name" is named `source`.
Workload parse_workload(const std::string& text, const std::string& source, int num_requests,
                        uint64_t seed);
// Encoder inputs for an encoder-decoder model: each request gets a length drawn uniformly from
// (max_len + 1) / 2 .. max_len, from `seed` and the request's index alone, so the same seed gives
// every request of a workload (built-in or file) the same length. Throws flashkv::Error unless
// 1 <= max_len <= kMaxEncoderTokens.
constexpr int32_t kMaxEncoderTokens = 1 << 16;
int32_t random_encoder_len(std::mt19937_64& gen, int32_t max_len);
void draw_encoder_lens(Workload& w, int32_t max_len, uint64_t seed);
// A workload file describing `w` exactly: token ids written out, each distinct shared prefix
// once under "prefixes" (named p0, p1, ...). Reading it back gives the same requests, name and
// speculative setting (`serve --save-workload`). Encoder lengths are not written: serving the file
// with the same --seed and --encoder-len draws them again.
std::string workload_to_json(const Workload& w);

}  // namespace flashkv::app
