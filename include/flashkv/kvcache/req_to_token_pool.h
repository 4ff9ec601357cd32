// ReqToTokenPool: the request-to-token map of a serving batch. Row r of `req_to_token`
// ([max_reqs, max_context_len] int32, on the pool's device) lists the KV slots of the tokens of
// the request holding row r, in token order. Rows are handed out and returned on the host; the
// table itself lives only on the device (no host mirror: the ops read it where it is).
// Not thread-safe: one scheduler thread owns a pool.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/kvcache/free_list.h"

namespace flashkv {

class ReqToTokenPool {
 public:
  // The table starts zeroed (every entry names the dummy slot 0).
  ReqToTokenPool(int64_t max_reqs, int64_t max_context_len, Device device = Device::cpu());

  int64_t max_reqs() const { return rows_.capacity(); }
  int64_t max_context_len() const { return req_to_token_.size(1); }
  Device device() const { return req_to_token_.device(); }
  int64_t num_free() const { return rows_.num_free(); }
  int64_t num_used() const { return rows_.num_used(); }
  bool is_live(int32_t row) const { return rows_.is_live(row); }

  // int32 [max_reqs, max_context_len] on device().
  const TensorView& req_to_token() const { return req_to_token_.view(); }

  // `n` free rows, or nullopt (nothing changes) when fewer than `n` are free: the caller decides
  // what to evict.
  std::optional<std::vector<int32_t>> alloc(int64_t n);
  // Returns rows; throws flashkv::Error (and frees none) when a row is out of range, not
  // allocated, or listed twice.
  void free(const std::vector<int32_t>& rows);

  // Writes `slots` (1-D int32, contiguous, on the host or on device()) into row `row` at token
  // positions [start, start + slots.numel()), ordered on `stream`. A host source is read before
  // this returns unless it is pinned memory (then keep it alive until the stream gets there).
  // Throws unless `row` is live and the range fits in max_context_len.
  void write(int32_t row, int64_t start, const TensorView& slots, Stream stream = {});
  void write(int32_t row, int64_t start, const std::vector<int32_t>& slots, Stream stream = {});
  // Token positions [start, start + n) of row `row`, copied to the host (waits for `stream`).
  std::vector<int32_t> read(int32_t row, int64_t start, int64_t n, Stream stream = {}) const;

 private:
  void check_range(const char* op, int32_t row, int64_t start, int64_t n) const;
  int32_t* row_ptr(int32_t row, int64_t start) const;

  IdFreeList rows_;
  Tensor req_to_token_;
};

}  // namespace flashkv
