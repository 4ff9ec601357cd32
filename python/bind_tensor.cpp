// DLPack arrays (through nanobind) to flashkv TensorViews.
#include "bind.h"

namespace flashkv::py {
namespace {

DType dtype_of_array(const Array& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  using C = nb::dlpack::dtype_code;
  FLASHKV_CHECK(t.lanes == 1, name, ": vector dtypes (lanes ", t.lanes, ") are not supported");
  const auto code = static_cast<C>(t.code);
  if (code == C::Float && t.bits == 32) return DType::f32;
  if (code == C::Float && t.bits == 16) return DType::f16;
  if (code == C::Bfloat && t.bits == 16) return DType::bf16;
  if (code == C::Float8_E4M3FN && t.bits == 8) return DType::fp8_e4m3;
  if (code == C::Float8_E5M2 && t.bits == 8) return DType::fp8_e5m2;
  if (code == C::Int && t.bits == 32) return DType::i32;
  if (code == C::Int && t.bits == 64) return DType::i64;
  if ((code == C::UInt || code == C::Bool) && t.bits == 8) return DType::u8;
  throw_error(
      str_cat(name, ": unsupported dtype (DLPack code ", int{t.code}, ", ", int{t.bits},
              " bits); expected float32/float16/bfloat16/float8, int32/int64, uint8 or bool"));
}

Device device_of_array(const Array& a, const char* name) {
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory: the CPU reads it directly
      return Device::cpu();
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      return Device::cuda(a.device_id());
    default:
      throw_error(str_cat(name, ": unsupported device (DLPack device type ", a.device_type(),
                          "); expected CPU or CUDA memory"));
  }
}

}  // namespace

TensorView view_of(const Array& a, const char* name, const std::string& dtype_override) {
  FLASHKV_CHECK(a.is_valid(), name, ": expected an array");
  FLASHKV_CHECK(a.ndim() >= 1 && a.ndim() <= static_cast<size_t>(kMaxDims), name,
                ": expected 1 to ", kMaxDims, " dimensions, got ", a.ndim());
  TensorView t;
  t.data = a.data();
  t.dtype = dtype_of_array(a, name);
  t.device = device_of_array(a, name);
  t.ndim = static_cast<int>(a.ndim());
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = static_cast<int64_t>(a.shape(d));
    t.stride[d] = a.stride(d);
  }
  if (!dtype_override.empty()) {
    const DType want = parse_dtype(dtype_override.c_str());
    if (t.dtype != want) {
      FLASHKV_CHECK(is_fp8(want) && t.dtype == DType::u8, name, ": expected dtype ",
                    dtype_name(want), " (or uint8 storage of it), got ", dtype_name(t.dtype));
      t.dtype = want;
    }
  }
  return t;
}

TensorView view_of(const OptArray& a, const char* name, const std::string& dtype_override) {
  return a ? view_of(*a, name, dtype_override) : TensorView();
}

TensorView kv_view_of(const Array& a, const char* name, const std::string& dtype_override,
                      int page_size) {
  TensorView t = view_of(a, name, dtype_override);
  if (t.ndim == 3) return t;
  FLASHKV_CHECK(t.ndim == 4, name, ": expected [slots, num_kv_heads, head_dim] or NHD [num_pages, ",
                "page_size, num_kv_heads, head_dim], got ", t.str());
  FLASHKV_CHECK(page_size <= 0 || t.shape[1] == page_size, name, ": page size (dimension 1) ",
                t.shape[1], " differs from the planned page_size ", page_size);
  // Slot s = page * page_size + offset must sit at a uniform stride.
  FLASHKV_CHECK(t.shape[1] == 1 || t.stride[0] == t.shape[1] * t.stride[1], name,
                ": pages are not evenly spaced: got ", t.str(), " with page stride ", t.stride[0],
                " and token stride ", t.stride[1], "; expected the page stride to be page_size (",
                t.shape[1], ") x the token stride, as in a contiguous [num_pages, page_size, ",
                "num_kv_heads, head_dim] array (the Python wrappers copy other views)");
  TensorView v;
  v.data = t.data;
  v.dtype = t.dtype;
  v.device = t.device;
  v.ndim = 3;
  v.shape[0] = t.shape[0] * t.shape[1];
  v.stride[0] = t.shape[1] == 1 ? t.stride[0] : t.stride[1];
  for (int d = 1; d < 3; ++d) {
    v.shape[d] = t.shape[d + 1];
    v.stride[d] = t.stride[d + 1];
  }
  return v;
}

}  // namespace flashkv::py
