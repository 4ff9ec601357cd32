#include <cstdio>
#include <string>

#include "args.h"
#include "commands.h"
#include "op_cases.h"

namespace flashkv::app {

// The device a command runs on: "auto" is CUDA when a GPU is visible, else the CPU.
Device resolve_device(const Args& args) {
  const std::string& s = args.get("--device");
  if (s == "auto") return cuda_available() ? Device::cuda(0) : Device::cpu();
  Device d;
  try {
    d = parse_device(s);
  } catch (const Error&) {
    args.fail("--device expects auto, cpu, cuda or cuda:N, got '" + s + "'");
  }
  if (d.is_cuda() && !cuda_available())
    args.fail(built_with_cuda() ? "--device " + s + ": no GPU is visible"
                                : "--device " + s + ": this flashkv was built without CUDA");
  return d;
}

int cmd_check(int argc, char** argv) {
  Args args(argc, argv, 2, "check",
            "Runs every operator on random inputs and compares it with the float64 reference.\n"
            "The last line is 'N passed, M failed'; the exit code is 1 if anything failed.",
            {{"--device", "auto|cpu|cuda[:N]", "device to check", "auto"},
             {"--op", "all|decode|prefill|extend|merge", "operators to check", "all"},
             {"--quick", "", "a small grid (seconds on a CPU)", ""},
             {"--seed", "N", "random seed", "1"}});
  const Device device = resolve_device(args);
  const std::string op = args.get("--op");
  if (op != "all" && op != "decode" && op != "prefill" && op != "extend" && op != "merge")
    args.fail("--op expects all, decode, prefill, extend or merge, got '" + op + "'");
  int passed = 0, failed = 0;
  std::printf("%-15s %-55s %-40s %s\n", "op", "case", "errors (rel, max_abs, lse)", "result");
  for (const OpCase& c : op_case_grid(args.flag("--quick"), static_cast<uint64_t>(args.get_int("--seed")))) {
    const std::string name = op_name(c.op);
    const bool wanted = op == "all" || name == op || (op == "prefill" && name.find("prefill") != std::string::npos) ||
                        (op == "merge" && c.op == OpKind::merge_states);
    if (!wanted) continue;
    const OpResult r = run_op_case(c, device);
    char errs[64];
    std::snprintf(errs, sizeof errs, "%.2e %.2e %.2e", r.errors.rel, r.errors.max_abs, r.errors.lse);
    std::printf("%-15s %-55s %-40s %s\n", name.c_str(), c.describe().c_str(),
                r.error.empty() ? errs : r.error.substr(0, 40).c_str(), r.passed ? "ok" : "FAILED");
    if (!r.error.empty()) std::printf("    error: %s\n", r.error.c_str());
    (r.passed ? passed : failed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

}  // namespace flashkv::app
