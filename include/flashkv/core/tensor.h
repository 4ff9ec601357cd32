// TensorView: a non-owning view (pointer, dtype, device, up to 4 dims, strides in elements), and
// the argument checks built on it.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "flashkv/core/device.h"
#include "flashkv/core/dtype.h"
#include "flashkv/core/error.h"

namespace flashkv {

constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device;
  int ndim = 0;  // 0: no tensor (an absent optional argument)
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t stride[kMaxDims] = {0, 0, 0, 0};  // in elements

  TensorView() = default;
  // A contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape,
             Device device = Device::cpu());

  bool defined() const { return ndim > 0; }
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t numel() const;
  bool is_contiguous() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  std::string str() const;  // e.g. "bf16[4, 8, 128] on cuda:0"

  // Typed pointer; throws flashkv::Error when T does not match the dtype.
  template <typename T>
  T* ptr() const {
    FLASHKV_CHECK(dtype_of<T>::value == dtype, "tensor of ", str(), ": accessed as ",
                  dtype_name(dtype_of<T>::value));
    return static_cast<T*>(data);
  }
  // Element offset of an index (no bounds check; see at()).
  int64_t offset(std::initializer_list<int64_t> idx) const;
  // Host-side checked read of one element as a double.
  double at(std::initializer_list<int64_t> idx) const;

  // Rows [begin, end) of dimension 0.
  TensorView rows(int64_t begin, int64_t end) const;
};

// Fluent argument checks for public entry points. Each failure throws flashkv::Error naming the
// argument, e.g. `q: expected dtype bf16, got f32 (tensor f32[3, 32, 128] on cpu)`.
class Expect {
 public:
  Expect(const TensorView& t, const char* name);
  Expect& defined();
  Expect& ndim(int n);
  Expect& dim(int d, int64_t expected, const char* what = nullptr);
  Expect& dim_at_least(int d, int64_t minimum, const char* what = nullptr);
  Expect& dtype(DType t);
  Expect& dtype_in(std::initializer_list<DType> ts);
  Expect& float_dtype();  // f32 / f16 / bf16
  Expect& index_dtype();  // i32 / i64
  Expect& device(Device d);
  Expect& on_host();
  Expect& contiguous();
  Expect& inner_contiguous();  // last dimension has stride 1

 private:
  [[noreturn]] void fail(const std::string& what) const;
  const TensorView& t_;
  const char* name_;
};

// Reads element i of a 1-D i32/i64 tensor that lives on the host.
int64_t index_at(const TensorView& t, int64_t i);

}  // namespace flashkv
