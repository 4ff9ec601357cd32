// The flashkv command line, run as a user runs it: exit codes, the JSON output contract of serve
// and bench, the last line of check, --help and bad input. Small sizes keep it to seconds.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>

#include "flashkv/core/device.h"
#include "json.h"
#include "model_presets.h"
#include "test_util.h"
#include "workload.h"

namespace flashkv::app {
namespace {

struct RunResult {
  int code = -1;
  std::string out, err;
};

std::string temp_path(const std::string& name) { return test::temp_file("cli_" + name); }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Runs `flashkv <args>` and collects its exit code, stdout and stderr.
RunResult flashkv(const std::string& args) {
  const std::string out = temp_path("stdout"), err = temp_path("stderr");
  const std::string cmd =
      std::string("'") + FLASHKV_CLI_PATH + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

std::string last_line(const std::string& text) {
  std::string t = text;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  const size_t nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

int count_lines(const std::string& text) {
  int n = 0;
  for (char c : text) n += c == '\n';
  return n;
}

double number(const JsonValue& obj, const char* key) {
  const JsonValue* v = obj.find(key);
  EXPECT_TRUE(v && v->is_number()) << "missing number field " << key;
  return v && v->is_number() ? v->number() : -1;
}

// The fields of the serve contract, with the values any correct run has.
void expect_serve_contract(const JsonValue& j, int requests) {
  ASSERT_TRUE(j.is_object());
  EXPECT_GT(number(j, "tokens_per_s"), 0);
  EXPECT_EQ(number(j, "requests"), requests);
  const double p50 = number(j, "attention_ms_p50"), p99 = number(j, "attention_ms_p99");
  EXPECT_GT(p50, 0);
  EXPECT_GE(p99, p50);
  const double hit = number(j, "prefix_hit_rate");
  EXPECT_GE(hit, 0);
  EXPECT_LE(hit, 1);
  EXPECT_GT(number(j, "peak_kv_slots"), 0);
  EXPECT_LE(number(j, "peak_kv_slots"), number(j, "kv_slots"));
  EXPECT_GT(number(j, "checked"), 0);
  EXPECT_EQ(number(j, "check_failures"), 0);
  ASSERT_TRUE(j.find("invariants_ok") && j.find("invariants_ok")->is_bool());
  EXPECT_TRUE(j.find("invariants_ok")->boolean());
}

TEST(Cli, ServeChatWritesTheJsonContract) {
  const std::string json = temp_path("serve.json");
  const RunResult r =
      flashkv("serve --device cpu --requests 8 --layers 2 --check --quiet --json " + json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("tokens/s"), std::string::npos);
  EXPECT_NE(r.out.find("invariants   ok"), std::string::npos) << r.out;
  const JsonValue j = parse_json(read_file(json));
  expect_serve_contract(j, 8);
  EXPECT_EQ(j.find("workload")->string(), "chat");
  // Eight chat requests share four system prompts: some prompt tokens come from the cache.
  EXPECT_GT(number(j, "prefix_hit_rate"), 0);
}

// An fp8 e5m2 pool through the ragged extend: the check's reference reads the new tokens' K/V
// as the pass did (as given, not rounded to e5m2's 2-bit mantissa), the prefix from the pool.
TEST(Cli, ServeChecksAnFp8E5m2Pool) {
  const std::string json = temp_path("serve-e5m2.json");
  const RunResult r = flashkv(
      "serve --device cpu --requests 24 --layers 2 --kv-dtype fp8_e5m2 --check --quiet --json " +
      json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const JsonValue j = parse_json(read_file(json));
  expect_serve_contract(j, 24);
  EXPECT_GT(number(j, "prefix_hit_rate"), 0);  // extends over a cached prefix ran
}

TEST(Cli, ServeSpeculativeWorkload) {
  const std::string json = temp_path("spec.json");
  const RunResult r = flashkv(
      "serve --device cpu --workload spec --requests 6 --layers 2 --check --quiet --json " + json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const JsonValue j = parse_json(read_file(json));
  expect_serve_contract(j, 6);
  EXPECT_GE(number(j, "accepted_tokens_per_step"), 1);
  EXPECT_TRUE(j.find("model")->find("speculative")->boolean());
}

TEST(Cli, ServeWorkloadFileWithSharedPrefixAndFp8Window) {
  const std::string file = temp_path("workload.json");
  write_file(file, R"({
    "name": "two turns",
    "prefixes": {"system": 64, "ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]},
    "requests": [
      {"arrival": 0, "prefix": "system", "prompt": 20, "output": 5},
      {"arrival": 40, "prefix": "system", "prompt": [1, 2, 3], "output": 3},
      {"arrival": 41, "prefix": "ids", "output": 2},
      {"arrival": 2, "prompt": 33, "output": 1}
    ]
  })");
  const std::string json = temp_path("file.json");
  const RunResult r =
      flashkv("serve --device cpu --workload " + file +
              " --kv-dtype fp8_e4m3 --window 16 --layers 2 --check --quiet --json " + json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const JsonValue j = parse_json(read_file(json));
  expect_serve_contract(j, 4);
  EXPECT_EQ(j.find("workload")->string(), "two turns");
  // The second request arrives after the first finished: its 64 system tokens are cached.
  EXPECT_GE(number(j, "prefix_hit_rate"), 64.0 / (84 + 67 + 16 + 33));
}

// --save-workload writes a file that serves the same requests again.
TEST(Cli, ServeSavesAWorkloadThatReadsBackTheSame) {
  const std::string saved = temp_path("saved.json"), again = temp_path("saved_again.json");
  const RunResult r = flashkv(
      "serve --device cpu --workload spec --requests 5 --layers 1 --quiet --save-workload " +
      saved);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const Workload w = load_workload_file(saved, 0, 1);
  const Workload spec = builtin_workload("spec", 5, false, 1);
  EXPECT_EQ(w.name, "spec");
  EXPECT_TRUE(w.spec.enabled);
  ASSERT_EQ(w.requests.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(w.requests[i].prompt, spec.requests[i].prompt);
    EXPECT_EQ(w.requests[i].prefix_len, spec.requests[i].prefix_len);
    EXPECT_EQ(w.requests[i].arrival, spec.requests[i].arrival);
    EXPECT_EQ(w.requests[i].output_len, spec.requests[i].output_len);
  }
  const RunResult replay = flashkv("serve --device cpu --layers 1 --quiet --workload " + saved +
                                   " --save-workload " + again);
  ASSERT_EQ(replay.code, 0) << replay.out << replay.err;
  EXPECT_EQ(read_file(again), read_file(saved));
}

TEST(Cli, SoakRunsCleanAndSaysWhatItChecked) {
  for (const char* spec : {"on", "off"}) {
    const RunResult r = flashkv(std::string("soak --device cpu --steps 150 --quiet --layers 1 ") +
                                "--speculative " + spec);
    ASSERT_EQ(r.code, 0) << spec << ": " << r.out << r.err;
    EXPECT_EQ(r.out.rfind("soak: 150 steps + ", 0), 0u) << r.out;
    EXPECT_NE(r.out.find("invariants   ok after every step"), std::string::npos) << r.out;
    EXPECT_EQ(r.err, "");
  }
}

TEST(Cli, BenchQuickWritesJsonCsvAndRoofline) {
  const std::string json = temp_path("bench.json"), csv = temp_path("bench.csv"),
                    svg = temp_path("roof.svg");
  const RunResult r =
      flashkv("bench --device cpu --grid quick --min-seconds 0 --roofline-mb 8 --json " + json +
              " --csv " + csv + " --plot " + svg);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const JsonValue j = parse_json(read_file(json));
  const JsonValue* m = j.find("machine");
  ASSERT_TRUE(m && m->is_object());
  EXPECT_EQ(m->find("device")->string(), "cpu");
  for (const char* k : {"read_gbps", "copy_gbps", "matmul_gflops"})
    EXPECT_GT(number(*m, k), 0) << k;
  EXPECT_EQ(number(*m, "matmul_sustained_gflops"), 0);  // measured on a GPU only
  const JsonValue* cases = j.find("cases");
  ASSERT_TRUE(cases && cases->is_array());
  ASSERT_EQ(cases->items().size(), 3u);
  for (const JsonValue& c : cases->items()) {
    for (const char* k : {"op", "device", "dtype", "kv_dtype"})
      EXPECT_TRUE(c.find(k) && c.find(k)->is_string()) << k;
    for (const char* k : {"batch", "qo_len", "kv_len", "prefix_len", "num_qo_heads", "num_kv_heads",
                          "head_dim", "page_size", "us", "gbps", "tflops"})
      EXPECT_GE(number(c, k), 0) << k;
    EXPECT_GT(number(c, "us"), 0);
    EXPECT_GT(number(c, "roofline_fraction"), 0);
    EXPECT_EQ(number(c, "prefix_len"), number(c, "kv_len") - number(c, "qo_len"));
  }
  EXPECT_EQ(count_lines(read_file(csv)), 4);  // header + 3 cases
  const std::string plot = read_file(svg);
  EXPECT_EQ(plot.rfind("<svg", 0), 0u);
  EXPECT_NE(plot.find("</svg>"), std::string::npos);
  size_t points = 0;
  for (size_t at = plot.find("<title>"); at != std::string::npos; at = plot.find("<title>", at + 1))
    ++points;
  EXPECT_EQ(points, 3u);  // one point per case
  EXPECT_NE(plot.find("read "), std::string::npos);
  EXPECT_NE(plot.find("matmul "), std::string::npos);
}

// bench --ab: each case, then its twin under the switch, with the twin's ratio and spread.
TEST(Cli, BenchAbTimesEachCaseWithATwinUnderTheSwitch) {
  const std::string json = temp_path("bench_ab.json");
  const RunResult r = flashkv(
      "bench --device cpu --grid quick --op decode --min-seconds 0 --roofline-mb 8 --ab "
      "FLASHKV_CPU_PREFETCH=off --json " +
      json);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find(" FLASHKV_CPU_PREFETCH=off ("), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("vs the row above; 7 rounds"), std::string::npos) << r.out;
  const JsonValue j = parse_json(read_file(json));
  const std::vector<JsonValue>& cases = j.find("cases")->items();
  ASSERT_EQ(cases.size(), 2u);
  EXPECT_EQ(cases[0].find("env")->string(), "");
  EXPECT_EQ(cases[0].find("vs_twin"), nullptr);
  EXPECT_EQ(cases[1].find("env")->string(), "FLASHKV_CPU_PREFETCH=off");
  EXPECT_GT(number(cases[1], "vs_twin"), 0);
  EXPECT_EQ(number(cases[1], "rounds"), 7);
}

// `flashkv check --device cpu --quick`, run once for the tests that read its output.
const RunResult& quick_check() {
  static const RunResult r = flashkv("check --device cpu --quick");
  return r;
}

TEST(Cli, CheckQuickEndsWithPassedFailedLine) {
  const RunResult& r = quick_check();
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(std::regex_match(last_line(r.out), std::regex("[1-9][0-9]* passed, 0 failed")))
      << last_line(r.out);
  EXPECT_NE(r.out.find("backend verify"), std::string::npos);
  EXPECT_NE(r.out.find("backend cross"), std::string::npos);
  EXPECT_NE(r.out.find("backend draft_steps"), std::string::npos);
}

// The quick grid lists attention-sinks cases (their description ends in "sinks") for every
// operator path and the main backend modes, and each of them passes.
TEST(Cli, CheckQuickListsSinksCasesAndTheyPass) {
  const RunResult& r = quick_check();
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  std::map<std::string, int> by_op;  // the op column of each sinks row
  bool split = false, window = false, cap = false;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.find(" sinks ") == std::string::npos) continue;
    EXPECT_EQ(line.substr(line.size() - 3), " ok") << line;
    // Ops are one word, backend modes "backend <mode>".
    std::istringstream words(line);
    std::string op, mode;
    words >> op;
    if (op == "backend" && words >> mode) op.append(" ").append(mode);
    ++by_op[op];
    split |= line.find(" split=") != std::string::npos;
    window |= line.find(" win=") != std::string::npos;
    cap |= line.find(" cap=") != std::string::npos;
  }
  for (const char* op :
       {"decode", "ragged_prefill", "paged_prefill", "extend", "backend decode", "backend extend",
        "backend extend+prefix", "backend verify", "backend draft_extend"})
    EXPECT_GT(by_op[op], 0) << "no sinks case for " << op << "\n" << r.out;
  EXPECT_GE(by_op["decode"], 2);
  EXPECT_TRUE(split && window && cap) << r.out;
}

TEST(Cli, HelpExitsZero) {
  for (const char* cmd :
       {"--help", "serve --help", "soak --help", "bench --help", "check --help", "info --help"}) {
    const RunResult r = flashkv(cmd);
    EXPECT_EQ(r.code, 0) << cmd;
    EXPECT_NE(r.out.find("usage: flashkv"), std::string::npos) << cmd;
  }
}

TEST(Cli, BadFlagsAreOneLineAndExitTwo) {
  for (const char* cmd : {"serve --frobnicate",
                          "serve --requests many",
                          "serve --dtype fp4",
                          "serve --heads 6 --kv-heads 4",
                          "serve --head-dim 72",
                          "serve --requests",
                          "bench --grid huge",
                          "bench --op attention",
                          "bench --ab FLASHKV_NOPE=1",
                          "bench --ab nonsense",
                          "check --op everything",
                          "info --verbose",
                          "nonsense",
                          "serve --device tpu",
                          "serve --json /nonexistent-dir/x.json",
                          "serve --save-workload /nonexistent-dir/w.json",
                          "soak --speculative maybe",
                          "soak --steps -5",
                          "soak --kv-slots 100",
                          "soak --flush-every 0",
                          "soak --heads 3"}) {
    const RunResult r = flashkv(cmd);
    EXPECT_EQ(r.code, 2) << cmd << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << cmd << ": " << r.err;
    EXPECT_EQ(r.err.rfind("flashkv", 0), 0u) << cmd << ": " << r.err;
  }
}

TEST(Cli, NoCommandPrintsUsageAndExitsTwo) {
  const RunResult r = flashkv("");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("usage: flashkv"), std::string::npos);
}

TEST(Cli, CudaWithoutAGpuIsOneLineAndExitTwo) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is visible";
  for (const char* cmd : {"serve --device cuda", "bench --device cuda", "check --device cuda:0"}) {
    const RunResult r = flashkv(cmd);
    EXPECT_EQ(r.code, 2) << cmd;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_TRUE(r.err.find("without CUDA") != std::string::npos ||
                r.err.find("no GPU") != std::string::npos)
        << r.err;
  }
}

TEST(Cli, BadWorkloadFilesAreOneLineAndExitTwo) {
  struct Bad {
    const char* text;
    const char* says;
  };
  const Bad bad[] = {
      {"{\"requests\": [", "line 1, column 15: unexpected end"},
      {"{\"requests\": [{\"prompt\": 10, \"output\": 0}]}", "requests[0].output"},
      {"{\"requests\": [{\"prompt\": 10, \"output\": 4, \"tokens\": 3}]}", "unknown key"},
      {"{\"requests\": [{\"prefix\": \"nope\", \"output\": 4}]}", "no prefix named"},
      {"{\"requests\": []}", "non-empty array"},
      {"{\"requests\": [{\"prompt\": 10, \"output\": 4}], \"requests\": 1}", "duplicate key"},
      {"{\"speculative\": {\"topk\": 99}, \"requests\": [{\"prompt\": 1, \"output\": 1}]}",
       "speculative.topk"},
      {"[1, 2]", "expected an object"},
  };
  const std::string file = temp_path("bad.json");
  for (const Bad& b : bad) {
    write_file(file, b.text);
    const RunResult r = flashkv("serve --device cpu --quiet --workload " + file);
    EXPECT_EQ(r.code, 2) << b.text << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(file), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(b.says), std::string::npos) << b.text << ": " << r.err;
  }
  const RunResult missing =
      flashkv("serve --device cpu --workload " + temp_path("no-such-file.json"));
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("no such file"), std::string::npos) << missing.err;
  // A request that cannot fit the pool it asked for.
  write_file(file, "{\"requests\": [{\"prompt\": 500, \"output\": 100}]}");
  const RunResult too_big = flashkv("serve --device cpu --kv-slots 256 --workload " + file);
  EXPECT_EQ(too_big.code, 2);
  EXPECT_NE(too_big.err.find("--kv-slots"), std::string::npos) << too_big.err;
}

// Model presets: --model list prints every preset with its source; a preset runs clean on the
// CPU with a flag overriding its layer count; unknown models and unsupported features are one
// line and exit code 2.
TEST(Cli, ModelListPrintsEveryPresetWithItsSource) {
  const RunResult r = flashkv("serve --model list");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const ModelPreset& p : model_presets()) {
    const size_t at = r.out.find("  " + p.name + "\n");
    ASSERT_NE(at, std::string::npos) << p.name;
    EXPECT_NE(r.out.find("source: " + p.model_id + " config.json: ", at), std::string::npos)
        << p.name;
  }
  EXPECT_EQ(flashkv("bench --model list").out, r.out);
}

TEST(Cli, ModelPresetsServeCleanOnTheCpu) {
  for (const char* model : {"mistral-7b-v0.1", "gemma-2-9b", "qwen3-8b", "phi-3-mini"}) {
    const std::string json = temp_path(std::string("model_") + model + ".json");
    const RunResult r = flashkv(std::string("serve --device cpu --model ") + model +
                                " --layers 2 --requests 4 --check --quiet --json " + json);
    ASSERT_EQ(r.code, 0) << model << ": " << r.err;
    const ModelPreset* p = find_model_preset(model);
    ASSERT_NE(p, nullptr);
    // The preset's shape with --layers overriding its layer count.
    EXPECT_NE(r.out.find(str_cat("2 layers, ", p->heads, "/", p->kv_heads, " heads, head dim ",
                                 p->head_dim)),
              std::string::npos)
        << model << ": " << r.out;
    const JsonValue j = parse_json(read_file(json));
    EXPECT_GT(number(j, "checked"), 0) << model;
    EXPECT_EQ(number(j, "check_failures"), 0) << model;
  }
}

TEST(Cli, FlagsOverrideAModelPreset) {
  const RunResult r = flashkv(
      "serve --device cpu --model gemma-2-9b --layers 3 --soft-cap 30 --window 15 --requests 2 "
      "--quiet");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("3 layers, 16/8 heads, head dim 256"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("window 15 on even layers, soft cap 30"), std::string::npos) << r.out;
}

TEST(Cli, UnknownOrUnsupportedModelsAreOneLineAndExitTwo) {
  const RunResult unknown = flashkv("serve --model llama-9");
  EXPECT_EQ(unknown.code, 2);
  EXPECT_EQ(count_lines(unknown.err), 1) << unknown.err;
  for (const ModelPreset& p : model_presets())
    EXPECT_NE(unknown.err.find(p.name), std::string::npos) << unknown.err;
  EXPECT_EQ(flashkv("bench --model llama-9").code, 2);
  // What an encoder-decoder model cannot be combined with, and encoder inputs without one.
  const std::pair<const char*, const char*> refused[] = {
      {"serve --device cpu --model t5-base --workload spec",
       "--workload spec: speculative decoding needs a decoder-only model"},
      {"soak --device cpu --model t5-base --speculative on",
       "--speculative on: speculative decoding needs a decoder-only model"},
      {"serve --device cpu --model t5-base --window 16",
       "--window 16: a model with cross attention has no sliding-window layers"},
      {"serve --device cpu --encoder-len 64", "--encoder-len: the model has no cross attention"},
      {"soak --device cpu --model llama-3.1-8b --encoder-len 64",
       "--encoder-len: the model has no cross attention"},
      {"serve --device cpu --model t5-base --encoder-len 0", "--encoder-len expects 1..65536"},
  };
  for (const auto& [cmd, says] : refused) {
    const RunResult r = flashkv(cmd);
    EXPECT_EQ(r.code, 2) << cmd << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << cmd << ": " << r.err;
    EXPECT_NE(r.err.find(says), std::string::npos) << cmd << ": " << r.err;
  }
}

// t5-base as published: 24 layers, self attention on the even ones and cross attention to each
// request's encoder input on the odd ones, scale 1. serve --check compares sampled layers with
// the reference; a saved workload replays with the same encoder inputs (drawn from the seed);
// soak checks the invariants after every step and runs without speculative decoding.
TEST(Cli, ServeAndSoakAnEncoderDecoderModel) {
  const std::string json = temp_path("t5.json"), saved = temp_path("t5_workload.json");
  const RunResult r = flashkv(
      "serve --device cpu --model t5-base --requests 6 --encoder-len 64 --check --quiet --json " +
      json + " --save-workload " + saved);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("24 layers, 12/12 heads, head dim 64, bf16, kv bf16, scale 1, cross "
                       "attention on odd layers"),
            std::string::npos)
      << r.out;
  const std::regex encoder(", ([0-9]+) encoder tokens \\(32\\.\\.64 a request\\)");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, encoder)) << r.out;
  const int encoder_tokens = std::stoi(m[1]);
  EXPECT_GE(encoder_tokens, 6 * 32);
  EXPECT_LE(encoder_tokens, 6 * 64);
  EXPECT_NE(r.out.find("prefix cache off"), std::string::npos) << r.out;
  const JsonValue j = parse_json(read_file(json));
  expect_serve_contract(j, 6);
  EXPECT_EQ(number(j, "prefix_hit_rate"), 0);

  const RunResult replay = flashkv(
      "serve --device cpu --model t5-base --layers 2 --encoder-len "
      "64 --quiet --workload " +
      saved);
  ASSERT_EQ(replay.code, 0) << replay.err;
  EXPECT_NE(replay.out.find(str_cat(", ", encoder_tokens, " encoder tokens")), std::string::npos)
      << replay.out;

  const RunResult s = flashkv("soak --device cpu --model t5-base --layers 4 --steps 100 --quiet");
  ASSERT_EQ(s.code, 0) << s.out << s.err;
  EXPECT_NE(s.out.find("cross attention on odd layers, encoder inputs of 64..128 tokens\n"),
            std::string::npos)
      << s.out;
  EXPECT_NE(s.out.find("invariants   ok after every step"), std::string::npos) << s.out;
  EXPECT_EQ(s.out.find("speculative"), std::string::npos) << s.out;
}

TEST(Cli, ServeChecksAModelWithSinks) {
  // gpt-oss: sinks on every layer, a 128-token window on alternate layers, head dim 64.
  const RunResult r =
      flashkv("serve --device cpu --model gpt-oss-20b --layers 2 --requests 4 --check --quiet");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("attention sinks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", 0 failures"), std::string::npos) << r.out;
}

TEST(Cli, BenchModelWithSinksTimesEachCaseWithAndWithoutThem) {
  const RunResult r = flashkv(
      "bench --device cpu --model gpt-oss-20b --grid quick --min-seconds 0 --roofline-mb 1");
  ASSERT_EQ(r.code, 0) << r.err;
  // The case rows (op names first) with " sinks": each case once with them, right after the same
  // case without, timed with it in alternating rounds: the row gives the time against the row
  // above and the rounds' spread.
  size_t with = 0, rows = 0;
  std::istringstream lines(r.out);
  std::string previous;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("decode ", 0) != 0 && line.rfind("extend ", 0) != 0) continue;
    ++rows;
    const size_t at = line.find(" sinks");
    if (at != std::string::npos) {
      ++with;
      EXPECT_NE(line.find("% vs the row above; 7 rounds: "), std::string::npos) << line;
      EXPECT_EQ(previous.find(" sinks"), std::string::npos) << previous;
      // The twin: the same columns up to the time.
      EXPECT_EQ(line.substr(0, 60), previous.substr(0, 60)) << previous << "\n" << line;
    }
    previous = line;
  }
  EXPECT_EQ(rows, 8u) << r.out;
  EXPECT_EQ(with, 4u) << r.out;  // decode and extend, full and windowed layers
}

TEST(Cli, BenchModelTimesTheModelsCases) {
  const RunResult r =
      flashkv("bench --device cpu --model gemma-2-9b --min-seconds 0 --roofline-mb 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("model: gemma-2-9b (google/gemma-2-9b)"), std::string::npos) << r.out;
  // Full and windowed layers, decode and extend, with the model's heads and soft cap.
  EXPECT_NE(r.out.find("16/8/256"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("win=4095 cap=50"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace flashkv::app
