// The float64 reference of one FlashKVBackend layer call, computed from the KV pool after the call
// (which wrote the new tokens' K/V there). What the backend tests, `flashkv check` and
// `flashkv serve --check` compare a layer's output with: it gathers each request's visible K/V
// rows from the pool by the request's own slot list (not through the backend's index building)
// and runs reference::ragged_attention with the options the layer declares (SEMANTICS.md).
#pragma once

#include <cstdint>
#include <vector>

#include "flashkv/backend/forward_batch.h"
#include "flashkv/reference/reference.h"

namespace flashkv {

class KVPool;
class SWAAllocator;

// One request of the batch as the reference sees it.
struct ReferenceRequest {
  // Full-pool slots of the request's tokens: encoder_len encoder tokens, then seq_len decoder
  // tokens, in token order (encoder_len + seq_len entries).
  const int32_t* slots = nullptr;
  int32_t encoder_len = 0;
  int32_t seq_len = 0;  // decoder tokens in the cache, this pass's new ones included
  // Query rows given for this request: its last qo_len decoder tokens (a suffix of the pass's
  // new tokens, so a caller may check only some rows of a long extend).
  int32_t qo_len = 0;
  // TARGET_VERIFY: the tree-mask rows of those queries, [qo_len, seq_len] row-major (0/1);
  // null: causal. Cross-attention layers ignore it.
  const uint8_t* mask = nullptr;
  // With layer_reference's new_k / new_v: the request's last new_len decoder tokens (this pass's
  // new ones) are rows [new_row, new_row + new_len) of those, not pool rows.
  int32_t new_len = 0;
  int64_t new_row = 0;
};

// q: host [sum qo_len, Hq, D_qk], the layer's query rows request after request. pool: the
// model's full-attention pool; swa_pool / swa_allocator (both or neither): where sliding-window
// layers keep their KV. Sliding-window layers see the whole sequence with window_left applied;
// cross-attention layers see the encoder tokens, non-causally. Throws flashkv::Error on an
// ENCODER_ONLY layer (it reads no pool), a slot outside the pool, qo_len outside 0..seq_len, or q
// rows that do not match the requests.
// new_k / new_v (both or neither; host or device, [rows, Hkv, D]): the k / v the pass was given,
// for a pass that read its new tokens from them (FlashKVBackend::reads_new_kv_from_input); the
// pool's rows are then dequantized with its scales and the new tokens taken as they are.
reference::Result layer_reference(const LayerSpec& layer, const std::vector<ReferenceRequest>& reqs,
                                  const TensorView& q, const KVPool& pool,
                                  const KVPool* swa_pool = nullptr,
                                  const SWAAllocator* swa_allocator = nullptr,
                                  const TensorView& new_k = TensorView(),
                                  const TensorView& new_v = TensorView());

}  // namespace flashkv
