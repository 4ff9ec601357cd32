#include "flashkv/core/tensor.h"

#include <sstream>

namespace flashkv {

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> shape_,
                       Device device_)
    : data(data_), dtype(dtype_), device(device_) {
  FLASHKV_CHECK(shape_.size() >= 1 && shape_.size() <= kMaxDims, "TensorView: expected 1 to ",
                kMaxDims, " dims, got ", shape_.size());
  ndim = static_cast<int>(shape_.size());
  int d = 0;
  for (int64_t s : shape_) {
    FLASHKV_CHECK(s >= 0, "TensorView: dimension ", d, " must be >= 0, got ", s);
    shape[d++] = s;
  }
  int64_t st = 1;
  for (d = ndim - 1; d >= 0; --d) {
    stride[d] = st;
    st *= shape[d];
  }
}

int64_t TensorView::numel() const {
  if (ndim == 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  // A view of no elements reads no memory, whatever its strides (an empty batch's arrays).
  for (int d = 0; d < ndim; ++d)
    if (shape[d] == 0) return true;
  int64_t st = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != st) return false;
    st *= shape[d];
  }
  return true;
}

std::string TensorView::str() const {
  if (!defined()) return "<none>";
  std::ostringstream os;
  os << dtype_name(dtype) << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "] on " << device.str();
  return os.str();
}

int64_t TensorView::offset(std::initializer_list<int64_t> idx) const {
  int64_t off = 0;
  int d = 0;
  for (int64_t i : idx) off += i * stride[d++];
  return off;
}

double TensorView::at(std::initializer_list<int64_t> idx) const {
  FLASHKV_CHECK(device.is_cpu(), "TensorView::at: tensor ", str(), " is not on the host");
  FLASHKV_CHECK(static_cast<int>(idx.size()) == ndim, "TensorView::at: expected ", ndim,
                " indices, got ", idx.size());
  int d = 0;
  for (int64_t i : idx) {
    FLASHKV_CHECK(i >= 0 && i < shape[d], "TensorView::at: index ", i, " out of range [0, ",
                  shape[d], ") in dimension ", d, " of ", str());
    ++d;
  }
  return load_as_double(data, dtype, offset(idx));
}

TensorView TensorView::rows(int64_t begin, int64_t end) const {
  FLASHKV_CHECK(ndim >= 1 && begin >= 0 && begin <= end && end <= shape[0], "TensorView::rows: [",
                begin, ", ", end, ") out of range for ", str());
  TensorView v = *this;
  v.shape[0] = end - begin;
  if (data) v.data = static_cast<char*>(data) + begin * stride[0] * dtype_size(dtype);
  return v;
}

Expect::Expect(const TensorView& t, const char* name) : t_(t), name_(name) {}

void Expect::fail(const std::string& what) const {
  throw_error(str_cat(name_, ": ", what, " (tensor ", t_.str(), ")"));
}

Expect& Expect::defined() {
  if (!t_.defined()) throw_error(str_cat(name_, ": expected a tensor, got none"));
  if (t_.data == nullptr && t_.numel() > 0) fail("null data pointer");
  return *this;
}

Expect& Expect::ndim(int n) {
  defined();
  if (t_.ndim != n) fail(str_cat("expected ", n, " dims, got ", t_.ndim));
  return *this;
}

Expect& Expect::dim(int d, int64_t expected, const char* what) {
  if (t_.ndim <= d) fail(str_cat("expected at least ", d + 1, " dims"));
  if (t_.shape[d] != expected)
    fail(str_cat("expected size ", expected, what ? str_cat(" (", what, ")") : "", " in dimension ",
                 d, ", got ", t_.shape[d]));
  return *this;
}

Expect& Expect::dim_at_least(int d, int64_t minimum, const char* what) {
  if (t_.ndim <= d) fail(str_cat("expected at least ", d + 1, " dims"));
  if (t_.shape[d] < minimum)
    fail(str_cat("expected size >= ", minimum, what ? str_cat(" (", what, ")") : "",
                 " in dimension ", d, ", got ", t_.shape[d]));
  return *this;
}

Expect& Expect::dtype(DType t) {
  if (t_.dtype != t)
    fail(str_cat("expected dtype ", dtype_name(t), ", got ", dtype_name(t_.dtype)));
  return *this;
}

Expect& Expect::dtype_in(std::initializer_list<DType> ts) {
  for (DType t : ts)
    if (t_.dtype == t) return *this;
  std::string list;
  for (DType t : ts) list += str_cat(list.empty() ? "" : "/", dtype_name(t));
  fail(str_cat("expected dtype ", list, ", got ", dtype_name(t_.dtype)));
}

Expect& Expect::float_dtype() { return dtype_in({DType::f32, DType::f16, DType::bf16}); }
Expect& Expect::index_dtype() { return dtype_in({DType::i32, DType::i64}); }

Expect& Expect::device(Device d) {
  if (t_.device != d) fail(str_cat("expected device ", d.str(), ", got ", t_.device.str()));
  return *this;
}

Expect& Expect::on_host() { return device(Device::cpu()); }

Expect& Expect::contiguous() {
  if (!t_.is_contiguous()) fail("expected a contiguous tensor");
  return *this;
}

Expect& Expect::inner_contiguous() {
  if (t_.ndim > 0 && t_.shape[t_.ndim - 1] > 1 && t_.stride[t_.ndim - 1] != 1)
    fail(str_cat("expected stride 1 in the last dimension, got ", t_.stride[t_.ndim - 1]));
  return *this;
}

int64_t index_at(const TensorView& t, int64_t i) {
  FLASHKV_CHECK(t.device.is_cpu(), "index_at: tensor ", t.str(), " is not on the host");
  FLASHKV_CHECK(i >= 0 && i < t.numel(), "index_at: index ", i, " out of range for ", t.str());
  if (t.dtype == DType::i32) return static_cast<const int32_t*>(t.data)[i * t.stride[0]];
  if (t.dtype == DType::i64) return static_cast<const int64_t*>(t.data)[i * t.stride[0]];
  throw_error(str_cat("index_at: expected an i32/i64 tensor, got ", t.str()));
}

}  // namespace flashkv
