// CUDA paged-decode benchmark: the shapes of the decode issue, timed by CUDA-graph replay, against
// the device-to-device copy bandwidth measured in the same run.
//
//   cuda_decode_bench [--quick] [--small] [--csv FILE] [--min-split N] [--blocks-per-sm N]
//                     [--layout-after-wait]  (without AttentionOptions::layout_ready)
//                     [--shape BxL]  (only batch B x KV length L of 32/8/128, bf16 then fp8;
//                                     e.g. for a profiler)
//                     [--in-order]   (slots in token order instead of shuffled)
//                     [--calls N]    (decode calls per graph; default max(8, sets))
//
// Per shape: one KV pool per input set (at least two, and enough that they do not fit in L2
// together), each a shuffled page-size-1 layout; the plan is made in CUDA-graph mode and one
// graph holds at least 8 paged_decode calls back to back, over the sets in turn, so a call never
// finds its KV in L2 and the graph's own launch is spread over many calls (a graph of one call
// times the graph launch too: 4 - 5 us more a call). Reported: time per call (median over
// replays), TB/s = KV bytes / time, and that as a fraction of the copy bandwidth. KV bytes count
// K and V of every token once; Q, O and indices are < 0.1%.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "flashkv/core/buffer.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/ops/attention.h"
#ifdef FLASHKV_DECODE_TRACE
#include "flashkv/kernels/decode_trace.h"
#endif

namespace {

using namespace flashkv;

using bench::detail::EventTimer;
using detail::cuda_check;

// Fills n bytes with finite pseudo-random values of dtype t (bf16 in [-1, 1); fp8 bytes with
// the exponent kept small so values stay finite).
__global__ void fill_random(unsigned char* dst, size_t n, uint32_t seed, int fp8) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n / 2;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    uint16_t v;
    if (fp8)
      v = static_cast<uint16_t>(h & 0xb7b7u);  // sign, exponent <= 6, any mantissa
    else
      v = static_cast<uint16_t>(0x3f00u | (h & 0x80ffu));  // bf16 in +-[0.5, 2)
    reinterpret_cast<uint16_t*>(dst)[i] = v;
  }
}

void fill(void* p, size_t bytes, uint32_t seed, bool fp8) {
  fill_random<<<1024, 256>>>(static_cast<unsigned char*>(p), bytes, seed, fp8 ? 1 : 0);
  cuda_check(cudaGetLastError(), "fill");
}

// Median time of `reps` runs of fn (ms), each timed with events on `s`.
float median_ms(cudaStream_t s, int reps, const std::function<void()>& fn) {
  return EventTimer(Stream{s}).median_ms(reps, fn);
}

// Device-to-device copy bandwidth (bytes read + written per second).
double copy_bandwidth(cudaStream_t s) {
  const size_t bytes = size_t{2} << 30;
  void *a, *b;
  cuda_check(cudaMalloc(&a, bytes), "malloc");
  cuda_check(cudaMalloc(&b, bytes), "malloc");
  fill(a, bytes, 1, false);
  cuda_check(cudaDeviceSynchronize(), "sync");
  for (int i = 0; i < 3; ++i)
    cuda_check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s), "copy");
  const float ms = median_ms(s, 10, [&] {
    cuda_check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s), "copy");
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (ms * 1e-3);
}

struct Shape {
  int hq, hkv, d, batch, kv_len;
  DType kv_dtype;
};

struct Options {
  bool quick = false;
  bool small_only = false;  // the four shapes with < 1M tokens x heads (bf16 only)
  int min_split = 0;
  int blocks_per_sm = 0;
  bool layout_ready = true;          // as the backend calls it
  int only_batch = 0, only_len = 0;  // --shape: one batch x length of 32/8/128
  bool in_order = false;             // --in-order: slots in token order (adjacent rows)
  int calls = 0;                     // --calls: decode calls per graph (0: max(8, sets))
  std::string csv;
};

#ifdef FLASHKV_DECODE_TRACE
// When each SM's CTAs end their streams (last tile computed, from the launch's first wait
// release): the spread over SMs, and whether the late SMs are the same ones launch after
// launch (the correlation of an SM's mean end over the even and the odd launches). Systematic
// lateness would favour balancing by SM; random lateness, finer dynamic work.
void print_stream_ends(const std::vector<cuda::decode_detail::TraceRecord>& rec, size_t per,
                       int sets) {
  constexpr int kMaxSm = 256;
  std::vector<double> sum[2], n[2];
  for (auto* v : {&sum[0], &sum[1], &n[0], &n[1]}) v->assign(kMaxSm, 0.0);
  std::vector<double> p10, p50, p90, pmax;
  for (int k = 1; k < sets; ++k) {
    const auto* b = &rec[k * per];
    uint64_t wait_first = ~0ull;
    for (size_t i = 0; i < per; ++i)
      if (b[i].items > 0) wait_first = std::min(wait_first, b[i].gt[1]);
    std::vector<double> sm_end(kMaxSm, -1.0);
    for (size_t i = 0; i < per; ++i) {
      if (b[i].items == 0 || b[i].smid < 0 || b[i].smid >= kMaxSm) continue;
      const double t = (double(b[i].gt[5]) - double(wait_first)) * 1e-3;
      sm_end[b[i].smid] = std::max(sm_end[b[i].smid], t);
    }
    std::vector<double> ends;
    for (int s = 0; s < kMaxSm; ++s) {
      if (sm_end[s] < 0) continue;
      ends.push_back(sm_end[s]);
      sum[k % 2][s] += sm_end[s];
      n[k % 2][s] += 1;
    }
    std::sort(ends.begin(), ends.end());
    if (ends.empty()) continue;
    p10.push_back(ends[ends.size() / 10]);
    p50.push_back(ends[ends.size() / 2]);
    p90.push_back(ends[ends.size() * 9 / 10]);
    pmax.push_back(ends.back());
  }
  double sx = 0, sy = 0, sxx = 0, syy = 0, sxy = 0, m = 0;
  std::vector<std::pair<double, int>> late;
  for (int s = 0; s < kMaxSm; ++s) {
    if (n[0][s] == 0 || n[1][s] == 0) continue;
    const double x = sum[0][s] / n[0][s], y = sum[1][s] / n[1][s];
    sx += x, sy += y, sxx += x * x, syy += y * y, sxy += x * y, m += 1;
    late.push_back({(x + y) / 2, s});
  }
  if (m < 2 || p50.empty()) return;
  const double cov = sxy / m - sx / m * sy / m;
  const double corr = cov / std::sqrt((sxx / m - sx / m * sx / m) * (syy / m - sy / m * sy / m));
  auto mean = [](const std::vector<double>& v) {
    double t = 0;
    for (double x : v) t += x;
    return t / v.size();
  };
  std::sort(late.rbegin(), late.rend());
  std::printf(
      "  stream ends by SM, us from the first wait release (mean over launches): p10 %.2f, "
      "median %.2f, p90 %.2f, max %.2f; even/odd launch correlation %.2f; latest SMs:",
      mean(p10), mean(p50), mean(p90), mean(pmax), corr);
  for (size_t i = 0; i < std::min<size_t>(8, late.size()); ++i)
    std::printf(" %d (%.2f)", late[i].second, late[i].first);
  std::printf("\n");
}

// One replay's timeline (see flashkv/kernels/decode_trace.h): per launch of the graph (the first
// left out), the release gap and span, and per CTA the phase durations; medians over launches.
void print_trace(cudaGraphExec_t exec, cudaStream_t stream, int sets) {
  using cuda::decode_detail::TraceRecord;
  cuda::decode_detail::decode_trace_reset();
  cuda_check(cudaGraphLaunch(exec, stream), "launch");
  cuda_check(cudaStreamSynchronize(stream), "sync");
  const std::vector<TraceRecord> rec = cuda::decode_detail::decode_trace_take();
  if (rec.size() < 2 * size_t(sets) || rec.size() % sets != 0) {
    std::printf("  trace: %zu records for %d launches\n", rec.size(), sets);
    return;
  }
  const size_t per = rec.size() / sets;
  double gt_sum = 0, clk_sum = 0;
  for (const TraceRecord& r : rec)
    gt_sum += double(r.gt[8] - r.gt[0]), clk_sum += double(r.clk[8] - r.clk[0]);
  const double us_per_clk = gt_sum / clk_sum * 1e-3;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  auto vmax = [](const std::vector<double>& v) {
    return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end());
  };
  // Working CTAs (with items): views, indices, first KV, tiles, count, rest (to exit).
  constexpr int kW = 6;
  const int w_from[kW] = {1, 2, 3, 4, 5, 6}, w_to[kW] = {2, 3, 4, 5, 6, 8};
  const char* w_name[kW] = {"views", "indices", "firstKV", "tiles", "count", "to-exit"};
  // Merging CTAs: count, first merge batch, rest; and their loop end / exit from wait_first.
  std::vector<double> period, gap, span, spread, w_med[kW], w_max[kW], m_count, m_first, m_rest,
      m_loop_end, m_exit, n_merging;
  for (int k = 1; k < sets; ++k) {
    const TraceRecord* a = &rec[(k - 1) * per];
    const TraceRecord* b = &rec[k * per];
    uint64_t prev_exit = 0, exit = 0, wait_first = ~0ull, enter_first = ~0ull, enter_last = 0;
    for (size_t i = 0; i < per; ++i) prev_exit = std::max(prev_exit, a[i].gt[8]);
    for (size_t i = 0; i < per; ++i) {
      exit = std::max(exit, b[i].gt[8]);
      wait_first = std::min(wait_first, b[i].gt[1]);
      enter_first = std::min(enter_first, b[i].gt[0]);
      enter_last = std::max(enter_last, b[i].gt[0]);
    }
    std::vector<double> ph[kW], mc, mf, mr, ml, me;
    for (size_t i = 0; i < per; ++i) {
      const TraceRecord& r = b[i];
      if (r.items == 0) continue;
      for (int j = 0; j < kW; ++j)
        ph[j].push_back(double(r.clk[w_to[j]] - r.clk[w_from[j]]) * us_per_clk);
      if (r.merged > 0) {
        mc.push_back(double(r.clk[6] - r.clk[5]) * us_per_clk);
        mf.push_back(double(r.clk[7] - r.clk[6]) * us_per_clk);
        mr.push_back(double(r.clk[8] - r.clk[7]) * us_per_clk);
        ml.push_back((double(r.gt[5]) - double(wait_first)) * 1e-3);
        me.push_back((double(r.gt[8]) - double(wait_first)) * 1e-3);
      }
    }
    period.push_back((double(exit) - double(prev_exit)) * 1e-3);
    gap.push_back((double(wait_first) - double(prev_exit)) * 1e-3);
    span.push_back((double(exit) - double(wait_first)) * 1e-3);
    spread.push_back((double(enter_last) - double(enter_first)) * 1e-3);
    for (int j = 0; j < kW; ++j) w_med[j].push_back(median(ph[j])), w_max[j].push_back(vmax(ph[j]));
    m_count.push_back(median(mc)), m_first.push_back(median(mf)), m_rest.push_back(median(mr));
    m_loop_end.push_back(median(ml)), m_exit.push_back(vmax(me));
    n_merging.push_back(double(mc.size()));
  }
  std::printf(
      "  trace: %zu CTAs a launch; period %.2f us = release gap %.2f + span %.2f "
      "(entries spread %.2f)\n",
      per, median(period), median(gap), median(span), median(spread));
  std::printf("  working CTAs, us median/max:");
  for (int j = 0; j < kW; ++j)
    std::printf(" %s %.2f/%.2f", w_name[j], median(w_med[j]), median(w_max[j]));
  std::printf(
      "\n  merging CTAs (%.0f): count %.2f, first batch %.2f, rest %.2f; loop end at %.2f, "
      "last exit at %.2f (from the first wait release)\n",
      median(n_merging), median(m_count), median(m_first), median(m_rest), median(m_loop_end),
      median(m_exit));
  print_stream_ends(rec, per, sets);
}

#endif

struct Result {
  double us, tbps, tokens_per_s;
};

Result run_shape(const Shape& sh, const Options& o, double copy_bps, int l2_bytes,
                 cudaStream_t stream, FILE* csv) {
  const Device gpu = Device::cuda();
  const DType qt = DType::bf16;
  const size_t esz = is_fp8(sh.kv_dtype) ? 1 : 2;
  const int64_t tokens = int64_t{sh.batch} * sh.kv_len;
  const int64_t slots = tokens + 64;
  const size_t pool_bytes = size_t(slots) * sh.hkv * sh.d * esz;  // one of K or V
  const double kv_bytes = 2.0 * tokens * sh.hkv * sh.d * esz;
  const int sets = std::clamp<int>(static_cast<int>(std::ceil(3.0 * l2_bytes / kv_bytes)), 2, 64);
  int calls = o.calls > 0 ? o.calls : std::max(sets, 8);
#ifdef FLASHKV_DECODE_TRACE
  calls = std::max(calls, 9);  // the trace measures launches after another (even and odd)
#endif

  // Shuffled slots (token order with --in-order), shared by all sets (indices stay hot in L2, as
  // after build_kv_indices).
  std::mt19937 rng(1234);
  std::vector<int32_t> perm(slots);
  std::iota(perm.begin(), perm.end(), 0);
  if (!o.in_order) std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> lens(sh.batch, sh.kv_len), indptr(sh.batch + 1);
  for (int i = 0; i <= sh.batch; ++i) indptr[i] = i * sh.kv_len;
  Tensor indices = Tensor::from_i32(std::vector<int32_t>(perm.begin(), perm.begin() + tokens), gpu);
  Tensor indptr_d = Tensor::from_i32(indptr, gpu);

  std::vector<Buffer> pools;
  for (int s = 0; s < sets; ++s) {
    pools.emplace_back(2 * pool_bytes, gpu);
    fill(pools.back().data(), 2 * pool_bytes, 77 + s, is_fp8(sh.kv_dtype));
  }
  Tensor q = Tensor::empty({sh.batch, sh.hq, sh.d}, qt, gpu);
  fill(q.data(), q.view().nbytes(), 5, false);
  Tensor out = Tensor::empty({sh.batch, sh.hq, sh.d}, qt, gpu);
  Tensor lse = Tensor::empty({sh.batch, sh.hq}, DType::f32, gpu);

  BatchShape bs;
  bs.batch_size = sh.batch;
  bs.kv_len = lens.data();
  bs.num_qo_heads = sh.hq;
  bs.num_kv_heads = sh.hkv;
  bs.head_dim_qk = bs.head_dim_v = sh.d;
  PlanOptions po;
  po.cuda_graph = true;
  po.max_batch_size = sh.batch;
  po.min_split_size = o.min_split;
  po.blocks_per_sm = o.blocks_per_sm;
  const DecodePlan plan = plan_decode(bs, device_info(gpu), po);
  Workspace ws(plan.layout.total_bytes, gpu);
  ws.upload(plan, Stream{stream});
  cuda_check(cudaStreamSynchronize(stream), "sync");

  AttentionOptions opt;
  opt.layout_ready = o.layout_ready;  // the indices were copied before the graph
  auto run_set = [&](int s) {
    auto* base = static_cast<unsigned char*>(pools[s].data());
    TensorView k(base, sh.kv_dtype, {slots, sh.hkv, sh.d}, gpu);
    TensorView v(base + pool_bytes, sh.kv_dtype, {slots, sh.hkv, sh.d}, gpu);
    PagedKV kv{k, v, indptr_d, indices, TensorView(), 1};
    paged_decode(plan, q, kv, opt, out, lse, ws, Stream{stream});
  };
  for (int s = 0; s < sets; ++s) run_set(s);  // warm-up outside the graph
  cuda_check(cudaStreamSynchronize(stream), "sync");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  for (int i = 0; i < calls; ++i) run_set(i % sets);
  cuda_check(cudaStreamEndCapture(stream, &graph), "capture");
  cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int i = 0; i < 3; ++i) cuda_check(cudaGraphLaunch(exec, stream), "launch");
  const int reps = o.quick ? 5 : 20;
  const float ms =
      median_ms(stream, reps, [&] { cuda_check(cudaGraphLaunch(exec, stream), "launch"); });
#ifdef FLASHKV_DECODE_TRACE
  if (sh.d == 128) print_trace(exec, stream, calls);
#endif
  // Sanity: the last output is finite.
  std::vector<uint16_t> h(out.numel());
  cuda_check(cudaMemcpy(h.data(), out.data(), h.size() * 2, cudaMemcpyDeviceToHost), "copy back");
  for (uint16_t x : h)
    if ((x & 0x7f80u) == 0x7f80u) {
      std::fprintf(stderr, "non-finite output\n");
      std::exit(1);
    }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  Result r;
  r.us = ms * 1e3 / calls;
  r.tbps = kv_bytes / (r.us * 1e-6) / 1e12;
  r.tokens_per_s = tokens / (r.us * 1e-6);
  const double floor_us = kv_bytes / copy_bps * 1e6;
  std::printf(
      "%3d/%2d/%3d %-8s %4dx%-6d %9.1f MB %2d sets %2d calls  items %4zu merges %3zu  %9.2f us  "
      "(floor %8.2f)  %5.2f TB/s  %5.1f%% of copy\n",
      sh.hq, sh.hkv, sh.d, dtype_name(sh.kv_dtype), sh.batch, sh.kv_len, kv_bytes / 1e6, sets,
      calls, plan.items.size(), plan.merges.size(), r.us, floor_us, r.tbps,
      100.0 * kv_bytes / (r.us * 1e-6) / copy_bps);
  std::fflush(stdout);
  if (csv)
    std::fprintf(csv, "%d,%d,%d,%s,%d,%d,%.0f,%d,%d,%zu,%zu,%.3f,%.3f,%.4f,%.4f\n", sh.hq, sh.hkv,
                 sh.d, dtype_name(sh.kv_dtype), sh.batch, sh.kv_len, kv_bytes, sets, calls,
                 plan.items.size(), plan.merges.size(), r.us, floor_us, r.tbps,
                 kv_bytes / (r.us * 1e-6) / copy_bps);
  return r;
}

// Every shape of the run, after the options are read.
int run_all(const Options& o) {
  cudaDeviceProp prop;
  cuda_check(cudaGetDeviceProperties(&prop, 0), "props");
  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const double copy_bps = copy_bandwidth(stream);
  std::printf("device: %s, %d SMs, L2 %d MB; copy bandwidth %.2f TB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, copy_bps / 1e12);
  std::printf("options: min_split %d, blocks_per_sm %d (0 = planner default)\n", o.min_split,
              o.blocks_per_sm);
  FILE* csv = o.csv.empty() ? nullptr : std::fopen(o.csv.c_str(), "w");
  if (csv)
    std::fprintf(csv,
                 "hq,hkv,d,kv_dtype,batch,kv_len,kv_bytes,sets,calls,items,merges,us,floor_us,"
                 "tbps,frac_copy\n");
  std::vector<std::pair<int, int>> bl = {{1, 1024},  {1, 4096},   {1, 32768},  {16, 4096},
                                         {64, 4096}, {256, 2048}, {64, 16384}, {8, 65536}};
  if (o.only_batch > 0) bl = {{o.only_batch, o.only_len}};
  std::vector<Result> bf16;
  for (auto [b, l] : bl) {
    if (o.small_only && int64_t{b} * l > 65536) break;
    bf16.push_back(
        run_shape({32, 8, 128, b, l, DType::bf16}, o, copy_bps, prop.l2CacheSize, stream, csv));
  }
  if (o.small_only) return 0;
  if (o.only_batch == 0) {
    run_shape({8, 1, 128, 64, 4096, DType::bf16}, o, copy_bps, prop.l2CacheSize, stream, csv);
    run_shape({32, 32, 128, 64, 4096, DType::bf16}, o, copy_bps, prop.l2CacheSize, stream, csv);
  }
  std::printf("fp8 e4m3 KV (tokens/s vs bf16):\n");
  for (size_t i = 0; i < bl.size(); ++i) {
    const auto [b, l] = bl[i];
    if (o.quick && o.only_batch == 0 && int64_t{b} * l < 65536) continue;
    const Result r =
        run_shape({32, 8, 128, b, l, DType::fp8_e4m3}, o, copy_bps, prop.l2CacheSize, stream, csv);
    std::printf("    -> %.2fx bf16 tokens/s\n", r.tokens_per_s / bf16[i].tokens_per_s);
  }
  if (csv) std::fclose(csv);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      o.quick = true;
    else if (a == "--small")
      o.small_only = true;
    else if (a == "--csv" && i + 1 < argc)
      o.csv = argv[++i];
    else if (a == "--min-split" && i + 1 < argc)
      o.min_split = std::atoi(argv[++i]);
    else if (a == "--blocks-per-sm" && i + 1 < argc)
      o.blocks_per_sm = std::atoi(argv[++i]);
    else if (a == "--layout-after-wait")
      o.layout_ready = false;
    else if (a == "--calls" && i + 1 < argc && (o.calls = std::atoi(argv[++i])) > 0)
      continue;
    else if (a == "--in-order")
      o.in_order = true;
    else if (a == "--shape" && i + 1 < argc &&
             std::sscanf(argv[++i], "%dx%d", &o.only_batch, &o.only_len) == 2 && o.only_batch > 0 &&
             o.only_len > 0)
      continue;
    else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--small] [--csv FILE] [--min-split N] [--blocks-per-sm N] "
                   "[--layout-after-wait] [--shape BxL] [--in-order] [--calls N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!cuda_available()) {
    std::fprintf(stderr, "no GPU\n");
    return 1;
  }
  try {
    return run_all(o);
  } catch (const Error& e) {  // a failed CUDA call (detail::cuda_check) or a rejected shape
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
