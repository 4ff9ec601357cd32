#include <algorithm>

#include "flashkv/core/error.h"
#include "flashkv/parallel/context_parallel.h"

namespace flashkv::parallel {

namespace {
constexpr int64_t kMaxBlock = int64_t{1} << 40;  // block * world stays far from overflow
constexpr int kMaxWorld = 1 << 16;
}  // namespace

CpShard::CpShard(const CpOptions& options, int world) : options_(options), world_(world) {
  FLASHKV_CHECK(world >= 1 && world <= kMaxWorld, "context parallelism: world size ", world,
                ": expected 1..", kMaxWorld);
  FLASHKV_CHECK(options.block >= 1 && options.block <= kMaxBlock,
                "CpOptions::block = ", options.block, ": expected 1..", kMaxBlock, " tokens");
  FLASHKV_CHECK(options.layout == CpLayout::interleaved || options.layout == CpLayout::contiguous,
                "CpOptions::layout: expected interleaved or contiguous, got ",
                static_cast<int>(options.layout));
}

int CpShard::owner(int64_t pos) const {
  const int64_t b = options_.block;
  if (options_.layout == CpLayout::interleaved) return static_cast<int>((pos / b) % world_);
  return static_cast<int>(std::min<int64_t>(pos / b, world_ - 1));
}

int64_t CpShard::local_len(int rank, int64_t len) const {
  const int64_t b = options_.block;
  if (len <= 0) return 0;
  if (options_.layout == CpLayout::interleaved) {
    const int64_t cycle = b * world_;
    const int64_t full = len / cycle;
    const int64_t rest = len - full * cycle - int64_t{rank} * b;
    return full * b + std::clamp<int64_t>(rest, 0, b);
  }
  const int64_t start = int64_t{rank} * b;
  if (rank == world_ - 1) return std::max<int64_t>(len - start, 0);
  return std::clamp<int64_t>(len - start, 0, b);
}

int64_t CpShard::global_pos(int rank, int64_t local) const {
  const int64_t b = options_.block;
  if (options_.layout == CpLayout::interleaved)
    return (local / b) * b * world_ + int64_t{rank} * b + local % b;
  return int64_t{rank} * b + local;
}

ZigzagRows zigzag_rows(int64_t n, int world, int rank) {
  FLASHKV_CHECK(world >= 1 && rank >= 0 && rank < world, "zigzag_rows: rank ", rank,
                " of a world of ", world);
  FLASHKV_CHECK(n >= 0, "zigzag_rows: n = ", n, ": expected >= 0");
  const int64_t chunks = 2 * int64_t{world};
  auto bound = [&](int64_t c) { return c * n / chunks; };
  ZigzagRows z;
  const int64_t c0 = rank, c1 = chunks - 1 - rank;
  z.begin[0] = bound(c0);
  z.len[0] = bound(c0 + 1) - z.begin[0];
  z.begin[1] = bound(c1);
  z.len[1] = bound(c1 + 1) - z.begin[1];
  return z;
}

}  // namespace flashkv::parallel
