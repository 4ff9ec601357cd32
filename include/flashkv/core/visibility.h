// Which keys a query row sees: the causal / sliding-window / prefix-offset rule of
// docs/SEMANTICS.md ("The attention function"), written once for host and device code.
//
// Request with L_q = qo_len query rows and L_kv = kv_len keys. Query row q (0-based, inside the
// request) sits at absolute position
//
//     p(q) = kv_len - qo_len + q          (the rows are the last qo_len positions)
//
// and key j (0 <= j < kv_len) is visible to it iff
//
//     (!causal || j <= p(q))  &&  (window_left < 0 || j >= p(q) - window_left)
//
// A custom mask replaces `causal` (callers pass causal && !custom_mask) and the window still
// applies. window_left reaches the kernels normalised (every negative value is -1, done once in
// ops/); the helpers only test `window_left >= 0`.
//
// The kernels work on ranges, so most helpers are range primitives. The raw primitives
// (window_first_key, causal_last_key, causal_key_end) do no clamping and test no flag, so a loop
// already specialised on `causal` / `windowed` pays nothing for them; the checked forms
// (first_visible_key, visible_key_end, visible, block_fully_visible) take the flags. All are
// templates over the index type T (int32_t on the device, int64_t where a product may overflow);
// write the type explicitly (e.g. visible<int64_t>(...)) when the arguments mix types.
//
// Rows of a block with consecutive positions first_pos .. last_pos see, together, the keys
// [first_visible_key(first_pos, w), visible_key_end(last_pos, kv_len, causal)) (empty when the
// end is not above the begin); each row's own set is that range for first_pos = last_pos = p(q).
//
// Callers:
//   plan/plan.cpp (build_tiles)             query_position, window_first_key, causal_key_end
//   kernels/cpu/attention_item.h            query_position, window_first_key, causal_last_key,
//                                           block_fully_visible
//   reference/reference.cpp                 query_position, visible
//   kernels/cuda/decode (view_of)           query_position(kv_len, 1, 0) and
//                                           window_first_key for v.lo
//   kernels/cuda/prefill/mask.cuh           make_row_block: query_position (pos0),
//                                           causal_key_end (hi), window_first_key (lo),
//                                           block_fully_visible as a key range (full_lo,
//                                           full_hi);
//                                           apply_mask: window_first_key (lo), causal_key_end (hi)
#pragma once

#if !defined(FLASHKV_HOST_DEVICE)
#if defined(__CUDACC__)
#define FLASHKV_HOST_DEVICE __host__ __device__
#else
#define FLASHKV_HOST_DEVICE
#endif
#endif

namespace flashkv {

// p(row) = kv_len - qo_len + row: the absolute position of query row `row` (0-based inside the
// request). Negative when the request has more rows than keys: such a row sees nothing under
// causal masking.
template <typename T>
FLASHKV_HOST_DEVICE constexpr T query_position(T kv_len, T qo_len, T row) {
  return kv_len - qo_len + row;
}

// The first key a row at position `pos` sees under a window of window_left >= 0 keys to its
// left: pos - window_left. Not clamped (may be negative); only meaningful for window_left >= 0.
template <typename T>
FLASHKV_HOST_DEVICE constexpr T window_first_key(T pos, T window_left) {
  return pos - window_left;
}

// The last key a row at position `pos` sees under causal masking: its own position. Not clamped
// (may be negative or past the last key).
template <typename T>
FLASHKV_HOST_DEVICE constexpr T causal_last_key(T pos) {
  return pos;
}

// One past causal_last_key: the end of a row's causal range, half-open. Not clamped.
template <typename T>
FLASHKV_HOST_DEVICE constexpr T causal_key_end(T pos) {
  return pos + 1;
}

// The first key a row at position `pos` sees, clamped at 0: window_first_key under a window
// (window_left >= 0), else 0.
template <typename T>
FLASHKV_HOST_DEVICE constexpr T first_visible_key(T pos, T window_left) {
  return window_left >= 0 && window_first_key(pos, window_left) > 0
             ? window_first_key(pos, window_left)
             : T(0);
}

// One past the last key a row at position `pos` sees, clamped to [0, kv_len]: causal_key_end
// under causal masking, else kv_len.
template <typename T>
FLASHKV_HOST_DEVICE constexpr T visible_key_end(T pos, T kv_len, bool causal) {
  return !causal                        ? kv_len
         : causal_key_end(pos) < 0      ? T(0)
         : causal_key_end(pos) > kv_len ? kv_len
                                        : causal_key_end(pos);
}

// The rule itself: key j (0 <= j < kv_len) is visible to the row at position `pos`.
template <typename T>
FLASHKV_HOST_DEVICE constexpr bool visible(T j, T pos, bool causal, T window_left) {
  return (!causal || j <= causal_last_key(pos)) &&
         (window_left < 0 || j >= window_first_key(pos, window_left));
}

// True when every key of [j_first, j_last] is visible to every row of positions
// first_pos .. last_pos (first_pos <= last_pos), so that a tile of keys needs no per-element
// mask: the earliest row sees the last key (causal) and the latest row the first key (window).
template <typename T>
FLASHKV_HOST_DEVICE constexpr bool block_fully_visible(T j_first, T j_last, T first_pos, T last_pos,
                                                       bool causal, T window_left) {
  return (!causal || j_last <= causal_last_key(first_pos)) &&
         (window_left < 0 || j_first >= window_first_key(last_pos, window_left));
}

}  // namespace flashkv
