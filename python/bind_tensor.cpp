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

nb::ndarray<nb::array_api> export_view(const TensorView& t, nb::handle owner) {
  nb::dlpack::dtype dt{};
  using C = nb::dlpack::dtype_code;
  switch (t.dtype) {
    case DType::f32:
      dt = {static_cast<uint8_t>(C::Float), 32, 1};
      break;
    case DType::f16:
      dt = {static_cast<uint8_t>(C::Float), 16, 1};
      break;
    case DType::bf16:
      dt = {static_cast<uint8_t>(C::Bfloat), 16, 1};
      break;
    case DType::i32:
      dt = {static_cast<uint8_t>(C::Int), 32, 1};
      break;
    case DType::i64:
      dt = {static_cast<uint8_t>(C::Int), 64, 1};
      break;
    default:
      dt = {static_cast<uint8_t>(C::UInt), 8, 1};
      break;  // u8, fp8 storage
  }
  size_t shape[kMaxDims];
  int64_t strides[kMaxDims];
  for (int d = 0; d < t.ndim; ++d) {
    shape[d] = static_cast<size_t>(t.shape[d]);
    strides[d] = t.stride[d];
  }
  const int device_type = t.device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  return nb::ndarray<nb::array_api>(t.data, static_cast<size_t>(t.ndim), shape, owner, strides, dt,
                                    device_type, t.device.index);
}

PagedKV paged_kv_of(const Array& k_cache, const Array& v_cache, const Array& indptr,
                    const Array& indices, const OptArray& last_page_len, int page_size,
                    float k_scale, float v_scale, const std::string& kv_dtype) {
  PagedKV kv;
  kv.k = kv_view_of(k_cache, "k_cache", kv_dtype, page_size);
  kv.v = kv_view_of(v_cache, "v_cache", kv_dtype, page_size);
  kv.indptr = view_of(indptr, "paged_kv_indptr");
  kv.indices = view_of(indices, "paged_kv_indices");
  kv.last_page_len = view_of(last_page_len, "paged_kv_last_page_len");
  kv.page_size = page_size;
  kv.k_scale = k_scale;
  kv.v_scale = v_scale;
  return kv;
}

}  // namespace flashkv::py
