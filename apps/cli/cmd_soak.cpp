// flashkv soak: a long random serving workload with the serving invariants checked after every
// step (soak.h lists them). Exit code 0 when every check held, 1 at the first violation (named
// with its step on stderr), 2 for bad flags.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include "args.h"
#include "commands.h"
#include "cp_session.h"
#include "flashkv/core/error.h"
#include "model_flags.h"
#include "serve_report.h"
#include "soak.h"

namespace flashkv::app {

namespace {

void print_summary(const SoakOptions& o, const SoakResult& r) {
  const ServeStats& st = r.stats;
  const int64_t steps = r.steps + r.drain_steps;
  std::printf("soak: %lld steps + %lld to drain in %.1f s (%.2f ms/step), seed %llu, %s\n",
              static_cast<long long>(r.steps), static_cast<long long>(r.drain_steps), r.seconds,
              steps > 0 ? 1000.0 * r.seconds / double(steps) : 0.0,
              static_cast<unsigned long long>(o.seed), o.device.str().c_str());
  const std::string encoder =
      o.encoder_len > 0
          ? str_cat(", encoder inputs of ", (o.encoder_len + 1) / 2, "..", o.encoder_len, " tokens")
          : std::string();
  std::printf("model        %s%s%s\n", o.model.str().c_str(), encoder.c_str(),
              o.speculative ? ", speculative (a one-layer draft, topk 2, 2 steps)" : "");
  std::printf("scheduler    %lld KV slots, %d requests in flight, %d new tokens per extend\n",
              static_cast<long long>(o.scheduler.kv_slots), o.scheduler.max_running,
              o.scheduler.token_budget);
  std::printf(
      "requests     %lld of %lld finished, %lld tokens generated, %lld prompt tokens "
      "(%.0f%% from the prefix cache)\n",
      static_cast<long long>(st.requests_done), static_cast<long long>(st.requests),
      static_cast<long long>(st.generated_tokens), static_cast<long long>(st.prompt_tokens),
      100.0 * st.prefix_hit_rate());
  std::string passes;
  for (const auto& [mode, m] : st.by_mode)
    passes += str_cat(passes.empty() ? "" : ", ", mode, " ", m.passes);
  std::printf("passes       %s\n", passes.c_str());
  std::printf(
      "KV pool      peak %lld slots, %lld blocks evicted, %lld admission waits, %lld idle "
      "points, %lld flushes to an empty pool\n",
      static_cast<long long>(st.peak_kv_slots), static_cast<long long>(st.evicted_blocks),
      static_cast<long long>(st.admission_waits), static_cast<long long>(r.idle_points),
      static_cast<long long>(r.flushes));
  std::printf("reference    %lld layer outputs checked, worst rel error %.2e, %lld failures\n",
              static_cast<long long>(st.checked), st.worst_rel_error,
              static_cast<long long>(st.check_failures));
  const CpConfig& cp = o.scheduler.cp;
  if (cp.enabled())
    std::printf("context par  %d rank%s, KV %s, states by %s%s; every rank checks its share\n",
                cp.comm->size(), cp.comm->size() == 1 ? "" : "s", cp_layout_str(cp.options).c_str(),
                cp_exchange_str(cp.options).c_str(),
                cp.options.kv_pass == parallel::CpKvPass::ring ? ", new K/V by ring" : "");
  if (r.failure.empty())
    std::printf(
        "invariants   ok after every step: slot ownership, request rows, prefix cache, "
        "finite outputs, reference, pool at idle and at the end\n");
  else
    std::printf("invariants   FAILED at %s\n", r.failure.c_str());
}

}  // namespace

int cmd_soak(int argc, char** argv) {
  // Small by default, so that 100k steps take minutes on a CPU.
  const ModelDefaults small{2, 4, 2, 64, 128};
  std::vector<FlagSpec> flags = {
      {"--device", "auto|cpu|cuda[:N]", "device to run on", "auto"},
      {"--steps", "N", "steps with arrivals (then the run drains)", "10000"},
      {"--seed", "N", "random seed (requests, activations, draft trees)", "1"},
      {"--speculative", "on|off",
       "speculative decoding (a draft model, tree verify; off for a model with cross attention)",
       "on"},
      {"--check-every", "N", "reference checks on every N-th step (0: none)", "4"},
      {"--flush-every", "N", "flush the prefix cache at every N-th idle point", "4"}};
  for (FlagSpec& f : model_flags(small, small, "48")) flags.push_back(std::move(f));
  flags.insert(flags.end(),
               {{"--kv-slots", "N", "KV pool size in tokens", "1024"},
                {"--token-budget", "N", "new prompt and encoder tokens per extend pass", "256"},
                {"--max-running", "N", "requests in flight", "16"},
                {"--quiet", "", "no progress line", ""}});
  for (FlagSpec& f : cp_flags()) flags.push_back(std::move(f));
  Args args(
      argc, argv, 2, "soak",
      "Runs a long random serving workload (bursts of arrivals and quiet spells, shared and\n"
      "nested prefixes, repeated prompts, outputs of 1 to 64 tokens, speculative steps) through\n"
      "the scheduler and FlashKVBackend, and after EVERY step checks: no KV slot leaked or live\n"
      "twice, req_to_token rows match the requests, the prefix cache's bookkeeping, no NaN or\n"
      "Inf in any layer's output, sampled layer outputs against the float64 reference, and\n"
      "whenever every request has finished, that the pool holds only the prefix cache's slots\n"
      "(and nothing once the cache is flushed). After --steps steps the run drains and the pool\n"
      "must end empty. Exit code 1 at the first violation, named with its step.",
      std::move(flags));
  SoakOptions o;
  const int cp_ranks = cp_ranks_from_flags(args);
  o.device = cp_ranks > 0 ? cp_device_from_flags(args, cp_ranks) : args.device();
  o.steps = args.get_int("--steps", 0, 1 << 30, 0);
  o.seed = static_cast<uint64_t>(args.get_int("--seed"));
  o.model = model_from_flags(args, o.device.is_cuda(), small, small);
  o.encoder_len = encoder_len_from_flags(args, o.model, o.device.is_cuda(), small, small);
  const std::string& spec = args.get("--speculative");
  if (spec != "on" && spec != "off")
    args.fail("--speculative expects on or off, got '" + spec + "'");
  // The draft model is decoder-only: a model with cross attention runs without it unless
  // --speculative on asks for it, which is refused.
  // So is one with --cp.
  o.speculative =
      spec == "on" && !((o.model.encoder_decoder || cp_ranks > 0) && !args.given("--speculative"));
  if (o.speculative && o.model.encoder_decoder)
    args.fail(
        "--speculative on: speculative decoding needs a decoder-only model; this one has "
        "cross attention");
  if (o.speculative && cp_ranks > 0)
    args.fail("--speculative on: speculative decoding is not supported with --cp");
  if (cp_ranks > 0 && o.model.encoder_decoder)
    args.fail("--cp: models with cross attention (encoder-decoder) are not supported");
  o.check_every = args.get_int("--check-every", 0, 1 << 30, 0);
  o.flush_every = args.get_int("--flush-every", 1, 1 << 30, 0);
  o.scheduler.kv_slots = args.get_int("--kv-slots", 1, 1 << 30, 0);
  o.scheduler.token_budget = args.get_int("--token-budget", 1, 1 << 24, 0);
  o.scheduler.max_running = args.get_int("--max-running", 1, 1 << 16, 0);
  const int64_t longest = int64_t{o.encoder_len} + SoakWorkload::kMaxPrompt +
                          SoakWorkload::kMaxOutput +
                          (o.speculative ? SpeculativeConfig().draft_tokens() : 0);
  if (o.scheduler.kv_slots < longest)
    args.fail(str_cat("--kv-slots ", o.scheduler.kv_slots, ": the soak's longest request needs ",
                      longest));

  // With --cp every rank runs the same soak; rank 0 prints, a rank that fails stops them all.
  std::unique_ptr<CpSession> session;
  if (cp_ranks > 0) {
    o.scheduler.cp.options = cp_options_from_flags(args, cp_ranks, longest);
    std::string error;
    session = CpSession::start(cp_ranks, o.device, error);
    if (!session) args.fail(error);
    o.scheduler.cp.comm = &session->comm();
    o.device = session->device();  // on GPUs, this rank's
  }
  const bool rank0 = !session || session->rank() == 0;
  const bool group = session && session->size() > 1;
  ProgressLine progress(stderr, isatty(fileno(stderr)) != 0, rank0 && !args.flag("--quiet"));
  SoakResult r;
  try {
    r = run_soak(o, [&](const Progress& p) { progress.update(p); });
  } catch (const std::exception& e) {
    if (!group) throw;
    std::fprintf(stderr, "flashkv soak: rank %d: %s\n", session->rank(), e.what());
    std::fflush(stderr);
    session->abort(1);
  }
  progress.finish();
  if (rank0) print_summary(o, r);
  if (!r.failure.empty()) {
    if (session)
      std::fprintf(stderr, "flashkv soak: rank %d: %s\n", session->rank(), r.failure.c_str());
    else
      std::fprintf(stderr, "flashkv soak: %s\n", r.failure.c_str());
    // The other ranks may be waiting for this one in a collective.
    if (group) {
      std::fflush(stdout);
      std::fflush(stderr);
      session->abort(1);
    }
    return 1;
  }
  return 0;
}

}  // namespace flashkv::app
