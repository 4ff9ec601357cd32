// Shared pieces of the Python binding (module flashkv._flashkv): DLPack arrays to TensorViews,
// and the registration functions of each part.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>

#include "flashkv/core/tensor.h"
#include "flashkv/ops/attention.h"

namespace flashkv::py {

namespace nb = nanobind;
using Array = nb::ndarray<>;
using OptArray = std::optional<nb::ndarray<>>;

// A view of a DLPack array (any framework; CPU, pinned host or CUDA memory). bool arrays become
// u8. `dtype_override` (a flashkv dtype name, "" for none) reinterprets a u8 array as an fp8 type
// (fp8 KV caches arrive as uint8 storage), or must equal the array's own dtype.
TensorView view_of(const Array& a, const char* name, const std::string& dtype_override = "");
TensorView view_of(const OptArray& a, const char* name, const std::string& dtype_override = "");

// A KV-cache array as the [slots, Hkv, D] view the operators take: 3-D as is, or 4-D NHD
// [num_pages, page_size, Hkv, D] with its first two dimensions merged (their strides must allow
// it). page_size > 0 is checked against dimension 1 of a 4-D array.
TensorView kv_view_of(const Array& a, const char* name, const std::string& dtype_override,
                      int page_size);

// A DLPack array over flashkv memory owned by `owner` (fp8 is exported as uint8 storage, since
// not every framework imports DLPack's fp8 codes).
nb::ndarray<nb::array_api> export_view(const TensorView& t, nb::handle owner);

// The paged KV cache an operator reads: k/v caches as kv_view_of takes them (read as `kv_dtype`,
// "" for their own) and the page table.
PagedKV paged_kv_of(const Array& k_cache, const Array& v_cache, const Array& indptr,
                    const Array& indices, const OptArray& last_page_len, int page_size,
                    float k_scale, float v_scale, const std::string& kv_dtype);

// Python passes a CUDA stream as its integer handle (e.g. torch's `stream.cuda_stream`).
inline Stream stream_of(uintptr_t handle) {
  return Stream{reinterpret_cast<void*>(handle)};  // NOLINT(performance-no-int-to-ptr): see above
}

void bind_ops(nb::module_& m);
void bind_backend(nb::module_& m);
void bind_parallel(nb::module_& m);

}  // namespace flashkv::py
