#include "flashkv/kvcache/req_to_token_pool.h"

namespace flashkv {

ReqToTokenPool::ReqToTokenPool(int64_t max_reqs, int64_t max_context_len, Device device)
    : rows_(0, max_reqs, "request row") {
  FLASHKV_CHECK(max_reqs > 0, "ReqToTokenPool: max_reqs: expected > 0, got ", max_reqs);
  FLASHKV_CHECK(max_context_len > 0, "ReqToTokenPool: max_context_len: expected > 0, got ",
                max_context_len);
  req_to_token_ = Tensor::empty({max_reqs, max_context_len}, DType::i32, device);
  fill_bytes(req_to_token_.data(), device, 0, req_to_token_.view().nbytes());
  if (device.is_cuda()) synchronize(device);
}

std::optional<std::vector<int32_t>> ReqToTokenPool::alloc(int64_t n) { return rows_.alloc(n); }

void ReqToTokenPool::free(const std::vector<int32_t>& rows) { rows_.free(rows); }

void ReqToTokenPool::check_range(const char* op, int32_t row, int64_t start, int64_t n) const {
  FLASHKV_CHECK(rows_.is_live(row), "ReqToTokenPool::", op, ": row ", row,
                rows_.contains(row) ? " is not allocated" : " is out of range");
  FLASHKV_CHECK(start >= 0 && n >= 0 && start + n <= max_context_len(), "ReqToTokenPool::", op,
                ": token range [", start, ", ", start + n,
                ") outside [0, max_context_len = ", max_context_len(), ")");
}

int32_t* ReqToTokenPool::row_ptr(int32_t row, int64_t start) const {
  return req_to_token_.ptr<int32_t>() + row * max_context_len() + start;
}

void ReqToTokenPool::write(int32_t row, int64_t start, const TensorView& slots, Stream stream) {
  Expect(slots, "slots").ndim(1).dtype(DType::i32).contiguous();
  FLASHKV_CHECK(slots.device.is_cpu() || slots.device == device(), "slots: expected the host or ",
                device().str(), ", got ", slots.device.str());
  check_range("write", row, start, slots.numel());
  copy_bytes(row_ptr(row, start), device(), slots.data, slots.device, slots.nbytes(), stream);
}

void ReqToTokenPool::write(int32_t row, int64_t start, const std::vector<int32_t>& slots,
                           Stream stream) {
  const TensorView view(const_cast<int32_t*>(slots.data()), DType::i32,
                        {static_cast<int64_t>(slots.size())});
  write(row, start, view, stream);
}

std::vector<int32_t> ReqToTokenPool::read(int32_t row, int64_t start, int64_t n,
                                          Stream stream) const {
  check_range("read", row, start, n);
  std::vector<int32_t> out(static_cast<size_t>(n));
  copy_bytes(out.data(), Device::cpu(), row_ptr(row, start), device(), out.size() * 4, stream);
  return out;
}

}  // namespace flashkv
