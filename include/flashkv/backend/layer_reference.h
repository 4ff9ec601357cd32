// The float64 reference of one FlashKVBackend layer call, computed from the KV pool after the call
// (which wrote the new tokens' K/V there). What the backend tests, `flashkv check` and
// `flashkv serve --check` compare a layer's output with: it gathers each request's visible K/V
// rows from the pool by the request's own slot list (not through the backend's index building)
// and runs reference::ragged_attention with the options the layer declares (SEMANTICS.md).
#pragma once

#include <cstdint>
#include <vector>

#include "flashkv/backend/forward_batch.h"
#include "flashkv/ops/reference.h"

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
};

// q: host [sum qo_len, Hq, D_qk], the layer's query rows request after request. pool: the
// model's full-attention pool; swa_pool / swa_allocator (both or neither): where sliding-window
// layers keep their KV. Sliding-window layers see the whole sequence with window_left applied;
// cross-attention layers see the encoder tokens, non-causally. Throws flashkv::Error on an
// ENCODER_ONLY layer (it reads no pool), a slot outside the pool, qo_len outside 0..seq_len, or q
// rows that do not match the requests.
reference::Result layer_reference(const LayerSpec& layer, const std::vector<ReferenceRequest>& reqs,
                                  const TensorView& q, const KVPool& pool,
                                  const KVPool* swa_pool = nullptr,
                                  const SWAAllocator* swa_allocator = nullptr);

}  // namespace flashkv
