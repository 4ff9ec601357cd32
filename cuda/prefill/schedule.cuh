// Scheduling inside a CTA: the two warp groups split their worker's row blocks, and take turns
// on the tensor cores.
//
// Why the turns: each SM sub-partition holds one warp of each group. A warp's tile step is an
// MMA phase (P.V of the previous tile, then Q.K^T of this one) followed by a softmax phase
// (reductions, exp2, conversions) that leaves the tensor cores idle. Left alone the two groups
// drift into the same phase; making them alternate (group A's MMA phase while group B runs its
// softmax, then the reverse) keeps the tensor cores busy. Two named barriers carry the turn
// across, as in FlashAttention-3's "ping-pong" schedule.
#pragma once

#include "prefill/tile_config.cuh"

namespace flashkv::cuda::prefill_detail {

// Named barrier ids (0 is __syncthreads): one per warp group for its own 128 threads, and one
// turn barrier per group over all 256 threads.
constexpr int kGroupBarrier = 1;  // + warp group
constexpr int kTurnBarrier = 3;   // + warp group

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Strict alternation of MMA phases between the two groups. Group 0 takes its first turn
// without waiting; every later turn of either group waits for the other group's previous turn
// to end. Both groups must take the same number of turns (finish() pads with empty ones), and
// group 0 finally consumes group 1's last hand-over so both barriers end where they began.
struct PingPong {
  int group;
  int turns = 0;

  __device__ __forceinline__ void begin_turn() {
    if (group == 1 || turns > 0) named_barrier_sync(kTurnBarrier + group, kCtaThreads);
  }
  __device__ __forceinline__ void end_turn() {
    named_barrier_arrive(kTurnBarrier + (group ^ 1), kCtaThreads);
    ++turns;
  }
  __device__ __forceinline__ void finish(int total_turns) {
    while (turns < total_turns) {
      begin_turn();
      end_turn();
    }
    if (group == 0 && total_turns > 0) named_barrier_sync(kTurnBarrier, kCtaThreads);
  }
};

// Turns a row block takes: one per KV tile plus the final P.V (none without visible keys).
__device__ __forceinline__ int block_turns(int num_tiles) {
  return num_tiles > 0 ? num_tiles + 1 : 0;
}

// Greedy split of a worker's blocks: each goes to the group with fewer turns so far (ties to
// group 0). Both groups replay it identically.
struct GroupSplit {
  int load[2] = {0, 0};
  __device__ __forceinline__ int assign(int turns) {
    const int g = load[1] < load[0] ? 1 : 0;
    load[g] += turns;
    return g;
  }
  __device__ __forceinline__ int total() const { return max(load[0], load[1]); }
};

}  // namespace flashkv::cuda::prefill_detail
