// The XOR swizzle of the kernels' shared-memory tiles. A tile is row-major, each row a whole
// number of 16-byte chunks; chunk c of row r is stored at chunk c ^ (r % 8), which stays inside
// its aligned group of 8 chunks. Eight rows' reads of one chunk column (ldmatrix) and one row's
// eight chunk writes then fall in distinct banks. It is also the tensor cores' 128-byte swizzle
// (prefill/wgmma.cuh), which the sm_90 prefill tiles use.
#pragma once

namespace flashkv::cuda {

// Where chunk `chunk` of row `row` is stored within its row, in 16-byte chunks.
__device__ __forceinline__ int swizzle_chunk(int row, int chunk) { return chunk ^ (row & 7); }

// Offset of chunk `chunk` of row `row` from the tile base, in units of kUnitBytes (1: bytes; 2:
// 16-bit elements), for rows of kRowChunks chunks. kSwizzle false: no XOR (rows of fewer than 8
// chunks).
template <int kRowChunks, int kUnitBytes, bool kSwizzle = true>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  static_assert(kUnitBytes == 1 || kUnitBytes == 2, "offsets in bytes or 16-bit elements");
  static_assert(!kSwizzle || kRowChunks % 8 == 0, "the swizzle needs rows of 8k chunks");
  constexpr int kChunkUnits = 16 / kUnitBytes;
  return row * (kRowChunks * kChunkUnits) +
         (kSwizzle ? swizzle_chunk(row, chunk) : chunk) * kChunkUnits;
}

}  // namespace flashkv::cuda
