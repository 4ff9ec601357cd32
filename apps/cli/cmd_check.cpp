#include <cstdio>
#include <string>

#include "args.h"
#include "backend_cases.h"
#include "commands.h"
#include "op_cases.h"

namespace flashkv::app {

int cmd_check(int argc, char** argv) {
  Args args(argc, argv, 2, "check",
            "Runs every operator, and every FlashKVBackend mode over a small model, on random\n"
            "inputs and compares the outputs with the float64 reference.\n"
            "The last line is 'N passed, M failed'; the exit code is 1 if anything failed.",
            {{"--device", "auto|cpu|cuda[:N]", "device to check", "auto"},
             {"--op", "all|decode|prefill|extend|merge|backend",
              "operators (or backend modes) to check", "all"},
             {"--quick", "", "a small grid (seconds on a CPU)", ""},
             {"--seed", "N", "random seed", "1"}});
  const Device device = args.device();
  const std::string op = args.get("--op");
  if (op != "all" && op != "decode" && op != "prefill" && op != "extend" && op != "merge" &&
      op != "backend")
    args.fail("--op expects all, decode, prefill, extend, merge or backend, got '" + op + "'");
  const bool quick = args.flag("--quick");
  const uint64_t seed = static_cast<uint64_t>(args.get_int("--seed"));
  int passed = 0, failed = 0;
  std::printf("%-22s %-55s %-40s %s\n", "op", "case", "errors (rel, max_abs, lse)", "result");
  for (const OpCase& c : op_case_grid(quick, seed)) {
    const std::string name = op_name(c.op);
    const bool wanted = op == "all" || name == op ||
                        (op == "prefill" && name.find("prefill") != std::string::npos) ||
                        (op == "merge" && c.op == OpKind::merge_states);
    if (!wanted) continue;
    const OpResult r = run_op_case(c, device);
    char errs[64];
    std::snprintf(errs, sizeof errs, "%.2e %.2e %.2e", r.errors.rel, r.errors.max_abs,
                  r.errors.lse);
    std::printf("%-22s %-55s %-40s %s\n", name.c_str(), c.describe().c_str(),
                r.error.empty() ? errs : r.error.substr(0, 40).c_str(), r.passed ? "ok" : "FAILED");
    if (!r.error.empty()) std::printf("    error: %s\n", r.error.c_str());
    (r.passed ? passed : failed)++;
  }
  if (op == "all" || op == "backend") {
    for (const BackendCase& c : backend_case_grid(quick, seed)) {
      const BackendResult r = run_backend_case(c, device);
      const std::string name = std::string("backend ") + scenario_name(c.scenario);
      char summary[64];
      std::snprintf(summary, sizeof summary, "%d outputs, worst rel %.2e", r.checked, r.worst_rel);
      std::printf("%-22s %-55s %-40s %s\n", name.c_str(), c.describe().c_str(),
                  r.error.empty() ? summary : r.error.substr(0, 40).c_str(),
                  r.passed ? "ok" : "FAILED");
      if (!r.error.empty()) std::printf("    error: %s\n", r.error.c_str());
      (r.passed ? passed : failed)++;
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

}  // namespace flashkv::app
