// Owning memory: Buffer (aligned host memory or cudaMalloc'd device memory) and Tensor (a
// Buffer with a TensorView over it).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "flashkv/core/tensor.h"

namespace flashkv {

class Buffer {
 public:
  Buffer() = default;
  Buffer(size_t bytes, Device device);  // host memory is 64-byte aligned
  ~Buffer();
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
};

// A contiguous tensor that owns its memory (shared between copies of the Tensor object).
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(std::initializer_list<int64_t> shape, DType dtype,
                      Device device = Device::cpu());
  static Tensor empty(const std::vector<int64_t>& shape, DType dtype,
                      Device device = Device::cpu());
  // A 1-D host tensor with the given values.
  static Tensor from_i32(const std::vector<int32_t>& values, Device device = Device::cpu());

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: a Tensor is usable as a view
  void* data() const { return view_.data; }
  template <typename T>
  T* ptr() const {
    return view_.ptr<T>();
  }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  int64_t numel() const { return view_.numel(); }
  int64_t size(int d) const { return view_.size(d); }
  bool defined() const { return view_.defined(); }

  Tensor to(Device device, Stream stream = {}) const;         // a copy (synchronous)
  void copy_from(const TensorView& src, Stream stream = {});  // same shape and dtype required

 private:
  std::shared_ptr<Buffer> buffer_;
  TensorView view_;
};

}  // namespace flashkv
