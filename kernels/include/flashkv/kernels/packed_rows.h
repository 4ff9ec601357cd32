// Packed query rows (a KV head's `group` query heads a token, token-major: packed row r is token
// r / group, query head r % group of the group) walked in equal steps without a division a step,
// for code compiled for the host and the device from one source (the prefill epilogue,
// kernels/cuda/prefill/epilogue.cuh).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHKV_PACKED_ROWS_HD __host__ __device__ __forceinline__
#else
#define FLASHKV_PACKED_ROWS_HD inline
#endif

namespace flashkv {

// The token and head of a packed row, and its element offset in a tensor whose tokens are
// stride_tok and heads stride_head elements apart; one division to start, then kStep rows a step
// (two adds a head wrap).
struct PackedRowWalk {
  int tok = 0;         // row / group
  int head = 0;        // row % group
  int64_t offset = 0;  // tok * stride_tok + head * stride_head

  FLASHKV_PACKED_ROWS_HD PackedRowWalk(int row, int group, int64_t stride_tok, int64_t stride_head)
      : tok(row / group),
        head(row - row / group * group),
        offset(tok * stride_tok + head * stride_head) {}

  // Moves kStep rows on: head + kStep < group + kStep <= (kStep + 1) * group, so at most kStep
  // wraps of the head.
  template <int kStep>
  FLASHKV_PACKED_ROWS_HD void advance(int group, int64_t stride_tok, int64_t stride_head) {
    head += kStep;
    offset += kStep * stride_head;
#pragma unroll
    for (int i = 0; i < kStep; ++i)
      if (head >= group) {
        head -= group;
        ++tok;
        offset += stride_tok - group * stride_head;
      }
  }
};

}  // namespace flashkv

#undef FLASHKV_PACKED_ROWS_HD
