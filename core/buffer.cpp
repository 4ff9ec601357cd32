#include "flashkv/core/buffer.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "flashkv/core/cuda_runtime.h"

namespace flashkv {

Buffer::Buffer(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, rounded);
    FLASHKV_CHECK(data_ != nullptr, "Buffer: out of host memory allocating ", bytes, " bytes");
  } else {
    data_ = detail::cuda_malloc(bytes, device);
  }
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      device_(o.device_) {}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    device_ = o.device_;
  }
  return *this;
}

void Buffer::release() {
  if (!data_) return;
  if (device_.is_cpu())
    std::free(data_);
  else
    detail::cuda_free(data_, device_);
  data_ = nullptr;
}

Tensor Tensor::empty(std::initializer_list<int64_t> shape, DType dtype, Device device) {
  return empty(std::vector<int64_t>(shape), dtype, device);
}

Tensor Tensor::empty(const std::vector<int64_t>& shape, DType dtype, Device device) {
  FLASHKV_CHECK(!shape.empty() && shape.size() <= kMaxDims, "Tensor::empty: expected 1 to ",
                kMaxDims, " dims, got ", shape.size());
  Tensor t;
  // The product of the non-zero dimensions, in bytes, must fit an int64: then neither this loop
  // nor numel() or the strides overflow (overflow is undefined), even with a zero dimension.
  int64_t n = 1;
  bool no_elements = false;
  for (int64_t s : shape) {
    FLASHKV_CHECK(s >= 0, "Tensor::empty: negative dimension ", s);
    if (s == 0) {
      no_elements = true;
      continue;
    }
    FLASHKV_CHECK(
        n <= std::numeric_limits<int64_t>::max() / static_cast<int64_t>(dtype_size(dtype)) / s,
        "Tensor::empty: a shape of more than 2^63 bytes (dimension ", s, ")");
    n *= s;
  }
  if (no_elements) n = 0;
  t.buffer_ = std::make_shared<Buffer>(static_cast<size_t>(n) * dtype_size(dtype), device);
  t.view_.data = t.buffer_->data();
  t.view_.dtype = dtype;
  t.view_.device = device;
  t.view_.ndim = static_cast<int>(shape.size());
  int64_t st = 1;
  for (int d = t.view_.ndim - 1; d >= 0; --d) {
    t.view_.shape[d] = shape[d];
    t.view_.stride[d] = st;
    st *= shape[d];
  }
  return t;
}

Tensor Tensor::from_i32(const std::vector<int32_t>& values, Device device) {
  Tensor host = empty({static_cast<int64_t>(values.size())}, DType::i32);
  if (!values.empty()) std::memcpy(host.data(), values.data(), values.size() * 4);
  return device.is_cpu() ? host : host.to(device);
}

Tensor Tensor::to(Device device, Stream stream) const {
  std::vector<int64_t> shape(view_.shape, view_.shape + view_.ndim);
  Tensor t = empty(shape, view_.dtype, device);
  t.copy_from(view_, stream);
  synchronize(device.is_cuda() ? device : view_.device, stream);
  return t;
}

void Tensor::copy_from(const TensorView& src, Stream stream) {
  FLASHKV_CHECK(src.dtype == view_.dtype && src.numel() == view_.numel(),
                "Tensor::copy_from: ", "expected ", view_.str(), ", got ", src.str());
  FLASHKV_CHECK(src.is_contiguous(), "Tensor::copy_from: source ", src.str(),
                " must be contiguous");
  copy_bytes(view_.data, view_.device, src.data, src.device, src.nbytes(), stream);
}

}  // namespace flashkv
