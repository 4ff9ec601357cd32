// The benchmark harness: a tiny CPU run produces every field of the JSON contract with sane
// values (no timing assertions), and the roofline loops run on every ISA this CPU has.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "attention_bench.h"
#include "flashkv/core/error.h"
#include "flashkv/core/thread_pool.h"
#include "json.h"
#include "report.h"
#include "roofline.h"

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

TEST(Bench, TinyCpuRunFillsTheJsonContract) {
  const Roofline machine = measure_roofline(Device::cpu(), quick_roofline());
  const std::vector<BenchCase> grid = bench_grid("quick", Device::cpu());
  ASSERT_EQ(grid.size(), 3u);
  const BenchReport report = run_cases(grid, machine, quick_timing());
  ASSERT_EQ(report.cases.size(), grid.size());
  const std::string json = to_json(report);
  for (const char* key : {"read_gbps", "copy_gbps", "matmul_gflops", "cores", "buffer_bytes"})
    EXPECT_GT(json_number_after(json, key), 0) << key << " in\n" << json;
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
  EXPECT_THROW(parse_op("verify"), Error);
  EXPECT_THROW(app::write_text_file("/nonexistent-dir/x.json", "{}"), Error);
}

}  // namespace
}  // namespace flashkv::bench
