// cuda::merge: merge_state / merge_states (SEMANTICS.md, "Merging partial states") on CUDA.
//
// Memory-bound: every state element is read once and every output element written once, so the
// kernel is shaped for bandwidth. A (row, head) pair is handled by `lanes` consecutive lanes of
// one warp (the head dim in 16-byte vectors, rounded up to a power of two, at most 32); each lane
// reads the pair's LSEs (the same addresses for all its lanes: one transaction), derives the
// state weights once, then reads whole 16-byte vectors of every state, up to four states' loads
// in flight before the first is used. Rows or strides that are not 16-byte aligned take the same
// kernel with one element per vector.
//
// Outputs may alias the first state (merge_state in place): each lane writes only the elements
// it has read, and the LSE is written after a __syncwarp, once every lane of the pair has read
// the LSEs it may overwrite.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/convert.cuh"
#include "common/merge.cuh"
#include "flashkv/core/cuda_runtime.h"
#include "flashkv/core/error.h"
#include "flashkv/kernels/kernels.h"

namespace flashkv::cuda {
namespace {

constexpr int kMergeThreads = 256;
constexpr int kMergeBlocksPerSm = 4;
constexpr int kStatesInFlight = 2;  // state vectors loaded before the first is accumulated
// 1024 threads an SM (registers capped at 64, none spilled): with two states, 32 KB of state
// vectors and the LSEs in flight per SM, about what the copy bandwidth times the memory latency
// asks of one SM (docs/perf/prefill.md, merge_state).

// kVec elements of T as floats: one 16-byte access when kVec * sizeof(T) == 16, else kVec == 1.
template <typename T, int kVec>
struct VecIo {
  static_assert(kVec == 1 || kVec * sizeof(T) == 16, "16-byte vectors or single elements");
  using Raw = std::conditional_t<kVec == 1, T, uint4>;
  static __device__ __forceinline__ Raw load(const T* src) {
    return *reinterpret_cast<const Raw*>(src);
  }
  static __device__ __forceinline__ void add(float (&acc)[kVec], float w, const Raw& raw) {
    if constexpr (kVec == 1) {
      acc[0] += w * to_f32<T>(raw);
    } else if constexpr (sizeof(T) == 4) {
      const float4 x = *reinterpret_cast<const float4*>(&raw);
      acc[0] += w * x.x, acc[1] += w * x.y, acc[2] += w * x.z, acc[3] += w * x.w;
    } else {
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = unpack2<T>(words[i]);
        acc[2 * i] += w * x.x;
        acc[2 * i + 1] += w * x.y;
      }
    }
  }
  static __device__ __forceinline__ void store(T* dst, const float (&x)[kVec], float scale) {
    if constexpr (kVec == 1) {
      *dst = from_f32<T>(x[0] * scale);
    } else if constexpr (sizeof(T) == 4) {
      *reinterpret_cast<float4*>(dst) =
          make_float4(x[0] * scale, x[1] * scale, x[2] * scale, x[3] * scale);
    } else {
      uint4 w;
      w.x = pack2<T>(x[0] * scale, x[1] * scale);
      w.y = pack2<T>(x[2] * scale, x[3] * scale);
      w.z = pack2<T>(x[4] * scale, x[5] * scale);
      w.w = pack2<T>(x[6] * scale, x[7] * scale);
      *reinterpret_cast<uint4*>(dst) = w;
    }
  }
};

// Grid: x covers rows * heads * lanes threads (lanes a power of two <= 32, log2 in lanes_log2).
// kPair: merge_state (two separate states), whose weights are computed once per lane; else any
// number of states, weighed again for each vector (their LSEs stay in L1).
template <typename T, int kVec, bool kPair>
__global__ void __launch_bounds__(kMergeThreads, kMergeBlocksPerSm)
    merge_kernel(const __grid_constant__ MergeParams p, int lanes_log2) {
  using Io = VecIo<T, kVec>;
  using Raw = typename Io::Raw;
  const int64_t thread = int64_t{blockIdx.x} * kMergeThreads + threadIdx.x;
  const int64_t pair = thread >> lanes_log2;
  const int sub = static_cast<int>(thread & ((1 << lanes_log2) - 1));
  const bool active = pair < p.rows * p.heads;
  const int64_t r = active ? pair / p.heads : 0;
  const int h = active ? static_cast<int>(pair % p.heads) : 0;
  auto lse_of = [&](int s) {
    const float* base = p.stacked ? p.lse_in[0] : p.lse_in[s];
    return base[r * p.lse_stride_n + (p.stacked ? s * p.lse_stride_s : 0) + h];
  };
  auto state_of = [&](int s) {
    const T* base = static_cast<const T*>(p.stacked ? p.o_in[0] : p.o_in[s]);
    return base + r * p.in_stride_n + (p.stacked ? s * p.in_stride_s : 0) + h * p.in_stride_h;
  };
  // The weights, 1 / sum and the LSE: common/merge.cuh. A state with LSE -inf weighs 0 and its
  // values, read anyway (so no load waits for an LSE), are never used.
  MergeState<> st;
  if (active) {
    const int vecs = p.head_dim / kVec;
    const int step = 1 << lanes_log2;
    T* out = static_cast<T*>(p.o_out) + r * p.out_stride_n + int64_t{h} * p.out_stride_h;
    if constexpr (kPair) {
      // The first vectors' loads are issued before the LSEs are used (a stall at the first use
      // of an LSE would otherwise hold them back), and each next pair before the current one is
      // stored.
      const T* s0 = state_of(0);
      const T* s1 = state_of(1);
      int v = sub;
      Raw x0{}, x1{};
      if (v < vecs) x0 = Io::load(s0 + v * kVec), x1 = Io::load(s1 + v * kVec);
      float w0, w1;
      st.pair(lse_of(0), lse_of(1), w0, w1);
      const float inv = st.inv_sum();
      for (; v < vecs; v += step) {
        float acc[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
        if (w0 != 0.0f) Io::add(acc, w0, x0);
        if (w1 != 0.0f) Io::add(acc, w1, x1);
        if (v + step < vecs)
          x0 = Io::load(s0 + (v + step) * kVec), x1 = Io::load(s1 + (v + step) * kVec);
        Io::store(out + v * kVec, acc, inv);
      }
    } else {
      for (int s = 0; s < p.num_states; ++s) st.see(lse_of(s));
      for (int s = 0; s < p.num_states; ++s) st.add(lse_of(s));
      const float inv = st.inv_sum();
      for (int v = sub; v < vecs; v += step) {
        float acc[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
        for (int s0 = 0; s0 < p.num_states; s0 += kStatesInFlight) {
          Raw x[kStatesInFlight];
          float w[kStatesInFlight];
#pragma unroll
          for (int j = 0; j < kStatesInFlight; ++j) {
            const int s = s0 + j;
            w[j] = s < p.num_states ? st.weight(lse_of(s)) : 0.0f;
            x[j] = Io::load(state_of(min(s, p.num_states - 1)) + v * kVec);
          }
#pragma unroll
          for (int j = 0; j < kStatesInFlight; ++j)
            if (w[j] != 0.0f) Io::add(acc, w[j], x[j]);
        }
        Io::store(out + v * kVec, acc, inv);
      }
    }
  }
  __syncwarp();  // every lane of the pair has read the LSEs before they may be overwritten
  if (active && sub == 0 && p.lse_out) p.lse_out[r * p.heads + h] = st.lse();
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Whether every state row and output row starts on a 16-byte boundary and the head dim is a
// whole number of 16-byte vectors (`vec` elements each).
bool vectorizable(const MergeParams& p, int vec) {
  bool ok = p.head_dim % vec == 0 && aligned16(p.o_in[0]) && aligned16(p.o_out) &&
            p.in_stride_n % vec == 0 && p.in_stride_h % vec == 0 && p.out_stride_n % vec == 0 &&
            p.out_stride_h % vec == 0;
  if (p.stacked) return ok && (p.num_states == 1 || p.in_stride_s % vec == 0);
  for (int s = 1; s < p.num_states; ++s) ok = ok && aligned16(p.o_in[s]);
  return ok;
}

template <typename T>
void launch(const MergeParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = vectorizable(p, kVec);
  const int64_t per_pair = vec ? p.head_dim / kVec : p.head_dim;
  int lanes_log2 = 0;
  while ((1 << lanes_log2) < per_pair && lanes_log2 < 5) ++lanes_log2;
  const int64_t threads = (p.rows * p.heads) << lanes_log2;
  const int64_t blocks = (threads + kMergeThreads - 1) / kMergeThreads;
  FLASHKV_CHECK(blocks <= 0x7fffffff, "merge_state (CUDA): rows * heads = ", p.rows * p.heads,
                " too large");
  const dim3 grid(static_cast<unsigned>(blocks)), block(kMergeThreads);
  const bool pair = !p.stacked && p.num_states == 2;
  if (vec && pair)
    merge_kernel<T, kVec, true><<<grid, block, 0, stream>>>(p, lanes_log2);
  else if (vec)
    merge_kernel<T, kVec, false><<<grid, block, 0, stream>>>(p, lanes_log2);
  else if (pair)
    merge_kernel<T, 1, true><<<grid, block, 0, stream>>>(p, lanes_log2);
  else
    merge_kernel<T, 1, false><<<grid, block, 0, stream>>>(p, lanes_log2);
}

}  // namespace

void merge(const MergeParams& p, Stream stream) {
  FLASHKV_CHECK(p.dtype == DType::f32 || p.dtype == DType::bf16 || p.dtype == DType::f16,
                "merge_state (CUDA): dtype ", dtype_name(p.dtype),
                " unsupported (expected f32, bf16 or f16)");
  if (p.rows * p.heads == 0 || p.head_dim == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  switch (p.dtype) {
    case DType::f32:
      launch<float>(p, s);
      break;
    case DType::bf16:
      launch<__nv_bfloat16>(p, s);
      break;
    default:
      launch<half>(p, s);
      break;
  }
  detail::cuda_check(cudaGetLastError(), "merge_state (CUDA): kernel launch");
}

}  // namespace flashkv::cuda
