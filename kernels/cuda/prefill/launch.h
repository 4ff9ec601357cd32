// Host-side declarations shared by cuda/prefill.cu (which selects a variant) and the explicit
// instantiation files cuda/inst/prefill_*.cu (which compile one each, so builds parallelise).
#pragma once

#include <cuda_runtime.h>

#include "flashkv/kernels/params.h"
#include "prefill/primitives.cuh"

namespace flashkv::cuda::prefill_detail {

// Runs every work item of p for every KV head (grid: p.num_workers x Hkv). Explicitly
// instantiated in cuda/inst/prefill_*.cu for the head dims the build enables.
template <int DQK, int DV, typename QT, KvFormat KVF>
void launch_prefill(const AttentionParams& p, cudaStream_t stream);

// The sm_90a kernels (kernel_sm90_ws.cuh, kernel_sm90.cuh): 16-bit Q at head dims D_qk = D and
// D_v = DV (64, 128 or 256 for both, or 192 / 128) with K/V of format F (16-bit or fp8), every
// variant of the sm_80 kernel. Instantiated for bf16 and f16 in cuda/inst/prefill_sm90_d<D>.cu
// (16-bit K/V) and prefill_sm90_<e4m3|e5m2>_d<D>.cu.
template <typename QT, int D, int DV, KvFormat F>
void launch_prefill_sm90(const AttentionParams& p, cudaStream_t stream);

}  // namespace flashkv::cuda::prefill_detail
