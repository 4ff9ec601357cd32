// Comparing an operator's output with the float64 reference, with the tolerances of
// SEMANTICS.md. Used by the tests and by `flashkv check`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashkv/core/tensor.h"
#include "flashkv/reference/reference.h"

namespace flashkv {

struct Tolerance {
  double rel = 1e-5;      // ||out - ref|| / ||ref||
  double max_abs = 1e-4;  // max |out - ref| (< 0: not checked)
  double lse = 1e-3;      // max |lse - ref| where finite; -inf must match exactly
};
// The tolerance SEMANTICS.md gives for outputs of `dtype` (fp8_kv: the fp8-KV bound).
Tolerance tolerance_for(DType dtype, bool fp8_kv = false);

struct Errors {
  double rel = 0, max_abs = 0, lse = 0;
  // NaN in the output where the reference has a number (an unwritten row, bad arithmetic), or
  // a number where the reference has NaN (a NaN input that was lost on the way)
  bool nan = false;
  bool within(const Tolerance& t) const;
  std::string str() const;
};

// out: host tensor [rows, heads, dim] (any float dtype, contiguous); lse: host [rows, heads]
// f32 or absent.
Errors compare(const TensorView& out, const TensorView& lse, const reference::Result& ref);

// Fills a host float tensor with unit-normal values times `scale` (rounded to its dtype).
void fill_normal(const TensorView& t, uint64_t seed, double scale = 1.0);

}  // namespace flashkv
