// AVX2 + FMA + F16C helpers: fp32 math on 8 lanes (interface: see simd_scalar.h).
#pragma once

#ifndef FLASHKV_CPU_ISA_NS
#error "include cpu/simd_avx2.h only from an ISA translation unit (cpu/attention_<isa>.cpp)"
#endif

#include "kernel_common.h"

namespace flashkv::cpu::FLASHKV_CPU_ISA_NS {

struct Avx2F32 {
  static constexpr int W = 8;
  static constexpr int kPack = 1;
  static constexpr int kBlockKeys = 32;  // keys per KV block
  static constexpr int kFewRowsBlockKeys = 32;
  static constexpr int kQkRows = 2;  // 2 rows x 4 key vectors = 8 accumulators
  static constexpr int kPvRows = 4;  // 4 rows x 2 vectors of 8 dims = 8 accumulators
  static constexpr int kPvVecs = 2;
  static constexpr bool kSplitKv = true;  // split() (attention_few_rows.h)
  using F = __m256;
  using Step = float;
  using Vec = __m256;
  using Native = float;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_max(F v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  static float reduce_add(F v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  // 2^x: 2^round(x) times a degree-6 polynomial of the rest (relative error < 2e-7); exactly 0
  // below -126 (and for -inf); NaN stays NaN (min/max return their second operand for a NaN).
  static F exp2(F x) {
    const F live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_NLT_UQ);
    x = _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-126.0f), x));
    const F n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F f = _mm256_sub_ps(x, n);
    F p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
  // tanh: odd Taylor series below |x| = 1/4, 1 - 2 / (e^2|x| + 1) above (error < 1e-6).
  static F exp2_probs(F x) { return exp2(x); }
  static F tanh(F x) {
    const F sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
    const F a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    const F z = _mm256_mul_ps(x, x);
    F s = _mm256_set1_ps(62.0f / 2835.0f);
    s = _mm256_fmadd_ps(s, z, _mm256_set1_ps(-17.0f / 315.0f));
    s = _mm256_fmadd_ps(s, z, _mm256_set1_ps(2.0f / 15.0f));
    s = _mm256_fmadd_ps(s, z, _mm256_set1_ps(-1.0f / 3.0f));
    const F small = _mm256_fmadd_ps(_mm256_mul_ps(s, z), x, x);
    const F e = exp2(_mm256_min_ps(_mm256_set1_ps(64.0f),
                                   _mm256_mul_ps(a, _mm256_set1_ps(2.0f * 1.4426950408889634f))));
    const F big =
        _mm256_sub_ps(_mm256_set1_ps(1.0f),
                      _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    const F use_small = _mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_LT_OQ);
    return _mm256_blendv_ps(_mm256_or_ps(big, sign), small, use_small);
  }
  static F keep_range(F s, int j0, int lo, int hi) {
    const __m256i j =
        _mm256_add_epi32(_mm256_set1_epi32(j0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), j),
                                        _mm256_cmpgt_epi32(j, _mm256_set1_epi32(hi)));
    return _mm256_blendv_ps(s, _mm256_set1_ps(-__builtin_inff()), _mm256_castsi256_ps(out));
  }
  static F keep_bytes(F s, const uint8_t* allowed) {
    const __m256i b =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(allowed)));
    const __m256i off = _mm256_cmpeq_epi32(b, _mm256_setzero_si256());
    return _mm256_blendv_ps(s, _mm256_set1_ps(-__builtin_inff()), _mm256_castsi256_ps(off));
  }

  // Tails (n < 8) go through a zeroed copy: AVX2 has no 16-bit masked loads.
  template <class T>
  static const T* tail(const T* p, int n, T (&buf)[8]) {
    if (n >= 8) return p;
    std::memset(buf, 0, sizeof(buf));
    std::memcpy(buf, p, sizeof(T) * (n > 0 ? n : 0));
    return buf;
  }
  static F load_float(const float* p, int n) {
    float b[8];
    return _mm256_loadu_ps(tail(p, n, b));
  }
  static F load_float(const bf16_t* p, int n) {
    bf16_t b[8];
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tail(p, n, b)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F load_float(const f16_t* p, int n) {
    f16_t b[8];
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail(p, n, b))));
  }
  template <class T>
  static void store_tail(T* p, const T (&v)[8], int n) {
    std::memcpy(p, v, sizeof(T) * (n < 8 ? n : 8));
  }
  static void store_float(float* p, F v, int n) {
    if (n >= 8) return _mm256_storeu_ps(p, v);
    float b[8];
    _mm256_storeu_ps(b, v);
    store_tail(p, b, n);
  }
  static void store_float(bf16_t* p, F v, int n) {
    // Round to nearest even (finite values).
    const __m256i u = _mm256_castps_si256(v);
    const __m256i r = _mm256_add_epi32(
        u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                            _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    const __m256i h = _mm256_srli_epi32(r, 16);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    bf16_t b[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(n >= 8 ? p : b), packed);
    if (n < 8) store_tail(p, b, n);
  }
  static void store_float(f16_t* p, F v, int n) {
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    f16_t b[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(n >= 8 ? p : b), h);
    if (n < 8) store_tail(p, b, n);
  }

  static Vec vzero() { return _mm256_setzero_ps(); }
  static Vec vload(const Step* p) { return _mm256_loadu_ps(p); }
  static void vstore(Step* p, Vec v) { _mm256_storeu_ps(p, v); }
  static F madd(F acc, const Step* a, Vec b) {
    return _mm256_fmadd_ps(_mm256_broadcast_ss(a), b, acc);
  }
  static F dot(F acc, Vec a, Vec b) { return _mm256_fmadd_ps(a, b, acc); }
  // Sums of the lanes of 4 vectors, half done: 128-bit half h of the result holds, for
  // i = 0..3, the sum of lanes 4h .. 4h + 3 of a[i].
  static F reduce_quad(const F (&a)[4]) {
    const F ab = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
    const F cd = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
    const __m256d x = _mm256_castps_pd(ab), y = _mm256_castps_pd(cd);
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  // Finishes 2 reduce_quad results: lane 4q + i = the full sum for vector i of quad q.
  static F finish_quads(const F (&t)[W / 4]) {
    return _mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20),
                         _mm256_permute2f128_ps(t[0], t[1], 0x31));
  }
  template <class Src>
  static Vec load_steps(const Src* p, int n, const Fp8Tables&) {
    return load_float(p, n);
  }
  template <int kFormat, class Fp8>
  static Vec load_fp8(const Fp8* p, int n, const Fp8Tables& t) {
    Fp8 b[8];
    long long bits;
    std::memcpy(&bits, tail(p, n, b), 8);
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bits));
    return _mm256_i32gather_ps(t.f32[kFormat], idx, 4);
  }
  static Vec load_steps(const fp8_e4m3_t* p, int n, const Fp8Tables& t) {
    return load_fp8<0>(p, n, t);
  }
  static Vec load_steps(const fp8_e5m2_t* p, int n, const Fp8Tables& t) {
    return load_fp8<1>(p, n, t);
  }

  // 16 bf16 values as two fp32 vectors, without widening: each 32-bit lane holds the pair
  // (2i, 2i + 1), so a shift gives the even-indexed values and a mask the odd-indexed ones
  // (the few-rows split path keeps Q and O in that order; see attention_few_rows.h).
  static void split(const bf16_t* p, F& even, F& odd) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    odd = _mm256_and_ps(_mm256_castsi256_ps(x), _mm256_castsi256_ps(_mm256_set1_epi32(-65536)));
  }
  // 16 fp8 values the same way, through f16 (F16C): an e5m2 byte is the high byte of an f16.
  static void split(const fp8_e5m2_t* p, F& even, F& odd) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    even = _mm256_cvtph_ps(_mm_slli_epi16(x, 8));
    odd = _mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16(-256)));
  }
  // e4m3 (bias 7) becomes the f16 with the same sign, exponent field and mantissa bits one place
  // lower (bias 15), which is the value / 256 for normal and subnormal values alike (the caller
  // takes the factor, kSplitFactor); S.1111.111 (NaN) becomes an f16 NaN.
  static void split(const fp8_e4m3_t* p, F& even, F& odd) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i bits = _mm_set1_epi16(static_cast<short>(0xBF80));  // sign, exponent, mantissa
    const __m128i nan_exp = _mm_set1_epi16(0x7C00);
    const __m128i nan = _mm_cmpeq_epi8(_mm_and_si128(x, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
    const __m128i e = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(x, 8), 1), bits);
    const __m128i o = _mm_and_si128(_mm_srai_epi16(x, 1), bits);
    even = _mm256_cvtph_ps(_mm_or_si128(e, _mm_and_si128(_mm_slli_epi16(nan, 8), nan_exp)));
    odd = _mm256_cvtph_ps(_mm_or_si128(o, _mm_and_si128(nan, nan_exp)));
  }
  // Scores of 4 rows x 4 keys from two vectors of 4 rows x 2 keys (lane 2r + k: row r, key k;
  // `a` keys 0-1, `b` keys 2-3): row r's four scores go to dst + r * stride.
  static void store_scores_4x4(F a, F b, float* dst, int stride) {
    const F even_rows = _mm256_shuffle_ps(a, b, 0x44);  // rows 0 | 2
    const F odd_rows = _mm256_shuffle_ps(a, b, 0xEE);   // rows 1 | 3
    _mm_storeu_ps(dst, _mm256_castps256_ps128(even_rows));
    _mm_storeu_ps(dst + stride, _mm256_castps256_ps128(odd_rows));
    _mm_storeu_ps(dst + 2 * stride, _mm256_extractf128_ps(even_rows, 1));
    _mm_storeu_ps(dst + 3 * stride, _mm256_extractf128_ps(odd_rows, 1));
  }

  static void transpose_store(Vec (&r)[W], Step* dst, int stride, int nout) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    // u[c] holds column c (and c + 4) of rows 0-3 / 4-7 in its two 128-bit halves.
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    const __m256 out[8] = {
        _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
        _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
        _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
        _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
    for (int c = 0; c < nout; ++c) _mm256_storeu_ps(dst + c * stride, out[c]);
  }
  template <int NC>
  static void store_probs(Step* dst, const F (&p)[NC]) {
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(dst + c * W, p[c]);
  }
};

}  // namespace flashkv::cpu::FLASHKV_CPU_ISA_NS
