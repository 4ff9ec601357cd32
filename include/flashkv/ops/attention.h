// The attention operators (SEMANTICS.md): one params struct per family, one entry point each,
// the device chosen by the tensors (CPU tensors run the CPU kernels, CUDA tensors the CUDA ones).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/core/tensor.h"
#include "flashkv/plan/plan.h"

namespace flashkv {

struct AttentionParams;  // the kernel contract (internal)

// A batch's paged KV. K/V pools are NHD: k [num_slots, Hkv, D_qk], v [num_slots, Hkv, D_v],
// dtype f32/f16/bf16/fp8_e4m3/fp8_e5m2 (both the same); slot s sits on page s / page_size.
// Request i owns entries indices[indptr[i] .. indptr[i+1]): token slots when page_size == 1,
// else page ids, the last page holding last_page_len[i] (1..page_size) tokens.
struct PagedKV {
  TensorView k, v;
  TensorView indptr;         // i32 [B + 1]
  TensorView indices;        // i32 [>= indptr[B]]
  TensorView last_page_len;  // i32 [B]; required when page_size > 1
  int page_size = 1;
  float k_scale = 1.0f;  // value used = stored value * scale (fp8 KV; 1 otherwise)
  float v_scale = 1.0f;
};

struct AttentionOptions {
  bool causal = true;         // ignored when custom_mask is given
  int window_left = -1;       // < 0: no window; else key j visible iff j >= p(q) - window_left
  float logits_soft_cap = 0;  // > 0: s = cap * tanh(s / cap)
  float sm_scale = 0;         // 0: 1 / sqrt(D_qk)
  // Speculative-decoding tree mask: u8 (0/1), request i's [qo_len_i, kv_len_i] row-major matrix
  // at element offset mask_indptr[i]. The operators require mask_indptr with a mask; the
  // reference also accepts it absent (matrices packed back to back).
  TensorView custom_mask;
  TensorView mask_indptr;  // i32 [B + 1]
  // ragged_prefill / paged_prefill only (paged_decode rejects them): merge each query row's
  // result with the state (merge_o, merge_lse) over a disjoint KV set before writing it, as
  // SEMANTICS.md "Merging partial states" (a state with LSE -inf contributes nothing); out gets
  // the merged O and lse (when given) the merged LSE. Extend's prefix pass takes the new tokens'
  // own causal state this way instead of a merge_state call. merge_o [Tq, Hq, D_v] in out's dtype,
  // merge_lse [Tq, Hq] f32 contiguous, both required together; they may be the same tensors as
  // out / lse (each row is read before it is written).
  TensorView merge_o, merge_lse;
  // With merge_o, CUDA sm_90 only (elsewhere ignored): the call may start while the kernel
  // before it on the stream is still running, and waits for that kernel only before it reads
  // merge_o / merge_lse or writes out / lse. Set it only when that kernel writes nothing else
  // this call reads (q, the KV and index tensors, the mask, the workspace) and reads nothing it
  // writes, as when it is the ragged_prefill that produced merge_o / merge_lse.
  bool overlap_previous = false;
  // paged_decode on CUDA sm_90 only (elsewhere ignored): the caller promises that kv_indptr,
  // kv_indices and last_page_len were written before the kernel ahead of this call on the stream
  // started (by copies, or by kernels that do not let their successors start early, as the
  // backend's index builders), so the decode kernel reads them while that kernel still runs.
  // Two dependent memory round trips less per call; matters on small batches.
  bool layout_ready = false;
  // Attention sinks (SEMANTICS.md): f32 [Hq] contiguous, on q's device; one logit per query head
  // (natural log) that joins the softmax denominator with no value vector; the LSE includes it.
  // Added once to what the call writes: with merge_o, to the merged result (the state given in
  // merge_o / merge_lse must not include it). Undefined: no sinks.
  TensorView sinks;
};

// Scratch memory an operator's plan needs: the uploaded plan and the partial states of split
// work. Sized by the plan (plan.layout.total_bytes); run() never allocates.
class Workspace {
 public:
  Workspace() = default;
  Workspace(size_t bytes, Device device) : buffer_(bytes, device) {}
  void* data() const { return buffer_.data(); }
  size_t bytes() const { return buffer_.bytes(); }
  Device device() const { return buffer_.device(); }
  // Grows (reallocating, contents lost) when smaller than `bytes`.
  void reserve(size_t bytes, Device device);
  // Copies the plan part of `plan` into the workspace (CUDA: one async host-to-device copy on
  // `stream` from a host staging buffer kept here; CPU: a memcpy). Call once per plan, before
  // the runs that use it; the runs then read the plan only from here.
  void upload(const Plan& plan, Stream stream = {});
  // Id of the plan last uploaded (0: none).
  uint64_t plan_id() const { return plan_id_; }

  // Puts the partial states of split work into caller memory (on this workspace's device, kept
  // alive by the caller) instead of after the plan, so that the workspace itself needs only
  // plan.layout.plan_bytes. Several workspaces may share one scratch buffer: partial states live
  // only within one run, and runs on one stream never overlap (FlashInfer's shared "float
  // workspace"). The start is aligned up to 256 bytes. Null: the workspace's own memory.
  void set_external_scratch(void* data, size_t bytes);
  bool has_external_scratch() const { return scratch_ != nullptr; }
  size_t external_scratch_bytes() const { return scratch_bytes_; }
  // Bytes this workspace must hold for `plan` (the plan part only with an external scratch).
  size_t bytes_needed(const Plan& plan) const;
  // Where `plan`'s partial O starts (partial LSE follows at the layout's distance).
  unsigned char* scratch(const Plan& plan) const;

 private:
  Buffer buffer_;
  unsigned char* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  std::vector<unsigned char> host_staging_;  // source of the async copy; outlives it
  uint64_t plan_id_ = 0;
};

// The three attention operators write out in q's dtype or in f32 (FlashInfer's o_data_type:
// partial outputs that a later merge_state combines without rounding them first).
//
// Ragged prefill: q [Tq, Hq, D_qk] against contiguous k [Tk, Hkv, D_qk], v [Tk, Hkv, D_v];
// request i owns q rows qo_indptr[i].. and k/v rows kv_indptr[i]..; out [Tq, Hq, D_v];
// lse [Tq, Hq] f32 (optional, base 2).
void ragged_prefill(const PrefillPlan& plan, const TensorView& q, const TensorView& k,
                    const TensorView& v, const TensorView& qo_indptr, const TensorView& kv_indptr,
                    const AttentionOptions& opt, const TensorView& out, const TensorView& lse,
                    Workspace& ws, Stream stream = {});

// Paged prefill: q [Tq, Hq, D_qk] against the paged KV; query rows are the last qo_len
// positions of each request (causal-with-prefix alignment).
void paged_prefill(const PrefillPlan& plan, const TensorView& q, const TensorView& qo_indptr,
                   const PagedKV& kv, const AttentionOptions& opt, const TensorView& out,
                   const TensorView& lse, Workspace& ws, Stream stream = {});

// Paged decode: q [B, Hq, D_qk], one query row per request; out [B, Hq, D_v].
void paged_decode(const DecodePlan& plan, const TensorView& q, const PagedKV& kv,
                  const AttentionOptions& opt, const TensorView& out, const TensorView& lse,
                  Workspace& ws, Stream stream = {});

// An attention call whose arguments were validated but which has not run yet. prepare_* check
// everything the operator of the same name checks, the device kernels' own limits included, and
// change nothing; run() then launches it. A caller that must validate a sequence of calls before
// the first of them writes anything prepares them all, then runs them (the backend validates a
// layer's attention before it appends the layer's K/V to the pool). The call refers to the
// tensors' memory, the plan's upload in the workspace and, on the host, index contents checked
// at prepare time: keep them alive and unchanged until run().
class PreparedAttention {
 public:
  void run(Stream stream = {}) const;

 private:
  friend PreparedAttention prepare_ragged_prefill(const PrefillPlan&, const TensorView&,
                                                  const TensorView&, const TensorView&,
                                                  const TensorView&, const TensorView&,
                                                  const AttentionOptions&, const TensorView&,
                                                  const TensorView&, Workspace&);
  friend PreparedAttention prepare_paged_prefill(const PrefillPlan&, const TensorView&,
                                                 const TensorView&, const PagedKV&,
                                                 const AttentionOptions&, const TensorView&,
                                                 const TensorView&, Workspace&);
  friend PreparedAttention prepare_paged_decode(const DecodePlan&, const TensorView&,
                                                const PagedKV&, const AttentionOptions&,
                                                const TensorView&, const TensorView&, Workspace&);
  PreparedAttention(std::shared_ptr<const AttentionParams> params, Device device, bool decode)
      : params_(std::move(params)), device_(device), decode_(decode) {}

  std::shared_ptr<const AttentionParams> params_;
  Device device_;
  bool decode_ = false;
};
PreparedAttention prepare_ragged_prefill(const PrefillPlan& plan, const TensorView& q,
                                         const TensorView& k, const TensorView& v,
                                         const TensorView& qo_indptr, const TensorView& kv_indptr,
                                         const AttentionOptions& opt, const TensorView& out,
                                         const TensorView& lse, Workspace& ws);
PreparedAttention prepare_paged_prefill(const PrefillPlan& plan, const TensorView& q,
                                        const TensorView& qo_indptr, const PagedKV& kv,
                                        const AttentionOptions& opt, const TensorView& out,
                                        const TensorView& lse, Workspace& ws);
PreparedAttention prepare_paged_decode(const DecodePlan& plan, const TensorView& q,
                                       const PagedKV& kv, const AttentionOptions& opt,
                                       const TensorView& out, const TensorView& lse, Workspace& ws);

// Merges two states over disjoint KV sets: o [T, H, D], lse [T, H] f32 (base 2). `o`/`lse` may
// be the same tensors as `o_a`/`lse_a`.
void merge_state(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
                 const TensorView& lse_b, const TensorView& o, const TensorView& lse,
                 Stream stream = {});
// Folds N states: states [T, N, H, D], lse [T, N, H] -> o [T, H, D], lse_out [T, H] (optional).
void merge_states(const TensorView& states, const TensorView& lse, const TensorView& o,
                  const TensorView& lse_out, Stream stream = {});

// The one place window_left is normalised (docs/SEMANTICS.md): every negative value means no
// window and becomes -1, so the kernels, which test `window_left >= 0`, see one value for it. The
// operators apply it to AttentionOptions::window_left; callers that compare windows (a wrapper
// checking a run's window against its plan's) use it too.
int normalize_window_left(int window_left);

// KV length (tokens) of request i of a paged KV whose index arrays are on the host.
int64_t paged_kv_len(const PagedKV& kv, int64_t i);

}  // namespace flashkv
