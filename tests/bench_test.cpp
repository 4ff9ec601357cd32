// The benchmark harness: a tiny CPU run produces every field of the JSON contract with sane
// values (no timing assertions), the roofline loops run on every ISA this CPU has, the work
// counts follow the masks, and the full grids hold the rows the performance issues ask for.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "attention_bench.h"
#include "flashkv/core/error.h"
#include "flashkv/core/thread_pool.h"
#include "flashkv/parallel/communicator.h"
#include "flashkv/parallel/context_parallel.h"
#include "json.h"
#include "report.h"
#include "roofline.h"
#include "roofline_svg.h"
#include "test_util.h"

namespace flashkv::bench {
namespace {

// A fast roofline: a small buffer (cache bandwidth, not DRAM) and short matrix rounds.
RooflineOptions quick_roofline() {
  RooflineOptions o;
  o.buffer_bytes = size_t{8} << 20;
  o.repeats = 2;
  o.matmul_seconds = 0.01;
  return o;
}

BenchOptions quick_timing() {
  BenchOptions o;
  o.warmup = 1;
  o.min_runs = 2;
  o.max_runs = 2;
  o.min_seconds = 0;
  return o;
}

// The number after `"key": ` in the text starting at `from`; NaN when the key is absent.
double json_number_after(const std::string& json, const std::string& key, size_t from = 0) {
  const std::string needle = "\"" + key + "\": ";
  const size_t at = json.find(needle, from);
  if (at == std::string::npos) return std::nan("");
  return std::strtod(json.c_str() + at + needle.size(), nullptr);
}

TEST(Bench, RooflineRunsEveryAvailableMatrixLoop) {
  const Roofline r = measure_roofline(Device::cpu(), quick_roofline());
  EXPECT_GT(r.read_gbps, 0);
  EXPECT_GT(r.copy_gbps, 0);
  EXPECT_GT(r.matmul_gflops, 0);
  EXPECT_FALSE(r.matmul_kind.empty());
  EXPECT_EQ(r.cores_or_sms, ThreadPool::global().size());
  EXPECT_EQ(r.buffer_bytes, size_t{8} << 20);
  // Each loop checks its own product before it is timed, so running them is the test.
  for (const char* isa : {"avx512bf16", "avx2", "portable"}) {
    RooflineOptions o = quick_roofline();
    o.cpu_matmul = isa;
    try {
      const Roofline ri = measure_roofline(Device::cpu(), o);
      EXPECT_GT(ri.matmul_gflops, 0) << isa;
    } catch (const Error& e) {  // only acceptable when the CPU lacks the ISA
      EXPECT_NE(std::string(e.what()).find("this CPU has no"), std::string::npos) << e.what();
    }
  }
  RooflineOptions bad = quick_roofline();
  bad.cpu_matmul = "sse9";
  EXPECT_THROW(measure_roofline(Device::cpu(), bad), Error);
}

// On a GPU the machine's matrix rate is the fastest single cuBLAS GEMM, and the same GEMM back to
// back for gemm_sustain_seconds gives the sustained rate (0: not measured; out of range: an error).
TEST(Bench, CudaRooflineMeasuresTheSustainedGemm) {
  FLASHKV_REQUIRE_GPU();
  RooflineOptions o;
  o.buffer_bytes = size_t{8} << 20;
  o.repeats = 2;
  o.gemm_n = 1024;
  o.gemm_sustain_seconds = 0.02;
  const Roofline r = measure_roofline(Device::cuda(0), o);
  EXPECT_GT(r.matmul_gflops, 0);
  EXPECT_GT(r.matmul_sustained_gflops, 0);
  EXPECT_TRUE(std::isfinite(r.matmul_sustained_gflops));
  o.gemm_sustain_seconds = 0;
  EXPECT_EQ(measure_roofline(Device::cuda(0), o).matmul_sustained_gflops, 0);
  o.gemm_sustain_seconds = -1;
  EXPECT_THROW(measure_roofline(Device::cuda(0), o), Error);
}

TEST(Bench, TinyCpuRunFillsTheJsonContract) {
  const Roofline machine = measure_roofline(Device::cpu(), quick_roofline());
  const std::vector<BenchCase> grid = bench_grid("quick", Device::cpu());
  ASSERT_EQ(grid.size(), 3u);
  const BenchReport report = run_cases(grid, machine, quick_timing());
  ASSERT_EQ(report.cases.size(), grid.size());
  const std::string json = to_json(report);
  for (const char* key : {"read_gbps", "copy_gbps", "matmul_gflops", "cores", "buffer_bytes"})
    EXPECT_GT(json_number_after(json, key), 0) << key << " in\n" << json;
  EXPECT_EQ(json_number_after(json, "matmul_sustained_gflops"), 0) << json;  // a GPU's only
  EXPECT_NE(json.find("\"device\": \"cpu\""), std::string::npos);
  EXPECT_NE(json.find("\"sms\": 0"), std::string::npos);
  size_t at = json.find("\"cases\"");
  ASSERT_NE(at, std::string::npos);
  for (const char* op : {"decode", "prefill", "extend"}) {
    at = json.find(std::string("{\"op\": \"") + op + "\"", at);
    ASSERT_NE(at, std::string::npos) << op << " case missing in\n" << json;
    EXPECT_EQ(json.find("\"device\": \"cpu\"", at), json.find("\"device\"", at));
    for (const char* key : {"batch", "qo_len", "kv_len", "num_qo_heads", "num_kv_heads", "head_dim",
                            "page_size", "us", "gbps", "tflops", "roofline_fraction", "runs"})
      EXPECT_GT(json_number_after(json, key, at), 0) << op << ": " << key;
    EXPECT_GE(json_number_after(json, "prefix_len", at), 0) << op;
    EXPECT_NE(json.find("\"dtype\": \"bf16\"", at), std::string::npos);
    EXPECT_NE(json.find("\"kv_dtype\": \"bf16\"", at), std::string::npos);
    // The quick grid's paged pools are shuffled; prefill reads none.
    const std::string layout = std::string(op) == "prefill" ? "none" : "shuffled";
    EXPECT_EQ(json.find("\"kv_layout\": \"" + layout + "\"", at), json.find("\"kv_layout\"", at))
        << op;
  }
  // The JSON figures are the report's, and they follow from time and work.
  const CaseResult& dec = report.cases[0];
  EXPECT_NEAR(dec.gbps, case_bytes(dec.c) / dec.us / 1e3, 1e-9 * dec.gbps);
  EXPECT_NEAR(dec.roofline_fraction, dec.gbps / machine.read_gbps, 1e-12);
  const CaseResult& ext = report.cases[2];
  EXPECT_NEAR(ext.roofline_fraction, ext.tflops * 1e3 / machine.matmul_gflops, 1e-12);
  // CSV: a header and one line per case.
  const std::string csv = to_csv(report);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 4);
  EXPECT_EQ(csv.rfind("op,device,batch,qo_len,kv_len,prefix_len,", 0), 0u);
}

// sustained_fraction: roofline_fraction's bound with the GEMM timed back to back in place of the
// single one (prefill, extend, verify); 0 for decode and where no sustained rate was measured.
TEST(Bench, SustainedFractionDividesByTheSustainedGemm) {
  Roofline machine;
  machine.read_gbps = 100;
  machine.matmul_gflops = 1000;
  machine.matmul_sustained_gflops = 800;
  const auto rates = [&](const BenchCase& c, double scale = 1) {
    CaseResult r;
    r.c = c;
    r.us = 50;
    set_rates(r, machine, scale);
    return r;
  };
  const CaseResult pre = rates(prefill_case(1, 96, Device::cpu(), 4, 2, 64));
  EXPECT_NEAR(pre.roofline_fraction, pre.tflops * 1e3 / 1000, 1e-12);
  EXPECT_NEAR(pre.sustained_fraction, pre.tflops * 1e3 / 800, 1e-12);
  const CaseResult ext = rates(extend_case(2, 64, 33, Device::cpu(), 4, 2, 64), 2);
  EXPECT_NEAR(ext.sustained_fraction, ext.tflops * 1e3 / 1600, 1e-12);  // of 2 x the machine
  const CaseResult ver = rates(verify_case(3, 45, 8, Device::cpu(), 4, 2, 64));
  EXPECT_DOUBLE_EQ(ver.sustained_fraction,
                   std::max(ver.gbps / machine.read_gbps, ver.tflops * 1e3 / 800));
  EXPECT_EQ(rates(decode_case(2, 300, Device::cpu(), 4, 2, 64)).sustained_fraction, 0);
  machine.matmul_sustained_gflops = 0;  // not measured (a CPU)
  const CaseResult cpu = rates(prefill_case(1, 96, Device::cpu(), 4, 2, 64));
  EXPECT_EQ(cpu.sustained_fraction, 0);
  EXPECT_GT(cpu.roofline_fraction, 0);
  // The outputs carry it: a column of the table ("-" when 0), a JSON key, a CSV column.
  BenchReport report;
  report.machine = machine;
  report.cases = {cpu, pre};
  std::ostringstream table;
  print_table(table, report);
  EXPECT_NE(table.str().find(" sust"), std::string::npos) << table.str();
  EXPECT_NE(table.str().find("%      -\n"), std::string::npos) << table.str();
  char pre_sust[16];
  std::snprintf(pre_sust, sizeof pre_sust, "%5.1f%%\n", 100 * pre.sustained_fraction);
  EXPECT_NE(table.str().find(pre_sust), std::string::npos) << table.str();
  const std::string json = to_json(report);
  const size_t second = json.find("{\"op\"", json.find("{\"op\"") + 1);
  EXPECT_NEAR(json_number_after(json, "sustained_fraction", second), pre.sustained_fraction, 1e-6);
  const std::string csv = to_csv(report);
  EXPECT_NE(csv.find(",roofline_fraction,sustained_fraction,runs,"), std::string::npos) << csv;
  // The plot draws the sustained ceiling (dashed) where one was measured, and names it.
  EXPECT_EQ(app::roofline_svg(report).find("stroke-dasharray"), std::string::npos);
  report.machine.matmul_sustained_gflops = 800;
  const std::string svg = app::roofline_svg(report);
  EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos);
  EXPECT_NE(svg.find("matmul sustained 800 GFLOP/s"), std::string::npos);
  EXPECT_NE(svg.find("% of the sustained one"), std::string::npos);
}

TEST(Bench, WorkCountsFollowTheIssueFormulas) {
  // Extend 4 x (3072 cached + 1024 new), 32/8/128 bf16: 4 * Hq * D * (n * p + n (n + 1) / 2).
  const BenchCase e = extend_case(4, 3072, 1024, Device::cpu());
  EXPECT_EQ(e.prefix_len(), 3072);
  EXPECT_DOUBLE_EQ(case_flops(e), 4.0 * 4 * 32 * 128 * (1024.0 * 3072 + 1024.0 * 1025 / 2));
  // Decode 16 x 4096: K and V of every token (2 * 8 * 128 * 2 bytes) plus Q and O.
  const BenchCase d = decode_case(16, 4096, Device::cpu());
  EXPECT_DOUBLE_EQ(case_bytes(d), 16.0 * 4096 * 2 * 8 * 128 * 2 + 2.0 * 16 * 32 * 128 * 2);
  EXPECT_DOUBLE_EQ(case_flops(d), 16.0 * 4 * 32 * 128 * 4096);
  // fp8 KV halves the KV bytes.
  const BenchCase d8 = decode_case(16, 4096, Device::cpu(), 32, 8, 128, DType::fp8_e4m3);
  EXPECT_DOUBLE_EQ(case_bytes(d8), 16.0 * 4096 * 2 * 8 * 128 + 2.0 * 16 * 32 * 128 * 2);
}

TEST(Bench, FullCpuGridTimesDecodeOnInOrderAndShuffledSlots) {
  const std::vector<BenchCase> grid = bench_grid("full", Device::cpu());
  int in_order = 0, shuffled = 0;
  for (const BenchCase& c : grid) {
    if (c.op != BenchOp::decode) continue;
    EXPECT_EQ(c.batch, 16);
    EXPECT_EQ(c.kv_len, 4096);
    EXPECT_EQ(c.page_size, 1);
    (c.kv_layout == KvLayout::in_order ? in_order : shuffled)++;
  }
  EXPECT_EQ(in_order, 1);
  EXPECT_EQ(shuffled, 1);
  const BenchCase d = decode_case(2, 64, Device::cpu(), 4, 2, 64, DType::bf16, KvLayout::in_order);
  EXPECT_STREQ(d.layout_name(), "in_order");
  EXPECT_NE(d.str().find(" in_order "), std::string::npos) << d.str();
  EXPECT_STREQ(prefill_case(1, 64, Device::cpu()).layout_name(), "none");
  EXPECT_STREQ(extend_case(1, 64, 8, Device::cpu()).layout_name(), "shuffled");
}

TEST(Bench, InOrderDecodeRunsAndReportsItsLayout) {
  const Roofline machine = measure_roofline(Device::cpu(), quick_roofline());
  const BenchCase d = decode_case(2, 300, Device::cpu(), 4, 2, 64, DType::bf16, KvLayout::in_order);
  const BenchReport report = run_cases({d}, machine, quick_timing());
  ASSERT_EQ(report.cases.size(), 1u);
  EXPECT_GT(report.cases[0].gbps, 0);
  EXPECT_NE(to_json(report).find("\"kv_layout\": \"in_order\""), std::string::npos);
  const std::string csv = to_csv(report);
  EXPECT_NE(csv.find(",kv_layout,"), std::string::npos);
  EXPECT_NE(csv.find(",in_order,"), std::string::npos) << csv;
}

TEST(Bench, PairedCasesAreTimedInAlternatingRoundsAndReportTheirRatio) {
  // A case and its twin with sinks (as bench --model makes them): seven rounds, each timing both.
  const Roofline machine = measure_roofline(Device::cpu(), quick_roofline());
  const BenchCase plain = decode_case(2, 130, Device::cpu(), 8, 2, 64);
  BenchCase twin = plain;
  twin.sinks = twin.paired = true;
  std::vector<const CaseResult*> seen;
  const BenchReport report = run_cases({plain, twin, plain}, machine, quick_timing(),
                                       [&](const CaseResult& r) { seen.push_back(&r); });
  ASSERT_EQ(report.cases.size(), 3u);
  EXPECT_EQ(seen.size(), 3u);  // each result as it is made, the pair's two included
  const CaseResult &a = report.cases[0], &b = report.cases[1], &alone = report.cases[2];
  EXPECT_EQ(a.rounds, 7);
  EXPECT_EQ(b.rounds, 7);
  EXPECT_EQ(alone.rounds, 0);
  EXPECT_EQ(a.runs, 7 * 2);  // quick_timing's 2 runs a round
  EXPECT_EQ(b.runs, 7 * 2);
  EXPECT_TRUE(b.c.sinks);
  EXPECT_GT(b.vs_twin_min, 0);
  EXPECT_LE(b.vs_twin_min, b.vs_twin);
  EXPECT_LE(b.vs_twin, b.vs_twin_max);
  EXPECT_EQ(a.vs_twin, 0);  // only the paired case carries the ratio
  const std::string json = to_json(report);
  const size_t first = json.find("\"vs_twin\": ");
  ASSERT_NE(first, std::string::npos) << json;
  EXPECT_EQ(json.find("\"vs_twin\": ", first + 1), std::string::npos) << json;
  EXPECT_NEAR(json_number_after(json, "vs_twin"), b.vs_twin, 1e-5 * b.vs_twin);  // 6 digits
  EXPECT_EQ(json_number_after(json, "rounds"), 7);
  std::ostringstream table;
  print_table_row(table, b);
  EXPECT_NE(table.str().find(" sinks ("), std::string::npos) << table.str();
  EXPECT_NE(table.str().find("% vs the row above; 7 rounds: "), std::string::npos) << table.str();
  // A paired case needs its twin before it.
  EXPECT_THROW(run_cases({twin}, machine, quick_timing()), Error);
}

// bench --ab: each case with a twin under a switch, timed in alternating rounds. The CPU kernels
// read FLASHKV_CPU_ISA on every call, so the twin's runs show that they ran under it.
TEST(Bench, SwitchTwinsRunUnderTheirSwitchAndPutItBack) {
  test::ScopedEnv isa("FLASHKV_CPU_ISA", nullptr);  // unset around the test
  const Roofline machine = measure_roofline(Device::cpu(), quick_roofline());
  BenchCase plain = decode_case(2, 130, Device::cpu(), 8, 2, 64);
  BenchCase sinks = plain;
  sinks.sinks = sinks.paired = true;  // a model's twin becomes a case of its own
  const std::vector<BenchCase> cases = switch_twins({plain, sinks}, "FLASHKV_CPU_ISA=scalar");
  ASSERT_EQ(cases.size(), 4u);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(cases[i].paired, i % 2 == 1) << i;
    EXPECT_EQ(cases[i].env, i % 2 ? "FLASHKV_CPU_ISA=scalar" : "") << i;
    EXPECT_EQ(cases[i].sinks, i >= 2) << i;
  }
  EXPECT_NE(cases[1].str().find(" FLASHKV_CPU_ISA=scalar"), std::string::npos) << cases[1].str();
  const BenchReport report = run_cases(cases, machine, quick_timing());
  ASSERT_EQ(report.cases.size(), 4u);
  EXPECT_EQ(std::getenv("FLASHKV_CPU_ISA"), nullptr);  // put back
  const CaseResult& twin = report.cases[1];
  EXPECT_EQ(twin.rounds, 7);
  EXPECT_GT(twin.vs_twin_min, 0);
  EXPECT_LE(twin.vs_twin_min, twin.vs_twin);
  EXPECT_LE(twin.vs_twin, twin.vs_twin_max);
  std::ostringstream table;
  print_table_row(table, twin);
  EXPECT_NE(table.str().find(" FLASHKV_CPU_ISA=scalar ("), std::string::npos) << table.str();
  const std::string json = to_json(report);
  EXPECT_NE(json.find("\"env\": \"FLASHKV_CPU_ISA=scalar\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"env\": \"\""), std::string::npos) << json;
  const std::string csv = to_csv(report);
  EXPECT_NE(csv.find(",FLASHKV_CPU_ISA=scalar," + app::json_number(twin.vs_twin) + ","),
            std::string::npos)
      << csv;
  EXPECT_NE(csv.find(",7\n"), std::string::npos) << csv;

  // A value the CPU kernels refuse fails the twin's runs (not its twin's), and the variable is
  // still put back.
  try {
    run_cases(switch_twins({plain}, "FLASHKV_CPU_ISA=bogus"), machine, quick_timing());
    ADD_FAILURE() << "expected the twin's runs to throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FLASHKV_CPU_ISA: expected scalar"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(std::getenv("FLASHKV_CPU_ISA"), nullptr);
  // Without the rounds (a case run alone) the switch applies too.
  BenchCase alone = plain;
  alone.env = "FLASHKV_CPU_ISA=bogus";
  EXPECT_THROW(run_case(alone, machine, quick_timing()), Error);
  EXPECT_EQ(std::getenv("FLASHKV_CPU_ISA"), nullptr);

  // The cases the twins are compared with run the default: the variable must be unset.
  isa.set("avx2");
  EXPECT_THROW(switch_twins({plain}, "FLASHKV_CPU_ISA=scalar"), Error);
  isa.set(nullptr);
  // Only flashkv's switches, as NAME=VALUE.
  for (const char* bad : {"FLASHKV_NOT_A_SWITCH=1", "FLASHKV_CPU_ISA", "=1", "PATH=/"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(switch_twins({plain}, bad), Error);
    alone.env = bad;
    EXPECT_THROW(validate_case(alone), Error);
  }
  try {
    switch_twins({plain}, "FLASHKV_NOT_A_SWITCH=1");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'FLASHKV_NOT_A_SWITCH' is not a flashkv switch"),
              std::string::npos)
        << e.what();
  }
}

TEST(Bench, MaskedWorkCountsOnlyTheAllowedPairs) {
  // Non-causal prefill 4 x 4096: every row sees all 4096 keys.
  BenchCase p = prefill_case(4, 4096, Device::cpu());
  p.causal = false;
  EXPECT_DOUBLE_EQ(case_flops(p), 4.0 * 4 * 32 * 128 * 4096.0 * 4096);
  EXPECT_DOUBLE_EQ(case_flops(p), 2 * case_flops(prefill_case(4, 4096, Device::cpu())) -
                                      4.0 * 4 * 32 * 128 * 4096);  // causal + the diagonal
  // A non-causal extend: the prefix plus all new tokens.
  BenchCase e = extend_case(2, 100, 10, Device::cpu(), 4, 2, 64);
  e.causal = false;
  EXPECT_DOUBLE_EQ(case_flops(e), 2 * 4.0 * 4 * 64 * (10.0 * 100 + 10.0 * 10));
  // Verify 64 x 8 drafts over 4096: each draft sees the prefix, itself and its ancestors in the
  // binary tree 0 <- {1, 2}, 1 <- {3, 4}, 2 <- {5, 6}, 3 <- {7}: depths 1 2 2 3 3 3 3 4 (21).
  const BenchCase v = verify_case(64, 4096, 8, Device::cpu());
  EXPECT_EQ(v.op, BenchOp::verify);
  EXPECT_EQ(v.qo_len, 8);
  EXPECT_EQ(v.kv_len, 4104);
  EXPECT_EQ(v.prefix_len(), 4096);
  EXPECT_EQ(verify_tree_parent(0), -1);
  EXPECT_EQ(verify_tree_parent(7), 3);
  EXPECT_DOUBLE_EQ(case_flops(v), 64.0 * 4 * 32 * 128 * (8.0 * 4096 + 21));
  const std::vector<uint8_t> m = verify_tree_mask(v);
  ASSERT_EQ(m.size(), 8u * 4104);
  for (int t = 0; t < 8; ++t) {
    const uint8_t* row = m.data() + size_t(t) * 4104;
    EXPECT_EQ(std::count(row, row + 4096, uint8_t{1}), 4096) << t;  // the whole prefix
    EXPECT_EQ(row[4096 + t], 1) << t;                               // itself
    EXPECT_EQ(row[4096], 1) << t;                                   // the root
    for (int u = t + 1; u < 8; ++u) EXPECT_EQ(row[4096 + u], 0) << t << " " << u;  // no later
  }
  EXPECT_EQ(m[7 * 4104 + 4096 + 3], 1);  // 7's parent
  EXPECT_EQ(m[7 * 4104 + 4096 + 2], 0);  // not its ancestor
  // Bytes: the pool holds prefix + drafts; Q, O and the u8 mask once.
  EXPECT_DOUBLE_EQ(case_bytes(v),
                   64.0 * 4104 * 2 * 8 * 128 * 2 + 2.0 * 64 * 8 * 32 * 128 * 2 + 64.0 * 8 * 4104);
  EXPECT_STREQ(v.layout_name(), "shuffled");
  EXPECT_STREQ(v.mask_name(), "tree");
  EXPECT_STREQ(p.mask_name(), "non-causal");
  EXPECT_STREQ(prefill_case(1, 8, Device::cpu()).mask_name(), "causal");
  EXPECT_STREQ(decode_case(1, 8, Device::cpu()).mask_name(), "none");
  EXPECT_NE(p.str().find(" non-causal"), std::string::npos) << p.str();
  EXPECT_NE(v.str().find("verify B=64 qo=8 kv=4104 "), std::string::npos) << v.str();
  EXPECT_NE(v.str().find(" tree-mask"), std::string::npos) << v.str();
}

TEST(Bench, FullCudaGridHasTheIssue28Rows) {
  // Built on any machine: the grid is a list of shapes, nothing runs.
  const std::vector<BenchCase> grid = bench_grid("full", Device::cuda(0));
  std::set<std::string> labels;
  for (const BenchCase& c : grid) {
    EXPECT_NO_THROW(validate_case(c)) << c.str();
    EXPECT_TRUE(labels.insert(c.str()).second) << "two rows read " << c.str();
    EXPECT_EQ(c.device, Device::cuda(0));
    EXPECT_EQ(c.dtype, DType::bf16);
  }
  const auto count = [&](const std::function<bool(const BenchCase&)>& f) {
    return std::count_if(grid.begin(), grid.end(), f);
  };
  const auto prefill_4x4096 = [](const BenchCase& c, int hq, int hkv, int d, bool causal) {
    return c.op == BenchOp::prefill && c.batch == 4 && c.qo_len == 4096 && c.kv_len == 4096 &&
           c.num_qo_heads == hq && c.num_kv_heads == hkv && c.head_dim == d && c.causal == causal;
  };
  EXPECT_EQ(count([&](const BenchCase& c) { return prefill_4x4096(c, 32, 8, 128, true); }), 1);
  EXPECT_EQ(count([&](const BenchCase& c) { return prefill_4x4096(c, 32, 8, 128, false); }), 1);
  EXPECT_EQ(count([&](const BenchCase& c) { return prefill_4x4096(c, 32, 32, 64, true); }), 1);
  EXPECT_EQ(count([&](const BenchCase& c) { return prefill_4x4096(c, 16, 16, 256, true); }), 1);
  // Extend at page sizes 1 and 16 with a bf16 pool, and at 1 with an fp8 one.
  for (const auto& [page, kv] :
       {std::pair{1, DType::bf16}, std::pair{16, DType::bf16}, std::pair{1, DType::fp8_e4m3}}) {
    const auto extend = [page = page, kv = kv](const BenchCase& c, int b, int prefix, int n,
                                               bool one_pass = false) {
      return c.op == BenchOp::extend && c.batch == b && c.prefix_len() == prefix && c.qo_len == n &&
             c.page_size == page && c.kv_dtype == kv && c.causal &&
             c.kv_layout == KvLayout::shuffled && c.num_qo_heads == 32 && c.num_kv_heads == 8 &&
             c.head_dim == 128 && c.one_paged_pass == one_pass;
    };
    EXPECT_EQ(count([&](const BenchCase& c) { return extend(c, 4, 3072, 1024); }), 1)
        << page << " " << dtype_name(kv);
    EXPECT_EQ(count([&](const BenchCase& c) { return extend(c, 16, 4096, 256); }), 1)
        << page << " " << dtype_name(kv);
    // A bf16 pool: each also as one paged pass, right after it and paired with it.
    const bool twins = kv == DType::bf16;
    for (const auto& [b, prefix, n] : {std::tuple{4, 3072, 1024}, std::tuple{16, 4096, 256}}) {
      const auto at = std::find_if(grid.begin(), grid.end(),
                                   [&, b = b, prefix = prefix, n = n](const BenchCase& c) {
                                     return extend(c, b, prefix, n, true);
                                   });
      ASSERT_EQ(at != grid.end(), twins) << page << " " << dtype_name(kv);
      if (!twins) continue;
      EXPECT_TRUE(at->paired);
      EXPECT_TRUE(extend(*(at - 1), b, prefix, n));
    }
  }
  EXPECT_EQ(count([](const BenchCase& c) { return c.one_paged_pass; }), 4);
  EXPECT_EQ(count([](const BenchCase& c) {
              return c.op == BenchOp::verify && c.batch == 64 && c.qo_len == 8 &&
                     c.prefix_len() == 4096 && c.page_size == 1 &&
                     c.kv_layout == KvLayout::shuffled && c.num_qo_heads == 32 &&
                     c.num_kv_heads == 8 && c.head_dim == 128;
            }),
            1);
  // The CPU grids stay as they were: no verify, nothing non-causal.
  for (const char* name : {"quick", "full"})
    for (const BenchCase& c : bench_grid(name, Device::cpu())) {
      EXPECT_NO_THROW(validate_case(c)) << c.str();
      EXPECT_NE(c.op, BenchOp::verify) << name;
      EXPECT_TRUE(c.causal) << name;
    }
  const std::vector<BenchCase> cpu_full = bench_grid("full", Device::cpu());
  ASSERT_EQ(cpu_full.size(), 5u);
  // Its extend, then the same as one paged pass paired with it.
  EXPECT_FALSE(cpu_full[3].one_paged_pass);
  EXPECT_TRUE(cpu_full[4].one_paged_pass && cpu_full[4].paired);
  EXPECT_EQ(cpu_full[4].kv_len, cpu_full[3].kv_len);
  EXPECT_EQ(cpu_full[4].qo_len, cpu_full[3].qo_len);
}

TEST(Bench, NewCaseKindsRunOnCpu) {
  // Tiny versions of the issue-28 rows: non-causal prefill, head dims 64 and 256 (Hq == Hkv),
  // extend on 16-token pages with a prefix that ends mid-page, verify with a tree mask.
  const Roofline machine = measure_roofline(Device::cpu(), quick_roofline());
  BenchCase full = prefill_case(1, 70, Device::cpu(), 4, 2, 64);
  full.causal = false;
  BenchCase paged = extend_case(2, 37, 21, Device::cpu(), 4, 2, 64);
  paged.page_size = 16;
  // The same extend as one paged pass, paired with it.
  BenchCase one_pass = paged;
  one_pass.one_paged_pass = true;
  one_pass.paired = true;
  const std::vector<BenchCase> cases = {full,
                                        prefill_case(1, 40, Device::cpu(), 2, 2, 64),
                                        prefill_case(1, 40, Device::cpu(), 2, 2, 256),
                                        paged,
                                        one_pass,
                                        verify_case(3, 45, 8, Device::cpu(), 4, 2, 64)};
  const BenchReport report = run_cases(cases, machine, quick_timing());
  ASSERT_EQ(report.cases.size(), cases.size());
  for (const CaseResult& r : report.cases) {
    EXPECT_GT(r.us, 0) << r.c.str();
    EXPECT_GT(r.gbps, 0) << r.c.str();
    EXPECT_GT(r.tflops, 0) << r.c.str();
    EXPECT_GT(r.roofline_fraction, 0) << r.c.str();
  }
  const CaseResult& v = report.cases.back();
  EXPECT_DOUBLE_EQ(v.roofline_fraction,
                   std::max(v.gbps / machine.read_gbps, v.tflops * 1e3 / machine.matmul_gflops));
  const std::string json = to_json(report), csv = to_csv(report);
  EXPECT_NE(json.find("\"op\": \"verify\""), std::string::npos);
  EXPECT_NE(json.find("\"mask\": \"tree\""), std::string::npos);
  EXPECT_NE(json.find("\"mask\": \"non-causal\""), std::string::npos);
  EXPECT_NE(json.find("\"page_size\": 16"), std::string::npos);
  EXPECT_NE(json.find("\"plans\": []"), std::string::npos) << json;
  EXPECT_NE(csv.find(",sinks,one_paged_pass,mask,env,vs_twin,vs_twin_min,vs_twin_max,rounds\n"),
            std::string::npos);
  EXPECT_NE(csv.find(",0,tree,,,,,\n"), std::string::npos) << csv;
  std::ostringstream table;
  print_table(table, report);
  EXPECT_NE(table.str().find(" non-causal\n"), std::string::npos) << table.str();
  EXPECT_NE(table.str().find(" tree-mask\n"), std::string::npos) << table.str();
  EXPECT_NE(table.str().find("verify "), std::string::npos) << table.str();
  // One paged pass: the same work, every K/V entry read from the pool, its marks in every output.
  const CaseResult& op = report.cases[4];
  EXPECT_GT(op.rounds, 0);
  EXPECT_DOUBLE_EQ(case_flops(one_pass), case_flops(paged));
  EXPECT_DOUBLE_EQ(case_bytes(one_pass), case_bytes(paged));  // bf16 either way
  BenchCase fp8_pool = paged, fp8_one_pass = one_pass;
  fp8_pool.kv_dtype = fp8_one_pass.kv_dtype = DType::fp8_e4m3;
  // The new tokens' K/V: 2 x 42 rows x 2 heads x 64 dims, 2 bytes each as given, 1 in the pool.
  EXPECT_DOUBLE_EQ(case_bytes(fp8_pool) - case_bytes(fp8_one_pass), 2.0 * 42 * 2 * 64);
  EXPECT_NE(op.c.str().find(" one-pass"), std::string::npos) << op.c.str();
  EXPECT_NE(json.find("\"one_paged_pass\": true"), std::string::npos) << json;
  EXPECT_NE(csv.find(",1,causal,"), std::string::npos) << csv;
  EXPECT_NE(table.str().find(" one-pass ("), std::string::npos) << table.str();
  // One paged pass is an extend's, without a window.
  BenchCase not_extend = prefill_case(1, 40, Device::cpu(), 2, 2, 64);
  not_extend.one_paged_pass = true;
  EXPECT_THROW(validate_case(not_extend), Error);
  BenchCase windowed = one_pass;
  windowed.window_left = 8;
  EXPECT_THROW(validate_case(windowed), Error);
  // A verify case needs a prefix, and a masked case takes no window.
  BenchCase bad = verify_case(1, 0, 4, Device::cpu());
  EXPECT_THROW(validate_case(bad), Error);
  bad = full;
  bad.window_left = 8;
  EXPECT_THROW(validate_case(bad), Error);
}

TEST(Bench, PlanGridTimesPrefillAndExtendPlansOf256Requests) {
  const std::vector<PlanCase> grid = bench_plan_grid(device_info(Device::cpu()));
  ASSERT_EQ(grid.size(), 3u);
  EXPECT_EQ(grid[0].kind, PlanKind::prefill);
  EXPECT_EQ(grid[1].kind, PlanKind::extend);
  EXPECT_EQ(grid[2].kind, PlanKind::extend_ragged);
  for (const PlanCase& c : grid) EXPECT_EQ(c.batch, 256);
  std::vector<std::string> seen;
  const std::vector<PlanResult> r =
      run_plan_grid("quick", Device::cpu(), {PlanKind::extend, PlanKind::extend_ragged},
                    [&](const PlanResult& p) { seen.push_back(plan_kind_name(p.c.kind)); });
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(seen, (std::vector<std::string>{"extend", "extend_ragged"}));
  for (const PlanResult& p : r) {
    EXPECT_GT(p.t.median_us, 0);
    EXPECT_LE(p.t.min_us, p.t.median_us);
    EXPECT_GE(p.t.items, 256);
  }
  EXPECT_EQ(r[0].t.plans, 1);  // one causal plan over prefix and new tokens
  EXPECT_EQ(r[1].t.plans, 2);  // the ragged plan and the prefix plan
  BenchReport report;
  report.plans = r;
  const std::string json = to_json(report);
  EXPECT_NE(json.find("{\"kind\": \"extend\", \"device\": \"cpu\", \"batch\": 256, "
                      "\"max_new\": 64, \"max_prefix\": 4096"),
            std::string::npos)
      << json;
  std::ostringstream line;
  print_plan_row(line, r[0]);
  EXPECT_EQ(line.str().rfind("plan (host) extend B=256 new=1..64 prefix=0..4096 on cpu: ", 0), 0u)
      << line.str();
}

// bench --cp's cases on one rank: the one-rank and the sharded runs both time the case, all of
// a call's time is local attention (no collective, no merge), the table and the JSON carry the
// breakdown, and the grids hold issue 29's sizes.
TEST(Bench, CpCasesOnOneRankReportTheirPhases) {
  const Roofline machine = measure_roofline(Device::cpu(), quick_roofline());
  parallel::OneRankCommunicator comm;
  BenchReport report;
  report.machine = machine;
  EXPECT_EQ(to_json(report).find("\"cp\""), std::string::npos);  // only with --cp
  report.cp.ranks = 1;
  report.cp.communicator = comm.name();
  std::ostringstream table;
  print_cp_header(table, 1, comm.name());
  for (const BenchCase& c : {decode_case(2, 300, Device::cpu(), 4, 2, 64),
                             extend_case(1, 64, 33, Device::cpu(), 4, 2, 64)}) {
    SCOPED_TRACE(c.str());
    const CpCaseResult r = run_cp_case(c, comm, parallel::CpOptions{}, machine, quick_timing());
    EXPECT_GT(r.one_rank.us, 0);
    EXPECT_GT(r.sharded.us, 0);
    EXPECT_GT(r.sharded.roofline_fraction, 0);
    EXPECT_DOUBLE_EQ(r.speedup, r.one_rank.us / r.sharded.us);
    EXPECT_EQ(r.one_rank.runs, 2);
    EXPECT_EQ(r.sharded.runs, 2);
    ASSERT_EQ(r.one_rank_phases.size(), 1u);
    ASSERT_EQ(r.sharded_phases.size(), 1u);
    for (const parallel::CpTiming& t : {r.one_rank_phases[0], r.sharded_phases[0]}) {
      EXPECT_GT(t.local_us, 0);
      EXPECT_EQ(t.comm_us, 0);
      EXPECT_EQ(t.merge_us, 0);
    }
    print_cp_case(table, r);
    report.cp.cases.push_back(r);
  }
  EXPECT_NE(table.str().find("context parallelism: 1 rank (one rank)"), std::string::npos)
      << table.str();
  EXPECT_NE(table.str().find("    sharded: rank 0: local "), std::string::npos) << table.str();
  const app::JsonValue j = app::parse_json(to_json(report));
  const app::JsonValue* cp = j.find("cp");
  ASSERT_TRUE(cp != nullptr);
  EXPECT_EQ(cp->find("ranks")->number(), 1);
  ASSERT_EQ(cp->find("cases")->items().size(), 2u);
  const app::JsonValue& e = cp->find("cases")->items()[1];
  EXPECT_EQ(e.find("op")->string(), "extend");
  EXPECT_EQ(e.find("prefix_len")->number(), 64);
  EXPECT_EQ(e.find("exchange")->string(), "all_gather");
  EXPECT_EQ(e.find("kv_pass")->string(), "all_gather");
  const app::JsonValue* phases = e.find("sharded")->find("phases");
  ASSERT_EQ(phases->items().size(), 1u);
  EXPECT_GT(phases->items()[0].find("local_us")->number(), 0);
  EXPECT_EQ(phases->items()[0].find("comm_us")->number(), 0);

  const std::vector<BenchCase> quick = cp_grid("quick", Device::cpu());
  ASSERT_EQ(quick.size(), 2u);
  EXPECT_EQ(quick[0].kv_len, 16384);
  EXPECT_EQ(quick[1].prefix_len(), 16384);
  const std::vector<BenchCase> full = cp_grid("full", Device::cpu());
  ASSERT_EQ(full.size(), 3u);
  EXPECT_EQ(full[0].kv_len, 262144);
  EXPECT_EQ(full[1].kv_len, 1048576);
  EXPECT_EQ(full[2].op, BenchOp::extend);
  EXPECT_EQ(full[2].prefix_len(), 262144);
  EXPECT_THROW(cp_grid("huge", Device::cpu()), Error);
  BenchCase bad = prefill_case(1, 64, Device::cpu(), 4, 2, 64);
  EXPECT_THROW(run_cp_case(bad, comm, {}, machine, quick_timing()), Error);
  bad = decode_case(1, 64, Device::cpu(), 4, 2, 64);
  bad.window_left = 8;
  EXPECT_THROW(run_cp_case(bad, comm, {}, machine, quick_timing()), Error);
}

TEST(Bench, RejectsBadCasesAndNames) {
  const Roofline machine = measure_roofline(Device::cpu(), quick_roofline());
  BenchCase c = decode_case(1, 64, Device::cpu(), 4, 2, 64);
  c.qo_len = 2;
  EXPECT_THROW(run_case(c, machine, quick_timing()), Error);
  c = prefill_case(1, 64, Device::cpu(), 4, 3, 64);
  EXPECT_THROW(run_case(c, machine, quick_timing()), Error);
  c = decode_case(1, 64, Device::cuda(0), 4, 2, 64);
  EXPECT_THROW(run_case(c, machine, quick_timing()), Error);  // roofline is the CPU's
  EXPECT_THROW(bench_grid("huge", Device::cpu()), Error);
  EXPECT_THROW(parse_op("mixed"), Error);
  EXPECT_THROW(run_plan_grid("huge", Device::cpu()), Error);
  EXPECT_THROW(app::write_text_file("/nonexistent-dir/x.json", "{}"), Error);
}

}  // namespace
}  // namespace flashkv::bench
