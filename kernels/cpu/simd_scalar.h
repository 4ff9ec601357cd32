// The "vector" helpers of the portable path: one lane, plain C++ (any CPU). The interface every
// simd_*.h provides to attention_kernel.h:
//   W lanes of fp32 per F; Vec holds W "steps" (Step: one f32, or a pair of bf16 when kPack == 2);
//   F math (exp2, tanh, reductions, masking), conversions from each storage type, the WxW
//   transpose of steps, and madd(acc, &a, b) = acc + broadcast(a) . b per step.
#pragma once

#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/simd_scalar.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

#include "kernel_common.h"

namespace flashkv::cpu::FLASHKV_CPU_ISA_NS {

struct ScalarF32 {
  static constexpr int W = 1;
  static constexpr int kPack = 1;
  static constexpr int kBlockKeys = 32;  // keys per KV block
  static constexpr int kFewRowsBlockKeys = 32;
  // Register tiles of the micro-kernels (rows x key vectors, rows x output vectors).
  static constexpr int kQkRows = 1;
  static constexpr int kPvRows = 2;
  static constexpr int kPvVecs = 8;
  using F = float;
  using Step = float;
  using Vec = float;
  using Native = float;  // the storage type whose rows load_steps reads without converting

  static F zero() { return 0.0f; }
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F max(F a, F b) { return a > b ? a : b; }
  static F fmadd(F a, F b, F c) { return a * b + c; }
  static float reduce_max(F v) { return v; }
  static float reduce_add(F v) { return v; }
  static F exp2(F x) { return x < -126.0f ? 0.0f : std::exp2(x); }
  static F exp2_probs(F x) { return exp2(x); }
  static F tanh(F x) { return std::tanh(x); }
  // Scores of keys outside [lo, hi] (key index j0 + lane) become -inf.
  static F keep_range(F s, int j0, int lo, int hi) {
    return j0 >= lo && j0 <= hi ? s : -__builtin_inff();
  }
  // Scores whose mask byte is 0 become -inf (W bytes readable).
  static F keep_bytes(F s, const uint8_t* allowed) { return *allowed ? s : -__builtin_inff(); }

  static F load_float(const float* p, int n) { return n > 0 ? *p : 0.0f; }
  static F load_float(const bf16_t* p, int n) { return n > 0 ? to_float(*p) : 0.0f; }
  static F load_float(const f16_t* p, int n) { return n > 0 ? to_float(*p) : 0.0f; }
  static void store_float(float* p, F v, int n) {
    if (n > 0) *p = v;
  }
  static void store_float(bf16_t* p, F v, int n) {
    if (n > 0) *p = to_bf16(v);
  }
  static void store_float(f16_t* p, F v, int n) {
    if (n > 0) *p = to_f16(v);
  }

  static Vec vzero() { return 0.0f; }
  static Vec vload(const Step* p) { return *p; }
  static void vstore(Step* p, Vec v) { *p = v; }
  static F madd(F acc, const Step* a, Vec b) { return acc + *a * b; }
  // acc + a . b per lane (both operands vectors of steps).
  static F dot(F acc, Vec a, Vec b) { return acc + a * b; }
  // Lane i of the result = the sum of the lanes of a[i].
  static F reduce_lanes(const F (&a)[W]) { return a[0]; }
  template <class Src>
  static Vec load_steps(const Src* p, int n, const Fp8Tables&) {
    return load_float(p, n);
  }
  static Vec load_steps(const fp8_e4m3_t* p, int n, const Fp8Tables& t) {
    return n > 0 ? t.f32[0][p->bits] : 0.0f;
  }
  static Vec load_steps(const fp8_e5m2_t* p, int n, const Fp8Tables& t) {
    return n > 0 ? t.f32[1][p->bits] : 0.0f;
  }
  static void transpose_store(Vec (&rows)[W], Step* dst, int /*stride*/, int nout) {
    if (nout > 0) dst[0] = rows[0];
  }
  template <int NC>
  static void store_probs(Step* dst, const F (&p)[NC]) {
    for (int c = 0; c < NC; ++c) dst[c] = p[c];
  }
};

}  // namespace flashkv::cpu::FLASHKV_CPU_ISA_NS
