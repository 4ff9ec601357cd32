// CUDA prefill benchmark on Llama-3-8B attention shapes (Hq 32, Hkv 8, D 128, bf16): causal
// self-attention and extend (new tokens on a cached prefix, page size 1). Prints time, TFLOP/s
// (4 * Hq * D * (new * prefix + new * (new + 1) / 2) per request) and the fraction of two
// ceilings measured in the same run: a cuBLAS bf16 GEMM and a pure mma.sync loop.
//
//   cuda_prefill_bench [--iters N] [--csv FILE] [--case causal|extend]  (only that kind)
//                      [--causal B:N[,B:N...]]  (the causal cases: B requests of N tokens each;
//                                                 default 1:8192,4:4096,1:16384)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/kernels/kernels.h"
#include "flashkv/ops/attention.h"

namespace {

using namespace flashkv;

using bench::detail::EventTimer;
using detail::cuda_check;

void cublas_check(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: cuBLAS status %d\n", what, static_cast<int>(e));
    std::exit(1);
  }
}

// Uniform values in [-sqrt(3), sqrt(3)) (unit variance) from a counter hash: fast for GBs.
__global__ void fill_random(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (static_cast<uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float u = static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
    p[i] = __float2bfloat16((u * 2.0f - 1.0f) * 1.7320508f);
  }
}

Tensor random_bf16(std::initializer_list<int64_t> shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::bf16, Device::cuda());
  fill_random<<<1024, 256>>>(static_cast<__nv_bfloat16*>(t.data()), t.numel(), seed);
  cuda_check(cudaGetLastError(), "fill_random");
  return t;
}

// Median time (us) of `iters` runs of fn, after 3 warm-up runs, with CUDA events.
double median_us(const std::function<void()>& fn, int iters) {
  for (int i = 0; i < 3; ++i) fn();
  cuda_check(cudaDeviceSynchronize(), "warm-up");
  return EventTimer(Stream{}).median_ms(iters, fn) * 1e3;
}

double gemm_tflops(int iters) {
  const int n = 8192;
  Tensor a = random_bf16({n, n}, 1), b = random_bf16({n, n}, 2);
  Tensor c = Tensor::empty({n, n}, DType::bf16, Device::cuda());
  cublasHandle_t h;
  cublas_check(cublasCreate(&h), "cublasCreate");
  const float alpha = 1.0f, beta = 0.0f;
  const double us = median_us(
      [&] {
        cublas_check(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.data(),
                                  CUDA_R_16BF, n, b.data(), CUDA_R_16BF, n, &beta, c.data(),
                                  CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     "cublasGemmEx");
      },
      iters);
  cublasDestroy(h);
  return 2.0 * n * n * double(n) / us * 1e-6;
}

// The mma.sync ceiling: each warp runs independent m16n8k16 bf16 MMAs back to back.
__global__ void mma_loop(float* out, int steps) {
  uint32_t a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x * 5u, threadIdx.x * 7u};
  uint32_t b0 = threadIdx.x * 11u, b1 = threadIdx.x * 13u;
  float acc[8][4] = {};
  for (int s = 0; s < steps; ++s) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(acc[i][0]), "+f"(acc[i][1]), "+f"(acc[i][2]), "+f"(acc[i][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  float sum = 0;
  for (int i = 0; i < 8; ++i) sum += acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3];
  if (sum == 1.2345f) out[0] = sum;  // keeps the loop alive
}

double mma_sync_tflops(int sms, int iters) {
  Tensor sink = Tensor::empty({1}, DType::f32, Device::cuda());
  const int steps = 4096, blocks = sms * 4, threads = 256;
  const double us = median_us(
      [&] { mma_loop<<<blocks, threads>>>(static_cast<float*>(sink.data()), steps); }, iters);
  const double flops = double(blocks) * (threads / 32) * steps * 8 * 2.0 * 16 * 8 * 16;
  return flops / us * 1e-6;
}

constexpr int kHq = 32, kHkv = 8, kD = 128;

double attention_flops(const std::vector<int>& fresh, const std::vector<int>& prefix) {
  double f = 0;
  for (size_t i = 0; i < fresh.size(); ++i)
    f += 4.0 * kHq * kD * (double(fresh[i]) * prefix[i] + double(fresh[i]) * (fresh[i] + 1) / 2);
  return f;
}

struct Row {
  std::string name;
  double us, tflops;
  double gbps = 0;  // memory-bound rows (merge_state): minimum bytes / time
};

// Device-to-device copy of 1 GiB: bytes read + written per second (GB/s), the ceiling of the
// memory-bound rows.
double copy_gbps(int iters) {
  const int64_t bytes = int64_t{1} << 30;
  Tensor a = Tensor::empty({bytes}, DType::u8, Device::cuda());
  Tensor b = Tensor::empty({bytes}, DType::u8, Device::cuda());
  cuda_check(cudaMemset(a.data(), 1, bytes), "memset");
  const double us = median_us(
      [&] {
        cuda_check(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice), "copy");
      },
      iters);
  return 2.0 * bytes / us * 1e-3;
}

PrefillPlan make_plan(const std::vector<int32_t>& qo, const std::vector<int32_t>& kv_len,
                      bool causal, int page_size) {
  BatchShape bs;
  bs.batch_size = static_cast<int32_t>(kv_len.size());
  bs.qo_indptr = qo.data();
  bs.kv_len = kv_len.data();
  bs.num_qo_heads = kHq;
  bs.num_kv_heads = kHkv;
  bs.head_dim_qk = bs.head_dim_v = kD;
  bs.page_size = page_size;
  bs.causal = causal;
  PlanOptions po;
  po.q_tile = cuda::prefill_cta_rows(kD, kD) / (kHq / kHkv);
  // FLASHKV_BENCH_BLOCKS_PER_SM: the workers the plan sizes for (default: the planner's).
  if (const char* b = std::getenv("FLASHKV_BENCH_BLOCKS_PER_SM")) po.blocks_per_sm = std::atoi(b);
  return plan_prefill(bs, device_info(Device::cuda()), po);
}

std::vector<int32_t> indptr(const std::vector<int>& lens) {
  std::vector<int32_t> p(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) p[i + 1] = p[i] + lens[i];
  return p;
}

// Causal self-attention of `batch` requests of `len` tokens (ragged).
Row bench_causal(int batch, int len, int iters) {
  const std::vector<int> lens(batch, len);
  const auto qo = indptr(lens);
  const int64_t tokens = qo.back();
  Tensor q = random_bf16({tokens, kHq, kD}, 11), k = random_bf16({tokens, kHkv, kD}, 12),
         v = random_bf16({tokens, kHkv, kD}, 13);
  Tensor out = Tensor::empty({tokens, kHq, kD}, DType::bf16, Device::cuda());
  Tensor lse = Tensor::empty({tokens, kHq}, DType::f32, Device::cuda());
  Tensor qo_t = Tensor::from_i32(qo, Device::cuda());
  const std::vector<int32_t> kv_len(lens.begin(), lens.end());
  PrefillPlan plan = make_plan(qo, kv_len, true, 1);
  Workspace ws(plan.layout.total_bytes, Device::cuda());
  ws.upload(plan);
  AttentionOptions opt;
  const double us =
      median_us([&] { ragged_prefill(plan, q, k, v, qo_t, qo_t, opt, out, lse, ws); }, iters);
  const std::vector<int> zero(batch, 0);
  const std::string name = "causal " + std::to_string(batch) + "x" + std::to_string(len);
  return {name, us, attention_flops(lens, zero) / us * 1e-6};
}

// Extend: `batch` requests of `fresh` new tokens on a `prefix` cache, page size 1 with a
// shuffled slot table. Both ways the serving backend runs it: ragged (new vs new, causal) +
// paged (new vs prefix) + merge_state, and one causal paged pass over prefix + new.
std::vector<Row> bench_extend(int batch, int prefix, int fresh, int iters) {
  const std::vector<int> news(batch, fresh), pres(batch, prefix), totals(batch, prefix + fresh);
  const auto qo = indptr(news);
  const int64_t tokens = qo.back(), slots = int64_t{batch} * (prefix + fresh);
  Tensor q = random_bf16({tokens, kHq, kD}, 21), k_new = random_bf16({tokens, kHkv, kD}, 22),
         v_new = random_bf16({tokens, kHkv, kD}, 23);
  Tensor k_pool = random_bf16({slots, kHkv, kD}, 24), v_pool = random_bf16({slots, kHkv, kD}, 25);
  std::vector<int32_t> perm(slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  // Request i: prefix slots then its new tokens' slots, all from the shuffled table.
  std::vector<int32_t> prefix_idx, all_idx;
  for (int i = 0; i < batch; ++i) {
    const int32_t* s = perm.data() + int64_t{i} * (prefix + fresh);
    prefix_idx.insert(prefix_idx.end(), s, s + prefix);
    all_idx.insert(all_idx.end(), s, s + prefix + fresh);
  }
  const Device gpu = Device::cuda();
  Tensor qo_t = Tensor::from_i32(qo, gpu);
  Tensor pre_indptr = Tensor::from_i32(indptr(pres), gpu),
         pre_idx = Tensor::from_i32(prefix_idx, gpu);
  Tensor all_indptr = Tensor::from_i32(indptr(totals), gpu),
         all_idx_t = Tensor::from_i32(all_idx, gpu);
  Tensor o_new = Tensor::empty({tokens, kHq, kD}, DType::bf16, gpu);
  Tensor o_pre = Tensor::empty({tokens, kHq, kD}, DType::bf16, gpu);
  Tensor o = Tensor::empty({tokens, kHq, kD}, DType::bf16, gpu);
  Tensor lse_new = Tensor::empty({tokens, kHq}, DType::f32, gpu);
  Tensor lse_pre = Tensor::empty({tokens, kHq}, DType::f32, gpu);
  Tensor lse = Tensor::empty({tokens, kHq}, DType::f32, gpu);

  const std::vector<int32_t> new_len(news.begin(), news.end()), pre_len(pres.begin(), pres.end()),
      all_len(totals.begin(), totals.end());
  PrefillPlan ragged_plan = make_plan(qo, new_len, true, 1);
  PrefillPlan prefix_plan = make_plan(qo, pre_len, false, 1);
  PrefillPlan single_plan = make_plan(qo, all_len, true, 1);
  Workspace ws_r(ragged_plan.layout.total_bytes, gpu), ws_p(prefix_plan.layout.total_bytes, gpu),
      ws_s(single_plan.layout.total_bytes, gpu);
  ws_r.upload(ragged_plan);
  ws_p.upload(prefix_plan);
  ws_s.upload(single_plan);
  AttentionOptions causal, full;
  full.causal = false;
  PagedKV pre_kv{k_pool, v_pool, pre_indptr, pre_idx, TensorView(), 1};
  PagedKV all_kv{k_pool, v_pool, all_indptr, all_idx_t, TensorView(), 1};
  // The new tokens' K/V also sit in the pool (the single pass reads them there).
  const double flops = attention_flops(news, pres);
  const std::string shape =
      std::to_string(batch) + "x(" + std::to_string(prefix) + "+" + std::to_string(fresh) + ")";
  std::vector<Row> rows;
  bool have_merge = true;
  try {
    merge_state(o_new, lse_new, o_pre, lse_pre, o, lse);
  } catch (const Error&) {
    have_merge = false;
  }
  auto ragged = [&] {
    ragged_prefill(ragged_plan, q, k_new, v_new, qo_t, qo_t, causal, o_new, lse_new, ws_r);
  };
  auto paged = [&] { paged_prefill(prefix_plan, q, qo_t, pre_kv, full, o_pre, lse_pre, ws_p); };
  const double us_r = median_us(ragged, iters), us_p = median_us(paged, iters);
  rows.push_back({"extend " + shape + " ragged part", us_r,
                  attention_flops(news, std::vector<int>(batch, 0)) / us_r * 1e-6});
  rows.push_back({"extend " + shape + " paged part", us_p,
                  4.0 * kHq * kD * double(fresh) * prefix * batch / us_p * 1e-6});
  if (have_merge) {
    const double us = median_us(
        [&] {
          ragged();
          paged();
          merge_state(o_new, lse_new, o_pre, lse_pre, o, lse);
        },
        iters);
    rows.push_back({"extend " + shape + " ragged+paged+merge_state", us, flops / us * 1e-6});
    // merge_state alone: reads two [tokens, Hq, D] bf16 states and their f32 LSEs, writes one.
    const double us_m =
        median_us([&] { merge_state(o_new, lse_new, o_pre, lse_pre, o, lse); }, iters);
    const double bytes = 3.0 * tokens * kHq * (kD * 2 + 4);
    rows.push_back({"extend " + shape + " merge_state alone", us_m, 0, bytes / us_m * 1e-3});
  } else {
    const double us = us_r + us_p;
    rows.push_back({"extend " + shape + " ragged+paged (no cuda merge)", us, flops / us * 1e-6});
  }
  // `base` merging with the state in o_new / lse_new as it writes.
  auto merging = [&](AttentionOptions base, bool overlap) {
    base.merge_o = o_new;
    base.merge_lse = lse_new;
    base.overlap_previous = overlap;
    return base;
  };
  // The serving path: the paged pass merges with the ragged state as it writes (in place), and
  // with overlap_previous starts on the SMs the ragged pass frees (programmatic dependent launch).
  for (bool overlap : {true, false}) {
    const AttentionOptions merged = merging(full, overlap);
    const double us = median_us(
        [&] {
          ragged();
          paged_prefill(prefix_plan, q, qo_t, pre_kv, merged, o_new, TensorView(), ws_p);
        },
        iters);
    rows.push_back({"extend " + shape + (overlap ? " ragged+merging paged" : " ... no overlap"), us,
                    flops / us * 1e-6});
  }
  // The other order: the prefix pass first, the ragged pass merging with its state (the short
  // ragged items then fill the SMs the paged pass's last wave leaves idle).
  const AttentionOptions merged_causal = merging(causal, true);
  const double us_o = median_us(
      [&] {
        paged_prefill(prefix_plan, q, qo_t, pre_kv, full, o_new, lse_new, ws_p);
        ragged_prefill(ragged_plan, q, k_new, v_new, qo_t, qo_t, merged_causal, o_new, TensorView(),
                       ws_r);
      },
      iters);
  rows.push_back({"extend " + shape + " paged+merging ragged", us_o, flops / us_o * 1e-6});
  const double us_s =
      median_us([&] { paged_prefill(single_plan, q, qo_t, all_kv, causal, o, lse, ws_s); }, iters);
  rows.push_back({"extend " + shape + " one paged pass", us_s, flops / us_s * 1e-6});
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  const char* csv = nullptr;
  std::string only;
  std::vector<std::pair<int, int>> causal = {{1, 8192}, {4, 4096}, {1, 16384}};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--csv") && i + 1 < argc)
      csv = argv[++i];
    else if (!std::strcmp(argv[i], "--case") && i + 1 < argc)
      only = argv[++i];
    else if (!std::strcmp(argv[i], "--causal") && i + 1 < argc) {
      causal.clear();
      for (const char* c = argv[++i]; *c != '\0';) {
        int b = 0, n = 0, used = 0;
        if (std::sscanf(c, "%d:%d%n", &b, &n, &used) != 2 || b < 1 || n < 1) {
          std::fprintf(stderr, "--causal: expected B:N[,B:N...] with B, N >= 1, got '%s'\n", c);
          return 2;
        }
        causal.emplace_back(b, n);
        c += used;
        if (*c == ',') ++c;
      }
    }
  }
  try {
    const DeviceInfo dev = device_info(Device::cuda());
    const double gemm = gemm_tflops(iters);
    const double mma = mma_sync_tflops(dev.num_sms, iters);
    std::printf("device: %s, %d SMs\n", dev.name.c_str(), dev.num_sms);
    std::printf(
        "ceilings: cuBLAS bf16 GEMM 8192^3 %.0f TFLOP/s; mma.sync m16n8k16 loop %.0f TFLOP/s\n",
        gemm, mma);
    std::vector<Row> rows;
    for (auto [b, n] : causal)
      if (only.empty() || only == "causal") rows.push_back(bench_causal(b, n, iters));
    for (auto [b, pre, fresh] : {std::tuple{4, 3072, 1024}, std::tuple{16, 4096, 256}}) {
      if (!only.empty() && only != "extend") continue;
      auto r = bench_extend(b, pre, fresh, iters);
      rows.insert(rows.end(), r.begin(), r.end());
    }
    const double copy = copy_gbps(iters);
    std::printf("ceiling: device-to-device copy 1 GiB %.0f GB/s (read + write)\n", copy);
    std::printf("%-46s %10s %9s %7s %7s\n", "case", "us", "TFLOP/s", "%GEMM", "%mma");
    for (const Row& r : rows) {
      if (r.gbps > 0)
        std::printf("%-46s %10.1f %7.0f GB/s %5.1f%% of copy\n", r.name.c_str(), r.us, r.gbps,
                    100 * r.gbps / copy);
      else
        std::printf("%-46s %10.1f %9.1f %6.1f%% %6.1f%%\n", r.name.c_str(), r.us, r.tflops,
                    100 * r.tflops / gemm, 100 * r.tflops / mma);
    }
    if (csv) {
      FILE* f = std::fopen(csv, "w");
      if (f) {
        std::fprintf(f, "case,us,tflops,gbps,gemm_tflops,mma_tflops,copy_gbps\n");
        for (const Row& r : rows)
          std::fprintf(f, "%s,%.2f,%.2f,%.1f,%.1f,%.1f,%.1f\n", r.name.c_str(), r.us, r.tflops,
                       r.gbps, gemm, mma, copy);
        std::fclose(f);
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
