// cuda::prefill: picks the compiled kernel variant for the runtime parameters (select), rejects
// what no variant supports before anything is launched, then runs the plan's items and the merge
// pass of split items.
//
// What callers pass: any PrefillPlan is computed correctly, but the kernel is fastest when an
// item's packed rows (q_tile tokens x G query heads) fill the CTA's row tile exactly:
// PlanOptions.q_tile = prefill_cta_rows(D_qk, D_v) / G, i.e. 128 / G for D_v <= 128 (the
// planner's CUDA default) and 64 / G for D_v = 256. blocks_per_sm = 2 (the default) matches the
// sm_80 kernel's two CTAs per SM; the sm_90a kernels fit one CTA an SM, so their grid runs in
// waves (two, or more where the planner rounds the workers up to whole waves), and the hardware
// hands an SM its next worker when one is done, which balances uneven workers better than one
// wave of half as many (docs/perf/prefill.md). Larger items are run in several row blocks by one
// CTA.
#include <cuda_runtime.h>

#include <string>

#include "common/kernel_launch.h"
#include "flashkv/core/error.h"
#include "flashkv/core/options.h"
#include "flashkv/kernels/kernels.h"
#include "prefill/launch.h"
#include "prefill/merge.cuh"
#include "prefill/tile_config.cuh"

namespace flashkv::cuda {
namespace prefill_detail {

namespace {

using LaunchFn = void (*)(const AttentionParams&, cudaStream_t);

// The kernel families, each a launcher for (Q type, K/V format) at head dims (DQK, DV): the sm_80
// kernel, and the sm_90a kernels.
template <int DQK, int DV>
struct Sm80Kernels {
  template <typename QT, KvFormat F>
  static LaunchFn launcher() {
    return &launch_prefill<DQK, DV, QT, F>;
  }
};
template <int DQK, int DV>
struct Sm90Kernels {
  template <typename QT, KvFormat F>
  static LaunchFn launcher() {
    return &launch_prefill_sm90<QT, DQK, DV, F>;
  }
};

template <typename Kernels, typename QT>
LaunchFn pick_kv_format(DType q, DType kv) {
  if (kv == q) return Kernels::template launcher<QT, KvFormat::kSame>();
  if (kv == DType::fp8_e4m3) return Kernels::template launcher<QT, KvFormat::kE4M3>();
  if (kv == DType::fp8_e5m2) return Kernels::template launcher<QT, KvFormat::kE5M2>();
  return nullptr;
}

template <typename Kernels>
LaunchFn pick_dtype(DType q, DType kv) {
  if (q == DType::bf16) return pick_kv_format<Kernels, __nv_bfloat16>(q, kv);
  if (q == DType::f16) return pick_kv_format<Kernels, __half>(q, kv);
  return nullptr;
}

// The family's compiled launcher for p's head dims and dtypes; null where it has none.
template <template <int, int> class Kernels>
LaunchFn pick(const AttentionParams& p) {
  const int dqk = p.head_dim_qk, dv = p.head_dim_v;
  const DType q = p.q_dtype, kv = p.kv_dtype;
#if defined(FLASHKV_HEAD_DIM_64)
  if (dqk == 64 && dv == 64) return pick_dtype<Kernels<64, 64>>(q, kv);
#endif
#if defined(FLASHKV_HEAD_DIM_128)
  if (dqk == 128 && dv == 128) return pick_dtype<Kernels<128, 128>>(q, kv);
#endif
#if defined(FLASHKV_HEAD_DIM_192)
  if (dqk == 192 && dv == 128) return pick_dtype<Kernels<192, 128>>(q, kv);
#endif
#if defined(FLASHKV_HEAD_DIM_256)
  if (dqk == 256 && dv == 256) return pick_dtype<Kernels<256, 256>>(q, kv);
#endif
  (void)dqk;
  (void)dv;
  (void)q;
  (void)kv;
  return nullptr;
}

// The head-dim pairs this build compiled (FLASHKV_HEAD_DIMS), as a readable list for errors.
const char* compiled_head_dims() {
  return ""
#if defined(FLASHKV_HEAD_DIM_64)
         " 64"
#endif
#if defined(FLASHKV_HEAD_DIM_128)
         " 128"
#endif
#if defined(FLASHKV_HEAD_DIM_192)
         " 192/128"
#endif
#if defined(FLASHKV_HEAD_DIM_256)
         " 256"
#endif
      ;
}

// The sm_90a kernels run every head dim and K/V format (16-bit or fp8 KV at head dims 64, 128 and
// 256, and 192 / 128) on a compute capability 9.0 device when this build has sm_90a code
// (FLASHKV_SM90A), unless FLASHKV_PREFILL_SM90=0 (read at every call, so a test or a benchmark can
// compare the kernels in one process).
LaunchFn pick_sm90(const AttentionParams& p) {
#if defined(FLASHKV_SM90A)
  if (!env_prefill_sm90()) return nullptr;  // FLASHKV_PREFILL_SM90=0 (core/options.h)
  if (current_device_cc() != 90) return nullptr;
  return pick<Sm90Kernels>(p);
#else
  (void)p;
  return nullptr;
#endif
}

bool aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

// The one place that decides which kernel runs; throws flashkv::Error for what none supports.
LaunchFn select(const AttentionParams& p) {
  FLASHKV_CHECK(p.q_dtype == DType::bf16 || p.q_dtype == DType::f16, "prefill: q dtype ",
                dtype_name(p.q_dtype), " is unsupported on CUDA (expected bf16 or f16)");
  FLASHKV_CHECK(p.kv_dtype == p.q_dtype || is_fp8(p.kv_dtype), "prefill: kv dtype ",
                dtype_name(p.kv_dtype), " is unsupported on CUDA with q dtype ",
                dtype_name(p.q_dtype), " (expected the same, fp8_e4m3 or fp8_e5m2)");
  const LaunchFn fn = pick<Sm80Kernels>(p);
  FLASHKV_CHECK(fn != nullptr, "prefill: head_dim_qk/head_dim_v ", p.head_dim_qk, "/", p.head_dim_v,
                " is unsupported on CUDA (this build has:", compiled_head_dims(), ")");
  // 16-byte asynchronous copies of Q/K/V rows and 4-byte stores of O pairs.
  const size_t kv_elem = dtype_size(p.kv_dtype);
  FLASHKV_CHECK(aligned(p.q, 16) && p.q_stride_n % 8 == 0 && p.q_stride_h % 8 == 0,
                "q: CUDA prefill needs a 16-byte aligned pointer and strides that are multiples "
                "of 8 elements, got strides ",
                p.q_stride_n, "/", p.q_stride_h);
  FLASHKV_CHECK(aligned(p.k, 16) && aligned(p.v, 16) && (p.k_stride_n * kv_elem) % 16 == 0 &&
                    (p.k_stride_h * kv_elem) % 16 == 0 && (p.v_stride_n * kv_elem) % 16 == 0 &&
                    (p.v_stride_h * kv_elem) % 16 == 0,
                "k/v: CUDA prefill needs 16-byte aligned pointers and row/head strides of a "
                "multiple of 16 bytes, got k strides ",
                p.k_stride_n, "/", p.k_stride_h, ", v strides ", p.v_stride_n, "/", p.v_stride_h);
  // O (and merge_o, which has O's dtype) is written in pairs of elements.
  const size_t o_pair = 2 * dtype_size(p.o_dtype);
  FLASHKV_CHECK(aligned(p.o, o_pair) && p.o_stride_n % 2 == 0 && p.o_stride_h % 2 == 0,
                "out: CUDA prefill needs a ", o_pair,
                "-byte aligned pointer and even strides, got strides ", p.o_stride_n, "/",
                p.o_stride_h);
  FLASHKV_CHECK(!p.merge_o || (aligned(p.merge_o, o_pair) && p.merge_stride_n % 2 == 0 &&
                               p.merge_stride_h % 2 == 0),
                "merge_o: CUDA prefill needs a ", o_pair,
                "-byte aligned pointer and even strides, got strides ", p.merge_stride_n, "/",
                p.merge_stride_h);
  if (LaunchFn sm90 = pick_sm90(p)) return sm90;
  return fn;
}

}  // namespace prefill_detail

int prefill_cta_rows(int head_dim_qk, int head_dim_v) {
  (void)head_dim_qk;
  return prefill_detail::prefill_cta_rows_of(head_dim_v);
}

void check_prefill(const AttentionParams& p) { (void)prefill_detail::select(p); }

void prefill(const AttentionParams& p, Stream stream) {
  using namespace prefill_detail;
  const LaunchFn launch = select(p);
  auto s = static_cast<cudaStream_t>(stream.handle);
  // A CUDA-graph plan's launches must not depend on the batch: the grid is the plan's fixed
  // worker count (the kernel reads its items through worker_indptr on the device), and the merge
  // pass runs over the layout's whole merge capacity, since a replayed batch may split where
  // this one did not.
  if (!p.cuda_graph && p.num_items == 0) return;
  FLASHKV_CHECK(p.num_workers > 0, "prefill: plan has no workers");
  launch(p, s);
  const int merges = p.cuda_graph ? p.max_merges : p.num_merges;
  if (merges == 0) return;
  if (p.q_dtype == DType::bf16)
    merge_partials_kernel<__nv_bfloat16><<<merges, kMergeThreads, 0, s>>>(p);
  else
    merge_partials_kernel<__half><<<merges, kMergeThreads, 0, s>>>(p);
  detail::cuda_check(cudaGetLastError(), "prefill: merge launch");
}

}  // namespace flashkv::cuda
