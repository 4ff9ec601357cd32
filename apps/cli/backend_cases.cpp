#include "backend_cases.h"

#include <algorithm>
#include <memory>
#include <random>
#include <utility>

#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/req_to_token_pool.h"

namespace flashkv::app {

const char* scenario_name(BackendScenario s) {
  switch (s) {
    case BackendScenario::decode:
      return "decode";
    case BackendScenario::extend:
      return "extend";
    case BackendScenario::extend_prefix:
      return "extend+prefix";
    case BackendScenario::mixed:
      return "mixed";
    case BackendScenario::verify:
      return "verify";
    case BackendScenario::draft_extend:
      return "draft_extend";
    case BackendScenario::draft_steps:
      return "draft_steps";
    case BackendScenario::sliding_window:
      return "window";
    case BackendScenario::cross_attention:
      return "cross";
  }
  return "?";
}

std::string BackendCase::describe() const {
  const ModelConfig& m = model;
  std::string s = str_cat("L=", m.num_layers, " Hq/Hkv=", m.num_qo_heads, "/", m.num_kv_heads,
                          " D=", m.head_dim, " ", dtype_name(m.dtype));
  if (m.kv_dtype != m.dtype) s += str_cat("/kv ", dtype_name(m.kv_dtype));
  if (m.sliding_window >= 0) s += str_cat(" win=", m.sliding_window);
  if (m.logit_cap > 0) s += str_cat(" cap=", m.logit_cap);
  if (m.encoder_decoder) s += " enc-dec";
  if (m.sinks) s += " sinks";
  return s;
}

namespace {

// One scenario's state: the pools, the model and the requests, and the running tally.
class Scenario {
 public:
  Scenario(const BackendCase& c, Device device)
      : c_(c),
        device_(device),
        gen_(c.seed),
        req_to_token_(16, 4096, device),
        allocator_(kSlots),
        model_(c.model, device, kSlots, c.seed + 1) {
    check_.enabled = true;
    check_.layers = c.model.num_layers;  // every layer ...
    check_.requests = 1 << 20;           // ... every request ...
    check_.rows = 0;                     // ... every row
  }

  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen_); }
  // A sequence length, scaled by the case.
  int len(int lo, int hi) { return uniform(lo * c_.scale, hi * c_.scale); }

  // A new request with `encoder` encoder tokens (their slots allocated, written by the first pass).
  Sequence* add(int encoder = 0) {
    auto s = std::make_unique<Sequence>();
    s->row = (*req_to_token_.alloc(1))[0];
    s->encoder_len = encoder;
    if (encoder > 0) {
      s->slots = take(encoder);
      req_to_token_.write(s->row, 0, s->slots);
    }
    seqs_.push_back(std::move(s));
    return seqs_.back().get();
  }

  // Slots in a shuffled order, so requests' KV interleave in the pool.
  std::vector<int32_t> take(int n) {
    auto slots = allocator_.alloc(n);
    FLASHKV_CHECK(slots.has_value(), "backend case: out of KV slots");
    std::shuffle(slots->begin(), slots->end(), gen_);
    return *slots;
  }

  // Appends num_new[i] tokens to seqs[i] and runs a pass of `mode` over them.
  void pass(ForwardMode mode, const std::vector<Sequence*>& seqs, const std::vector<int>& num_new,
            bool write_encoder_kv = false) {
    std::vector<BatchEntry> entries;
    for (size_t i = 0; i < seqs.size(); ++i) {
      append_tokens(*seqs[i], take(num_new[i]), req_to_token_);
      BatchEntry e{seqs[i], seqs[i]->seq_len(), num_new[i], {}};
      if (mode == ForwardMode::TARGET_VERIFY) {
        e.tree_parents.assign(num_new[i], -1);
        for (int j = 1; j < num_new[i]; ++j) e.tree_parents[j] = uniform(0, j - 1);
      }
      entries.push_back(std::move(e));
    }
    StepBatch step(mode, std::move(entries), req_to_token_, device_, write_encoder_kv);
    tally(model_.forward(step, check_));
  }

  void tally(const PassResult& p) {
    ++result.passes;
    result.checked += p.checked;
    result.failures += p.failures;
    result.worst_rel = std::max(result.worst_rel, p.worst_rel);
    if (p.nonfinite && !result.nonfinite) {
      result.nonfinite = true;
      if (result.error.empty()) result.error = "NaN or Inf: " + p.nonfinite_where;
    }
    if (p.failures > 0 && result.error.empty()) result.error = p.failure;
  }

  // Prefills n requests of random lengths in one extend pass.
  std::vector<Sequence*> prefill(int n, int lo, int hi, int encoder_lo = 0, int encoder_hi = 0) {
    std::vector<Sequence*> seqs;
    std::vector<int> lens;
    for (int i = 0; i < n; ++i) {
      seqs.push_back(add(encoder_hi > 0 ? len(encoder_lo, encoder_hi) : 0));
      lens.push_back(len(lo, hi));
    }
    pass(ForwardMode::EXTEND, seqs, lens, /*write_encoder_kv=*/encoder_hi > 0);
    return seqs;
  }

  // Multi-step drafting over every request: topk branches of `steps` tokens each; one random
  // step of every layer is checked, every row.
  void draft_steps(const std::vector<Sequence*>& seqs, int topk, int steps) {
    model_.enable_multi_step_draft(topk, steps);
    std::vector<int32_t> lens;
    lens.reserve(seqs.size());
    for (const Sequence* s : seqs) lens.push_back(s->seq_len());
    const std::vector<int32_t> slots = take(static_cast<int>(seqs.size()) * topk * steps);
    tally(model_.forward_draft_steps(seqs, lens, slots, req_to_token_, check_));
  }

  BackendResult result;

 private:
  static constexpr int64_t kSlots = 16384;
  BackendCase c_;
  Device device_;
  std::mt19937_64 gen_;
  ReqToTokenPool req_to_token_;
  TokenAllocator allocator_;
  Model model_;
  CheckOptions check_;
  std::vector<std::unique_ptr<Sequence>> seqs_;
};

}  // namespace

BackendResult run_backend_case(const BackendCase& c, Device device) {
  BackendResult r;
  try {
    Scenario s(c, device);
    switch (c.scenario) {
      case BackendScenario::decode: {
        auto seqs = s.prefill(5, 1, 120);
        s.pass(ForwardMode::DECODE, seqs, std::vector<int>(seqs.size(), 1));
        s.pass(ForwardMode::DECODE, seqs, std::vector<int>(seqs.size(), 1));
        break;
      }
      case BackendScenario::extend:
        s.prefill(3, 1, 80);
        break;
      case BackendScenario::extend_prefix: {
        auto seqs = s.prefill(3, 1, 100);
        seqs.push_back(s.add());  // no prefix, in the same batch
        s.pass(ForwardMode::EXTEND, seqs, {s.len(1, 30), s.len(1, 30), 1, s.len(1, 40)});
        break;
      }
      case BackendScenario::mixed: {
        auto seqs = s.prefill(3, 1, 100);
        s.pass(ForwardMode::MIXED, seqs, {1, s.len(2, 40), 1});
        break;
      }
      case BackendScenario::verify: {
        auto seqs = s.prefill(3, 1, 100);
        s.pass(ForwardMode::TARGET_VERIFY, seqs, std::vector<int>(seqs.size(), s.uniform(2, 6)));
        break;
      }
      case BackendScenario::draft_extend: {
        auto seqs = s.prefill(3, 1, 100);
        s.pass(ForwardMode::DRAFT_EXTEND, seqs, {s.len(1, 4), 1, s.len(1, 4)});
        break;
      }
      case BackendScenario::draft_steps: {
        auto seqs = s.prefill(3, 1, 100);
        s.draft_steps(seqs, s.uniform(1, 4), s.uniform(1, 4));
        break;
      }
      case BackendScenario::sliding_window: {
        auto seqs = s.prefill(3, 1, 100);
        s.pass(ForwardMode::EXTEND, seqs, {s.len(1, 30), s.len(1, 30), s.len(1, 30)});
        s.pass(ForwardMode::DECODE, seqs, {1, 1, 1});
        break;
      }
      case BackendScenario::cross_attention: {
        auto seqs = s.prefill(2, 1, 20, 1, 60);
        s.pass(ForwardMode::DECODE, seqs, {1, 1});
        break;
      }
    }
    r = s.result;
    r.passed = r.failures == 0 && !r.nonfinite && r.checked > 0;
  } catch (const Error& e) {
    r.error = e.what();
    r.passed = false;
  }
  return r;
}

std::vector<BackendCase> backend_case_grid(bool quick, uint64_t seed) {
  std::mt19937_64 gen(seed ^ 0xBACC3D);
  std::vector<BackendCase> cases;
  std::vector<ModelConfig> shapes;
  ModelConfig base;
  base.num_layers = 2;
  base.num_qo_heads = 8;
  base.num_kv_heads = 2;
  base.head_dim = 64;
  shapes.push_back(base);
  if (!quick) {
    ModelConfig wide = base;
    wide.num_qo_heads = 16;
    wide.num_kv_heads = 4;
    wide.head_dim = 128;
    shapes.push_back(wide);
  }
  const BackendScenario all[] = {BackendScenario::decode,         BackendScenario::extend,
                                 BackendScenario::extend_prefix,  BackendScenario::mixed,
                                 BackendScenario::verify,         BackendScenario::draft_extend,
                                 BackendScenario::draft_steps,    BackendScenario::sliding_window,
                                 BackendScenario::cross_attention};
  for (const ModelConfig& shape : shapes) {
    for (BackendScenario sc : all) {
      BackendCase c;
      c.scenario = sc;
      c.model = shape;
      c.scale = quick ? 1 : 3;
      c.seed = gen();
      if (sc == BackendScenario::sliding_window) {
        c.model.num_layers = 4;
        c.model.sliding_window = 13;
      }
      if (sc == BackendScenario::cross_attention) {
        c.model.num_layers = 4;
        c.model.encoder_decoder = true;
      }
      cases.push_back(c);
    }
    // The fp8 KV cache (with non-unit scales) in decode and extend on top of a prefix; e5m2's
    // 2-bit mantissa only in the extend, whose ragged pass reads the new tokens unrounded.
    const std::pair<BackendScenario, DType> fp8_cases[] = {
        {BackendScenario::decode, DType::fp8_e4m3},
        {BackendScenario::extend_prefix, DType::fp8_e4m3},
        {BackendScenario::extend_prefix, DType::fp8_e5m2}};
    for (const auto& [sc, kv] : fp8_cases) {
      BackendCase c;
      c.scenario = sc;
      c.model = shape;
      c.model.kv_dtype = kv;
      c.scale = quick ? 1 : 3;
      c.seed = gen();
      cases.push_back(c);
    }
  }
  // Attention sinks (a per-layer f32 [Hq] tensor, as gpt-oss has) in the modes whose passes add
  // them differently: decode, extend alone (the ragged pass adds the sink) and on prefixes (the
  // prefix pass merges the new tokens' state and adds it once), target verify, draft extend,
  // MIXED, multi-step drafting, and windowed and full layers together; the cap on the scores
  // leaves the sink alone. After the cases above so that their seeds do not change.
  const BackendScenario with_sinks[] = {
      BackendScenario::decode,      BackendScenario::extend,        BackendScenario::extend_prefix,
      BackendScenario::mixed,       BackendScenario::verify,        BackendScenario::draft_extend,
      BackendScenario::draft_steps, BackendScenario::sliding_window};
  for (const ModelConfig& shape : shapes) {
    for (BackendScenario sc : with_sinks) {
      BackendCase c;
      c.scenario = sc;
      c.model = shape;
      c.model.sinks = true;
      c.scale = quick ? 1 : 3;
      c.seed = gen();
      if (sc == BackendScenario::extend_prefix) c.model.logit_cap = 20.0f;
      if (sc == BackendScenario::sliding_window) {
        c.model.num_layers = 4;
        c.model.sliding_window = 13;
      }
      cases.push_back(c);
    }
  }
  return cases;
}

}  // namespace flashkv::app
