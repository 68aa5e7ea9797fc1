// Throughput of the AVX2 instructions the int8 / int4 tiles use, in cycles per 256-bit instruction: 8
// independent chains per loop, timed with rdtsc against a chain of dependent vpaddd (one cycle each).
//   g++ -O2 -mavx2 -mfma benchmarks/zen1-avx2/tile-ab/ports.cpp -o /tmp/ports && /tmp/ports
#include <immintrin.h>
#include <x86intrin.h>
#include <cstdint>
#include <cstdio>

#define K(x) asm volatile("" : "+x"(x))
static double tsc_per_cycle;

template <class F>
double ticks(F f) {
  uint64_t best = ~0ull;
  for (int rep = 0; rep < 15; ++rep) {
    const uint64_t t = __rdtsc();
    f();
    const uint64_t e = __rdtsc() - t;
    if (e < best) best = e;
  }
  return static_cast<double>(best);
}

template <class F>
void run(const char* name, int per_iter, F f) {
  printf("%-22s %.2f cycles per instruction\n", name, ticks(f) / 1e6 / per_iter / tsc_per_cycle);
}

int main() {
  const __m256i b = _mm256_set1_epi8(3), one = _mm256_set1_epi16(1);
  const __m256 fb = _mm256_set1_ps(1.0001f);
  __m256i a0 = b, a1 = b, a2 = b, a3 = b, a4 = b, a5 = b, a6 = b, a7 = b;
  __m256 f0 = fb, f1 = fb, f2 = fb, f3 = fb;
  tsc_per_cycle = ticks([&] {
#define STEP a0 = _mm256_add_epi32(a0, b); K(a0);
    for (int i = 0; i < 1000000; ++i) { STEP STEP STEP STEP STEP STEP STEP STEP STEP STEP STEP STEP STEP STEP STEP STEP }
  }) / 16e6;
  printf("core clock %.2f x the TSC's\n", 1.0 / tsc_per_cycle);
#define EIGHT(op, y) \
  [&] { for (int i = 0; i < 1000000; ++i) { a0 = op(a0, y); a1 = op(a1, y); a2 = op(a2, y); a3 = op(a3, y); \
        a4 = op(a4, y); a5 = op(a5, y); a6 = op(a6, y); a7 = op(a7, y); \
        K(a0); K(a1); K(a2); K(a3); K(a4); K(a5); K(a6); K(a7); } }
  run("vpmaddubsw", 8, EIGHT(_mm256_maddubs_epi16, b));
  run("vpmaddwd", 8, EIGHT(_mm256_madd_epi16, one));
  run("vpsignb", 8, EIGHT(_mm256_sign_epi8, b));
  run("vpaddd", 8, EIGHT(_mm256_add_epi32, b));
  run("vpxor", 8, EIGHT(_mm256_xor_si256, b));
  run("maddubs4+madd4", 8, [&] {
    for (int i = 0; i < 1000000; ++i) {
      a0 = _mm256_maddubs_epi16(a0, b); a1 = _mm256_maddubs_epi16(a1, b);
      a2 = _mm256_maddubs_epi16(a2, b); a3 = _mm256_maddubs_epi16(a3, b);
      a4 = _mm256_madd_epi16(a4, one); a5 = _mm256_madd_epi16(a5, one);
      a6 = _mm256_madd_epi16(a6, one); a7 = _mm256_madd_epi16(a7, one);
      K(a0); K(a1); K(a2); K(a3); K(a4); K(a5); K(a6); K(a7);
    }
  });
  run("vmulps", 4, [&] {
    for (int i = 0; i < 1000000; ++i) {
      f0 = _mm256_mul_ps(f0, fb); f1 = _mm256_mul_ps(f1, fb); f2 = _mm256_mul_ps(f2, fb); f3 = _mm256_mul_ps(f3, fb);
      K(f0); K(f1); K(f2); K(f3);
    }
  });
  run("maddubs4+mulps4", 8, [&] {
    for (int i = 0; i < 1000000; ++i) {
      a0 = _mm256_maddubs_epi16(a0, b); a1 = _mm256_maddubs_epi16(a1, b);
      a2 = _mm256_maddubs_epi16(a2, b); a3 = _mm256_maddubs_epi16(a3, b);
      f0 = _mm256_mul_ps(f0, fb); f1 = _mm256_mul_ps(f1, fb); f2 = _mm256_mul_ps(f2, fb); f3 = _mm256_mul_ps(f3, fb);
      K(a0); K(a1); K(a2); K(a3); K(f0); K(f1); K(f2); K(f3);
    }
  });
  printf("(%d)\n", _mm256_extract_epi32(_mm256_add_epi32(a0, a7), 0) + static_cast<int>(_mm256_cvtss_f32(f0)));
}
