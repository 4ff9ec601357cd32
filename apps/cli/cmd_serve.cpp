// flashkv serve: runs a serving workload through FlashKVBackend (scheduler.h says how) and
// reports throughput, attention time per pass, prefix-cache reuse, KV use and, with --check,
// how many sampled layer outputs matched the float64 reference.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>
#include <string>

#include "args.h"
#include "commands.h"
#include "cp_session.h"
#include "flashkv/core/thread_pool.h"
#include "flashkv/parallel/host_collectives.h"
#include "json.h"
#include "model_flags.h"
#include "scheduler.h"
#include "serve_report.h"
#include "workload.h"

namespace flashkv::app {

namespace {

// The KV pool when --kv-slots is auto: room for three quarters of the running-request cap at
// the workload's average length (prefix sharing makes the rest fit), and at least twice the
// longest request; at most what fits the memory budget.
int64_t auto_kv_slots(const Workload& w, int max_running, int64_t max_slots) {
  int64_t total = 0, longest = 0;
  for (const RequestSpec& r : w.requests) {
    const int64_t need = Scheduler::slots_needed(r, w.spec);
    total += need;
    longest = std::max(longest, need);
  }
  const int64_t average = total / static_cast<int64_t>(w.requests.size());
  int64_t slots = std::max(2 * longest, int64_t{max_running} * average * 3 / 4);
  slots = (slots + 255) / 256 * 256;
  return std::min(slots, std::max(max_slots, longest));
}

// After a run with --cp: every rank's figures to every rank (each rank checked its own share and
// its own outputs). A rank other than 0 prints its failures itself; rank 0's report counts them,
// and every rank exits with the same status.
void gather_cp_results(CpSession& session, const parallel::CpOptions& o, const Scheduler& s,
                       ServeStats& stats, ServeSetup::CpReport& report) {
  constexpr int kFields = 5;
  const int64_t mine[kFields] = {stats.checked, stats.check_failures,
                                 static_cast<int64_t>(stats.invariant_failures.size()),
                                 stats.nonfinite_passes, s.rank_share()->peak_slots()};
  std::vector<int64_t> all(static_cast<size_t>(kFields) * session.size());
  parallel::all_gather_host(session.comm(), mine, sizeof mine, all.data());
  const int me = session.rank();
  if (me != 0) {
    if (!stats.first_failure.empty())
      std::fprintf(stderr, "flashkv serve: rank %d: check failed: %s\n", me,
                   stats.first_failure.c_str());
    for (const std::string& f : stats.invariant_failures)
      std::fprintf(stderr, "flashkv serve: rank %d: invariant failed: %s\n", me, f.c_str());
  }
  report.ranks = session.size();
  report.layout = cp_layout_str(o);
  report.exchange = cp_exchange_str(o);
  report.kv_pass = cp_kv_pass_str(o);
  report.checked.clear();
  report.peak_slots.clear();
  for (int r = 0; r < session.size(); ++r) {
    const int64_t* f = all.data() + static_cast<size_t>(r) * kFields;
    report.checked.push_back(f[0]);
    report.peak_slots.push_back(f[4]);
    if (r == me) continue;
    stats.check_failures += f[1];
    if (f[2] > 0 || f[3] > 0)
      stats.invariant_failures.push_back(
          str_cat("rank ", r, ": ", f[2], " invariants failed, ", f[3],
                  " passes with NaN or Inf (that rank printed them)"));
  }
}

}  // namespace

int cmd_serve(int argc, char** argv) {
  const ModelDefaults cpu_model{4, 8, 2, 64, 256}, gpu_model{32, 32, 8, 128, 512};
  std::vector<FlagSpec> flags = {
      {"--device", "auto|cpu|cuda[:N]", "device to serve on", "auto"},
      {"--workload", "chat|long|spec|FILE", "built-in workload or a workload file (JSON)", "chat"},
      {"--requests", "N", "number of requests (auto: the workload's own count)", "auto"},
      {"--check", "", "compare sampled layer outputs with the float64 reference", ""},
      {"--json", "FILE", "write the report's figures as JSON", ""},
      {"--save-workload", "FILE", "write the workload as a file that reads back identically", ""},
      {"--seed", "N", "random seed (workload, activations, draft trees)", "1"}};
  for (FlagSpec& f : model_flags(cpu_model, gpu_model, "-1")) flags.push_back(std::move(f));
  flags.insert(flags.end(),
               {{"--kv-slots", "N", "KV pool size in tokens (auto: from the workload)", "auto"},
                {"--token-budget", "N",
                 "new prompt and encoder tokens per extend pass (auto: 512 / 8192)", "auto"},
                {"--max-running", "N", "requests in flight (auto: 16 / 256)", "auto"},
                {"--quiet", "", "no progress line", ""}});
  for (FlagSpec& f : cp_flags()) flags.push_back(std::move(f));
  Args args(
      argc, argv, 2, "serve",
      "Serves a workload through FlashKVBackend: requests arrive over time with shared prompt\n"
      "prefixes (a prefix cache reuses their KV), a continuous-batching scheduler runs extend\n"
      "and decode passes over a stack of attention layers fed random activations, and each\n"
      "request generates tokens until its output length. Sizes default to a small model on a\n"
      "CPU and a Llama-3-8B-shaped one on a GPU. Exit code 1 when a check or an end-of-run\n"
      "invariant fails.",
      std::move(flags));
  const int cp_ranks = cp_ranks_from_flags(args);
  Device device = cp_ranks > 0 ? cp_device_from_flags(args, cp_ranks) : args.device();
  const bool gpu = device.is_cuda();
  const uint64_t seed = static_cast<uint64_t>(args.get_int("--seed"));
  args.require_writable("--json");
  args.require_writable("--save-workload");

  const ModelConfig model = model_from_flags(args, gpu, cpu_model, gpu_model);
  const int32_t encoder_len = encoder_len_from_flags(args, model, gpu, cpu_model, gpu_model);

  const std::string& which = args.get("--workload");
  const int requests = args.get_int("--requests", 1, kMaxWorkloadRequests, 0);
  Workload workload;
  try {
    workload = is_builtin_workload(which) ? builtin_workload(which, requests, gpu, seed)
                                          : load_workload_file(which, requests, seed);
  } catch (const Error& e) {
    // A name that is neither built in nor a file reads "--workload chta: cannot read (no such
    // file)".
    args.fail(str_cat("--workload ", e.what()));
  }
  if (cp_ranks > 0 && workload.spec.enabled)
    args.fail(str_cat("--workload ", which, ": speculative decoding is not supported with --cp"));
  if (cp_ranks > 0 && model.encoder_decoder)
    args.fail("--cp: models with cross attention (encoder-decoder) are not supported");
  if (model.encoder_decoder) {
    if (workload.spec.enabled)
      args.fail(str_cat("--workload ", which, ": speculative decoding needs a decoder-only model; ",
                        "this one has cross attention"));
    draw_encoder_lens(workload, encoder_len, seed);
  }

  parallel::CpOptions cp_options;
  if (cp_ranks > 0) {
    int64_t longest = 1;
    for (const RequestSpec& r : workload.requests)
      longest = std::max(longest, Scheduler::slots_needed(r, workload.spec));
    cp_options = cp_options_from_flags(args, cp_ranks, longest);
  }
  // Every rank runs the same workload with the same seed; rank 0 writes the files and the report.
  std::unique_ptr<CpSession> session;
  if (cp_ranks > 0) {
    std::string error;
    session = CpSession::start(cp_ranks, device, error);
    if (!session) args.fail(error);
    device = session->device();  // on GPUs, this rank's
  }
  const bool rank0 = !session || session->rank() == 0;

  // Saved before the run, so that a run that fails can be replayed from it.
  if (rank0 && !args.get("--save-workload").empty())
    write_text_file(args.get("--save-workload"), workload_to_json(workload));

  SchedulerOptions so;
  so.seed = seed;
  so.token_budget = args.get_int("--token-budget", 1, 1 << 24, gpu ? 8192 : 512);
  so.max_running = args.get_int("--max-running", 1, 1 << 16, gpu ? 256 : 16);
  so.check.enabled = args.flag("--check");
  if (session) {
    so.cp.comm = &session->comm();
    so.cp.options = cp_options;
  }
  // The pool may use half the GPU's memory, or 2 GiB of host memory.
  const int64_t slot_bytes = int64_t{model.num_layers + (workload.spec.enabled ? 1 : 0)} * 2 *
                             model.num_kv_heads * model.head_dim *
                             static_cast<int64_t>(dtype_size(model.kv_dtype));
  const int64_t budget =
      gpu ? static_cast<int64_t>(device_info(device).memory_bytes / 2) : (int64_t{2} << 30);
  const int64_t max_slots = std::max<int64_t>(budget / slot_bytes, 256);
  so.kv_slots = args.get("--kv-slots") == "auto"
                    ? auto_kv_slots(workload, so.max_running, max_slots)
                    : args.get_int("--kv-slots", 1, std::numeric_limits<int>::max() - 4096, 0);
  for (size_t i = 0; i < workload.requests.size(); ++i) {
    const int64_t need = Scheduler::slots_needed(workload.requests[i], workload.spec);
    if (need > so.kv_slots)
      args.fail(str_cat("request ", i, " of workload ", workload.name, " needs ", need,
                        " KV slots, more than the pool's ", so.kv_slots, " (--kv-slots)"));
  }

  ServeSetup setup;
  setup.workload = workload.name;
  setup.device = device.str();
  setup.threads_or_sms = gpu ? device_info(device).num_sms : ThreadPool::global().size();
  setup.model = model;
  setup.scheduler = so;
  setup.spec = workload.spec;
  setup.prompt_tokens = workload.prompt_tokens();
  setup.output_tokens = workload.output_tokens();
  setup.encoder_len = encoder_len;
  setup.encoder_tokens = workload.encoder_tokens();
  setup.num_prefixes = workload.num_prefixes;

  ProgressLine progress(stderr, isatty(fileno(stderr)) != 0, rank0 && !args.flag("--quiet"));
  ServeStats stats;
  try {
    Scheduler scheduler(workload, model, device, so);
    stats = scheduler.run([&](const Progress& p) { progress.update(p); });
    progress.finish();
    if (session) gather_cp_results(*session, cp_options, scheduler, stats, setup.cp);
  } catch (const std::exception& e) {
    if (!session || session->size() == 1) throw;
    // The other ranks would wait for this one in their next collective: stop them all.
    std::fprintf(stderr, "flashkv serve: rank %d: %s\n", session->rank(), e.what());
    std::fflush(stderr);
    session->abort(1);
  }
  if (rank0) {
    print_serve_report(std::cout, setup, stats);
    if (!args.get("--json").empty()) write_text_file(args.get("--json"), serve_json(setup, stats));
  }
  return stats.check_failures == 0 && stats.invariant_failures.empty() ? 0 : 1;
}

}  // namespace flashkv::app
