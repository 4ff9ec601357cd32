// AVX-512 helpers (interface: see simd_scalar.h). Avx512F32: fp32 math on 16 lanes (F/BW/VL/DQ).
// Avx512Bf16: steps are bf16 pairs and madd is one `vdpbf16ps` (AVX512_BF16); defined only when
// the including unit targets it (FLASHKV_CPU_HAS_BF16).
#pragma once

#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/simd_avx512.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

#include "kernel_common.h"

namespace flashkv::cpu::FLASHKV_CPU_ISA_NS {

struct Avx512Common {
  static constexpr int W = 16;
  static constexpr int kBlockKeys = 64;         // keys per KV block
  static constexpr int kFewRowsBlockKeys = 32;  // ... in tasks of few rows (decode)
  using F = __m512;

  // Masks of the first n lanes (n may be <= 0 or past the width).
  static __mmask16 lanes16(int n) {
    return n >= 16 ? static_cast<__mmask16>(0xffff)
                   : static_cast<__mmask16>(n <= 0 ? 0u : (1u << n) - 1);
  }
  static __mmask32 lanes32(int n) { return n >= 32 ? 0xffffffffu : n <= 0 ? 0u : (1u << n) - 1; }

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }

  // 2^x: scalef(polynomial of x - round(x), round(x)); exactly 0 below -126 (and for -inf).
  // Degree 6 (Taylor): relative error < 2e-7; degree 4: < 6e-5, for probabilities that are
  // rounded to bf16 (relative step 4e-3) anyway.
  template <int kDegree = 6>
  static F exp2(F x) {
    static_assert(kDegree == 4 || kDegree == 6, "exp2: degree 4 or 6");
    // NaN stays NaN: it is live and passes the min (which returns its second operand for it).
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    x = _mm512_min_ps(_mm512_set1_ps(127.0f), x);
    const F n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F f = _mm512_sub_ps(x, n);
    F p;
    if constexpr (kDegree == 6) {
      p = _mm512_set1_ps(1.5403530393381606e-4f);
      p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
      p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    } else {
      p = _mm512_set1_ps(9.6181291076284772e-3f);
    }
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, p, n);
  }
  // tanh: odd Taylor series below |x| = 1/4, 1 - 2 / (e^2|x| + 1) above (error < 1e-6).
  static F tanh(F x) {
    const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    const __m512i xi = _mm512_castps_si512(x);
    const F a = _mm512_castsi512_ps(_mm512_andnot_si512(sign_bit, xi));
    const F z = _mm512_mul_ps(x, x);
    F s = _mm512_set1_ps(62.0f / 2835.0f);
    s = _mm512_fmadd_ps(s, z, _mm512_set1_ps(-17.0f / 315.0f));
    s = _mm512_fmadd_ps(s, z, _mm512_set1_ps(2.0f / 15.0f));
    s = _mm512_fmadd_ps(s, z, _mm512_set1_ps(-1.0f / 3.0f));
    const F small = _mm512_fmadd_ps(_mm512_mul_ps(s, z), x, x);
    const F e = exp2(_mm512_min_ps(_mm512_set1_ps(64.0f),
                                   _mm512_mul_ps(a, _mm512_set1_ps(2.0f * 1.4426950408889634f))));
    const F big =
        _mm512_sub_ps(_mm512_set1_ps(1.0f),
                      _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    const F signed_big = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(big), _mm512_and_si512(sign_bit, xi)));
    const __mmask16 use_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_LT_OQ);
    return _mm512_mask_mov_ps(signed_big, use_small, small);
  }
  static F keep_range(F s, int j0, int lo, int hi) {
    const __m512i j =
        _mm512_add_epi32(_mm512_set1_epi32(j0),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 ok = _mm512_cmpge_epi32_mask(j, _mm512_set1_epi32(lo)) &
                         _mm512_cmple_epi32_mask(j, _mm512_set1_epi32(hi));
    return _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), ok, s);
  }
  static F keep_bytes(F s, const uint8_t* allowed) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(allowed));
    return _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), _mm_test_epi8_mask(b, b), s);
  }

  static F load_float(const float* p, int n) { return _mm512_maskz_loadu_ps(lanes16(n), p); }
  static F load_float(const bf16_t* p, int n) {
    const __m256i h = _mm256_maskz_loadu_epi16(lanes16(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F load_float(const f16_t* p, int n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes16(n), p));
  }
  static void store_float(float* p, F v, int n) { _mm512_mask_storeu_ps(p, lanes16(n), v); }
  static void store_float(f16_t* p, F v, int n) {
    _mm256_mask_storeu_epi16(p, lanes16(n),
                             _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store_float(bf16_t* p, F v, int n) {
    // Round to nearest even (finite values).
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_add_epi32(
        u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                            _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    _mm256_mask_storeu_epi16(p, lanes16(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }

  // Sums of the lanes of 4 vectors, half done: 128-bit lane l of the result holds, for
  // i = 0..3, the sum of lanes 4l .. 4l + 3 of a[i] (pairwise unpack-and-add).
  static F reduce_quad(const F (&a)[4]) {
    const F ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const F cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Finishes 4 reduce_quad results: lane 4q + i = the full sum for vector i of quad q.
  static F finish_quads(const F (&t)[W / 4]) {
    const F u01 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x44),
                                _mm512_shuffle_f32x4(t[0], t[1], 0xEE));
    const F u23 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x44),
                                _mm512_shuffle_f32x4(t[2], t[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88),
                         _mm512_shuffle_f32x4(u01, u23, 0xDD));
  }

  // 32 fp8 bytes (zero-extended to 16-bit lanes) -> 32 bf16 through the 128-entry magnitude
  // table (4 registers of 32 entries, two vpermi2w and a blend) plus the sign bit.
  static __m512i fp8_to_bf16(__m512i w, const uint16_t* table) {
    const __m512i t0 = _mm512_load_si512(table), t1 = _mm512_load_si512(table + 32);
    const __m512i t2 = _mm512_load_si512(table + 64), t3 = _mm512_load_si512(table + 96);
    const __m512i low = _mm512_permutex2var_epi16(t0, w, t1);
    const __m512i high = _mm512_permutex2var_epi16(t2, w, t3);
    const __mmask32 upper = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40));
    const __m512i mag = _mm512_mask_blend_epi16(upper, low, high);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8);
    return _mm512_or_si512(mag, sign);
  }

  // In-place transpose of 16 rows of 16 x 32-bit elements.
  static void transpose16(__m512i (&r)[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    // u[4i + e] holds element 4k + e of rows 4i..4i+3 in 128-bit lane k.
    for (int i = 0; i < 16; i += 4) {
      u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; ++e) {
      const __m512i v02 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88);
      const __m512i v13 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
      const __m512i w02 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
      const __m512i w13 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
      r[e] = _mm512_shuffle_i32x4(v02, w02, 0x88);
      r[8 + e] = _mm512_shuffle_i32x4(v02, w02, 0xDD);
      r[4 + e] = _mm512_shuffle_i32x4(v13, w13, 0x88);
      r[12 + e] = _mm512_shuffle_i32x4(v13, w13, 0xDD);
    }
  }
};

struct Avx512F32 : Avx512Common {
  static constexpr int kPack = 1;
  static F exp2_probs(F x) { return exp2<6>(x); }
  static constexpr int kQkRows = 4;  // 4 rows x 4 key vectors = 16 accumulators
  static constexpr int kPvRows = 6;  // 6 rows x 4 vectors of 16 dims = 24 accumulators
  static constexpr int kPvVecs = 4;
  using Step = float;
  using Vec = __m512;
  using Native = float;

  static Vec vzero() { return _mm512_setzero_ps(); }
  static Vec vload(const Step* p) { return _mm512_loadu_ps(p); }
  static void vstore(Step* p, Vec v) { _mm512_storeu_ps(p, v); }
  static F madd(F acc, const Step* a, Vec b) { return _mm512_fmadd_ps(_mm512_set1_ps(*a), b, acc); }
  static F dot(F acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
  template <class Src>
  static Vec load_steps(const Src* p, int n, const Fp8Tables&) {
    return load_float(p, n);
  }
  template <int kFormat, class Fp8>
  static Vec load_fp8(const Fp8* p, int n, const Fp8Tables& t) {
    const __m512i w =
        _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(lanes16(n), p)));
    const __m512i h = fp8_to_bf16(w, t.bf16[kFormat]);
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
  }
  static Vec load_steps(const fp8_e4m3_t* p, int n, const Fp8Tables& t) {
    return load_fp8<0>(p, n, t);
  }
  static Vec load_steps(const fp8_e5m2_t* p, int n, const Fp8Tables& t) {
    return load_fp8<1>(p, n, t);
  }
  static void transpose_store(Vec (&rows)[W], Step* dst, int stride, int nout) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(rows[i]);
    transpose16(r);
    for (int c = 0; c < nout; ++c) _mm512_storeu_si512(dst + c * stride, r[c]);
  }
  template <int NC>
  static void store_probs(Step* dst, const F (&p)[NC]) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(dst + c * W, p[c]);
  }
};

#if FLASHKV_CPU_HAS_BF16
struct Avx512Bf16 : Avx512Common {
  static constexpr int kPack = 2;
  static F exp2_probs(F x) { return exp2<4>(x); }  // P is rounded to bf16
  static constexpr int kQkRows = 4;
  static constexpr int kPvRows = 6;
  static constexpr int kPvVecs = 4;
  using Step = uint32_t;  // two bf16: (element 2i, element 2i + 1)
  using Vec = __m512i;
  using Native = bf16_t;

  using Avx512Common::store_float;
  static void store_float(bf16_t* p, F v, int n) {
    _mm256_mask_storeu_epi16(p, lanes16(n), (__m256i)(_mm512_cvtneps_pbh(v)));
  }

  static Vec vzero() { return _mm512_setzero_si512(); }
  static Vec vload(const Step* p) { return _mm512_loadu_si512(p); }
  static void vstore(Step* p, Vec v) { _mm512_storeu_si512(p, v); }
  static F madd(F acc, const Step* a, Vec b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)(_mm512_set1_epi32(static_cast<int>(*a))),
                            (__m512bh)(b));
  }
  static F dot(F acc, Vec a, Vec b) { return _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(b)); }
  // Up to 32 elements of a row -> 16 steps, zero-padded.
  static Vec load_steps(const bf16_t* p, int n, const Fp8Tables&) {
    return _mm512_maskz_loadu_epi16(lanes32(n), p);
  }
  static Vec load_steps(const float* p, int n, const Fp8Tables&) {
    const F lo = _mm512_maskz_loadu_ps(lanes16(n), p);
    const F hi = _mm512_maskz_loadu_ps(lanes16(n - 16), p + 16);
    return (__m512i)(_mm512_cvtne2ps_pbh(hi, lo));
  }
  static Vec load_steps(const f16_t* p, int n, const Fp8Tables&) {
    const __m512i h = _mm512_maskz_loadu_epi16(lanes32(n), p);
    const F lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    const F hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    return (__m512i)(_mm512_cvtne2ps_pbh(hi, lo));
  }
  static Vec load_steps(const fp8_e4m3_t* p, int n, const Fp8Tables& t) {
    return fp8_to_bf16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(lanes32(n), p)), t.bf16[0]);
  }
  static Vec load_steps(const fp8_e5m2_t* p, int n, const Fp8Tables& t) {
    return fp8_to_bf16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(lanes32(n), p)), t.bf16[1]);
  }
  static void transpose_store(Vec (&rows)[W], Step* dst, int stride, int nout) {
    transpose16(rows);
    for (int c = 0; c < nout; ++c) _mm512_storeu_si512(dst + c * stride, rows[c]);
  }
  // Rows a and b (32 elements each) -> steps (a[d], b[d]) for d = 0..15 and 16..31.
  static void interleave(Vec a, Vec b, Vec* lo, Vec* hi) {
    const __m512i l = _mm512_unpacklo_epi16(a, b);  // lane k: d = 8k .. 8k+3
    const __m512i h = _mm512_unpackhi_epi16(a, b);  // lane k: d = 8k+4 .. 8k+7
    *lo = _mm512_permutex2var_epi64(l, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), h);
    *hi = _mm512_permutex2var_epi64(l, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), h);
  }
  template <int NC>
  static void store_probs(Step* dst, const F (&p)[NC]) {
    static_assert(NC % 2 == 0, "probabilities are stored as bf16 pairs of 32 keys");
    for (int c = 0; c < NC; c += 2)
      _mm512_storeu_si512(dst + c * W / 2, (__m512i)(_mm512_cvtne2ps_pbh(p[c + 1], p[c])));
  }
};
#endif

}  // namespace flashkv::cpu::FLASHKV_CPU_ISA_NS
