// flashkv bench: measures the machine's roofline, then times a grid of attention cases against
// it, printing a table (and writing JSON / CSV / a roofline chart on request).
#include <iostream>

#include "args.h"
#include "attention_bench.h"
#include "commands.h"
#include "json.h"
#include "model_flags.h"
#include "model_presets.h"
#include "report.h"
#include "roofline_svg.h"

namespace flashkv::app {

int cmd_bench(int argc, char** argv) {
  Args args(
      argc, argv, 2, "bench",
      "Measures the machine's memory bandwidth and matrix rate, then times each attention case\n"
      "of a grid and reports its time, GB/s, TFLOP/s and fraction of the bound that applies\n"
      "(bandwidth for decode, matrix rate for prefill and extend, the roofline at its\n"
      "intensity for verify), then the planner's host time for prefill and extend batches of\n"
      "256 requests.",
      {{"--device", "auto|cpu|cuda[:N]", "device to benchmark", "auto"},
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
       {"--min-seconds", "S", "time each case for at least this long (at least 5 runs)", "0.25"},
       {"--roofline-mb", "N", "MiB the bandwidth loops stream (auto: CPU 8x LLC, GPU 2 GiB)",
        "auto"}});
  const Device device = args.device();
  const std::string& op = args.get("--op");
  if (op != "all" && op != "decode" && op != "prefill" && op != "extend" && op != "verify")
    args.fail("--op expects all, decode, prefill, extend or verify, got '" + op + "'");
  const std::string& grid = args.get("--grid");
  if (grid != "quick" && grid != "full")
    args.fail("--grid expects quick or full, got '" + grid + "'");
  for (const char* flag : {"--json", "--csv", "--plot"}) args.require_writable(flag);
  bench::BenchOptions timing;
  timing.min_seconds = args.get_double("--min-seconds", 0, 3600);
  bench::RooflineOptions roof;
  roof.buffer_bytes = size_t(args.get_int("--roofline-mb", 1, 1 << 16, 0)) << 20;

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
    if (op == "all" || op == "extend") kinds.push_back(bench::PlanKind::extend);
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
