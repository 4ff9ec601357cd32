#include "flashkv/reference/compare.h"

#include <cmath>
#include <limits>
#include <random>

namespace flashkv {

Tolerance tolerance_for(DType dtype, bool fp8_kv) {
  if (fp8_kv) return {5e-2, -1, 2e-2};
  if (dtype == DType::f32) return {1e-5, 1e-4, 1e-3};
  return {1e-2, 2e-2, 2e-2};
}

bool Errors::within(const Tolerance& t) const {
  return !nan && rel <= t.rel && (t.max_abs < 0 || max_abs <= t.max_abs) && lse <= t.lse;
}

std::string Errors::str() const {
  return str_cat("rel ", rel, ", max_abs ", max_abs, ", lse ", lse, nan ? ", NaN" : "");
}

Errors compare(const TensorView& out, const TensorView& lse, const reference::Result& ref) {
  Expect(out, "out").on_host().contiguous().dim(0, ref.rows).dim(1, ref.heads).dim(2, ref.head_dim);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  Errors e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.o.size(); ++i) {
    const double a = load_as_double(out.data, out.dtype, static_cast<int64_t>(i));
    if (std::isnan(ref.o[i])) {  // NaN in the inputs: the output must be NaN there too
      e.nan |= !std::isnan(a);
      continue;
    }
    if (std::isnan(a)) e.nan = true;
    const double d = a - ref.o[i];
    num += d * d;
    den += ref.o[i] * ref.o[i];
    e.max_abs = std::max(e.max_abs, std::fabs(d));
  }
  e.rel = e.nan ? kInf : (den > 0 ? std::sqrt(num / den) : std::sqrt(num));
  if (e.nan) e.max_abs = kInf;
  if (lse.defined()) {
    Expect(lse, "lse").on_host().contiguous().dtype(DType::f32).dim(0, ref.rows).dim(1, ref.heads);
    const auto* l = static_cast<const float*>(lse.data);
    for (size_t i = 0; i < ref.lse.size(); ++i) {
      const double a = l[i], r = ref.lse[i];
      if (std::isnan(a) || std::isnan(r)) {  // NaN only where the reference has NaN
        if (std::isnan(a) != std::isnan(r)) {
          e.nan = true;
          e.lse = kInf;
        }
      } else if (std::isinf(a) || std::isinf(r)) {
        if (a != r) e.lse = kInf;
      } else {
        e.lse = std::max(e.lse, std::fabs(a - r));
      }
    }
  }
  return e;
}

void fill_normal(const TensorView& t, uint64_t seed, double scale) {
  Expect(t, "t").on_host().contiguous();
  FLASHKV_CHECK(is_float(t.dtype), "fill_normal: expected a float tensor, got ", t.str());
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data, t.dtype, i, dist(gen) * scale);
}

}  // namespace flashkv
