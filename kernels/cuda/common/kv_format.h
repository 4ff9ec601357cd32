// How the KV cache stores its elements relative to the queries, for every CUDA kernel family
// (decode and prefill are compiled per format). Host and device code both use it.
#pragma once

namespace flashkv::cuda {

// kSame: K and V in Q's 16-bit type (bf16 or f16). kE4M3 / kE5M2: fp8, which the kernels widen
// exactly to 16 bits (every e4m3 and e5m2 value is an f16 and a bf16 value); the KV scales
// (AttentionParams::k_scale, v_scale) apply to the scores and the output.
enum class KvFormat : int { kSame = 0, kE4M3 = 1, kE5M2 = 2 };

}  // namespace flashkv::cuda
