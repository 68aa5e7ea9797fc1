// Shared by quantkit's CPU kernel sources (qk_cpu.cpp: the matrices; qk_step.cpp: the decode step's
// other pieces): the tile constants, the instruction-set switches and the bf16 and exp helpers.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define QK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define QK_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma")))

namespace qk {

constexpr int kTile = 16;
constexpr int kBlock = 32;

// The instruction set in use (2 AVX512-VNNI, 1 AVX2+FMA, 0 none; lowered by set_isa) and whether the
// AVX512-BF16 path is on: defined in qk_cpu.cpp.
int isa();
bool bf16_ok();

// fp32 -> bf16, round to nearest even (NaN kept a NaN), as torch's .to(torch.bfloat16)
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline void to_bf16_row(const float* x, int64_t k, uint16_t* out) {
  for (int64_t i = 0; i < k; ++i) out[i] = to_bf16(x[i]);
}

// bf16 -> fp32 of one value (exact)
inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float through_bf16(float f) { return bf16_value(to_bf16(f)); }

QK_AVX512 inline __m512 bf16x16_avx512(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x for x <= 0 .. moderate: 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5], degree-6 polynomial (rel. error
// ~2e-7), scaled by vscalefps (which saturates to 0 / inf instead of wrapping)
QK_AVX512 inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // ln 2 * frac
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// x * sigmoid(x) as x / (1 + e^-x), fp32 (torch's silu before its bf16 rounding)
QK_AVX512 inline __m512 silu_avx512(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

}  // namespace qk
