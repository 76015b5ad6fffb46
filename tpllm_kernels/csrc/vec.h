// Float vectors shared by the CPU kernels, in two layers:
//
//  - v16f: GCC/Clang vector extensions (any target: AVX-512, 2 x AVX2, NEON), for the portable
//    code paths. Lanes are summed as a fixed tree (sum16), never one by one as the compiler's
//    `omp simd` reductions do, and always in the same order.
//  - simd::F16, where the module is built for AVX-512 (one zmm register) or AVX2 + FMA (two ymm
//    registers): 16 float lanes with explicit fused multiply-adds, masks, reductions and the
//    transposed sums the hand-tiled kernels need. A kernel is written once against F16; each
//    build of the module (tpllm_kernels/cpu_ext.py: one per ISA level, picked at load) instantiates it
//    for its ISA. Every operation is defined lane for lane the same on both, reductions included
//    (the same trees), so both variants compute bit-identical results: the AVX2 variant only
//    takes two registers where AVX-512 takes one.
#pragma once
#include <cstdint>
#include <cstring>

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

inline v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof(v)); }

// in registers (a scalar loop over a stored vector stalls on store forwarding: it made the GEMV
// 10% slower). The order: lanes i + (i + 8), then i + (i + 4), then (0 + 1) + (2 + 3).
inline float sum16(v16f v) {
  v8f a, b;
  __builtin_memcpy(&a, &v, sizeof(a));
  __builtin_memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof(a), sizeof(b));
  const v8f s8 = a + b;
  v4f c, d;
  __builtin_memcpy(&c, &s8, sizeof(c));
  __builtin_memcpy(&d, reinterpret_cast<const char*>(&s8) + sizeof(c), sizeof(d));
  const v4f s4 = c + d;
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TPLLM_SIMD16 1
#include <immintrin.h>

namespace simd {

#if defined(__AVX512F__)
constexpr int kRegsPerVec = 1;  // registers per F16: kernels size their register tiles by it
struct F16 { __m512 v; };
inline F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
// 16 bfloat16 (raw bits) widened to float: exact, a shift
inline F16 load(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
// 16 int8 widened to float: exact
inline F16 load(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
// A Q4_1 block's 32 weights d * q + m from its 16 bytes of 4-bit pairs (low nibbles -> lo,
// high -> hi). The block's 16 possible weights d * j + m (j in [0, 15], each rounded once, as
// fma rounds it) fill one register and each weight is picked from it by its code: vpermps reads
// an index's low 4 bits only, so the low nibbles need no mask. Bit for bit the AVX2 form's
// fma(d, float(q), m), for 2 permutes + 1 fma where that takes 2 conversions + 2 fmas + a mask:
// the rebuild is what bounds the GEMV over the Q4 copies, so fewer instructions run it faster.
inline void rebuild_q4(const uint8_t* p, float d, float m, F16& lo, F16& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d), codes, _mm512_set1_ps(m));
  lo = {_mm512_permutexvar_ps(b, table)};
  hi = {_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table)};
}
inline void store(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline F16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F16 operator+(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a*b + c
inline F16 fnma(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a*b
inline F16 round_nearest(F16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// p * 2^k for integral k in [-126, 127] (exact: a power of two)
inline F16 ldexp(F16 p, F16 k) { return {_mm512_scalef_ps(p.v, k.v)}; }
// lanes [0, n) of a, `fill` in the others (n in [0, 16])
inline F16 first(F16 a, int n, float fill) {
  const __mmask16 m = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1u);
  return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), m, a.v)};
}
inline void store_first(float* p, F16 a, int n) {
  _mm512_mask_storeu_ps(p, n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1u), a.v);
}
inline float reduce_max(F16 a) { return _mm512_reduce_max_ps(a.v); }
// lanes where x >= 0 from a, the others from b
inline F16 where_nonnegative(F16 x, F16 a, F16 b) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, _mm512_setzero_ps(), _CMP_GE_OQ), b.v, a.v)};
}
inline F16 operator/(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }

// One hardware register of floats (kNatLanes of them), for register tiles: GCC keeps arrays of
// these in registers, where it spilled arrays of AVX2's two-register F16 to the stack on every
// iteration (the prefill attention's tiles ran 3x slower for it). A lane's arithmetic is the
// same either way, so results do not change.
using Nat = __m512;
constexpr int kNatLanes = 16;
inline Nat nload(const float* p) { return _mm512_loadu_ps(p); }
inline void nstore(float* p, Nat a) { _mm512_storeu_ps(p, a); }
inline Nat nset1(float x) { return _mm512_set1_ps(x); }
inline Nat nfma(Nat a, Nat b, Nat c) { return _mm512_fmadd_ps(a, b, c); }
inline Nat nmul(Nat a, Nat b) { return _mm512_mul_ps(a, b); }
inline __m256 lo8(F16 a) { return _mm512_castps512_ps256(a.v); }
inline __m256 hi8(F16 a) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
}

// Four sums of 16 lanes at a time (see transpose_sum): quad(d)'s 128-bit part q holds
// quarter q's sums ((x0 + x2) + (x1 + x3)) of d[0..3].
using Quad = __m512;
inline Quad quad(const F16* d) {
  __m512 e[2];
  for (int j = 0; j < 2; ++j)  // lanes of 128 bits: [a0+a2, b0+b2, a1+a3, b1+b3]
    e[j] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * j].v, d[2 * j + 1].v),
                         _mm512_unpackhi_ps(d[2 * j].v, d[2 * j + 1].v));
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x44), _mm512_shuffle_ps(e[0], e[1], 0xEE));
}
// lane j = (quarter 0 + quarter 2) + (quarter 1 + quarter 3) of token j
inline F16 combine(const Quad* f) {
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x44),
                                   _mm512_shuffle_f32x4(f[0], f[1], 0xEE));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], 0x44),
                                   _mm512_shuffle_f32x4(f[2], f[3], 0xEE));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88),
                        _mm512_shuffle_f32x4(h01, h23, 0xDD))};
}

#else  // AVX2 + FMA: the same 16 lanes as two 8-lane registers, lo = lanes 0-7
constexpr int kRegsPerVec = 2;
struct F16 { __m256 lo, hi; };
inline F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F16 load(const int8_t* p) {  // 16 int8 widened to float: exact
  const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))};
}
inline F16 load(const uint16_t* p) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16))};
}
// A Q4_1 block's 32 weights d * q + m from its 16 bytes of 4-bit pairs (low nibbles -> lo,
// high -> hi), each rounded once as fma rounds it. (A 16-entry table, as the AVX-512 form
// uses, takes two 8-lane permutes and a blend per 8 weights here: no fewer operations.)
inline void rebuild_q4(const uint8_t* p, float d, float m, F16& lo, F16& hi) {
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i f = _mm256_set1_epi32(15);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  lo = {_mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(a, f)), vm),
        _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(b, f)), vm)};
  hi = {_mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), vm),
        _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), vm)};
}
inline void store(float* p, F16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline F16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 operator+(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 max(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 fma(F16 a, F16 b, F16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 fnma(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 round_nearest(F16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 pow2(__m256 k) {  // 2^k from the exponent bits (k integral, in [-126, 127])
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline F16 ldexp(F16 p, F16 k) {
  return {_mm256_mul_ps(p.lo, pow2(k.lo)), _mm256_mul_ps(p.hi, pow2(k.hi))};
}
inline __m256 lane_mask(int n) {  // lanes [0, n) all ones (n may be outside [0, 8])
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota));
}
inline F16 first(F16 a, int n, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, lane_mask(n)), _mm256_blendv_ps(f, a.hi, lane_mask(n - 8))};
}
inline void store_first(float* p, F16 a, int n) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(lane_mask(n)), a.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(lane_mask(n - 8)), a.hi);
}
inline float reduce_max(F16 a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline F16 where_nonnegative(F16 x, F16 a, F16 b) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, z, _CMP_GE_OQ)),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, z, _CMP_GE_OQ))};
}
inline F16 operator/(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }

using Nat = __m256;
constexpr int kNatLanes = 8;
inline Nat nload(const float* p) { return _mm256_loadu_ps(p); }
inline void nstore(float* p, Nat a) { _mm256_storeu_ps(p, a); }
inline Nat nset1(float x) { return _mm256_set1_ps(x); }
inline Nat nfma(Nat a, Nat b, Nat c) { return _mm256_fmadd_ps(a, b, c); }
inline Nat nmul(Nat a, Nat b) { return _mm256_mul_ps(a, b); }
inline __m256 lo8(F16 a) { return a.lo; }
inline __m256 hi8(F16 a) { return a.hi; }

// As AVX-512's quad, but quarters 0 + 2 and 1 + 3 already added: [Q0 + Q2 | Q1 + Q3] of d[0..3]
// (each 256-bit op acts per 128-bit lane exactly as the 512-bit one does)
using Quad = __m256;
inline __m256 quad_half(__m256 d0, __m256 d1, __m256 d2, __m256 d3) {
  const __m256 e0 = _mm256_add_ps(_mm256_unpacklo_ps(d0, d1), _mm256_unpackhi_ps(d0, d1));
  const __m256 e1 = _mm256_add_ps(_mm256_unpacklo_ps(d2, d3), _mm256_unpackhi_ps(d2, d3));
  return _mm256_add_ps(_mm256_shuffle_ps(e0, e1, 0x44), _mm256_shuffle_ps(e0, e1, 0xEE));
}
inline Quad quad(const F16* d) {
  return _mm256_add_ps(quad_half(d[0].lo, d[1].lo, d[2].lo, d[3].lo),
                       quad_half(d[0].hi, d[1].hi, d[2].hi, d[3].hi));
}
inline F16 combine(const Quad* f) {
  auto two = [](__m256 a, __m256 b) {  // [a.Q02 + a.Q13 | b.Q02 + b.Q13]
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  };
  return {two(f[0], f[1]), two(f[2], f[3])};
}
#endif

// The sum of the 16 lanes in sum16's order
inline float reduce_add(F16 a) {
  const __m256 s8 = _mm256_add_ps(lo8(a), hi8(a));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 h = _mm_hadd_ps(s4, s4);  // [s0 + s1, s2 + s3, ...]
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// d[j] (j < 16) -> one vector whose lane j is the sum of d[j]'s lanes; four tokens at a time,
// so a caller can reduce each four as soon as they are computed (fewer live registers)
inline F16 transpose_sum(const F16* d) {
  const Quad f[4] = {quad(d), quad(d + 4), quad(d + 8), quad(d + 12)};
  return combine(f);
}

// exp(x) for x <= 0: 2^k * p(r), x = k ln2 + r, p the degree-6 Taylor polynomial of the scalar
// exp_nonpositive (kernel_common.h); underflows to 0 below -87
inline F16 exp_nonpositive(F16 x) {
  x = max(x, set1(-87.0f));
  const F16 k = round_nearest(x * set1(1.44269504088896341f));
  F16 r = fnma(k, set1(0.693359375f), x);
  r = fma(k, set1(2.12194440e-4f), r);
  F16 p = set1(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = fma(p, r, set1(c));
  return ldexp(p, k);
}

}  // namespace simd
#endif
