// Context parallelism: one request's KV sharded across the ranks of a Communicator, each rank
// attending over its shard with the existing operators, the partial (O, LSE) states exchanged and
// merged with merge_states (docs/PARALLEL.md). Every result equals the one-rank result within the
// SEMANTICS.md tolerances.
//
// Usage, on every rank: plan() once per batch (host only; sizes the exchange buffers), then run()
// once per layer. run() validates everything it was given before its first collective, so a bad
// argument throws on the rank that got it (the others then stop at their collective's timeout).
// run() allocates nothing: with the NCCL communicator it only enqueues work on the stream.
#pragma once

#include <cstdint>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/ops/attention.h"
#include "flashkv/parallel/communicator.h"
#include "flashkv/plan/plan.h"

namespace flashkv::parallel {

enum class CpLayout : uint8_t {
  // Runs of `block` tokens go to the ranks round robin: position t lives on rank (t / block) % P
  // (vLLM's cp_kv_cache_interleave_size).
  interleaved,
  // Rank r holds positions [r * block, (r + 1) * block); the last rank also every position after.
  contiguous,
};
enum class CpExchange : uint8_t {
  // Every rank gathers every rank's whole state and merges the rows it needs.
  all_gather,
  // Decode: each rank merges one slice of the heads, then the merged slices are all-gathered
  // (fewer bytes than all_gather from three ranks on). Extend: each rank receives only the rows
  // it owns.
  all_to_all,
};

// How an extend's new tokens' K/V reach the ranks whose rows attend to them (decode has no new
// tokens to pass and ignores it).
enum class CpKvPass : uint8_t {
  // Every rank gathers every rank's new tokens' K/V (all_gather_v) and attends its rows over all
  // of them in one pass.
  all_gather,
  // Passed around a ring: each rank starts with its own new tokens' K/V, attends its rows over the
  // block it holds, and in P - 1 steps sends that block to rank r + 1 and receives rank r - 1's
  // (Communicator::send_recv), one attention pass a block. The states of the passes before the
  // last are merged with the prefix states (merge_states), and the last pass merges with that as
  // it writes. A rank holds two blocks at a time (the one it attends and sends, the one it
  // receives), never every rank's.
  ring,
};

struct CpOptions {
  CpLayout layout = CpLayout::interleaved;
  int64_t block = 1;  // tokens per run (interleaved) or per rank (contiguous); >= 1
  CpExchange exchange = CpExchange::all_gather;
  CpKvPass kv_pass = CpKvPass::all_gather;
};

// Where a sharded run()'s time goes, for benchmarks (flashkv bench --cp): given to set_timing(),
// every later run() adds its phases' wall-clock time to it. Each phase ends with
// comm.synchronize(stream), so the split is exact where the operators and collectives complete
// inside their calls (the CPU, MPI) and costs one wait on the stream per phase on a GPU; without a
// CpTiming, run() reads no clock and waits for nothing.
struct CpTiming {
  double local_us = 0;  // the local attention passes over this rank's shard (with run()'s checks)
  double comm_us = 0;   // the collectives, the wait for the other ranks to join them included
  double merge_us = 0;  // merge_states and the copies that reorder rows and states around them
  double total_us() const { return local_us + comm_us + merge_us; }
};

// Where a request's positions live. Each rank stores its positions in increasing order, so local
// entry k of a request on rank r is position global_pos(r, k).
class CpShard {
 public:
  CpShard(const CpOptions& options, int world);
  int world() const { return world_; }
  int owner(int64_t pos) const;
  // How many of the positions [0, len) rank `rank` holds.
  int64_t local_len(int rank, int64_t len) const;
  // The index of position `pos` among its owner's positions.
  int64_t local_index(int64_t pos) const { return local_len(owner(pos), pos); }
  int64_t global_pos(int rank, int64_t local) const;

 private:
  CpOptions options_;
  int world_;
};

// The zigzag split of a request's n new tokens across `world` ranks, for causal balance: 2 * world
// chunks, chunk c = [c * n / (2 world), (c + 1) * n / (2 world)); rank r owns chunks r and
// 2 world - 1 - r, in that order.
struct ZigzagRows {
  int64_t begin[2];
  int64_t len[2];
  int64_t total() const { return len[0] + len[1]; }
};
ZigzagRows zigzag_rows(int64_t n, int world, int rank);

// Decode: every rank holds the batch's queries and its shard of each request's KV; every rank
// ends with the exact output.
struct CpDecodeShape {
  std::vector<int32_t> kv_len;  // global KV length of each request (its decode row included)
  int32_t num_qo_heads = 0, num_kv_heads = 0, head_dim_qk = 0, head_dim_v = 0;
  int32_t page_size = 1;
  DType dtype = DType::bf16;  // q and out
  // A sliding window (AttentionOptions::window_left; < 0: none). Its positions are global, so
  // with more than one rank each request's window becomes a mask over the rank's local entries
  // and the local pass is a one-row masked paged_prefill instead of paged_decode.
  int32_t window_left = -1;
};

class CpDecode {
 public:
  CpDecode(Communicator& comm, const CpOptions& options);
  // Plans the local decode over this rank's share (local_kv_len()) and sizes the buffers.
  void plan(const CpDecodeShape& shape, const PlanOptions& plan_options = {}, Stream stream = {});
  // This rank's KV length of each request: what the `kv` given to run() must hold.
  const std::vector<int32_t>& local_kv_len() const { return local_kv_len_; }
  // q [B, Hq, D_qk] (the same on every rank); kv: this rank's shard (request i's local_kv_len()[i]
  // tokens in increasing position); out [B, Hq, D_v]; lse [B, Hq] f32 (optional). opt: sm_scale,
  // logits_soft_cap, sinks (added once: by rank 0's local pass, whose state enters the merge
  // once); its window_left must be the plan's; custom masks are refused.
  void run(const TensorView& q, const PagedKV& kv, const AttentionOptions& opt,
           const TensorView& out, const TensorView& lse, Stream stream = {});
  // Every later run() adds its phases to *timing (null: none); the caller keeps it alive.
  void set_timing(CpTiming* timing) { timing_ = timing; }

 private:
  Communicator& comm_;
  CpOptions options_;
  CpTiming* timing_ = nullptr;
  CpDecodeShape shape_;
  std::vector<int32_t> local_kv_len_;
  DecodePlan plan_;
  // A windowed decode on more than one rank: one-row requests with a mask over global positions.
  bool masked_ = false;
  PrefillPlan masked_plan_;
  Tensor qo_indptr_, mask_, mask_indptr_;
  Workspace ws_;
  bool planned_ = false;
  std::vector<int64_t> head_begin_;  // all_to_all: rank s merges heads [head_begin_[s], [s + 1])
  std::vector<Buffer> bufs_;
};

// Extend (and target verify / draft extend): each request has a cached prefix, sharded as in
// decode, and new tokens split zigzag across the ranks (zigzag_rows). Each rank gives its own new
// tokens' q/k/v and gets their output. Internally: the new tokens' q (and, with
// CpKvPass::all_gather, their k/v) are all-gathered; each rank attends all new rows over its
// prefix shard (non-causal: the prefix precedes them), the states are exchanged and merged for the
// rows each rank owns, and those rows then attend over all new tokens (causal on their global
// positions): in one pass over the gathered K/V, or (CpKvPass::ring) one pass per rank's block
// as the blocks go round, merged with the prefix state as the last one is written.
struct CpExtendShape {
  std::vector<int32_t> prefix_len;  // cached tokens of each request (global)
  std::vector<int32_t> extend_len;  // new tokens of each request
  int32_t num_qo_heads = 0, num_kv_heads = 0, head_dim_qk = 0, head_dim_v = 0;
  int32_t page_size = 1;
  DType dtype = DType::bf16;  // q, the new tokens' k/v, out
  // The masks, as AttentionOptions has them (fixed here: the local passes' plans and masks are
  // derived from them). custom_mask / mask_indptr, optional, on the host: request i's
  // [extend_len[i], prefix_len[i] + extend_len[i]] u8 matrix at element mask_indptr[i].
  bool causal = true;
  int32_t window_left = -1;
  TensorView custom_mask, mask_indptr;
};

class CpExtend {
 public:
  CpExtend(Communicator& comm, const CpOptions& options);
  void plan(const CpExtendShape& shape, const PlanOptions& plan_options = {}, Stream stream = {});
  // This rank's cached-prefix length of each request (what run()'s `prefix` must hold).
  const std::vector<int32_t>& local_prefix_len() const { return local_prefix_len_; }
  // Rows this rank owns: request i's new tokens zigzag_rows(extend_len[i], P, rank), packed
  // request by request (the first chunk, then the second).
  int64_t num_own_rows() const { return own_indptr_.empty() ? 0 : own_indptr_.back(); }
  // q [T_own, Hq, D_qk], k [T_own, Hkv, D_qk], v [T_own, Hkv, D_v]: this rank's new tokens;
  // prefix: this rank's prefix shard (local_prefix_len()); out [T_own, Hq, D_v], lse [T_own, Hq]
  // f32 (optional). opt: sm_scale, logits_soft_cap, sinks (added once, by the last pass); its
  // causal and window_left must be the plan's, its masks and merge state undefined.
  void run(const TensorView& q, const TensorView& k, const TensorView& v, const PagedKV& prefix,
           const AttentionOptions& opt, const TensorView& out, const TensorView& lse,
           Stream stream = {});
  // The new tokens this rank's KV pool keeps: those at the positions (prefix_len[i] + t) the
  // layout gives this rank, request by request in increasing position, so that after the pass
  // each request holds its local share of prefix + new tokens (CpShard::local_len).
  int64_t num_local_new() const { return num_local_new_; }
  // After run() (and before the next run or plan), writes those tokens' K/V into this rank's
  // pool with append_kv. k, v: what the last run() was given (with one rank they are the source;
  // otherwise the rows come from the new tokens run() gathered, or with the ring, from the blocks
  // as they passed); out_cache_loc
  // [num_local_new()] (i32/i64): their slots; k_pool / v_pool and the scales as append_kv takes
  // them.
  void append_local_kv(const TensorView& k, const TensorView& v, const TensorView& out_cache_loc,
                       const TensorView& k_pool, const TensorView& v_pool, float k_scale = 1.0f,
                       float v_scale = 1.0f, Stream stream = {});
  // Every later run() adds its phases to *timing (null: none); the caller keeps it alive.
  void set_timing(CpTiming* timing) { timing_ = timing; }

 private:
  struct Segment {  // a copy of `rows` rows
    int64_t src, dst, rows;
  };
  // An attention pass of the owned rows (each owned chunk a request of its own) over new tokens'
  // K/V: a paged view with page size 1 over a buffer of them, kv_indices picking each chunk's
  // rows; causal or a mask over those rows built at plan time.
  struct NewPass {
    PrefillPlan plan;
    Workspace ws;
    bool masked = false, causal = false;
    int32_t window_left = -1;
    Tensor kv_indptr, kv_indices, mask, mask_indptr;
  };
  struct PassLists;  // a NewPass's host arrays while it is planned
  void build_pass(NewPass& pass, const PassLists& lists, const BatchShape& shape,
                  const DeviceInfo& info, const PlanOptions& plan_options);
  void upload_pass(NewPass& pass, void* scratch, size_t scratch_bytes, Stream stream);
  void keep_ring_rows(int step, const void* k, const void* v, size_t row_k, size_t row_v,
                      Stream stream);
  void copy_segments(void* dst, int64_t dst_base, const void* src, int64_t src_base,
                     const std::vector<Segment>& segments, size_t row_bytes, Stream stream);
  Communicator& comm_;
  CpOptions options_;
  CpTiming* timing_ = nullptr;
  CpExtendShape shape_;
  bool planned_ = false;
  std::vector<int32_t> local_prefix_len_;
  std::vector<int32_t> new_indptr_;      // global new-token rows of each request
  std::vector<int32_t> own_indptr_;      // own rows of each request
  std::vector<int64_t> rank_rows_;       // rows each rank owns
  std::vector<int64_t> rank_row_begin_;  // their first row in the rank-major gather
  std::vector<Segment> to_global_;       // rank-major gather -> global order
  std::vector<Segment> to_owner_;        // global order -> owner-major (all_to_all send)
  std::vector<Segment> own_of_global_;   // global order -> own order (all_gather pick)
  std::vector<Segment> local_new_;       // global order -> the new tokens this rank keeps
  int64_t num_local_new_ = 0;
  bool ran_ = false;  // run() since the last plan()
  PrefillPlan prefix_plan_;
  Workspace prefix_ws_;
  bool prefix_masked_ = false, custom_ = false;
  Tensor qo_indptr_, own_qo_indptr_, prefix_mask_, prefix_mask_indptr_;
  // CpKvPass::all_gather: one pass over the gathered new tokens (global order).
  NewPass new_pass_;
  // CpKvPass::ring: step j's pass over the block of rank (rank - j) mod P, which holds that
  // rank's own rows (rank_rows_) in its own order, K then V; and the rows of each block this
  // rank keeps (append_local_kv), copied out as the block passes.
  std::vector<NewPass> ring_passes_;
  std::vector<std::vector<Segment>> ring_keep_;
  std::vector<Buffer> bufs_;
};

}  // namespace flashkv::parallel
