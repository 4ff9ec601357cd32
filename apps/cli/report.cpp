#include "report.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cp_session.h"
#include "flashkv/core/error.h"
#include "json.h"

namespace flashkv::bench {
using app::json_number;
using app::json_string;
namespace {

std::string fixed(double x, int decimals) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, x);
  return buf;
}

std::string table_header() {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%-8s %5s %6s %7s %-11s %3s %-8s %-14s %11s %9s %8s %6s %6s", "op",
                "batch", "qo_len", "kv_len", "Hq/Hkv/D", "P", "slots", "dtype/kv", "us", "GB/s",
                "TFLOP/s", "roof", "sust");
  return buf;
}

// A case's columns, up to the roofline fractions (single and sustained GEMM; "-" where the
// sustained one is not measured).
std::string table_columns(const CaseResult& r) {
  const BenchCase& c = r.c;
  const std::string heads = str_cat(c.num_qo_heads, "/", c.num_kv_heads, "/", c.head_dim);
  const std::string types = str_cat(dtype_name(c.dtype), "/", dtype_name(c.kv_dtype));
  char sustained[16] = "     -";
  if (r.sustained_fraction > 0)
    std::snprintf(sustained, sizeof sustained, "%5.1f%%", 100.0 * r.sustained_fraction);
  char buf[220];
  std::snprintf(
      buf, sizeof buf, "%-8s %5d %6d %7d %-11s %3d %-8s %-14s %11.1f %9.1f %8.3f %5.1f%% %s",
      op_name(c.op), c.batch, c.qo_len, c.kv_len, heads.c_str(), c.page_size, c.layout_name(),
      types.c_str(), r.us, r.gbps, r.tflops, 100.0 * r.roofline_fraction, sustained);
  return buf;
}

// A time ratio as a signed change: 1.004 -> "+0.4%".
std::string signed_percent(double ratio) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%+.1f%%", 100.0 * (ratio - 1.0));
  return buf;
}

}  // namespace

void print_machine(std::ostream& os, const Roofline& m) {
  os << "machine: " << m.name << " (" << m.device.str() << ", " << m.cores_or_sms
     << (m.device.is_cpu() ? " threads" : " SMs") << "): read " << fixed(m.read_gbps, 1)
     << " GB/s, copy " << fixed(m.copy_gbps, 1) << " GB/s, matmul " << fixed(m.matmul_gflops, 0)
     << " GFLOP/s (" << m.matmul_kind << ")";
  if (m.matmul_sustained_gflops > 0)
    os << ", " << fixed(m.matmul_sustained_gflops, 0) << " GFLOP/s sustained";
  os << "\n";
}

void print_table_header(std::ostream& os) { os << table_header() << "\n"; }

void print_table_row(std::ostream& os, const CaseResult& r) {
  const BenchCase& c = r.c;
  os << table_columns(r);
  // A model's case (bench --model): its window, soft cap and sinks.
  if (c.window_left >= 0) os << " win=" << c.window_left;
  if (c.logit_cap > 0) os << " cap=" << c.logit_cap;
  if (c.sinks) os << " sinks";
  if (c.one_paged_pass) os << " one-pass";  // an extend as one paged pass
  if (!c.env.empty()) os << " " << c.env;   // bench --ab's twin: the switch it runs under
  // A paired case: its time against its twin's (the row above), timed in alternating rounds.
  if (c.paired && r.rounds > 0)
    os << " (" << signed_percent(r.vs_twin) << " vs the row above; " << r.rounds
       << " rounds: " << signed_percent(r.vs_twin_min) << " .. " << signed_percent(r.vs_twin_max)
       << ")";
  // Masks other than the op's usual one: non-causal new tokens, verify's tree.
  const std::string mask = c.mask_name();
  if (mask == "non-causal") os << " non-causal";
  if (mask == "tree") os << " tree-mask";
  os << "\n";
}

void print_plan_row(std::ostream& os, const PlanResult& r) {
  const PlanCase& c = r.c;
  os << "plan (host) " << plan_kind_name(c.kind) << " B=" << c.batch << " new=1.." << c.q_max
     << (c.max_kv > 0 ? str_cat(" prefix=0..", c.max_kv) : std::string(" no prefix")) << " on "
     << c.device.device.str() << ": " << fixed(r.t.median_us, 2) << " us median, "
     << fixed(r.t.min_us, 2) << " us min (" << r.t.plans
     << (r.t.plans == 1 ? " plan: " : " plans: ") << r.t.summary() << ")\n";
}

void print_cp_header(std::ostream& os, int ranks, const std::string& communicator) {
  os << "context parallelism: " << ranks << (ranks == 1 ? " rank (" : " ranks (") << communicator
     << "): each case on rank 0 alone, then sharded across the group (us: the slowest rank's; "
        "roof: of "
     << ranks << " x the machine)\n"
     << table_header() << " ranks speed-up\n";
}

void print_cp_case(std::ostream& os, const CpCaseResult& r) {
  char buf[64];
  std::snprintf(buf, sizeof buf, " %5d", 1);
  os << table_columns(r.one_rank) << buf << "\n";
  const int ranks = static_cast<int>(r.sharded_phases.size());
  std::snprintf(buf, sizeof buf, " %5d %7.2fx", ranks, r.speedup);
  os << table_columns(r.sharded) << buf << "\n";
  os << "  " << ranks << (ranks == 1 ? " rank, " : " ranks, ") << app::cp_layout_str(r.options)
     << ", " << app::cp_exchange_str(r.options)
     << (r.options.kv_pass == parallel::CpKvPass::ring ? ", new K/V by ring" : "")
     << "; where each rank's median call spent its time:\n";
  auto line = [&](const char* who, int rank, const parallel::CpTiming& t) {
    const double sum = t.total_us() > 0 ? t.total_us() : 1;
    os << "    " << who << " rank " << rank << ": local " << fixed(t.local_us, 1) << " us ("
       << fixed(100 * t.local_us / sum, 0) << "%), comm " << fixed(t.comm_us, 1) << " us ("
       << fixed(100 * t.comm_us / sum, 0) << "%), merge " << fixed(t.merge_us, 1) << " us ("
       << fixed(100 * t.merge_us / sum, 0) << "%)\n";
  };
  for (const parallel::CpTiming& t : r.one_rank_phases) line("alone:  ", 0, t);
  for (size_t s = 0; s < r.sharded_phases.size(); ++s)
    line("sharded:", static_cast<int>(s), r.sharded_phases[s]);
}

void print_table(std::ostream& os, const BenchReport& report) {
  print_machine(os, report.machine);
  print_table_header(os);
  for (const CaseResult& r : report.cases) print_table_row(os, r);
  for (const PlanResult& r : report.plans) print_plan_row(os, r);
}

std::string to_json(const BenchReport& report) {
  const Roofline& m = report.machine;
  std::ostringstream os;
  os << "{\n  \"machine\": {\"device\": " << json_string(m.device.str())
     << ", \"name\": " << json_string(m.name)
     << ", \"cores\": " << (m.device.is_cpu() ? m.cores_or_sms : 0)
     << ", \"sms\": " << (m.device.is_cuda() ? m.cores_or_sms : 0)
     << ", \"read_gbps\": " << json_number(m.read_gbps)
     << ", \"copy_gbps\": " << json_number(m.copy_gbps)
     << ", \"matmul_gflops\": " << json_number(m.matmul_gflops)
     << ", \"matmul_kind\": " << json_string(m.matmul_kind)
     << ", \"matmul_sustained_gflops\": " << json_number(m.matmul_sustained_gflops)
     << ", \"buffer_bytes\": " << m.buffer_bytes << "},\n  \"cases\": [";
  for (size_t i = 0; i < report.cases.size(); ++i) {
    const CaseResult& r = report.cases[i];
    const BenchCase& c = r.c;
    os << (i ? ",\n" : "\n") << "    {\"op\": " << json_string(op_name(c.op))
       << ", \"device\": " << json_string(c.device.str()) << ", \"batch\": " << c.batch
       << ", \"qo_len\": " << c.qo_len << ", \"kv_len\": " << c.kv_len
       << ", \"prefix_len\": " << c.prefix_len() << ", \"num_qo_heads\": " << c.num_qo_heads
       << ", \"num_kv_heads\": " << c.num_kv_heads << ", \"head_dim\": " << c.head_dim
       << ", \"page_size\": " << c.page_size << ", \"kv_layout\": " << json_string(c.layout_name())
       << ", \"dtype\": " << json_string(dtype_name(c.dtype))
       << ", \"kv_dtype\": " << json_string(dtype_name(c.kv_dtype))
       << ", \"us\": " << json_number(r.us) << ", \"gbps\": " << json_number(r.gbps)
       << ", \"tflops\": " << json_number(r.tflops)
       << ", \"roofline_fraction\": " << json_number(r.roofline_fraction)
       << ", \"sustained_fraction\": " << json_number(r.sustained_fraction)
       << ", \"runs\": " << r.runs << ", \"cuda_graph\": " << (r.cuda_graph ? "true" : "false")
       << ", \"window_left\": " << c.window_left << ", \"logit_cap\": " << json_number(c.logit_cap)
       << ", \"sinks\": " << (c.sinks ? "true" : "false")
       << ", \"one_paged_pass\": " << (c.one_paged_pass ? "true" : "false")
       << ", \"mask\": " << json_string(c.mask_name()) << ", \"env\": " << json_string(c.env);
    if (c.paired)
      os << ", \"vs_twin\": " << json_number(r.vs_twin)
         << ", \"vs_twin_min\": " << json_number(r.vs_twin_min)
         << ", \"vs_twin_max\": " << json_number(r.vs_twin_max) << ", \"rounds\": " << r.rounds;
    os << "}";
  }
  os << (report.cases.empty() ? "]" : "\n  ]") << ",\n  \"plans\": [";
  for (size_t i = 0; i < report.plans.size(); ++i) {
    const PlanResult& r = report.plans[i];
    os << (i ? ",\n" : "\n") << "    {\"kind\": " << json_string(plan_kind_name(r.c.kind))
       << ", \"device\": " << json_string(r.c.device.device.str()) << ", \"batch\": " << r.c.batch
       << ", \"max_new\": " << r.c.q_max << ", \"max_prefix\": " << r.c.max_kv
       << ", \"median_us\": " << json_number(r.t.median_us)
       << ", \"min_us\": " << json_number(r.t.min_us) << ", \"plans\": " << r.t.plans
       << ", \"items\": " << r.t.items << ", \"merges\": " << r.t.merges
       << ", \"workers\": " << r.t.workers << "}";
  }
  os << (report.plans.empty() ? "]" : "\n  ]");
  if (report.cp.ranks > 0) {
    os << ",\n  \"cp\": {\"ranks\": " << report.cp.ranks
       << ", \"communicator\": " << json_string(report.cp.communicator) << ", \"cases\": [";
    auto run = [&](const CaseResult& r, const std::vector<parallel::CpTiming>& phases) {
      os << "{\"us\": " << json_number(r.us) << ", \"gbps\": " << json_number(r.gbps)
         << ", \"tflops\": " << json_number(r.tflops)
         << ", \"roofline_fraction\": " << json_number(r.roofline_fraction)
         << ", \"sustained_fraction\": " << json_number(r.sustained_fraction)
         << ", \"runs\": " << r.runs << ", \"phases\": [";
      for (size_t s = 0; s < phases.size(); ++s)
        os << (s ? ", " : "") << "{\"rank\": " << s
           << ", \"local_us\": " << json_number(phases[s].local_us)
           << ", \"comm_us\": " << json_number(phases[s].comm_us)
           << ", \"merge_us\": " << json_number(phases[s].merge_us) << "}";
      os << "]}";
    };
    for (size_t i = 0; i < report.cp.cases.size(); ++i) {
      const CpCaseResult& r = report.cp.cases[i];
      const BenchCase& c = r.one_rank.c;
      os << (i ? ",\n" : "\n") << "    {\"op\": " << json_string(op_name(c.op))
         << ", \"device\": " << json_string(c.device.str()) << ", \"batch\": " << c.batch
         << ", \"qo_len\": " << c.qo_len << ", \"kv_len\": " << c.kv_len
         << ", \"prefix_len\": " << c.prefix_len() << ", \"num_qo_heads\": " << c.num_qo_heads
         << ", \"num_kv_heads\": " << c.num_kv_heads << ", \"head_dim\": " << c.head_dim
         << ", \"page_size\": " << c.page_size
         << ", \"kv_layout\": " << json_string(c.layout_name())
         << ", \"dtype\": " << json_string(dtype_name(c.dtype))
         << ", \"kv_dtype\": " << json_string(dtype_name(c.kv_dtype))
         << ", \"mask\": " << json_string(c.mask_name()) << ", \"layout\": "
         << json_string(r.options.layout == parallel::CpLayout::interleaved ? "interleaved"
                                                                            : "contiguous")
         << ", \"block\": " << r.options.block
         << ", \"exchange\": " << json_string(app::cp_exchange_str(r.options))
         << ", \"kv_pass\": " << json_string(app::cp_kv_pass_str(r.options))
         << ", \"speedup\": " << json_number(r.speedup) << ",\n     \"one_rank\": ";
      run(r.one_rank, r.one_rank_phases);
      os << ",\n     \"sharded\": ";
      run(r.sharded, r.sharded_phases);
      os << "}";
    }
    os << (report.cp.cases.empty() ? "]}" : "\n  ]}");
  }
  os << "\n}\n";
  return os.str();
}

std::string to_csv(const BenchReport& report) {
  std::ostringstream os;
  os << "op,device,batch,qo_len,kv_len,prefix_len,num_qo_heads,num_kv_heads,head_dim,page_size,"
        "kv_layout,dtype,kv_dtype,us,gbps,tflops,roofline_fraction,sustained_fraction,runs,"
        "cuda_graph,window_left,logit_cap,sinks,one_paged_pass,mask,env,vs_twin,vs_twin_min,"
        "vs_twin_max,rounds\n";
  for (const CaseResult& r : report.cases) {
    const BenchCase& c = r.c;
    os << op_name(c.op) << ',' << c.device.str() << ',' << c.batch << ',' << c.qo_len << ','
       << c.kv_len << ',' << c.prefix_len() << ',' << c.num_qo_heads << ',' << c.num_kv_heads << ','
       << c.head_dim << ',' << c.page_size << ',' << c.layout_name() << ',' << dtype_name(c.dtype)
       << ',' << dtype_name(c.kv_dtype) << ',' << json_number(r.us) << ',' << json_number(r.gbps)
       << ',' << json_number(r.tflops) << ',' << json_number(r.roofline_fraction) << ','
       << json_number(r.sustained_fraction) << ',' << r.runs << ',' << (r.cuda_graph ? 1 : 0) << ','
       << c.window_left << ',' << json_number(c.logit_cap) << ',' << (c.sinks ? 1 : 0) << ','
       << (c.one_paged_pass ? 1 : 0) << ',' << c.mask_name() << ',' << c.env;
    // A paired case's ratio to its twin (empty for the others, as the JSON leaves them out).
    if (c.paired)
      os << ',' << json_number(r.vs_twin) << ',' << json_number(r.vs_twin_min) << ','
         << json_number(r.vs_twin_max) << ',' << r.rounds;
    else
      os << ",,,,";
    os << '\n';
  }
  return os.str();
}

}  // namespace flashkv::bench
