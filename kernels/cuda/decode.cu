// cuda::paged_decode: picks the kernel instantiation for the runtime parameters (select) and
// runs the decode kernel over the plan's workers. Split requests are merged inside the kernel
// (the CTA that finishes a request's last outstanding chunk merges them; decode_kernel.cuh), so
// one launch does everything, and its grid depends only on the worker count: a CUDA graph
// replays it with any batch.
//
// On sm_90 the kernel is launched with programmatic stream serialization: its CTAs may be
// scheduled while the previous kernel of the stream finishes, and wait for it in
// griddepcontrol.wait, which hides most of the launch latency between back-to-back kernels.
// FLASHKV_DECODE_PDL=0 in the environment turns that off (to measure what it brings).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/kernel_launch.h"
#include "decode/traits.h"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"
#include "flashkv/core/options.h"
#include "flashkv/kernels/kernels.h"

namespace flashkv::cuda {
namespace {

using LaunchFn = void (*)(const AttentionParams&, cudaStream_t, bool);

// Programmatic dependent launch for the decode kernel: sm_90+ unless FLASHKV_DECODE_PDL=0.
bool use_programmatic_launch() {
  static const bool allowed = env_decode_pdl();  // core/options.h
  return allowed && current_device_cc() >= 90;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <int D, typename QT, KvFormat kKv>
LaunchFn pick_tiles(int group) {
  // 8 query heads per mma column tile. Up to 16 heads share one pass over the KV (two tiles;
  // head dim 256 keeps one, its accumulators would not fit the registers); larger groups run as
  // several CTAs per KV head (grid.z), each reading the KV once.
  if constexpr (D <= 128) {
    if (group > 8) return &decode_detail::launch_decode<D, QT, kKv, 2>;
  }
  return &decode_detail::launch_decode<D, QT, kKv, 1>;
}

template <int D, typename QT>
LaunchFn pick_kv(DType kv, int group) {
  switch (kv) {
    case DType::fp8_e4m3:
      return pick_tiles<D, QT, KvFormat::kE4M3>(group);
    case DType::fp8_e5m2:
      return pick_tiles<D, QT, KvFormat::kE5M2>(group);
    default:
      return pick_tiles<D, QT, KvFormat::kSame>(group);
  }
}

template <int D>
LaunchFn pick_q(const AttentionParams& p, int group) {
  if (p.q_dtype == DType::bf16) return pick_kv<D, __nv_bfloat16>(p.kv_dtype, group);
  return pick_kv<D, half>(p.kv_dtype, group);
}

// The one place that decides which kernel runs; throws flashkv::Error for what no instantiation
// supports, before anything is launched.
LaunchFn select(const AttentionParams& p) {
  FLASHKV_CHECK(p.paged && p.qo_indptr == nullptr,
                "paged_decode (CUDA): expected paged KV and one query row per request");
  FLASHKV_CHECK(p.custom_mask == nullptr,
                "paged_decode (CUDA): custom_mask is not supported by the decode kernel (use "
                "paged_prefill for masked rows)");
  FLASHKV_CHECK(p.q_dtype == DType::bf16 || p.q_dtype == DType::f16,
                "paged_decode (CUDA): q dtype ", dtype_name(p.q_dtype),
                " is unsupported on CUDA (expected bf16 or f16)");
  const bool kv_ok =
      p.kv_dtype == p.q_dtype || p.kv_dtype == DType::fp8_e4m3 || p.kv_dtype == DType::fp8_e5m2;
  FLASHKV_CHECK(kv_ok, "paged_decode (CUDA): kv dtype ", dtype_name(p.kv_dtype), " with q dtype ",
                dtype_name(p.q_dtype), " is unsupported");
  FLASHKV_CHECK(p.head_dim_qk == p.head_dim_v, "paged_decode (CUDA): head_dim_v: expected ",
                p.head_dim_qk, " (the same as head_dim_qk), got ", p.head_dim_v);
  FLASHKV_CHECK(p.num_kv_heads > 0 && p.num_qo_heads % p.num_kv_heads == 0,
                "paged_decode (CUDA): num_qo_heads must be a multiple of num_kv_heads");
  FLASHKV_CHECK(p.num_kv_heads <= 65535,
                "paged_decode (CUDA): num_kv_heads: expected <= 65535, got ", p.num_kv_heads);
  // 16-byte vectors: rows of q, o, k and v must start on 16-byte boundaries.
  const int64_t kv_bytes = is_fp8(p.kv_dtype) ? 1 : 2;
  FLASHKV_CHECK(aligned16(p.q) && aligned16(p.o) && p.q_stride_n % 8 == 0 &&
                    p.q_stride_h % 8 == 0 && p.o_stride_n % 8 == 0 && p.o_stride_h % 8 == 0,
                "paged_decode (CUDA): q/out rows must be 16-byte aligned (strides in multiples "
                "of 8 elements)");
  FLASHKV_CHECK(aligned16(p.k) && aligned16(p.v) && (p.k_stride_n * kv_bytes) % 16 == 0 &&
                    (p.k_stride_h * kv_bytes) % 16 == 0 && (p.v_stride_n * kv_bytes) % 16 == 0 &&
                    (p.v_stride_h * kv_bytes) % 16 == 0,
                "paged_decode (CUDA): k/v rows must be 16-byte aligned");
  FLASHKV_CHECK(p.k_stride_n >= 0 && p.v_stride_n >= 0 &&
                    std::max(p.k_stride_n, p.v_stride_n) * kv_bytes <= int64_t{UINT32_MAX},
                "paged_decode (CUDA): k/v token strides: expected 0 .. 4 GiB in bytes, got ",
                p.k_stride_n * kv_bytes, " and ", p.v_stride_n * kv_bytes);
  const int group = p.num_qo_heads / p.num_kv_heads;
  switch (p.head_dim_qk) {
#if FLASHKV_HEAD_DIM_64
    case 64:
      return pick_q<64>(p, group);
#endif
#if FLASHKV_HEAD_DIM_128
    case 128:
      return pick_q<128>(p, group);
#endif
#if FLASHKV_HEAD_DIM_256
    case 256:
      return pick_q<256>(p, group);
#endif
    default: {
      const int d = p.head_dim_qk;
      const bool kernel_exists = d == 64 || d == 128 || d == 256;
      throw_error(str_cat("paged_decode (CUDA): head_dim ", d,
                          kernel_exists
                              ? " is not in this build's FLASHKV_HEAD_DIMS"
                              : " is unsupported (the decode kernels cover 64, 128, 256)"));
    }
  }
}

}  // namespace

void check_paged_decode(const AttentionParams& p) { (void)select(p); }

void paged_decode(const AttentionParams& p, Stream stream) {
  const LaunchFn launch = select(p);
  if (p.num_items == 0) return;
  launch(p, static_cast<cudaStream_t>(stream.handle), use_programmatic_launch());
}

}  // namespace flashkv::cuda
