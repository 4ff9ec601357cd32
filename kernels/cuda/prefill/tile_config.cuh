// Tile shapes and the shared-memory layout of the prefill kernel, as constexpr values usable on
// the host (launch configuration) and the device.
//
// Why these shapes: a CTA is 4 warps; each warp owns 16 * kMTiles packed query rows and all of
// the KV tile's columns, so every K/V fragment read from shared memory feeds kMTiles MMAs. With
// D_v <= 128 a warp holds 32 rows (O accumulators: 32 x D_v fp32 = 128 registers a thread at
// D_v = 128), so the CTA tile is 128 packed rows; at D_v = 256 that would not fit in registers,
// so a warp holds 16 rows and the CTA 64. The KV tile is 64 keys (32 when D_qk > 128) so that
// Q + two stages of K and V stay under ~113 KB and two CTAs share an SM (the planner's default
// blocks_per_sm = 2).
#pragma once

#include "common/swizzle.cuh"
#include "prefill/primitives.cuh"

namespace flashkv::cuda::prefill_detail {

constexpr int kPrefillWarps = 4;
constexpr int kPrefillThreads = kPrefillWarps * 32;  // also the tile loaders

constexpr int prefill_m_tiles(int head_dim_v) { return head_dim_v <= 128 ? 2 : 1; }
constexpr int prefill_cta_rows_of(int head_dim_v) {
  return kPrefillWarps * 16 * prefill_m_tiles(head_dim_v);
}
constexpr int prefill_kv_tile(int head_dim_qk) { return head_dim_qk <= 128 ? 64 : 32; }

template <int DQK, int DV, typename QT, KvFormat KVF>
struct TileConfig {
  static_assert(DQK % 64 == 0 || DQK == 192, "head_dim_qk: 64, 128, 192 or 256");
  static_assert(DV % 64 == 0, "head_dim_v: 64, 128 or 256");
  using Q = QT;
  static constexpr KvFormat kKvFormat = KVF;
  static constexpr bool kFp8 = KVF != KvFormat::kSame;
  static constexpr int kDqk = DQK, kDv = DV;
  static constexpr int kThreads = kPrefillThreads;
  static constexpr int kMTiles = prefill_m_tiles(DV);
  static constexpr int kRowsPerWarp = 16 * kMTiles;
  static constexpr int kCtaRows = prefill_cta_rows_of(DV);
  static constexpr int kKvTile = prefill_kv_tile(DQK);
  static constexpr int kStages = 2;
  // 16-byte chunks of one 16-bit row.
  static constexpr int kQkChunks = DQK / 8;
  static constexpr int kVChunks = DV / 8;

  // Shared memory (bytes). 16-bit tiles are row-major with 16-byte chunks XOR-swizzled by the
  // row (common/swizzle.cuh), so ldmatrix and the cp.async stores are bank-conflict free. fp8 KV
  // lands in plain staging tiles (two stages) and is widened into one 16-bit K and V tile.
  static constexpr int kQBytes = kCtaRows * DQK * 2;
  static constexpr int kKStageBytes = kKvTile * DQK * 2;
  static constexpr int kVStageBytes = kKvTile * DV * 2;
  static constexpr int k16Stages = kFp8 ? 1 : kStages;
  static constexpr int kK8StageBytes = kFp8 ? kKvTile * DQK : 0;
  static constexpr int kV8StageBytes = kFp8 ? kKvTile * DV : 0;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQBytes;
  static constexpr int kVOffset = kKOffset + k16Stages * kKStageBytes;
  static constexpr int kK8Offset = kVOffset + k16Stages * kVStageBytes;
  static constexpr int kV8Offset = kK8Offset + kStages * kK8StageBytes;
  static constexpr int kSmemBytes = kV8Offset + kStages * kV8StageBytes;
  static_assert(kSmemBytes <= 113 * 1024, "two CTAs per SM need <= ~113 KB each");
};

// Element offset of 16-bit element chunk `chunk` (8 elements) of row `row` in a swizzled tile
// of `kChunks` chunks a row (common/swizzle.cuh; every head dim here is 8k chunks a row).
template <int kChunks>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return swizzled_offset<kChunks, 2>(row, chunk);
}

}  // namespace flashkv::cuda::prefill_detail
