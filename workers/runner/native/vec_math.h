// Vector math shared by the native kernels (AVX-512; exp and SiLU also AVX2): exp, the pieces
// of a softmax, and the SiLU that linear.cpp's fused MLP up and fused_ops' silu_mul share.
//
// A row's softmax was a scalar max, an `omp simd` loop of std::exp and a scalar loop
// rounding the probabilities to bf16; in the prompt-attention kernel that was 40% of a
// 272-token prompt's time. These are one vector pass for the max and one for exp, sum and
// the store (272 tokens: 0.48 -> 0.37 ms, alternating in one process).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace switchyard {

// exp(x) in 8 lanes for AVX2 CPUs: exp16's method (2^n p(r), the same polynomial, the same
// clamps), with 2^n built in the exponent bits since AVX2 has no scalef. x below -87.3
// gives 0; n stays in [-126, 127], so 2^n is a normal float.
inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

// A 256-bit load of 16 bf16 values as two fp32 vectors, exactly: the even-indexed values
// (each 32-bit lane's low half, shifted up) and the odd-indexed ones (its high half).
inline __m256 bf16_even8(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
inline __m256 bf16_odd8(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-65536)));
}

// The sum of a vector's 8 lanes.
inline float hsum8(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// fp32 -> bf16 bits (in each 32-bit lane's low half) rounded to nearest even, as c10's
// rounding of finite values (fused_ops' bf16_bits).
inline __m256i bf16_round8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

// a / b, b >= 1, in explicit steps so that every kernel inlining it gets the same bits:
// with -ffast-math GCC turns a vector `/` (which _mm256_div_ps and _mm512_div_ps are) into a
// reciprocal estimate and a Newton step of its own choosing, VRCPPS in 256-bit code and
// VRCP14PS in 512-bit, and the vector width of an auto-vectorised loop follows the CPU's
// tuning (256 bits on Sapphire Rapids): there fused_ops' silu_mul and linear_silu rounded a
// SiLU an ulp apart, and a bf16 near a rounding tie went either way. Here: the estimate
// (12 bits) refined by a Newton step, then the quotient corrected by its residual (the
// quotient correctly rounded but for the rarest near-ties). b at or above 2^126 gives 0:
// VRCPPS flushes its tiny reciprocal.
inline __m256 div8(__m256 a, __m256 b) {
  __m256 r = _mm256_rcp_ps(b);
  r = _mm256_fmadd_ps(r, _mm256_fnmadd_ps(b, r, _mm256_set1_ps(1.f)), r);
  const __m256 q = _mm256_mul_ps(a, r);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(b, q, a), r, q);
}

// silu(x) = x / (1 + e^-x); 0 below x = -88.3, where e^-x saturates (the true value is
// under 5e-37 there).
inline __m256 silu8(__m256 x) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
  const __m256 y = div8(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-88.3f), _CMP_LT_OQ), y);
}

// silu(g) * u, the SiLU rounded to bf16 first if kBf16 (as storing it in a bf16 tensor
// does): the product that silu_mul stores, before its own rounding.
template <bool kBf16>
inline __m256 silu_mul8(__m256 g, __m256 u) {
  __m256 act = silu8(g);
  if constexpr (kBf16) act = _mm256_castsi256_ps(_mm256_slli_epi32(bf16_round8(act), 16));
  return _mm256_mul_ps(act, u);
}

}  // namespace switchyard

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace switchyard {

// exp(x) in 16 lanes: 2^n p(r) with x = n ln2 + r, |r| <= ln2 / 2 and p the degree-6
// Taylor polynomial (relative error under 2e-7, 1-2 ulp, as torch's vectorised exp);
// x below -87.3 gives 0 (a score that far below its row's max), x above 88.3 saturates.
inline __m512 exp16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 in two parts so that r keeps its low bits.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// The lanes of a 16-wide step with `left` elements still to go.
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// The max of s[0..n), n >= 1.
inline float row_max(const float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16)
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, tail_mask(n - j), s + j));
  return _mm512_reduce_max_ps(m);
}

// a / b, b >= 1: as div8 (and why it is not a `/`), from VRCP14PS's 14 bits.
inline __m512 div16(__m512 a, __m512 b) {
  __m512 r = _mm512_rcp14_ps(b);
  r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(b, r, _mm512_set1_ps(1.f)), r);
  const __m512 q = _mm512_mul_ps(a, r);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(b, q, a), r, q);
}

// silu(x) = x / (1 + e^-x); 0 below x = -88.3, where e^-x saturates.
inline __m512 silu16(__m512 x) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
  const __m512 y = div16(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.3f), _CMP_GE_OQ), y);
}

// fp32 -> bf16 bits (in each 32-bit lane's low half) rounded to nearest even, as c10 rounds
// finite values (fused_ops' bf16_bits). VCVTNEPS2BF16 rounds the same way but flushes
// denormals to zero, so a value that must match fused_ops' rounding is rounded here.
inline __m512i bf16_round16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}

// silu(g) * u, the SiLU rounded to bf16 first if kBf16: as silu_mul8.
template <bool kBf16>
inline __m512 silu_mul16(__m512 g, __m512 u) {
  __m512 act = silu16(g);
  if constexpr (kBf16) act = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_round16(act), 16));
  return _mm512_mul_ps(act, u);
}

inline void store_masked(float* out, __mmask16 k, __m512 v) { _mm512_mask_storeu_ps(out, k, v); }

#if defined(__AVX512BF16__)
// bf16 bits, rounded to nearest even (as c10::BFloat16).
inline void store_masked(uint16_t* out, __mmask16 k, __m512 v) {
  _mm256_mask_storeu_epi16(out, k, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif

// out[0..n) <- exp(s[0..n) - m), out fp32 (it may be s) or bf16 bits; returns the sum of
// the fp32 values.
template <typename T>
inline float exp_sum(const float* s, int64_t n, float m, T* out) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv));
    sum = _mm512_mask_add_ps(sum, k, sum, e);
    store_masked(out + j, k, e);
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace switchyard

#endif  // __AVX512F__
