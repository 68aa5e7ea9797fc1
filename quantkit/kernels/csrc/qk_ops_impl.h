// One ISA unit's ops (qk_ops.h's table), compiled once per instruction set: the unit's source defines
// QK_TARGET (0 generic, 1 AVX2+FMA, 2 AVX512 F/BW/VL/VNNI, 3 the same with AVX512-BF16, 4 AVX2+FMA with
// AVX-VNNI) and includes this file, and kernels/build.py compiles it with that ISA's -m flags.
//
// The fused ops are written once over `vf`, a vector of W fp32 lanes: 16 on AVX512, 8 on AVX2, and 8 in
// plain C++ arrays for the generic unit (which the compiler vectorises for whatever baseline it targets).
// The int4 / int8 tiles, the bf16 rows and the attention scores have hand-written versions where an
// instruction set has a better one (VNNI, vpmaddubsw, vdpbf16ps). The roundings are torch's (see qk_step.cpp);
// only the order of fp32 sums and the exp polynomial differ between units.
//
// Everything here has internal linkage (an anonymous namespace, no std templates): a unit compiled with
// AVX512 flags must not emit weak code that the linker could pick for a unit run on a lesser CPU.

#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK_AVX512 (QK_TARGET == 2 || QK_TARGET == 3)
#define QK_NATIVE_BF16 (QK_TARGET == 3)
#define QK_AVX2 (QK_TARGET == 1 || QK_TARGET == 4)  // 8-lane vectors
#define QK_AVXVNNI (QK_TARGET == 4)                 // vpdpbusd on 256 bits (Intel Core 12th gen on, Zen 5)

#if QK_TARGET >= 1
#include <immintrin.h>
#endif

#include "qk_bf16.h"
#include "qk_ops.h"
#include "qk_quant_impl.h"  // the quantizer's ops, in namespace qkq

namespace {

using qk::DeltaTok;
using qk::kDeltaBlockCols;
using qk::kMaxDeltaRows;
using qk::GdnArgs;
using qk::kBlock;
using qk::kTile;
using qk::QAct;
using qk::QMat;

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

inline float through_bf16(float f) { return bf16_value(to_bf16(f)); }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

inline float sigmoid1(float x) { return 1.f / (1.f + expf(-x)); }

// ---------------------------------------------------------------- the vector of W fp32 lanes
#if QK_AVX512
constexpr int W = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vld(const float* p) { return _mm512_loadu_ps(p); }
inline void vst(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline float vmaxr(vf a) { return _mm512_reduce_max_ps(a); }
inline __mmask16 lanes(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }
inline vf vld_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
inline void vst_n(float* p, vf x, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), x); }
inline vf vld16_n(const uint16_t* p, int64_t n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes(n), p)), 16));
}
inline vf vld16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// 2W bf16 values split into the even- and odd-indexed ones (for dots whose sum order is free)
inline void vld16x2(const uint16_t* p, vf& even, vf& odd) {
  const __m512i v = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// rounded through bf16 (nearest even, as to_bf16; a NaN stays a NaN)
inline vf vround16(vf x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))),
                           _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(r);
}
inline void vst16_n(uint16_t* p, vf x, int64_t n) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(vround16(x)), 16);
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtepi32_epi16(r));
}
inline void vst16(uint16_t* p, vf x) { vst16_n(p, x, 16); }
// e^x: 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5], degree-6 polynomial (rel. error ~2e-7), vscalefps
inline vf vexp(vf x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const vf t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const vf n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  vf p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
constexpr uintptr_t kStreamAlign = 64;
inline void vstream(float* p, vf x) { _mm512_stream_ps(p, x); }  // p kStreamAlign-aligned
inline void stream_fence() { _mm_sfence(); }

#elif QK_AVX2
constexpr int W = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vld(const float* p) { return _mm256_loadu_ps(p); }
inline void vst(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vmaxr(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vf vld16(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void vld16x2(const uint16_t* p, vf& even, vf& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline vf vround16(vf x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), hi);
  const __m256i q = _mm256_or_si256(_mm256_and_si256(u, hi), _mm256_set1_epi32(0x00400000));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, q, _mm256_castps_si256(nan)));
}
inline void vst16(uint16_t* p, vf x) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(vround16(x)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
// e^x as exp_avx512, with 2^n made in the exponent bits (x kept >= -87.3 so that 2^n stays normal)
inline vf vexp(vf x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.3f));
  const vf t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const vf n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  vf p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
constexpr uintptr_t kStreamAlign = 32;
inline void vstream(float* p, vf x) { _mm256_stream_ps(p, x); }
inline void stream_fence() { _mm_sfence(); }

#else  // generic: plain C++, correct on any CPU the compiler targets
constexpr int W = 8;
struct vf {
  float v[W];
};
#define QK_LANES(expr) \
  vf r;                \
  for (int i = 0; i < W; ++i) r.v[i] = (expr); \
  return r
inline vf vzero() { QK_LANES(0.f); }
inline vf vset(float x) { QK_LANES(x); }
inline vf vld(const float* p) { QK_LANES(p[i]); }
inline void vst(float* p, vf x) { for (int i = 0; i < W; ++i) p[i] = x.v[i]; }
constexpr uintptr_t kStreamAlign = 1;
inline void vstream(float* p, vf x) { vst(p, x); }
inline void stream_fence() {}
inline vf vadd(vf a, vf b) { QK_LANES(a.v[i] + b.v[i]); }
inline vf vsub(vf a, vf b) { QK_LANES(a.v[i] - b.v[i]); }
inline vf vmul(vf a, vf b) { QK_LANES(a.v[i] * b.v[i]); }
inline vf vdiv(vf a, vf b) { QK_LANES(a.v[i] / b.v[i]); }
inline vf vmax(vf a, vf b) { QK_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline vf vabs(vf a) { QK_LANES(fabsf(a.v[i])); }
inline vf vfma(vf a, vf b, vf c) { QK_LANES(a.v[i] * b.v[i] + c.v[i]); }  // two roundings (no FMA assumed)
inline vf vld16(const uint16_t* p) { QK_LANES(bf16_value(p[i])); }
inline void vld16x2(const uint16_t* p, vf& even, vf& odd) {
  for (int i = 0; i < W; ++i) {
    even.v[i] = bf16_value(p[2 * i]);
    odd.v[i] = bf16_value(p[2 * i + 1]);
  }
}
inline vf vround16(vf x) { QK_LANES(through_bf16(x.v[i])); }
inline void vst16(uint16_t* p, vf x) { for (int i = 0; i < W; ++i) p[i] = to_bf16(x.v[i]); }
inline vf vexp(vf x) { QK_LANES(expf(x.v[i])); }
#undef QK_LANES
inline float vsum(vf a) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += a.v[i];
  return s;
}
inline float vmaxr(vf a) {
  float m = a.v[0];
  for (int i = 1; i < W; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
#endif

#if !QK_AVX512  // tails through a zeroed buffer (AVX512 masks its loads and stores)
inline vf vld_n(const float* p, int64_t n) {
  float t[W] = {};
  memcpy(t, p, n * sizeof(float));
  return vld(t);
}
inline void vst_n(float* p, vf x, int64_t n) {
  float t[W];
  vst(t, x);
  memcpy(p, t, n * sizeof(float));
}
inline vf vld16_n(const uint16_t* p, int64_t n) {
  uint16_t t[W] = {};
  memcpy(t, p, n * sizeof(uint16_t));
  return vld16(t);
}
inline void vst16_n(uint16_t* p, vf x, int64_t n) {
  uint16_t t[W];
  vst16(t, x);
  memcpy(p, t, n * sizeof(uint16_t));
}
#endif

// the lanes of a row from i: W of them, or the tail
inline vf ld(const float* p, int64_t n, int64_t i) { return n - i >= W ? vld(p + i) : vld_n(p + i, n - i); }
inline vf ld16(const uint16_t* p, int64_t n, int64_t i) { return n - i >= W ? vld16(p + i) : vld16_n(p + i, n - i); }
inline void st16(uint16_t* p, vf x, int64_t n, int64_t i) {
  if (n - i >= W) vst16(p + i, x); else vst16_n(p + i, x, n - i);
}

inline vf vsilu(vf x) { return vdiv(x, vadd(vset(1.f), vexp(vsub(vzero(), x)))); }
inline vf vsigmoid(vf x) { return vdiv(vset(1.f), vadd(vset(1.f), vexp(vsub(vzero(), x)))); }

// ---------------------------------------------------------------- activations
void to_bf16_row(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(x[i]);
}

// x ~ q * d per block of 32, rounding to nearest even (as nearbyint); identical on every unit
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, int32_t* s, float* ds) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    vf m = vzero();
    for (int i = 0; i < kBlock; i += W) m = vmax(m, vabs(vld(xb + i)));
    const float amax = vmaxr(m);
    const float dd = amax / 127.f;
    const float id = dd > 0.f ? 1.f / dd : 0.f;
    int32_t sum = 0;
#if QK_AVX512
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(vld(xb), vset(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(vld(xb + 16), vset(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif QK_AVX2
    __m256i qi[4];  // vcvtps2dq rounds to nearest even under the default MXCSR
    for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(vld(xb + 8 * j), vset(id)));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    sum = _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
#else
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(nearbyintf(xb[i] * id));
      q[b * kBlock + i] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
    d[b] = dd;
    s[b] = sum;
    ds[b] = dd * static_cast<float>(sum);
  }
}

// out[i] = silu(g[i]) * u[i] for 32 values
void silu_mul32(const float* g, const float* u, float* out) {
  for (int i = 0; i < kBlock; i += W) vst(out + i, vmul(vsilu(vld(g + i)), vld(u + i)));
}

// sum of n floats (n % 64 == 0) with four independent chains: a plain streaming read
double sum_f32(const float* p, int64_t n) {
  vf a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 4 * W) {
    a0 = vadd(a0, vld(p + i));
    a1 = vadd(a1, vld(p + i + W));
    a2 = vadd(a2, vld(p + i + 2 * W));
    a3 = vadd(a3, vld(p + i + 3 * W));
  }
  return vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

// ---------------------------------------------------------------- bf16 matrices
// Software prefetch: every weight stream (the bf16 rows, the int4 / int8 tiles) asks for the bytes kPrefetch
// ahead of it into L2. Asked into L1 (the hint these kernels used first), the tiles of several rows (a verify's)
// ran at a speed that changed from one run to the next, at worst far slower than one row, and the bf16 rows were
// slower than with no hint at all; into L2 the speed is steady, two rows of the int8 head take the time of one,
// and one-row tiles and bf16 rows beat both the L1 hint and none (A/B in alternating processes with each
// QUANTKIT_CPU_ISA; reports/bench-mtp.md, bench-decode.md and bench-engines.md carry the end-to-end figures).
// A tile read in two 8-row passes asks in the first. The AVX-VNNI unit's int8 tiles go without (nothing gained
// where it was measured); the plain AVX2 unit's int8 tiles ask, at every count of rows
// (reports/zen1-avx2/tile-ab.md).
constexpr int64_t kPrefetch = 4096;

// `lines` 64-byte lines of a stream, kPrefetch bytes ahead of p, asked for into L2
inline void prefetch_ahead(const uint8_t* p, int lines) {
  for (int l = 0; l < lines; ++l) prefetch_l2(p + kPrefetch + 64 * l);
}

// w . x for MR activation rows (k % 32 == 0), each row with accumulators enough that no FMA waits on another.
// A tile's weight rows go one after another, so the weights are one sequential stream: measured against 8
// (AVX512) and 4 (AVX2) weight rows side by side, whose streams lie k apart, on a 248k x 2048 head, A/B in
// alternating processes (reports/bench-engines.md has the end-to-end effect). Several activation rows share each
// load of the weights (a batch's rows read the tile from memory once and from L1 once, not once per row); each
// row's sums run in the one-row order, so a row's dot has the same bits in any batch.
template <int MR>
inline void rows_bf16(const uint16_t* w, int64_t k, const QAct* a, float* dot) {
  int64_t j = 0;
#if QK_NATIVE_BF16
  __m512 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (; j + 64 <= k; j += 64) {
    prefetch_ahead(reinterpret_cast<const uint8_t*>(w + j), 1);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + j), w1 = (__m512bh)_mm512_loadu_si512(w + j + 32);
    for (int r = 0; r < MR; ++r) {
      a0[r] = _mm512_dpbf16_ps(a0[r], w0, (__m512bh)_mm512_loadu_si512(a[r].xb + j));
      a1[r] = _mm512_dpbf16_ps(a1[r], w1, (__m512bh)_mm512_loadu_si512(a[r].xb + j + 32));
    }
  }
  if (j < k) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + j);
    for (int r = 0; r < MR; ++r) a0[r] = _mm512_dpbf16_ps(a0[r], w0, (__m512bh)_mm512_loadu_si512(a[r].xb + j));
  }
  for (int r = 0; r < MR; ++r) dot[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
#else
  // bf16 widened to fp32 in registers: even and odd elements as two halves (a shift and a mask)
  vf a0[MR], a1[MR], a2[MR], a3[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = a2[r] = a3[r] = vzero();
  vf we, wo, xe, xo;
  for (; j + 4 * W <= k; j += 4 * W) {
    prefetch_ahead(reinterpret_cast<const uint8_t*>(w + j), 1);
    vld16x2(w + j, we, wo);
    for (int r = 0; r < MR; ++r) {
      vld16x2(a[r].xb + j, xe, xo);
      a0[r] = vfma(we, xe, a0[r]);
      a1[r] = vfma(wo, xo, a1[r]);
    }
    vld16x2(w + j + 2 * W, we, wo);
    for (int r = 0; r < MR; ++r) {
      vld16x2(a[r].xb + j + 2 * W, xe, xo);
      a2[r] = vfma(we, xe, a2[r]);
      a3[r] = vfma(wo, xo, a3[r]);
    }
  }
  for (; j < k; j += 2 * W) {
    vld16x2(w + j, we, wo);
    for (int r = 0; r < MR; ++r) {
      vld16x2(a[r].xb + j, xe, xo);
      a0[r] = vfma(we, xe, a0[r]);
      a1[r] = vfma(wo, xo, a1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) dot[r] = vsum(vadd(vadd(a0[r], a1[r]), vadd(a2[r], a3[r])));
#endif
}

// Activation rows per pass of a bf16 tile: their accumulators and the weights' registers fit (4 per row and 4
// shared where bf16 is widened; 2 per row natively)
#if QK_NATIVE_BF16
constexpr int kBf16Rows = 8;
#elif QK_AVX512
constexpr int kBf16Rows = 4;
#elif QK_AVX2
constexpr int kBf16Rows = 2;
#else
constexpr int kBf16Rows = 1;
#endif

// MR activation rows of a 16-row bf16 tile, out [MR][16] (rows past m.n give 0)
template <int MR>
void tile_bf16(const QMat& m, int64_t t, const QAct* a, float* out) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(m.qw);
  const int64_t r0 = t * kTile, n = imin(kTile, m.n - r0);
  float dot[MR];
  for (int64_t i = 0; i < kTile; ++i) {
    if (i < n) rows_bf16<MR>(w + (r0 + i) * m.k, m.k, a, dot);
    for (int r = 0; r < MR; ++r) out[r * kTile + i] = i < n ? dot[r] : 0.f;
  }
}

// ---------------------------------------------------------------- int4 / int8 tiles
#if QK_AVX512
// Activation rows per pass over a tile: with 32 zmm registers the codes of a block (8 for int8; 4 + 4 nibble
// halves for int4) and 8 rows' sums fit together, so a batch of 8 rows unpacks and loads each tile once and its
// rows' dot chains run side by side (4 rows left the second half of a batch to a second pass over the tile).
constexpr int kRowsPerCall = 8;

// One 32-block of a tile against MR activation rows: ga[r] += d_b * (codes . xq) as int32 -> fp32. The
// high nibbles are masked in place (0xF0, i.e. 16 x code) and their sum shifted right by 4 (exact: a
// multiple of 16); the +8 offset and the group's scale are applied once per group (tile_int4).
template <int MR>
__attribute__((always_inline)) inline void int4_block(const uint8_t* p, const QAct* a, int64_t b, __m512* ga) {
  const __m512i mlo = _mm512_set1_epi8(0x0F), mhi = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512i lo[4], hi[4];
  for (int c = 0; c < 4; ++c) {
    __m512i v = _mm512_loadu_si512(p + 64 * c);
    lo[c] = _mm512_and_si512(v, mlo);
    hi[c] = _mm512_and_si512(v, mhi);
  }
  for (int r = 0; r < MR; ++r) {
    const int8_t* xq = a[r].q + b * kBlock;
    __m512i il = _mm512_setzero_si512(), ih = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      il = _mm512_dpbusd_epi32(il, lo[c], _mm512_set1_epi32(load_i32(xq + 8 * c)));
      ih = _mm512_dpbusd_epi32(ih, hi[c], _mm512_set1_epi32(load_i32(xq + 8 * c + 4)));
    }
    const __m512i is = _mm512_add_epi32(il, _mm512_srai_epi32(ih, 4));
    ga[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(a[r].d[b]), ga[r]);
  }
}

// A 16-row int4 tile, group by group: per row, sum_b d_b (codes_b . xq_b) over the group's blocks, less
// the +8 offset (8 sum_b d_b s_b), times the group's scale, plus its zero times sum_b d_b s_b.
template <int MR>
void tile_int4(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock, ng = m.k / m.group, bpg = m.group / kBlock;
  const uint8_t* qw = m.qw + t * nb * 256;
  const uint16_t* sc = static_cast<const uint16_t*>(m.scales) + t * ng * kTile;
  const uint16_t* zp = m.zeros ? m.zeros + t * ng * kTile : nullptr;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512 ga[MR];
    float dss[MR];
    for (int r = 0; r < MR; ++r) {
      ga[r] = _mm512_setzero_ps();
      dss[r] = 0.f;
    }
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      prefetch_ahead(qw + b * 256, 4);
      int4_block<MR>(qw + b * 256, a, b, ga);
      for (int r = 0; r < MR; ++r) dss[r] += a[r].ds[b];
    }
    const __m512 s = vld16(sc + g * kTile);
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_sub_ps(ga[r], _mm512_set1_ps(8.f * dss[r])), s, acc[r]);
    if (zp) {
      const __m512 z = vld16(zp + g * kTile);
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(dss[r]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
}

template <int MR>
void tile_int8(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock;
  const uint8_t* qw = m.qw + t * nb * 512;
  __m512 fs[MR];
  for (int r = 0; r < MR; ++r) fs[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = qw + b * 512;
    prefetch_ahead(p, 8);
    __m512i w[8];
    for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(p + 64 * c);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = a[r].q + b * kBlock;
      __m512i is;
      if constexpr (MR == 1) {
        __m512i i[4];
        for (int j = 0; j < 4; ++j)
          i[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
        for (int j = 0; j < 4; ++j)
          i[j] = _mm512_dpbusd_epi32(i[j], w[j + 4], _mm512_set1_epi32(load_i32(xq + 4 * j + 16)));
        is = _mm512_add_epi32(_mm512_add_epi32(i[0], i[1]), _mm512_add_epi32(i[2], i[3]));
        is = _mm512_sub_epi32(is, _mm512_set1_epi32(128 * a[r].s[b]));
      } else {  // one chain per row starting at the -128 offset's correction (the rows' chains run side by
                // side): the same exact sums in fewer ops per row, which keeps a verify's rows of the int8 head
                // near one row's pace (one row runs faster with four chains; reports/mtp-verify-states/)
        is = _mm512_set1_epi32(-128 * a[r].s[b]);
        for (int j = 0; j < 8; ++j) is = _mm512_dpbusd_epi32(is, w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
      }
      fs[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(a[r].d[b]), fs[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps(static_cast<const float*>(m.scales) + t * kTile);
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * kTile, _mm512_mul_ps(s, fs[r]));
}

#elif QK_AVXVNNI
constexpr int kRowsPerCall = 4;  // ymm registers: 16

// As the AVX512 tiles, on 256 bits: each 64-byte row of codes is two ymm (the tile's rows 0-7 and 8-15).
// The high nibbles are shifted down (one more op per 32 bytes, shared by the rows) so that each row keeps
// one accumulator, not two. One activation row takes both halves in one pass; several take one half at a
// time so that their accumulators fit the registers.
template <int MR, int H>
__attribute__((always_inline)) inline void int4_half_block(const uint8_t* p, const QAct* a, int64_t b, __m256* ga) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256i is[MR * H];
  for (int i = 0; i < MR * H; ++i) is[i] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c)
    for (int h = 0; h < H; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c + 32 * h));
      const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = a[r].q + b * kBlock + 8 * c;
        is[r * H + h] = _mm256_dpbusd_avx_epi32(is[r * H + h], lo, _mm256_set1_epi32(load_i32(xq)));
        is[r * H + h] = _mm256_dpbusd_avx_epi32(is[r * H + h], hi, _mm256_set1_epi32(load_i32(xq + 4)));
      }
    }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < H; ++h)
      ga[r * H + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r * H + h]), _mm256_set1_ps(a[r].d[b]), ga[r * H + h]);
}

// rows h0 .. h0 + 8H of a tile (H = 1: one half, 2: both)
template <int MR, int H>
void tile_int4_part(const QMat& m, int64_t t, const QAct* a, int h0, float* out) {
  const int64_t nb = m.k / kBlock, ng = m.k / m.group, bpg = m.group / kBlock;
  const uint8_t* qw = m.qw + t * nb * 256 + 32 * h0;
  const uint16_t* sc = static_cast<const uint16_t*>(m.scales) + t * ng * kTile + 8 * h0;
  const uint16_t* zp = m.zeros ? m.zeros + t * ng * kTile + 8 * h0 : nullptr;
  __m256 acc[MR * H];
  for (int i = 0; i < MR * H; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256 ga[MR * H];
    float dss[MR];
    for (int i = 0; i < MR * H; ++i) ga[i] = _mm256_setzero_ps();
    for (int r = 0; r < MR; ++r) dss[r] = 0.f;
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      if (h0 == 0) prefetch_ahead(qw + b * 256, 4);  // the second half's pass reads the same lines
      int4_half_block<MR, H>(qw + b * 256, a, b, ga);
      for (int r = 0; r < MR; ++r) dss[r] += a[r].ds[b];
    }
    for (int h = 0; h < H; ++h) {
      const __m256 s = vld16(sc + g * kTile + 8 * h);
      for (int r = 0; r < MR; ++r)
        acc[r * H + h] = _mm256_fmadd_ps(_mm256_sub_ps(ga[r * H + h], _mm256_set1_ps(8.f * dss[r])), s, acc[r * H + h]);
      if (zp) {
        const __m256 z = vld16(zp + g * kTile + 8 * h);
        for (int r = 0; r < MR; ++r) acc[r * H + h] = _mm256_fmadd_ps(z, _mm256_set1_ps(dss[r]), acc[r * H + h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(out + r * kTile + 8 * (h0 + h), acc[r * H + h]);
}

template <int MR>
void tile_int4(const QMat& m, int64_t t, const QAct* a, float* out) {
  if (MR == 1) {
    tile_int4_part<1, 2>(m, t, a, 0, out);
  } else {
    tile_int4_part<MR, 1>(m, t, a, 0, out);
    tile_int4_part<MR, 1>(m, t, a, 1, out);
  }
}

template <int MR, int H>
void tile_int8_part(const QMat& m, int64_t t, const QAct* a, int h0, float* out) {
  const int64_t nb = m.k / kBlock;
  const uint8_t* qw = m.qw + t * nb * 512 + 32 * h0;
  __m256 fs[MR * H];
  for (int i = 0; i < MR * H; ++i) fs[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = qw + b * 512;
    __m256i is[MR * H];
    for (int i = 0; i < MR * H; ++i) is[i] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c)
      for (int h = 0; h < H; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c + 32 * h));
        for (int r = 0; r < MR; ++r)
          is[r * H + h] = _mm256_dpbusd_avx_epi32(is[r * H + h], w, _mm256_set1_epi32(load_i32(a[r].q + b * kBlock + 4 * c)));
      }
    for (int r = 0; r < MR; ++r) {
      const __m256i off = _mm256_set1_epi32(128 * a[r].s[b]);
      const __m256 d = _mm256_set1_ps(a[r].d[b]);
      for (int h = 0; h < H; ++h)
        fs[r * H + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(is[r * H + h], off)), d, fs[r * H + h]);
    }
  }
  const float* sc = static_cast<const float*>(m.scales) + t * kTile + 8 * h0;
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < H; ++h)
      _mm256_storeu_ps(out + r * kTile + 8 * (h0 + h), _mm256_mul_ps(_mm256_loadu_ps(sc + 8 * h), fs[r * H + h]));
}

template <int MR>
void tile_int8(const QMat& m, int64_t t, const QAct* a, float* out) {
  if (MR == 1) {
    tile_int8_part<1, 2>(m, t, a, 0, out);
  } else {
    tile_int8_part<MR, 1>(m, t, a, 0, out);
    tile_int8_part<MR, 1>(m, t, a, 1, out);
  }
}

#elif QK_AVX2
// Activation rows per pass over a tile. Without VNNI each product is a vpmaddubsw plus an add, so the
// unpacked codes are worth sharing among as many rows as the 16 ymm registers hold. An int8 tile takes its
// rows in one pass over both 8-row halves, an int4 tile one or two rows so and three or four one half at a
// time (four int16 block sums and four fp32 sums live, the codes and the activation broadcasts transient).
constexpr int kRowsPerCall = 4;

// A running sum held in its register at this point: GCC otherwise reassociates a block's integer adds,
// issues every vpmaddubsw first and spills their results to the stack (the tiles then ran no faster with
// four rows than with two).
__attribute__((always_inline)) inline void keep(__m256i& v) { asm("" : "+x"(v)); }

// The MR activation rows' pointers, read once per call instead of through `a` in the inner loops.
template <int MR>
struct Rows {
  const int8_t* q[MR];
  const float* d[MR];
  const int32_t* s[MR];
  const float* ds[MR];
};

template <int MR>
__attribute__((always_inline)) inline Rows<MR> rows_of(const QAct* a) {
  Rows<MR> x;
  for (int r = 0; r < MR; ++r) {
    x.q[r] = a[r].q;
    x.d[r] = a[r].d;
    x.s[r] = a[r].s;
    x.ds[r] = a[r].ds;
  }
  return x;
}

// One 32-block of an 8-row half against MR rows: the int32 dot of each row's codes with the block, less
// the +8 offset (8 s_b), exact. vpmaddubsw pairs are at most 2 * 15 * 127 and a block adds 8 of them
// (30480), so the sums stay in int16 until one vpmaddwd widens them.
template <int MR>
__attribute__((always_inline)) inline void int4_half_dots(const uint8_t* p, const Rows<MR>& x, int64_t b, __m256i* is) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256i s16[MR];
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c));
    const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = x.q[r] + b * kBlock + 8 * c;
      const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xq)));
      const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xq + 4)));
      s16[r] = c ? _mm256_add_epi16(s16[r], _mm256_add_epi16(pl, ph)) : _mm256_add_epi16(pl, ph);
      keep(s16[r]);
    }
  }
  for (int r = 0; r < MR; ++r)
    is[r] = _mm256_sub_epi32(_mm256_madd_epi16(s16[r], _mm256_set1_epi16(1)), _mm256_set1_epi32(8 * x.s[r][b]));
}

// Rows 8h .. 8h+7 of a 16-row int4 tile against MR activation rows, group by group: per row, the sum over
// the group's blocks of d_b times the block's dot, times the group's scale, plus its zero times sum_b d_b s_b.
// The fp32 operations and their order are tile_int4<1>'s, so a row gets the same bits in any batch.
template <int MR, bool OneBlockGroups>
__attribute__((always_inline)) inline void tile_int4_half(const QMat& m, int64_t t, const QAct* a, int h, float* out) {
  const int64_t nb = m.k / kBlock, bpg = m.group / kBlock, ng = m.k / m.group;
  const uint8_t* qw = m.qw + t * nb * 256 + 32 * h;
  const uint16_t* sc = static_cast<const uint16_t*>(m.scales) + t * ng * kTile + 8 * h;
  const uint16_t* zp = m.zeros ? m.zeros + t * ng * kTile + 8 * h : nullptr;
  const Rows<MR> x = rows_of<MR>(a);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256 fs[MR];
    __m256i is[MR];
    if (OneBlockGroups) {
      if (h == 0) prefetch_ahead(qw + g * 256, 4);  // the second half's pass reads the same lines
      int4_half_dots<MR>(qw + g * 256, x, g, is);
      for (int r = 0; r < MR; ++r)
        fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_set1_ps(x.d[r][g]), _mm256_setzero_ps());
    } else {
      for (int r = 0; r < MR; ++r) fs[r] = _mm256_setzero_ps();
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        if (h == 0) prefetch_ahead(qw + b * 256, 4);
        int4_half_dots<MR>(qw + b * 256, x, b, is);
        for (int r = 0; r < MR; ++r) fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_set1_ps(x.d[r][b]), fs[r]);
      }
    }
    const __m256 s = vld16(sc + g * kTile);
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(s, fs[r], acc[r]);
    if (zp) {
      const __m256 z = vld16(zp + g * kTile);
      for (int r = 0; r < MR; ++r) {
        float zs = 0.f;
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) zs += x.ds[r][b];
        acc[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(zs), acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * kTile + 8 * h, acc[r]);
}

template <int MR>
void tile_int4(const QMat& m, int64_t t, const QAct* a, float* out) {
  for (int h = 0; h < 2; ++h) {
    if (m.group == kBlock) tile_int4_half<MR, true>(m, t, a, h, out);
    else tile_int4_half<MR, false>(m, t, a, h, out);
  }
}

// MR activation rows of an int8 tile in one pass over both halves, so the codes stream once, in order and
// prefetched (two 8-row passes left the memory idle during the second: reports/zen1-avx2/tile-ab.md). Back
// to the signed code, then |w| x sign(x, w), which vpmaddubsw's u8 x s8 cannot overflow (2 * 128 * 127); the
// int32 dots are exact and the fp32 operations tile_int8<1>'s.
template <int MR>
void tile_int8(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock;
  const uint8_t* qw = m.qw + t * nb * 512;
  const Rows<MR> x = rows_of<MR>(a);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f0[MR], f1[MR];
  for (int r = 0; r < MR; ++r) f0[r] = f1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = qw + b * 512;
    prefetch_ahead(p, 8);
    __m256i i0[MR], i1[MR];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c)), flip);
      const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c + 32)), flip);
      const __m256i aw0 = _mm256_sign_epi8(w0, w0), aw1 = _mm256_sign_epi8(w1, w1);
      for (int r = 0; r < MR; ++r) {
        const __m256i xr = _mm256_set1_epi32(load_i32(x.q[r] + b * kBlock + 4 * c));
        const __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw0, _mm256_sign_epi8(xr, w0)), ones);
        const __m256i d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw1, _mm256_sign_epi8(xr, w1)), ones);
        i0[r] = c ? _mm256_add_epi32(i0[r], d0) : d0;
        i1[r] = c ? _mm256_add_epi32(i1[r], d1) : d1;
        keep(i0[r]);
        keep(i1[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m256 d = _mm256_set1_ps(x.d[r][b]);
      f0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[r]), d, f0[r]);
      f1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[r]), d, f1[r]);
    }
  }
  const float* s = static_cast<const float*>(m.scales) + t * kTile;
  const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(out + r * kTile, _mm256_mul_ps(s0, f0[r]));
    _mm256_storeu_ps(out + r * kTile + 8, _mm256_mul_ps(s1, f1[r]));
  }
}

// One activation row (decode): both 8-row halves in one pass, so each 64-byte line of codes is used whole
// when it arrives and the activation broadcasts serve both halves. The sums are pinned as in the prefill
// tiles: unpinned, GCC kept the group sums on the stack, a store-to-load chain through every block.
template <>
void tile_int4<1>(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock, bpg = m.group / kBlock, ng = m.k / m.group;
  const uint8_t* qw = m.qw + t * nb * 256;
  const uint16_t* sc = static_cast<const uint16_t*>(m.scales) + t * ng * kTile;
  const uint16_t* zp = m.zeros ? m.zeros + t * ng * kTile : nullptr;
  const int8_t* xq = a->q;
  const float* xd = a->d;
  const int32_t* xs = a->s;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  for (int64_t g = 0; g < ng; ++g) {
    __m256 fs0 = _mm256_setzero_ps(), fs1 = fs0;
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const uint8_t* p = qw + b * 256;
      prefetch_ahead(p, 4);
      const int8_t* xb = xq + b * kBlock;
      __m256i s0, s1;
      for (int c = 0; c < 4; ++c) {
        const __m256i xl = _mm256_set1_epi32(load_i32(xb + 8 * c)), xh = _mm256_set1_epi32(load_i32(xb + 8 * c + 4));
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c + 32));
        const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v0, mask), xl),
                                            _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), mask), xh));
        const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v1, mask), xl),
                                            _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), mask), xh));
        s0 = c ? _mm256_add_epi16(s0, p0) : p0;
        s1 = c ? _mm256_add_epi16(s1, p1) : p1;
        keep(s0);
        keep(s1);
      }
      const __m256i ones = _mm256_set1_epi16(1), off = _mm256_set1_epi32(8 * xs[b]);
      const __m256 d = _mm256_set1_ps(xd[b]);
      fs0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(s0, ones), off)), d, fs0);
      fs1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(s1, ones), off)), d, fs1);
    }
    acc0 = _mm256_fmadd_ps(vld16(sc + g * kTile), fs0, acc0);
    acc1 = _mm256_fmadd_ps(vld16(sc + g * kTile + 8), fs1, acc1);
    if (zp) {
      float zs = 0.f;
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) zs += a->ds[b];
      acc0 = _mm256_fmadd_ps(vld16(zp + g * kTile), _mm256_set1_ps(zs), acc0);
      acc1 = _mm256_fmadd_ps(vld16(zp + g * kTile + 8), _mm256_set1_ps(zs), acc1);
    }
  }
  _mm256_storeu_ps(out, acc0);
  _mm256_storeu_ps(out + 8, acc1);
}

// One activation row: |x| made once per 4 codes for both halves (vpmaddubsw takes |x| unsigned against
// sign(w, x) signed, which cannot overflow: a code of -128, which would, is never stored, see repack_int8);
// cheaper here than tile_int8<MR>'s |w| per code, and the same exact int32 dots.
template <>
void tile_int8<1>(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock;
  const uint8_t* qw = m.qw + t * nb * 512;
  const int8_t* xq = a->q;
  const float* xd = a->d;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 fs0 = _mm256_setzero_ps(), fs1 = fs0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = qw + b * 512;
    prefetch_ahead(p, 8);
    const int8_t* xb = xq + b * kBlock;
    __m256i i0, i1;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i x = _mm256_set1_epi32(load_i32(xb + 4 * c));
      const __m256i ax = _mm256_sign_epi8(x, x);
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c)), flip);
      const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c + 32)), flip);
      const __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, x)), ones);
      const __m256i d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, x)), ones);
      i0 = c ? _mm256_add_epi32(i0, d0) : d0;
      i1 = c ? _mm256_add_epi32(i1, d1) : d1;
      keep(i0);
      keep(i1);
    }
    const __m256 d = _mm256_set1_ps(xd[b]);
    fs0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), d, fs0);
    fs1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), d, fs1);
  }
  const float* s = static_cast<const float*>(m.scales) + t * kTile;
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_loadu_ps(s), fs0));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_loadu_ps(s + 8), fs1));
}

// Two activation rows (a 2-token verify) of an int4 tile in one pass over both halves, as tile_int8 takes every
// count of rows: the codes stream once, in order and prefetched (reports/zen1-avx2/tile-ab.md; three and four
// rows, a prefill's, ran no faster so, and stay on the half passes). Each row's sums and their order are
// tile_int4<1>'s.
template <int MR>
__attribute__((always_inline)) inline void tile_int4_pass(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock, bpg = m.group / kBlock, ng = m.k / m.group;
  const uint8_t* qw = m.qw + t * nb * 256;
  const uint16_t* sc = static_cast<const uint16_t*>(m.scales) + t * ng * kTile;
  const uint16_t* zp = m.zeros ? m.zeros + t * ng * kTile : nullptr;
  const Rows<MR> x = rows_of<MR>(a);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256 fs0[MR], fs1[MR];
    for (int r = 0; r < MR; ++r) fs0[r] = fs1[r] = _mm256_setzero_ps();
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const uint8_t* p = qw + b * 256;
      prefetch_ahead(p, 4);
      __m256i s[2][MR];  // per half, per row
      for (int c = 0; c < 4; ++c) {
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c + 32 * h));
          const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
          for (int r = 0; r < MR; ++r) {
            const int8_t* xb = x.q[r] + b * kBlock + 8 * c;
            const __m256i pr = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xb))),
                                                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xb + 4))));
            s[h][r] = c ? _mm256_add_epi16(s[h][r], pr) : pr;
            keep(s[h][r]);
          }
        }
      }
      const __m256i ones = _mm256_set1_epi16(1);
      for (int r = 0; r < MR; ++r) {
        const __m256i off = _mm256_set1_epi32(8 * x.s[r][b]);
        const __m256 d = _mm256_set1_ps(x.d[r][b]);
        fs0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(s[0][r], ones), off)), d, fs0[r]);
        fs1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(s[1][r], ones), off)), d, fs1[r]);
      }
    }
    const __m256 c0 = vld16(sc + g * kTile), c1 = vld16(sc + g * kTile + 8);
    for (int r = 0; r < MR; ++r) {
      acc0[r] = _mm256_fmadd_ps(c0, fs0[r], acc0[r]);
      acc1[r] = _mm256_fmadd_ps(c1, fs1[r], acc1[r]);
    }
    if (zp) {
      const __m256 z0 = vld16(zp + g * kTile), z1 = vld16(zp + g * kTile + 8);
      for (int r = 0; r < MR; ++r) {
        float zs = 0.f;
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) zs += x.ds[r][b];
        acc0[r] = _mm256_fmadd_ps(z0, _mm256_set1_ps(zs), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(z1, _mm256_set1_ps(zs), acc1[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(out + r * kTile, acc0[r]);
    _mm256_storeu_ps(out + r * kTile + 8, acc1[r]);
  }
}

template <>
void tile_int4<2>(const QMat& m, int64_t t, const QAct* a, float* out) { tile_int4_pass<2>(m, t, a, out); }

#else
constexpr int kRowsPerCall = 1;

// The same sums as the SIMD tiles, one row at a time: int32 dots per block, then the block's scale.
template <int MR>
void tile_int4(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock, ng = m.k / m.group, bpg = m.group / kBlock;
  const uint8_t* qw = m.qw + t * nb * 256;
  const uint16_t* sc = static_cast<const uint16_t*>(m.scales) + t * ng * kTile;
  const uint16_t* zp = m.zeros ? m.zeros + t * ng * kTile : nullptr;
  for (int r = 0; r < MR; ++r)
    for (int row = 0; row < kTile; ++row) {
      float acc = 0.f;
      for (int64_t g = 0; g < ng; ++g) {
        float ga = 0.f, dss = 0.f;
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
          const uint8_t* p = qw + b * 256 + 4 * row;
          const int8_t* xq = a[r].q + b * kBlock;
          int32_t is = 0;
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = p[64 * c + i];
              is += (byte & 15) * xq[8 * c + i] + (byte >> 4) * xq[8 * c + 4 + i];
            }
          ga += static_cast<float>(is) * a[r].d[b];
          dss += a[r].ds[b];
        }
        acc += (ga - 8.f * dss) * bf16_value(sc[g * kTile + row]);
        if (zp) acc += bf16_value(zp[g * kTile + row]) * dss;
      }
      out[r * kTile + row] = acc;
    }
}

template <int MR>
void tile_int8(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock;
  const uint8_t* qw = m.qw + t * nb * 512;
  const float* sc = static_cast<const float*>(m.scales) + t * kTile;
  for (int r = 0; r < MR; ++r)
    for (int row = 0; row < kTile; ++row) {
      float fs = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = qw + b * 512 + 4 * row;
        const int8_t* xq = a[r].q + b * kBlock;
        int32_t is = 0;
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i) is += p[64 * c + i] * xq[4 * c + i];
        fs += static_cast<float>(is - 128 * a[r].s[b]) * a[r].d[b];
      }
      out[r * kTile + row] = sc[row] * fs;
    }
}
#endif

template <int MR>
void tile_mr(const QMat& m, int64_t t, const QAct* a, float* out) {
  if (m.fmt == 4) tile_int4<MR>(m, t, a, out); else tile_int8<MR>(m, t, a, out);
}

// rows of `a` in chunks of kRowsPerCall; out [rows][16]
void tile(const QMat& m, int64_t t, const QAct* a, int64_t rows, float* out) {
  if (m.fmt == 16) {
    for (int64_t r = 0; r < rows; r += kBf16Rows) {
      switch (imin(kBf16Rows, rows - r)) {
        case 1: tile_bf16<1>(m, t, a + r, out + r * kTile); break;
#if QK_TARGET >= 1
        case 2: tile_bf16<2>(m, t, a + r, out + r * kTile); break;
#endif
#if QK_AVX512
        case 3: tile_bf16<3>(m, t, a + r, out + r * kTile); break;
        case 4: tile_bf16<4>(m, t, a + r, out + r * kTile); break;
#endif
#if QK_NATIVE_BF16
        case 5: tile_bf16<5>(m, t, a + r, out + r * kTile); break;
        case 6: tile_bf16<6>(m, t, a + r, out + r * kTile); break;
        case 7: tile_bf16<7>(m, t, a + r, out + r * kTile); break;
        case 8: tile_bf16<8>(m, t, a + r, out + r * kTile); break;
#endif
        default: break;
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; r += kRowsPerCall) {
    switch (imin(kRowsPerCall, rows - r)) {
      case 1: tile_mr<1>(m, t, a + r, out + r * kTile); break;
#if QK_TARGET >= 1
      case 2: tile_mr<2>(m, t, a + r, out + r * kTile); break;
      case 3: tile_mr<3>(m, t, a + r, out + r * kTile); break;
      case 4: tile_mr<4>(m, t, a + r, out + r * kTile); break;
#endif
#if QK_AVX512
      case 5: tile_mr<5>(m, t, a + r, out + r * kTile); break;
      case 6: tile_mr<6>(m, t, a + r, out + r * kTile); break;
      case 7: tile_mr<7>(m, t, a + r, out + r * kTile); break;
      case 8: tile_mr<8>(m, t, a + r, out + r * kTile); break;
#endif
      default: break;
    }
  }
}

// ---------------------------------------------------------------- the gated delta rule
// A block of CB * W columns of delta_head, from `in` to `dst` (rows ins and ds floats apart; v, kv and out at
// the block's first column): a column's kv and out depend on that column alone, so the block goes through both
// passes with kv and out in registers and the second pass reads the block's rows from L1 (the same operations in
// the same order per element as whole rows, so the same bits).
constexpr int kDeltaCols = 4;
static_assert(kDeltaCols * W <= kDeltaBlockCols, "a delta rule block wider than its scratch");
template <int CB>
inline void delta_cols(const float* in, int64_t ins, float* dst, int64_t ds, int64_t K, const float* q,
                       const float* k, const float* v, float decay, float beta, float* kv, float* out, bool inplace,
                       bool stream) {
  const vf dv = vset(decay);
  vf acc[CB], o[CB];
  for (int c = 0; c < CB; ++c) acc[c] = vzero();
  for (int64_t i = 0; i < K; ++i) {
    const vf ki = vset(k[i]);
    for (int c = 0; c < CB; ++c) {
      const vf sv = vmul(vld(in + i * ins + c * W), dv);
      if (inplace) vst(dst + i * ds + c * W, sv);
      acc[c] = vfma(ki, sv, acc[c]);
    }
  }
  const vf bv = vset(beta);
  for (int c = 0; c < CB; ++c) {
    acc[c] = vmul(vsub(vld(v + c * W), acc[c]), bv);
    vst(kv + c * W, acc[c]);
    o[c] = vzero();
  }
  for (int64_t i = 0; i < K; ++i) {
    float* row = dst + i * ds;
    const vf ki = vset(k[i]), qi = vset(q[i]);
    for (int c = 0; c < CB; ++c) {
      const vf sv = vfma(ki, acc[c], inplace ? vld(row + c * W) : vmul(vld(in + i * ins + c * W), dv));
      if (stream) vstream(row + c * W, sv); else vst(row + c * W, sv);
      o[c] = vfma(qi, sv, o[c]);
    }
  }
  for (int c = 0; c < CB; ++c) vst(out + c * W, o[c]);
}

// the block of CB * W columns at j0 of delta_rows: token by token, the states between in tmp [K, CB * W]
template <int CB>
inline void delta_rows_cols(const float* Sin, float* S, int64_t K, int64_t V, int64_t j0, int64_t t,
                            const DeltaTok* tok, float* tmp, bool stream) {
  for (int64_t j = 0; j < t; ++j) {
    const bool last = j + 1 == t;
    const float* in = j == 0 ? Sin + j0 : tmp;
    float* dst = last ? S + j0 : tmp;
    const DeltaTok& d = tok[j];
    delta_cols<CB>(in, j == 0 ? V : CB * W, dst, last ? V : CB * W, K, d.q, d.k, d.v + j0, d.decay, d.beta,
                   d.kv + j0, d.out + j0, in == dst, last && stream);
  }
}

// t tokens of the gated delta rule (delta_head's) on one head (V % W == 0), from Sin to S (which may be Sin),
// each block of columns through every token while it is in L1; the states between stay in tmp
// [K, kDeltaBlockCols]. The same bits as t calls of delta_head.
void delta_rows(const float* Sin, float* S, int64_t K, int64_t V, int64_t t, const DeltaTok* tok, float* tmp,
                bool stream) {
  stream = stream && Sin != S && reinterpret_cast<uintptr_t>(S) % kStreamAlign == 0 &&
           (V * sizeof(float)) % kStreamAlign == 0;
  int64_t j0 = 0;
  for (; j0 + kDeltaCols * W <= V; j0 += kDeltaCols * W)
    delta_rows_cols<kDeltaCols>(Sin, S, K, V, j0, t, tok, tmp, stream);
  for (; j0 < V; j0 += W) delta_rows_cols<1>(Sin, S, K, V, j0, t, tok, tmp, stream);
  if (stream) stream_fence();
}

// One head for one token, state S [K, V] fp32 from Sin: S = Sin * decay; kv = k^T S; S += k (beta (v - kv))^T;
// out = q^T S. Two passes over each block of columns (delta_cols), the second from L1. In place (Sin == S) the
// first writes S * decay; out of place, the first pass only reads Sin and the second writes S, with non-temporal
// stores where `stream` (a state nothing reads before it leaves the cache): its lines are then not read for
// ownership first, as plain stores to a buffer out of cache read them (a verify writing its last state to a
// second buffer so spent more than one writing in place).
void delta_head(const float* Sin, float* S, int64_t K, int64_t V, const float* q, const float* k, const float* v,
                float decay, float beta, float* kv, float* out, bool stream) {
  if (V % W) {  // a width no vector divides: plain loops
    for (int64_t j = 0; j < V; ++j) kv[j] = 0.f;
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) {
        S[i * V + j] = Sin[i * V + j] * decay;
        kv[j] += k[i] * S[i * V + j];
      }
    for (int64_t j = 0; j < V; ++j) {
      kv[j] = (v[j] - kv[j]) * beta;
      out[j] = 0.f;
    }
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) {
        S[i * V + j] += k[i] * kv[j];
        out[j] += q[i] * S[i * V + j];
      }
    return;
  }
  const DeltaTok d = {q, k, v, decay, beta, kv, out};
  delta_rows(Sin, S, K, V, 1, &d, nullptr, stream);  // one token: no state between, no scratch
}

// ---------------------------------------------------------------- attention over bf16 K/V
// scores s [G, n] of G query heads against key rows 0..n-1: bf16(bf16(q . k) * scaling)
#if QK_NATIVE_BF16
// lane i = the sum of v[i]'s 16 lanes: a transpose-and-add tree (15 adds for 16 sums instead of 16 reductions)
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// 32 bf16 values at p + d of a row of hd (a multiple of 16): the last 16 of an odd row padded with zeros
inline __m512bh row32(const uint16_t* p, int64_t d, int64_t hd) {
  return (__m512bh)(d + 32 <= hd ? _mm512_loadu_si512(p + d) : _mm512_maskz_loadu_epi16(0xFFFFu, p + d));
}

// keys j0..j1-1 of the scores of a row of n keys (s [G, n]); j0 a multiple of 16 (or past the batches): the keys
// are batched where a range over all n batches them (from key 0, up to n rounded down to R), so any split of 0..n
// at such points gives the same bits
template <int G>
void scores_range(const uint16_t* q, const uint16_t* k, int64_t j0, int64_t j1, int64_t n, int64_t hd, float scaling,
                  float* s) {
  constexpr int R = 16 / G;  // key rows per batch: 16 dot products reduced together
  const __m512 sc = _mm512_set1_ps(scaling);
  const int64_t batched = imin(j1, n / R * R);
  int64_t j = j0;
  for (; j + R <= batched; j += R) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 32) {
      __m512bh qv[G];
      for (int h = 0; h < G; ++h) qv[h] = row32(q + h * hd, d, hd);
      for (int r = 0; r < R; ++r) {
        const __m512bh kv = row32(k + (j + r) * hd, d, hd);
        for (int h = 0; h < G; ++h) acc[r * G + h] = _mm512_dpbf16_ps(acc[r * G + h], kv, qv[h]);
      }
    }
    float out[16];
    _mm512_storeu_ps(out, vround16(_mm512_mul_ps(vround16(reduce16(acc)), sc)));
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < G; ++h) s[h * n + j + r] = out[r * G + h];
  }
  for (; j < j1; ++j)
    for (int h = 0; h < G; ++h) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; d += 32)
        a = _mm512_dpbf16_ps(a, row32(k + j * hd, d, hd), row32(q + h * hd, d, hd));
      s[h * n + j] = through_bf16(through_bf16(_mm512_reduce_add_ps(a)) * scaling);
    }
}
#else
// bf16 widened to fp32: per key row, its W-wide pieces against the G query rows (each read once per row)
template <int G>
void scores_range(const uint16_t* q, const uint16_t* k, int64_t j0, int64_t j1, int64_t n, int64_t hd, float scaling,
                  float* s) {
  for (int64_t j = j0; j < j1; ++j) {
    vf acc[G];
    for (int h = 0; h < G; ++h) acc[h] = vzero();
    for (int64_t d = 0; d < hd; d += W) {
      const vf kv = vld16(k + j * hd + d);
      for (int h = 0; h < G; ++h) acc[h] = vfma(vld16(q + h * hd + d), kv, acc[h]);
    }
    for (int h = 0; h < G; ++h) s[h * n + j] = through_bf16(through_bf16(vsum(acc[h])) * scaling);
  }
}
#endif

// in place: each row of s [G, n] -> bf16(softmax) in fp32
void attend_softmax(float* s, int64_t g, int64_t n) {
  for (int64_t h = 0; h < g; ++h) {
    float* sh = s + h * n;
    // the max W lanes at a time (a NaN score ignored, as fmaxf ignores it: vmax keeps its second operand)
    vf mv = vset(-INFINITY);
    int64_t j = 0;
    for (; j + W <= n; j += W) mv = vmax(vld(sh + j), mv);
    float mx = vmaxr(mv);
    for (; j < n; ++j) mx = fmaxf(mx, sh[j]);
    float sum = 0.f;
    j = 0;
    for (; j + W <= n; j += W) {
      const vf e = vexp(vsub(vld(sh + j), vset(mx)));
      vst(sh + j, e);
      sum += vsum(e);
    }
    for (; j < n; ++j) {
      sh[j] = expf(sh[j] - mx);
      sum += sh[j];
    }
    const vf sv = vset(sum);
    for (j = 0; j + W <= n; j += W) vst(sh + j, vround16(vdiv(vld(sh + j), sv)));
    for (; j < n; ++j) sh[j] = through_bf16(sh[j] / sum);
  }
}

// acc [G, hd] = p [G, n] @ v [n, hd] in fp32, rows in order; blocks of 64 value rows stay in L1 while
// C chunks of W columns of the G outputs sit in registers
constexpr int64_t kSumRows = 64;

// acc [G, hd] += p [G, n] (columns j0..j1-1) @ v [j0..j1-1, hd], value rows in order
template <int G, int C>
void sum_block(const float* p, const uint16_t* v, int64_t n, int64_t j0, int64_t j1, int64_t hd, float* acc) {
  for (int64_t d = 0; d < hd; d += W * C) {
    vf a[G][C];
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < C; ++c) a[h][c] = vld(acc + h * hd + d + W * c);
    for (int64_t j = j0; j < j1; ++j) {
      vf vv[C];
      for (int c = 0; c < C; ++c) vv[c] = vld16(v + j * hd + d + W * c);
      for (int h = 0; h < G; ++h) {
        const vf w = vset(p[h * n + j]);
        for (int c = 0; c < C; ++c) a[h][c] = vfma(w, vv[c], a[h][c]);
      }
    }
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < C; ++c) vst(acc + h * hd + d + W * c, a[h][c]);
  }
}

// two chunks of W columns in registers where they and the G accumulators fit (32 zmm, 16 ymm)
template <int G>
bool sum_two(int64_t hd) {
  constexpr bool two = W == 16 ? G <= 8 : G <= 4;
  return two && hd % (2 * W) == 0;
}

// T rows of G query heads against one kv head, row t (q + t * qs [G, hd]) over keys 0..n0+t-1, out + t * os [G,
// hd]: each row's bits its own (T = 1) call's (its scores, softmax and value rows in the same order), but each
// block of keys and of values is read from memory once for the T rows. s holds T rows of G * (n0 + T - 1)
// scores, acc T rows of G * hd.
template <int G>
void attend_rows_group(int64_t T, const uint16_t* q, int64_t qs, const uint16_t* k, const uint16_t* v, int64_t n0,
                       int64_t hd, float scaling, float* s, float* acc, uint16_t* out, int64_t os) {
  constexpr int64_t kKeys = 64;  // keys per block: a multiple of 16 (scores_range's split points)
  const int64_t nl = n0 + T - 1, ss = G * nl;
  // row t has n0 + t keys: a block starting at j0 is read by the rows from max(0, j0 - n0 + 1) on
  for (int64_t j0 = 0; j0 < nl; j0 += kKeys)
    for (int64_t t = j0 < n0 ? 0 : j0 - n0 + 1; t < T; ++t)
      scores_range<G>(q + t * qs, k, j0, imin(j0 + kKeys, n0 + t), n0 + t, hd, scaling, s + t * ss);
  for (int64_t t = 0; t < T; ++t) {
    attend_softmax(s + t * ss, G, n0 + t);
    for (int64_t i = 0; i < G * hd; ++i) acc[t * G * hd + i] = 0.f;
  }
  const bool two = sum_two<G>(hd);
  for (int64_t j0 = 0; j0 < nl; j0 += kSumRows)
    for (int64_t t = j0 < n0 ? 0 : j0 - n0 + 1; t < T; ++t) {
      const int64_t n = n0 + t, j1 = imin(n, j0 + kSumRows);
      if (two) sum_block<G, 2>(s + t * ss, v, n, j0, j1, hd, acc + t * G * hd);
      else sum_block<G, 1>(s + t * ss, v, n, j0, j1, hd, acc + t * G * hd);
    }
  for (int64_t t = 0; t < T; ++t) to_bf16_row(acc + t * G * hd, G * hd, out + t * os);
}

// T rows of G query heads (1, 2, 4, 8 or 16) against one kv head (attend_rows_group), row t's at q + t * qs with
// n0 + t keys, its output at out + t * os
void attend_rows(int G, int64_t T, const uint16_t* q, int64_t qs, const uint16_t* k, const uint16_t* v, int64_t n0,
                 int64_t hd, float scaling, float* s, float* acc, uint16_t* out, int64_t os) {
  switch (G) {
#if QK_NATIVE_BF16
    case 16: attend_rows_group<16>(T, q, qs, k, v, n0, hd, scaling, s, acc, out, os); break;
#else
    case 16:  // sixteen accumulators do not fit the registers of the widening scores: two groups of 8
      attend_rows_group<8>(T, q, qs, k, v, n0, hd, scaling, s, acc, out, os);
      attend_rows_group<8>(T, q + 8 * hd, qs, k, v, n0, hd, scaling, s, acc, out + 8 * hd, os);
      break;
#endif
    case 8: attend_rows_group<8>(T, q, qs, k, v, n0, hd, scaling, s, acc, out, os); break;
    case 4: attend_rows_group<4>(T, q, qs, k, v, n0, hd, scaling, s, acc, out, os); break;
    case 2: attend_rows_group<2>(T, q, qs, k, v, n0, hd, scaling, s, acc, out, os); break;
    default: attend_rows_group<1>(T, q, qs, k, v, n0, hd, scaling, s, acc, out, os); break;
  }
}

// ---------------------------------------------------------------- a layer's elementwise ops (bf16 rows)
// sum of squares of n bf16 values, fp32
float sum_sq(const uint16_t* x, int64_t n) {
  vf acc = vzero();
  for (int64_t i = 0; i < n; i += W) {
    const vf v = ld16(x, n, i);
    acc = vadd(acc, vmul(v, v));
  }
  return vsum(acc);
}

// y = bf16((x * rsqrt(mean(x^2) + eps)) * scale): transformers' Qwen3_5MoeRMSNorm with (1 + w) precomputed
void rms_row(const uint16_t* x, int64_t n, const float* scale, float eps, uint16_t* y) {
  const float ms = sum_sq(x, n) / static_cast<float>(n);
  const vf r = vset(1.f / sqrtf(ms + eps));
  for (int64_t i = 0; i < n; i += W) st16(y, vmul(vmul(ld16(x, n, i), r), ld(scale, n, i)), n, i);
}

void add_bf16(const uint16_t* x, const uint16_t* a, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; i += W) st16(y, vadd(ld16(x, n, i), ld16(a, n, i)), n, i);
}

// bf16(bf16(silu(gate)) * up)
void silu_mul_bf16(const uint16_t* g, const uint16_t* u, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; i += W) st16(y, vmul(vround16(vsilu(ld16(g, n, i))), ld16(u, n, i)), n, i);
}

// p = e^(x - mx) of n bf16 values; returns their sum (lane sums, then across lanes)
float exp_shifted(const uint16_t* x, int64_t n, float mx, float* p) {
  vf acc = vzero();
  for (int64_t i = 0; i < n; i += W) {
    vf e = vexp(vsub(ld16(x, n, i), vset(mx)));
    if (n - i >= W) {
      vst(p + i, e);
    } else {
      vst_n(p + i, e, n - i);
      e = vld_n(p + i, n - i);  // the tail's lanes past n must not join the sum
    }
    acc = vadd(acc, e);
  }
  return vsum(acc);
}

// x + bf16(bf16(routed) + bf16(gate * shared)), gate = bf16(sigmoid(sg)) given
void moe_out(const uint16_t* x, const float* routed, const uint16_t* shared, float gate, int64_t n, uint16_t* y) {
  const vf gv = vset(gate);
  for (int64_t i = 0; i < n; i += W) {
    const vf blk = vround16(vadd(vround16(ld(routed, n, i)), vround16(vmul(gv, ld16(shared, n, i)))));
    st16(y, vadd(ld16(x, n, i), blk), n, i);
  }
}

// o = bf16(o * bf16(sigmoid(g))): the attention output's gate
void gate_mul(uint16_t* o, const uint16_t* g, int64_t n) {
  for (int64_t i = 0; i < n; i += W) st16(o, vmul(ld16(o, n, i), vround16(vsigmoid(ld16(g, n, i)))), n, i);
}

// ---------------------------------------------------------------- Gated DeltaNet layer
// conv window shifted by the new input, then out[c] = bf16(silu(sum_j window[j][c] * w[j][c])), taps in
// order, each product and sum rounded (torch's mul / add_ per tap)
void gdn_conv(const GdnArgs& g, uint16_t* out) {
  const int64_t K = g.taps, C = g.channels;
  memmove(g.conv, g.conv + C, (K - 1) * C * sizeof(uint16_t));
  memcpy(g.conv + (K - 1) * C, g.qkv, C * sizeof(uint16_t));
  for (int64_t c = 0; c < C; c += W) {
    vf acc = vmul(ld16(g.conv, C, c), ld(g.conv_w, C, c));
    for (int64_t j = 1; j < K; ++j) acc = vadd(acc, vmul(ld16(g.conv + j * C, C, c), ld(g.conv_w + j * C, C, c)));
    st16(out, vsilu(acc), C, c);
  }
}

// x * rsqrt(sum(x^2) + 1e-6) / div of one bf16 row into fp32 (the delta rule's q and k)
void l2norm_row(const uint16_t* x, int64_t n, float div, float* y) {
  const float ss = sum_sq(x, n);
  const vf r = vset(1.f / sqrtf(ss + 1e-6f)), dv = vset(div);
  for (int64_t i = 0; i < n; i += W) {
    vf v = vmul(ld16(x, n, i), r);
    if (div != 1.f) v = vdiv(v, dv);
    if (n - i >= W) vst(y + i, v); else vst_n(y + i, v, n - i);
  }
}

// one value head h of one token, before the state update: its q/k (of k-head h / (Hv/Hk)), v and gates, the
// vectors in scratch (2 * dk + 3 * dv floats: q, k, v, kv, o)
DeltaTok gdn_prep(const GdnArgs& g, const uint16_t* x, int64_t h, float* scratch) {
  float *q = scratch, *k = q + g.dk, *v = k + g.dk;
  DeltaTok d;
  d.q = q;
  d.k = k;
  d.v = v;
  d.kv = v + g.dv;
  d.out = d.kv + g.dv;
  const int64_t kh = h / (g.hv / g.hk), key_dim = g.hk * g.dk;
  l2norm_row(x + kh * g.dk, g.dk, sqrtf(static_cast<float>(g.dk)), q);
  l2norm_row(x + key_dim + kh * g.dk, g.dk, 1.f, k);
  const uint16_t* xv = x + 2 * key_dim + h * g.dv;
  for (int64_t i = 0; i < g.dv; ++i) v[i] = bf16_value(xv[i]);
  d.beta = through_bf16(sigmoid1(bf16_value(g.b[h])));
  const float sp = bf16_value(g.a[h]) + g.dt_bias[h];
  const float softplus = sp > 20.f ? sp : log1pf(expf(sp));
  d.decay = expf(g.neg_a[h] * softplus);
  return d;
}

// the gated RMSNorm of head h's update output o: y = bf16(o * rsqrt(mean(o^2) + eps)) with o rounded to bf16
// first; w * y (bf16 when w is); times silu(z) in fp32; rounded to bf16 (ob: dv bf16 scratch)
void gdn_post(const GdnArgs& g, int64_t h, const float* o, uint16_t* ob, uint16_t* out) {
  for (int64_t i = 0; i < g.dv; ++i) ob[i] = to_bf16(o[i]);
  const float ms = sum_sq(ob, g.dv) / static_cast<float>(g.dv);
  const vf r = vset(1.f / sqrtf(ms + g.eps));
  const uint16_t* zh = g.z + h * g.dv;
  for (int64_t i = 0; i < g.dv; i += W) {
    const vf y = vround16(vmul(ld16(ob, g.dv, i), r));
    vf wy = vmul(ld(g.norm_w, g.dv, i), y);
    if (g.norm_w_bf16) wy = vround16(wy);
    st16(out + h * g.dv, vmul(wy, vsilu(ld16(zh, g.dv, i))), g.dv, i);
  }
}

// one value head h: gdn_prep, the state update from s_in to s, gdn_post
void gdn_head(const GdnArgs& g, const uint16_t* x, int64_t h, const float* s_in, float* s, bool stream,
              float* scratch, uint16_t* ob, uint16_t* out) {
  const DeltaTok d = gdn_prep(g, x, h, scratch);
  delta_head(s_in, s, g.dk, g.dv, d.q, d.k, d.v, d.decay, d.beta, d.kv, d.out, stream);
  gdn_post(g, h, d.out, ob, out);
}

// gdn_head for t tokens of one head (g[j], x + j * g[0].channels and out[j] token j's; dv a multiple of 16), the
// states between in scratch only (t * (2 * dk + 3 * dv) + dk * kDeltaBlockCols floats)
void gdn_head_rows(const GdnArgs* g, int64_t t, const uint16_t* x, int64_t h, const float* s_in, float* s,
                   bool stream, float* scratch, uint16_t* ob, uint16_t* const* out) {
  const GdnArgs& g0 = g[0];
  const int64_t per = 2 * g0.dk + 3 * g0.dv;
  DeltaTok tok[kMaxDeltaRows];
  for (int64_t j = 0; j < t; ++j) tok[j] = gdn_prep(g[j], x + j * g0.channels, h, scratch + j * per);
  delta_rows(s_in, s, g0.dk, g0.dv, t, tok, scratch + t * per, stream);
  for (int64_t j = 0; j < t; ++j) gdn_post(g[j], h, tok[j].out, ob, out[j]);
}

// ---------------------------------------------------------------- gated attention layer
// rows [R, hd] bf16 -> RMSNorm with per-row scales [R, hd], then the rotary on the first `rot` dims:
// y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), as transformers' apply_rotary_pos_emb on bf16
void norm_rotate(const uint16_t* x, int64_t stride, int64_t rows, int64_t hd, const float* scale,
                 const uint16_t* cos, const uint16_t* sin, int64_t rot, float eps, uint16_t* nrm, uint16_t* y) {
  const int64_t half = rot / 2;
  for (int64_t r = 0; r < rows; ++r) {
    rms_row(x + r * stride, hd, scale + r * hd, eps, nrm);
    uint16_t* yr = y + r * hd;
    for (int64_t i = 0; i < rot; ++i) {
      const float xi = bf16_value(nrm[i]);
      const float other = i < half ? -bf16_value(nrm[i + half]) : bf16_value(nrm[i - half]);
      const float a = through_bf16(xi * bf16_value(cos[i])), b = through_bf16(other * bf16_value(sin[i]));
      yr[i] = to_bf16(a + b);
    }
    memcpy(yr + rot, nrm + rot, (hd - rot) * sizeof(uint16_t));
  }
}

// the bits of n floats as signed integers I: {max, min, max of the magnitude bits} (qk_step.cpp's argmax)
template <typename I, typename U>
void bit_range(const U* __restrict x, int64_t n, int32_t* out) {
  constexpr I kMax = static_cast<I>(static_cast<U>(~U(0)) >> 1), kMin = static_cast<I>(-kMax - 1);
  I mx = kMin, mn = kMax, ma = 0;
  for (int64_t i = 0; i < n; ++i) {
    const I v = static_cast<I>(x[i]), a = static_cast<I>(v & kMax);
    mx = mx > v ? mx : v;
    mn = mn < v ? mn : v;
    ma = ma > a ? ma : a;
  }
  out[0] = mx;
  out[1] = mn;
  out[2] = ma;
}

#if QK_TARGET == 0
#define QK_NAME "generic"
#define QK_LEVEL 0
#define QK_ENTRY qk_ops_generic
#elif QK_TARGET == 1
#define QK_NAME "avx2"
#define QK_LEVEL 1
#define QK_ENTRY qk_ops_avx2
#elif QK_TARGET == 2
#define QK_NAME "avx512"
#define QK_LEVEL 2
#define QK_ENTRY qk_ops_avx512
#elif QK_TARGET == 4
#define QK_NAME "avx2vnni"
#define QK_LEVEL 1
#define QK_ENTRY qk_ops_avx2vnni
#else
#define QK_NAME "avx512bf16"
#define QK_LEVEL 2
#define QK_ENTRY qk_ops_avx512bf16
#endif

// constant-initialised: loading the module runs none of this unit's code
constexpr qk::Ops kOps = {QK_NAME,    QK_LEVEL,  quantize_row, tile,     to_bf16_row, silu_mul32,
                          sum_f32,    delta_head, attend_rows, rms_row,  add_bf16,    silu_mul_bf16,
                          exp_shifted, moe_out,   gate_mul,    gdn_conv, gdn_head,    gdn_head_rows, norm_rotate,
                          qkq::int4_sym<uint16_t>, qkq::int4_sym<float>, qkq::int8_row, bit_range<int16_t, uint16_t>,
                          bit_range<int32_t, uint32_t>};

}  // namespace

extern "C" const qk::Ops* QK_ENTRY() { return &kOps; }
