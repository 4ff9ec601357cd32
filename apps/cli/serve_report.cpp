#include "serve_report.h"

#include <sstream>

#include "json.h"

namespace flashkv::app {

ProgressLine::ProgressLine(FILE* out, bool in_place, bool enabled)
    : out_(out), in_place_(in_place), enabled_(enabled) {}

std::string ProgressLine::format(const Progress& p) {
  char buf[240];
  const double tps = p.serve_s > 0 ? p.generated_tokens / p.serve_s : 0;
  const double kv = p.kv_slots ? 100.0 * p.kv_used / p.kv_slots : 0.0;
  if (p.steps > 0) {  // the soak test
    std::snprintf(buf, sizeof buf,
                  "soak: step %lld/%lld, %lld requests done | %.1f tokens/s | KV %lld/%lld slots "
                  "(%.0f%%) | invariants ok",
                  static_cast<long long>(p.step), static_cast<long long>(p.steps),
                  static_cast<long long>(p.done), tps, static_cast<long long>(p.kv_used),
                  static_cast<long long>(p.kv_slots), kv);
    return buf;
  }
  std::snprintf(buf, sizeof buf,
                "serve: %lld/%lld requests done, %lld running, %lld waiting | %.1f tokens/s | "
                "KV %lld/%lld slots (%.0f%%)",
                static_cast<long long>(p.done), static_cast<long long>(p.total),
                static_cast<long long>(p.running), static_cast<long long>(p.waiting), tps,
                static_cast<long long>(p.kv_used), static_cast<long long>(p.kv_slots), kv);
  return buf;
}

void ProgressLine::update(const Progress& p) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  // A terminal line redraws ten times a second (and shows the final state); a log gets a line
  // every five seconds, the first one five seconds in (the report follows the last).
  const auto period = in_place_ ? std::chrono::milliseconds(100) : std::chrono::milliseconds(5000);
  if (!started_) {
    started_ = true;
    last_ = now;
    if (!in_place_) return;
  } else if (now - last_ < period &&
             !(in_place_ && (p.steps > 0 ? p.step == p.steps : p.done == p.total))) {
    return;
  }
  last_ = now;
  shown_ = true;
  const std::string line = format(p);
  if (in_place_)
    std::fprintf(out_, "\r%s\x1b[K", line.c_str());
  else
    std::fprintf(out_, "%s\n", line.c_str());
  std::fflush(out_);
}

void ProgressLine::finish() {
  if (enabled_ && in_place_ && shown_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
}

namespace {

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

}  // namespace

void print_serve_report(std::ostream& os, const ServeSetup& s, const ServeStats& st) {
  const SchedulerOptions& o = s.scheduler;
  os << "workload     " << s.workload << ": " << st.requests << " requests, " << s.prompt_tokens
     << " prompt tokens (" << s.num_prefixes << " shared prefixes), " << s.output_tokens
     << " output tokens"
     << (s.encoder_len > 0 ? str_cat(", ", s.encoder_tokens, " encoder tokens (",
                                     (s.encoder_len + 1) / 2, "..", s.encoder_len, " a request)")
                           : "")
     << (s.spec.enabled
             ? str_cat(", speculative (", s.spec.topk, " x ", s.spec.num_steps, " draft trees)")
             : "")
     << "\n";
  os << "model        " << s.model.str() << (s.spec.enabled ? " + 1-layer draft model" : "")
     << "\n";
  os << "device       " << s.device << " (" << s.threads_or_sms
     << (s.device == "cpu" ? " threads" : " SMs") << "); KV pool " << o.kv_slots
     << " slots, token budget " << o.token_budget << ", up to " << o.max_running
     << " running requests\n";
  if (s.cp.ranks > 0) {
    os << "context par  " << s.cp.ranks << (s.cp.ranks == 1 ? " rank" : " ranks") << ", KV "
       << s.cp.layout << ", states by " << s.cp.exchange
       << (s.cp.kv_pass == "ring" ? ", new K/V by ring" : "")
       << "; each rank's own KV pool peaked at";
    for (size_t r = 0; r < s.cp.peak_slots.size(); ++r)
      os << (r ? ", " : " ") << s.cp.peak_slots[r];
    os << " slots";
    if (o.check.enabled) {
      os << "; layer outputs checked per rank:";
      for (size_t r = 0; r < s.cp.checked.size(); ++r) os << (r ? ", " : " ") << s.cp.checked[r];
    }
    os << "\n";
  }
  os << "requests     " << st.requests_done << " done in " << st.steps << " steps, "
     << fmt("%.2f", st.serve_s) << " s (checks " << fmt("%.2f", st.check_s) << " s more)\n";
  os << "throughput   " << fmt("%.1f", st.tokens_per_s()) << " generated tokens/s ("
     << st.generated_tokens << " tokens; prefill " << (st.prompt_tokens - st.cached_prompt_tokens)
     << " prompt tokens)\n";
  os << "attention    per pass p50 " << fmt("%.3f", st.pass_ms_percentile(50)) << " ms, p99 "
     << fmt("%.3f", st.pass_ms_percentile(99)) << " ms over " << st.pass_ms.size() << " passes:";
  for (const auto& [mode, m] : st.by_mode)
    os << " " << mode << " " << m.passes << " x " << fmt("%.3f", m.passes ? m.ms / m.passes : 0)
       << " ms;";
  os << "\n";
  if (s.encoder_len > 0)
    os << "prefix cache off (each request's decoder K/V depend on its own encoder input); the K/V "
       << "of " << st.encoder_tokens << " encoder tokens written once, as their requests were "
       << "admitted\n";
  else
    os << "prefix cache hit rate " << fmt("%.1f", 100.0 * st.prefix_hit_rate()) << "% ("
       << st.cached_prompt_tokens << " of " << st.prompt_tokens << " prompt tokens reused), "
       << st.evicted_blocks << " blocks evicted, " << st.cached_blocks_end << " blocks ("
       << st.cached_slots_end << " slots) cached at the end\n";
  os << "KV pool      peak " << st.peak_kv_slots << " of " << st.kv_slots << " slots ("
     << fmt("%.0f", st.kv_slots ? 100.0 * st.peak_kv_slots / st.kv_slots : 0) << "%; at most "
     << st.peak_working_kv_slots << " held by running requests), " << st.admission_waits
     << " admissions waited for KV space\n";
  if (st.spec_steps > 0)
    os << "speculative  " << st.spec_steps << " steps, "
       << fmt("%.2f",
              st.spec_request_steps ? double(st.accepted_tokens) / st.spec_request_steps : 0)
       << " tokens accepted per request step\n";
  if (o.check.enabled) {
    os << "check        " << st.checked << " layer outputs checked against the float64 reference, "
       << st.check_failures << " failures (worst relative error " << fmt("%.2e", st.worst_rel_error)
       << ")\n";
    if (!st.first_failure.empty()) os << "             first failure: " << st.first_failure << "\n";
  } else {
    os << "check        off (--check compares sampled layer outputs with the float64 reference)\n";
  }
  if (st.invariant_failures.empty()) {
    os << "invariants   ok: every KV slot returned except the " << st.cached_slots_end
       << " the prefix cache holds; no NaN in any output\n";
  } else {
    for (const std::string& f : st.invariant_failures) os << "invariants   FAILED: " << f << "\n";
  }
}

std::string serve_json(const ServeSetup& s, const ServeStats& st) {
  const ModelConfig& m = s.model;
  std::ostringstream os;
  os << "{\n"
     << "  \"tokens_per_s\": " << json_number(st.tokens_per_s()) << ",\n"
     << "  \"requests\": " << st.requests_done << ",\n"
     << "  \"attention_ms_p50\": " << json_number(st.pass_ms_percentile(50)) << ",\n"
     << "  \"attention_ms_p99\": " << json_number(st.pass_ms_percentile(99)) << ",\n"
     << "  \"prefix_hit_rate\": " << json_number(st.prefix_hit_rate()) << ",\n"
     << "  \"peak_kv_slots\": " << st.peak_kv_slots << ",\n"
     << "  \"checked\": " << st.checked << ",\n"
     << "  \"check_failures\": " << st.check_failures << ",\n"
     << "  \"invariants_ok\": " << (st.invariant_failures.empty() ? "true" : "false") << ",\n"
     << "  \"workload\": " << json_string(s.workload) << ",\n"
     << "  \"device\": " << json_string(s.device) << ",\n"
     << "  \"model\": {\"layers\": " << m.num_layers << ", \"num_qo_heads\": " << m.num_qo_heads
     << ", \"num_kv_heads\": " << m.num_kv_heads << ", \"head_dim\": " << m.head_dim
     << ", \"dtype\": " << json_string(dtype_name(m.dtype))
     << ", \"kv_dtype\": " << json_string(dtype_name(m.kv_dtype))
     << ", \"sliding_window\": " << m.sliding_window
     << ", \"speculative\": " << (s.spec.enabled ? "true" : "false") << "},\n"
     << "  \"kv_slots\": " << st.kv_slots << ",\n"
     << "  \"peak_working_kv_slots\": " << st.peak_working_kv_slots << ",\n"
     << "  \"prompt_tokens\": " << st.prompt_tokens << ",\n"
     << "  \"cached_prompt_tokens\": " << st.cached_prompt_tokens << ",\n"
     << "  \"generated_tokens\": " << st.generated_tokens << ",\n"
     << "  \"steps\": " << st.steps << ",\n"
     << "  \"passes\": " << st.pass_ms.size() << ",\n"
     << "  \"serve_s\": " << json_number(st.serve_s) << ",\n"
     << "  \"check_s\": " << json_number(st.check_s) << ",\n"
     << "  \"evicted_blocks\": " << st.evicted_blocks << ",\n"
     << "  \"accepted_tokens_per_step\": "
     << json_number(st.spec_request_steps ? double(st.accepted_tokens) / st.spec_request_steps : 0);
  if (s.cp.ranks > 0) {
    os << ",\n  \"context_parallel\": {\"ranks\": " << s.cp.ranks
       << ", \"layout\": " << json_string(s.cp.layout)
       << ", \"exchange\": " << json_string(s.cp.exchange)
       << ", \"kv_pass\": " << json_string(s.cp.kv_pass) << ", \"peak_kv_slots_per_rank\": [";
    for (size_t r = 0; r < s.cp.peak_slots.size(); ++r) os << (r ? ", " : "") << s.cp.peak_slots[r];
    os << "]}";
  }
  os << "\n}\n";
  return os.str();
}

}  // namespace flashkv::app
