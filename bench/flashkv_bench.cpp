// flashkv_bench: measures the machine's roofline, then runs a named grid of attention cases and
// prints a table (and optionally JSON / CSV).
//   flashkv_bench [--device cpu|cuda|cuda:N] [--grid quick|full] [--op decode|prefill|extend|all]
//                 [--json FILE] [--csv FILE] [--roofline-only]
#include <cstring>
#include <iostream>
#include <string>

#include "attention_bench.h"
#include "flashkv/core/error.h"
#include "report.h"

namespace {

int usage(const char* msg) {
  std::cerr << "flashkv_bench: " << msg
            << "\nusage: flashkv_bench [--device cpu|cuda|cuda:N] [--grid quick|full] "
               "[--op decode|prefill|extend|all] [--json FILE] [--csv FILE] [--roofline-only]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flashkv;
  using namespace flashkv::bench;
  std::string device_name = "cpu", grid = "quick", op = "all", json, csv;
  bool roofline_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string* dst) {
      if (i + 1 >= argc) return false;
      *dst = argv[++i];
      return true;
    };
    bool ok = true;
    if (a == "--device")
      ok = value(&device_name);
    else if (a == "--grid")
      ok = value(&grid);
    else if (a == "--op")
      ok = value(&op);
    else if (a == "--json")
      ok = value(&json);
    else if (a == "--csv")
      ok = value(&csv);
    else if (a == "--roofline-only")
      roofline_only = true;
    else if (a == "--help" || a == "-h")
      return usage("benchmark of the attention operators") * 0;
    else
      return usage(("unknown argument '" + a + "'").c_str());
    if (!ok) return usage(("missing value after " + a).c_str());
  }
  try {
    const Device device = parse_device(device_name);
    std::vector<BenchCase> cases;
    for (const BenchCase& c : bench_grid(grid, device))
      if (op == "all" || parse_op(op) == c.op) cases.push_back(c);
    const Roofline machine = measure_roofline(device);
    print_machine(std::cout, machine);
    BenchReport report;
    report.machine = machine;
    if (!roofline_only) {
      print_table_header(std::cout);
      report = run_cases(cases, machine, BenchOptions{}, [](const CaseResult& r) {
        print_table_row(std::cout, r);
        std::cout.flush();
      });
    }
    if (!json.empty()) write_text_file(json, to_json(report));
    if (!csv.empty()) write_text_file(csv, to_csv(report));
  } catch (const Error& e) {
    std::cerr << "flashkv_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
