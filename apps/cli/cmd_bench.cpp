// flashkv bench: measures the machine's roofline, then times a grid of attention cases against
// it, printing a table (and writing JSON / CSV / a roofline chart on request). With --cp N, under
// mpirun -np N: the long-context cases on rank 0 alone and sharded across the N ranks.
#include <cstdio>
#include <exception>
#include <iostream>
#include <memory>

#include "args.h"
#include "attention_bench.h"
#include "commands.h"
#include "cp_session.h"
#include "json.h"
#include "model_flags.h"
#include "model_presets.h"
#include "report.h"
#include "roofline_svg.h"

namespace flashkv::app {
namespace {

// bench --cp N: the context-parallel grid on every rank of the group (rank 0 prints and writes).
int bench_cp(const Args& args, int ranks, const std::string& op, const std::string& grid,
             const bench::BenchOptions& timing, const bench::RooflineOptions& roof) {
  Device device = cp_device_from_flags(args, ranks);
  if (op != "all" && op != "decode" && op != "extend")
    args.fail(str_cat("--op ", op, ": --cp times decode and extend (--op all, decode or extend)"));
  for (const char* flag : {"--model", "--csv", "--plot"})
    if (args.given(flag)) args.fail(str_cat(flag, " is not supported with --cp (--json is)"));
  args.require_writable("--json");
  std::vector<bench::BenchCase> cases;
  for (const bench::BenchCase& c : bench::cp_grid(grid, device))
    if (op == "all" || bench::parse_op(op) == c.op) cases.push_back(c);
  cp_options_from_flags(args, ranks, 1);  // refuses bad --cp-* flags before the group starts
  // Rank 0 measures the roofline and times each one-rank case alone while the others wait, which
  // takes minutes at the full sizes: no timeout on the collectives. A rank that fails stops the
  // group itself (abort below).
  parallel::CommOptions comm_options;
  comm_options.timeout_s = 0;
  std::string error;
  std::unique_ptr<CpSession> session = CpSession::start(ranks, device, error, comm_options);
  if (!session) args.fail(error);
  device = session->device();  // on GPUs, this rank's
  for (bench::BenchCase& c : cases) c.device = device;
  const bool rank0 = session->rank() == 0;
  bench::BenchReport report;
  report.cp.ranks = session->size();
  report.cp.communicator = session->comm().name();
  try {
    if (rank0) {
      report.machine = bench::measure_roofline(device, roof);
      bench::print_machine(std::cout, report.machine);
    } else {
      report.machine.device = device;  // the figures are rank 0's, which alone reports
    }
    session->comm().barrier();
    if (!args.flag("--roofline-only")) {
      if (rank0) bench::print_cp_header(std::cout, session->size(), session->comm().name());
      for (const bench::BenchCase& c : cases) {
        // --cp-block auto splits this case's sharded KV (the whole KV of decode, the prefix of
        // extend) evenly.
        const int64_t sharded = c.op == bench::BenchOp::decode ? c.kv_len : c.prefix_len();
        const parallel::CpOptions options = cp_options_from_flags(args, ranks, sharded);
        report.cp.cases.push_back(
            bench::run_cp_case(c, session->comm(), options, report.machine, timing));
        if (rank0) {
          bench::print_cp_case(std::cout, report.cp.cases.back());
          std::cout.flush();
        }
      }
    }
  } catch (const std::exception& e) {
    if (session->size() == 1) throw;
    // The other ranks would wait for this one in their next collective: stop them all.
    std::fprintf(stderr, "flashkv bench: rank %d: %s\n", session->rank(), e.what());
    std::fflush(stderr);
    session->abort(1);
  }
  if (rank0 && !args.get("--json").empty())
    write_text_file(args.get("--json"), bench::to_json(report));
  return 0;
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  std::vector<FlagSpec> flags = {
      {"--device", "auto|cpu|cuda[:N]", "device to benchmark", "auto"},
      {"--op", "all|decode|prefill|extend|verify", "operators to time", "all"},
      {"--grid", "quick|full",
       "case grid: quick (seconds on a CPU) or full (the performance targets)", "quick"},
      {"--model", "NAME|list",
       "time a published model's decode and extend cases (its heads, head dim, window, soft "
       "cap) at --grid's sizes instead of the grid (list: the presets and their sources)",
       ""},
      {"--json", "FILE", "write the machine and every case as JSON", ""},
      {"--csv", "FILE", "write every case as CSV", ""},
      {"--plot", "FILE.svg", "write a roofline chart (SVG)", ""},
      {"--roofline-only", "", "measure the machine only", ""},
      {"--ab", "NAME=VALUE",
       "time each case in alternating rounds with a twin run under the switch NAME=VALUE (a "
       "FLASHKV_* variable), and print the twin's time ratio and its spread",
       ""},
      {"--min-seconds", "S", "time each case for at least this long (at least 5 runs)", "0.25"},
      {"--roofline-mb", "N", "MiB the bandwidth loops stream (auto: CPU 8x LLC, GPU 2 GiB)",
       "auto"}};
  for (FlagSpec& f : cp_flags()) flags.push_back(std::move(f));
  Args args(
      argc, argv, 2, "bench",
      "Measures the machine's memory bandwidth and matrix rate, then times each attention case\n"
      "of a grid and reports its time, GB/s, TFLOP/s and fraction of the bound that applies\n"
      "(bandwidth for decode, matrix rate for prefill and extend, the roofline at its\n"
      "intensity for verify), then the planner's host time for prefill and extend batches of\n"
      "256 requests.\n"
      "With --cp N (under mpirun -np N; --device cuda: a GPU a rank, through NCCL): one long\n"
      "request's decode and extend on rank 0 alone, then sharded across the N ranks, with the\n"
      "speed-up and where each rank's time goes (local attention, communication, merge);\n"
      "--grid quick: 1 x 16384 tokens, full: 1 x 262144 and 1 x 1048576 decode, extend on a\n"
      "262144-token prefix.",
      std::move(flags));
  const int cp_ranks = cp_ranks_from_flags(args);
  const std::string& op = args.get("--op");
  if (op != "all" && op != "decode" && op != "prefill" && op != "extend" && op != "verify")
    args.fail("--op expects all, decode, prefill, extend or verify, got '" + op + "'");
  const std::string& grid = args.get("--grid");
  if (grid != "quick" && grid != "full")
    args.fail("--grid expects quick or full, got '" + grid + "'");
  bench::BenchOptions timing;
  timing.min_seconds = args.get_double("--min-seconds", 0, 3600);
  bench::RooflineOptions roof;
  roof.buffer_bytes = size_t(args.get_int("--roofline-mb", 1, 1 << 16, 0)) << 20;
  if (cp_ranks > 0) {
    if (args.given("--ab")) args.fail("--ab is not supported with --cp");
    return bench_cp(args, cp_ranks, op, grid, timing, roof);
  }
  for (const char* flag : {"--json", "--csv", "--plot"}) args.require_writable(flag);

  const Device device = args.device();
  const ModelPreset* preset = preset_from_flags(args);
  std::vector<bench::BenchCase> grid_cases;
  if (preset) {
    const ModelConfig m = preset->config();
    const std::string reason = model_unsupported_reason(m, device.is_cuda());
    if (!reason.empty()) args.fail(str_cat("--model ", preset->name, ": ", reason));
    bench::ModelShape shape;
    shape.num_qo_heads = m.num_qo_heads;
    shape.num_kv_heads = m.num_kv_heads;
    shape.head_dim = m.head_dim;
    shape.logit_cap = m.logit_cap;
    shape.sinks = m.sinks;
    for (int l = 0; l < m.num_layers; ++l)
      (m.windowed(l) ? shape.has_window : shape.has_full) = true;
    shape.window_left = m.sliding_window;
    grid_cases = bench::model_grid(grid, device, shape);
  } else {
    grid_cases = bench::bench_grid(grid, device);
  }
  std::vector<bench::BenchCase> cases;
  for (const bench::BenchCase& c : grid_cases)
    if (op == "all" || bench::parse_op(op) == c.op) cases.push_back(c);
  if (args.given("--ab")) {
    try {
      cases = bench::switch_twins(cases, args.get("--ab"));
    } catch (const Error& e) {
      args.fail(str_cat("--ab: ", e.what()));
    }
  }
  bench::BenchReport report;
  report.machine = bench::measure_roofline(device, roof);
  bench::print_machine(std::cout, report.machine);
  if (preset)
    std::cout << "model: " << preset->name << " (" << preset->model_id << "): " << preset->shape()
              << (preset->encoder_decoder
                      ? "; its self-attention shape (cross attention is not a bench operator)"
                      : "")
              << "\n";
  if (!args.flag("--roofline-only")) {
    bench::print_table_header(std::cout);
    const bench::Roofline machine = report.machine;
    report = bench::run_cases(cases, machine, timing, [](const bench::CaseResult& r) {
      bench::print_table_row(std::cout, r);
      std::cout.flush();
    });
    // The grid's planner lines (not with --model: they are Llama-3-8B batches), for the ops
    // that plan with plan_prefill on the host per batch.
    std::vector<bench::PlanKind> kinds;
    if (op == "all" || op == "prefill") kinds.push_back(bench::PlanKind::prefill);
    if (op == "all" || op == "extend") {
      kinds.push_back(bench::PlanKind::extend);
      kinds.push_back(bench::PlanKind::extend_ragged);
    }
    if (!preset && !kinds.empty())
      report.plans = bench::run_plan_grid(grid, device, kinds, [](const bench::PlanResult& r) {
        bench::print_plan_row(std::cout, r);
        std::cout.flush();
      });
  }
  if (!args.get("--json").empty()) write_text_file(args.get("--json"), bench::to_json(report));
  if (!args.get("--csv").empty()) write_text_file(args.get("--csv"), bench::to_csv(report));
  if (!args.get("--plot").empty()) write_text_file(args.get("--plot"), roofline_svg(report));
  return 0;
}

}  // namespace flashkv::app
