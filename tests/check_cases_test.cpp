// The case grids of `flashkv check` (apps/cli/op_cases, backend_cases) run in-process on every
// device the tests see: the attention-sinks cases cover the paths they are meant to, and pass on
// the CPU and, with a GPU visible, on CUDA (the command line tests run the CPU only).
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "backend_cases.h"
#include "flashkv/core/device.h"
#include "op_cases.h"

namespace flashkv::app {
namespace {

std::vector<Device> devices() {
  std::vector<Device> d = {Device::cpu()};
  if (cuda_available()) d.push_back(Device::cuda(0));
  return d;
}

const char* device_name(Device d) { return d.is_cpu() ? "cpu" : "cuda"; }

TEST(CheckCases, SinksOpCasesCoverEveryPathAndPass) {
  for (bool quick : {true, false}) {
    std::set<OpKind> ops;
    bool split_decode = false, window_decode = false, split_prefill = false, cap = false;
    bool empty_kv = false;
    for (const OpCase& c : op_case_grid(quick, 1)) {
      if (!c.sinks) continue;
      ops.insert(c.op);
      split_decode |= c.op == OpKind::decode && c.fixed_split > 0;
      window_decode |= c.op == OpKind::decode && c.window_left >= 0;
      split_prefill |= c.op != OpKind::decode && c.fixed_split > 0;
      cap |= c.soft_cap > 0;
      for (int32_t kv : c.kv_lens) empty_kv |= kv == 0;
      EXPECT_NE(c.describe().find(" sinks"), std::string::npos) << c.describe();
    }
    SCOPED_TRACE(quick ? "quick grid" : "full grid");
    EXPECT_EQ(ops, (std::set<OpKind>{OpKind::decode, OpKind::ragged_prefill, OpKind::paged_prefill,
                                     OpKind::extend}));
    EXPECT_TRUE(split_decode && window_decode && split_prefill && cap && empty_kv);
  }
  for (Device d : devices())
    for (const OpCase& c : op_case_grid(true, 1)) {
      if (!c.sinks) continue;
      const OpResult r = run_op_case(c, d);
      EXPECT_TRUE(r.passed) << device_name(d) << " " << op_name(c.op) << " " << c.describe() << ": "
                            << (r.error.empty() ? r.errors.str() : r.error);
    }
}

TEST(CheckCases, SinksBackendCasesCoverTheModesAndPass) {
  std::set<BackendScenario> modes;
  for (const BackendCase& c : backend_case_grid(true, 1))
    if (c.model.sinks) modes.insert(c.scenario);
  for (BackendScenario s : {BackendScenario::decode, BackendScenario::extend_prefix,
                            BackendScenario::verify, BackendScenario::draft_extend})
    EXPECT_EQ(modes.count(s), 1u) << scenario_name(s);
  for (Device d : devices())
    for (const BackendCase& c : backend_case_grid(true, 1)) {
      if (!c.model.sinks) continue;
      const BackendResult r = run_backend_case(c, d);
      EXPECT_TRUE(r.passed) << device_name(d) << " " << scenario_name(c.scenario) << " "
                            << c.describe() << ": " << r.error;
      EXPECT_GT(r.checked, 0) << scenario_name(c.scenario);
    }
}

}  // namespace
}  // namespace flashkv::app
