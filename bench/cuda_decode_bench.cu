// CUDA paged-decode benchmark: the shapes of the decode issue, timed by CUDA-graph replay, against
// the device-to-device copy bandwidth measured in the same run.
//
//   cuda_decode_bench [--quick] [--small] [--csv FILE] [--min-split N] [--blocks-per-sm N]
//
// Per shape: one KV pool per input set (enough sets that they do not fit in L2 together), each a
// shuffled page-size-1 layout; the plan is made in CUDA-graph mode and one graph holds one
// paged_decode per set, so a replay reads every set once from device memory. Reported: time
// per call (median over replays), TB/s = KV bytes / time, and that as a fraction of the copy
// bandwidth. KV bytes count K and V of every token once; Q, O and indices are < 0.1%.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/ops/attention.h"

namespace {

using namespace flashkv;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

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
    if (fp8) v = static_cast<uint16_t>(h & 0xb7b7u);  // sign, exponent <= 6, any mantissa
    else v = static_cast<uint16_t>(0x3f00u | (h & 0x80ffu));  // bf16 in +-[0.5, 2)
    reinterpret_cast<uint16_t*>(dst)[i] = v;
  }
}

void fill(void* p, size_t bytes, uint32_t seed, bool fp8) {
  fill_random<<<1024, 256>>>(static_cast<unsigned char*>(p), bytes, seed, fp8 ? 1 : 0);
  check(cudaGetLastError(), "fill");
}

// Median time of `reps` runs of fn (ms), each timed with events on `s`.
template <typename F>
float median_ms(cudaStream_t s, int reps, F&& fn) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(a, s), "record");
    fn();
    check(cudaEventRecord(b, s), "record");
    check(cudaEventSynchronize(b), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "elapsed");
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Device-to-device copy bandwidth (bytes read + written per second).
double copy_bandwidth(cudaStream_t s) {
  const size_t bytes = size_t{2} << 30;
  void *a, *b;
  check(cudaMalloc(&a, bytes), "malloc");
  check(cudaMalloc(&b, bytes), "malloc");
  fill(a, bytes, 1, false);
  check(cudaDeviceSynchronize(), "sync");
  for (int i = 0; i < 3; ++i) check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s), "copy");
  const float ms = median_ms(s, 10, [&] {
    check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s), "copy");
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
  std::string csv;
};

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
  const int sets = std::clamp<int>(static_cast<int>(std::ceil(3.0 * l2_bytes / kv_bytes)), 1, 64);

  // Shuffled slots, shared by all sets (indices stay hot in L2, as after build_kv_indices).
  std::mt19937 rng(1234);
  std::vector<int32_t> perm(slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
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
  check(cudaStreamSynchronize(stream), "sync");

  AttentionOptions opt;
  auto run_set = [&](int s) {
    auto* base = static_cast<unsigned char*>(pools[s].data());
    TensorView k(base, sh.kv_dtype, {slots, sh.hkv, sh.d}, gpu);
    TensorView v(base + pool_bytes, sh.kv_dtype, {slots, sh.hkv, sh.d}, gpu);
    PagedKV kv{k, v, indptr_d, indices, TensorView(), 1};
    paged_decode(plan, q, kv, opt, out, lse, ws, Stream{stream});
  };
  for (int s = 0; s < sets; ++s) run_set(s);  // warm-up outside the graph
  check(cudaStreamSynchronize(stream), "sync");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  for (int s = 0; s < sets; ++s) run_set(s);
  check(cudaStreamEndCapture(stream, &graph), "capture");
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int i = 0; i < 3; ++i) check(cudaGraphLaunch(exec, stream), "launch");
  const int reps = o.quick ? 5 : 20;
  const float ms = median_ms(stream, reps, [&] { check(cudaGraphLaunch(exec, stream), "launch"); });
  // Sanity: the last output is finite.
  std::vector<uint16_t> h(out.numel());
  check(cudaMemcpy(h.data(), out.data(), h.size() * 2, cudaMemcpyDeviceToHost), "copy back");
  for (uint16_t x : h)
    if ((x & 0x7f80u) == 0x7f80u) {
      std::fprintf(stderr, "non-finite output\n");
      std::exit(1);
    }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  Result r;
  r.us = ms * 1e3 / sets;
  r.tbps = kv_bytes / (r.us * 1e-6) / 1e12;
  r.tokens_per_s = tokens / (r.us * 1e-6);
  const double floor_us = kv_bytes / copy_bps * 1e6;
  std::printf("%3d/%2d/%3d %-8s %4dx%-6d %9.1f MB %5d sets  items %4zu merges %3zu  %9.2f us  "
              "(floor %8.2f)  %5.2f TB/s  %5.1f%% of copy\n",
              sh.hq, sh.hkv, sh.d, dtype_name(sh.kv_dtype), sh.batch, sh.kv_len, kv_bytes / 1e6,
              sets, plan.items.size(), plan.merges.size(), r.us, floor_us, r.tbps,
              100.0 * kv_bytes / (r.us * 1e-6) / copy_bps);
  std::fflush(stdout);
  if (csv)
    std::fprintf(csv, "%d,%d,%d,%s,%d,%d,%.0f,%d,%zu,%zu,%.3f,%.3f,%.4f,%.4f\n", sh.hq, sh.hkv,
                 sh.d, dtype_name(sh.kv_dtype), sh.batch, sh.kv_len, kv_bytes, sets,
                 plan.items.size(), plan.merges.size(), r.us, floor_us, r.tbps,
                 kv_bytes / (r.us * 1e-6) / copy_bps);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") o.quick = true;
    else if (a == "--small") o.small_only = true;
    else if (a == "--csv" && i + 1 < argc) o.csv = argv[++i];
    else if (a == "--min-split" && i + 1 < argc) o.min_split = std::atoi(argv[++i]);
    else if (a == "--blocks-per-sm" && i + 1 < argc) o.blocks_per_sm = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--small] [--csv FILE] [--min-split N] [--blocks-per-sm N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!cuda_available()) {
    std::fprintf(stderr, "no GPU\n");
    return 1;
  }
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "props");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const double copy_bps = copy_bandwidth(stream);
  std::printf("device: %s, %d SMs, L2 %d MB; copy bandwidth %.2f TB/s (read + write)\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, copy_bps / 1e12);
  std::printf("options: min_split %d, blocks_per_sm %d (0 = planner default)\n", o.min_split,
              o.blocks_per_sm);
  FILE* csv = o.csv.empty() ? nullptr : std::fopen(o.csv.c_str(), "w");
  if (csv)
    std::fprintf(csv, "hq,hkv,d,kv_dtype,batch,kv_len,kv_bytes,sets,items,merges,us,floor_us,"
                      "tbps,frac_copy\n");
  const std::vector<std::pair<int, int>> bl = {{1, 1024},   {1, 4096},   {1, 32768},
                                               {16, 4096},  {64, 4096},  {256, 2048},
                                               {64, 16384}, {8, 65536}};
  std::vector<Result> bf16;
  for (auto [b, l] : bl) {
    if (o.small_only && int64_t{b} * l > 65536) break;
    bf16.push_back(run_shape({32, 8, 128, b, l, DType::bf16}, o, copy_bps, prop.l2CacheSize,
                             stream, csv));
  }
  if (o.small_only) return 0;
  run_shape({8, 1, 128, 64, 4096, DType::bf16}, o, copy_bps, prop.l2CacheSize, stream, csv);
  run_shape({32, 32, 128, 64, 4096, DType::bf16}, o, copy_bps, prop.l2CacheSize, stream, csv);
  std::printf("fp8 e4m3 KV (tokens/s vs bf16):\n");
  for (size_t i = 0; i < bl.size(); ++i) {
    const auto [b, l] = bl[i];
    if (o.quick && int64_t{b} * l < 65536) continue;
    const Result r = run_shape({32, 8, 128, b, l, DType::fp8_e4m3}, o, copy_bps,
                               prop.l2CacheSize, stream, csv);
    std::printf("    -> %.2fx bf16 tokens/s\n", r.tokens_per_s / bf16[i].tokens_per_s);
  }
  if (csv) std::fclose(csv);
  return 0;
}
