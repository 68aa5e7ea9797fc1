// quantkit's CPU kernels for 4-bit and 8-bit weights at decode batch sizes.
//
// Why our own: torch 2.13's `_weight_int4pack_mm_for_cpu` is compute-bound at batch 1 (25-37 GMAC/s on
// 2 threads, bf16 activations) and a MoE layer costs 16 such calls plus ~50 small ops from Python;
// kt-kernel's workers spin against torch's OpenMP pool (measured on the 2-core build machine). Here activations are
// quantized to int8 per block of 32 (one fp32 scale per block, as GGUF's Q8_0) and dotted against the
// stored codes with VNNI (`vpdpbusd`: u8 codes x s8 activations) or AVX2 (`vpmaddubsw`), on torch's own
// thread pool (at::parallel_for), and the k routed experts of a MoE layer run in one call.
//
// Weight layout (made once at load by quantkit/runtime/cpu_kernel.py; the stored formats are unchanged):
// rows in tiles of 16 (padded with zero-scale rows), K in blocks of 32.
// - int4: qw uint8 [NT, K/32, 4, 16, 4]: byte (t, b, c, r, i) holds code(16t+r, 32b+8c+i) in its low
//   nibble and code(16t+r, 32b+8c+4+i) in its high nibble; scales (and zeros, asymmetric) bf16
//   [NT, K/g, 16]; w = (q - 8) * scale + zero, quantkit's int4 convention.
// - int8: qw uint8 [NT, K/32, 8, 16, 4]: byte (t, b, c, r, i) = q(16t+r, 32b+4c+i) + 128; scales fp32
//   [NT*16]; w = q * scale.
// - bf16 (fmt 16): the stored row-major matrix as it is; 8 rows at a time dotted with bf16 activations by
//   AVX512-BF16 (`vdpbf16ps`, fp32 accumulation), only where the CPU has it.
// For one 16-row tile and one 32-block the 4 (int4) or 8 (int8) 64-byte rows are each one zmm: lane r
// holds 4 consecutive codes of row r, multiplied by the same 4 activation bytes broadcast to all lanes.
// The +8 / +128 offsets of the unsigned codes are removed with the block's activation sum.
//
// Beside the matrices: linear_many (a layer's projections of one input, quantized once, in one parallel
// region) and stream_sum (a plain streaming read, the benches' read-bandwidth probe). The lean decode
// step's other pieces are in qk_step.cpp.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qk_common.h"
#include "qk_cpu.h"
#include "qk_layers.h"
#include "qk_step.h"

namespace qk {

int g_isa = -1;  // 2: AVX512-VNNI, 1: AVX2+FMA, 0: none

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

int isa() {
  if (g_isa < 0) g_isa = detect_isa();
  return g_isa;
}

bool detect_bf16() {
  __builtin_cpu_init();
  return detect_isa() == 2 && __builtin_cpu_supports("avx512bf16");
}

bool g_bf16_off = false;  // QUANTKIT_NO_AVX512 turns the bf16 path off with the AVX512 one
bool bf16_ok() { return !g_bf16_off && isa() == 2 && detect_bf16(); }

}  // namespace qk

using namespace qk;

namespace {

// Software prefetch distance in bytes ahead of the bf16 rows' streams. 8 KiB beat 1-4 KiB (248k x 2048
// matrices, one and two threads, 4 KiB and 2 MiB pages, measured side by side on the 2-core build machine:
// +3-15%); further ahead gained nothing. The int4 and int8 tiles issue no prefetches and leave their
// streams to the hardware prefetcher: without them, the kernel alone out of cache read 1.06-1.10x (int4)
// and 1.13-1.19x (int8) faster, and bench decode's checkpoints decoded 1.08x (int4) and 1.20x (int8)
// faster (medians of 10-30 alternating rounds, both builds in one process, on the build machine).
constexpr int64_t kPrefetch = 8192;

struct QMat {
  const uint8_t* qw = nullptr;
  const void* scales = nullptr;   // int4: bf16 [NT, G, 16]; int8: fp32 [NT*16]
  const uint16_t* zeros = nullptr;  // int4 asymmetric: bf16 [NT, G, 16]
  int64_t fmt = 4;  // 4, 8 or 16 (bf16, row-major [n, k] at qw)
  int64_t group = 32;
  int64_t n = 0;  // real rows
  int64_t k = 0;  // columns (a multiple of 32)
  int64_t tiles() const { return (n + kTile - 1) / kTile; }
};

// One activation row quantized per block of 32: x ~ q * d; s = sum of the block's q; ds = d * s.
struct QAct {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  const float* ds;
  const uint16_t* xb;  // the same row in bf16 (for bf16 matrices)
};

struct QActBuf {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s;
  std::vector<uint16_t> xb;
  void resize(int64_t rows, int64_t k) {
    q.resize(rows * k);
    xb.resize(rows * k);
    d.resize(rows * k / kBlock);
    ds.resize(rows * k / kBlock);
    s.resize(rows * k / kBlock);
  }
  QAct row(int64_t r, int64_t k) const {
    const int64_t nb = k / kBlock;
    return {q.data() + r * k, d.data() + r * nb, s.data() + r * nb, ds.data() + r * nb, xb.data() + r * k};
  }
};

void quantize_row(const float* x, int64_t k, int8_t* q, float* d, int32_t* s, float* ds) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float dd = amax / 127.f;
    const float id = dd > 0.f ? 1.f / dd : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * id));
      q[b * kBlock + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = dd;
    s[b] = sum;
    ds[b] = dd * static_cast<float>(sum);
  }
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// x's values as contiguous fp32 without a torch op for the decode dtypes (an op costs a few microseconds,
// as much as a small matrix): fp32 as it is, bf16 widened into `buf` (exact), others through torch (`keep`)
const float* f32_values(const torch::Tensor& x, std::vector<float>& buf, torch::Tensor& keep) {
  if (x.scalar_type() == torch::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  if (x.scalar_type() == torch::kBFloat16 && x.is_contiguous()) {
    const int64_t n = x.numel();
    buf.resize(n);
    const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t i = 0; i < n; ++i) buf[i] = bf16_value(p[i]);
    return buf.data();
  }
  keep = x.to(torch::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// A result [rows, n] in bf16 for bf16 inputs (rounded as torch's .to(torch.bfloat16)), fp32 otherwise.
struct Result {
  torch::Tensor t;
  float* f = nullptr;
  uint16_t* h = nullptr;
  Result(int64_t rows, int64_t n, bool bf16) {
    t = torch::empty({rows, n}, bf16 ? torch::kBFloat16 : torch::kFloat);
    if (bf16) h = reinterpret_cast<uint16_t*>(t.data_ptr()); else f = t.data_ptr<float>();
  }
  void put(int64_t at, const float* v, int64_t count) const {
    if (h) to_bf16_row(v, count, h + at); else std::memcpy(f + at, v, count * sizeof(float));
  }
};


// out[r] = row r of w (row-major, k % 32 == 0) . x, for R rows
template <int R>
QK_BF16 void rows_bf16(const uint16_t* w, int64_t k, const uint16_t* x, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + j);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * k + j) + kPrefetch, _MM_HINT_T0);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * k + j), xv);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// a 16-row tile of a bf16 matrix (rows past n give 0)
void tile_bf16(const QMat& m, int64_t t, const QAct& a, float* out) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(m.qw);
  int64_t r = t * kTile;
  const int64_t end = std::min<int64_t>(r + kTile, m.n);
  float* o = out;
  for (; r + 8 <= end; r += 8, o += 8) rows_bf16<8>(w + r * m.k, m.k, a.xb, o);
  for (; r < end; ++r, ++o) rows_bf16<1>(w + r * m.k, m.k, a.xb, o);
  for (; o < out + kTile; ++o) *o = 0.f;
}

// One 32-block of a tile against MR activation rows: ga[r] += d_b * (codes . xq) as int32 -> fp32. The
// high nibbles are masked in place (0xF0, i.e. 16 x code) and their sum shifted right by 4 (exact: a
// multiple of 16); the +8 offset and the group's scale are applied once per group (tile_int4_avx512).
template <int MR>
QK_AVX512 __attribute__((always_inline)) inline void int4_block_avx512(const uint8_t* p, const QAct* a, int64_t b,
                                                                      __m512* ga) {
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
// the +8 offset (8 sum_b d_b s_b), times the group's scale, plus its zero times sum_b d_b s_b. Widening
// the scales and removing the offset once per group instead of once per block made bench decode's int4
// checkpoint decode 1.04x faster (median of 30 alternating rounds, both builds in one process, on the
// build machine). Sharing each activation broadcast between four tiles was 1.29x faster in cache but
// 0.9x out of it, so a tile is still computed on its own.
template <int MR>
QK_AVX512 void tile_int4_avx512(const QMat& m, int64_t t, const QAct* a, float* out) {
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
      int4_block_avx512<MR>(qw + b * 256, a, b, ga);
      for (int r = 0; r < MR; ++r) dss[r] += a[r].ds[b];
    }
    const __m512 s = bf16x16_avx512(sc + g * kTile);
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_sub_ps(ga[r], _mm512_set1_ps(8.f * dss[r])), s, acc[r]);
    if (zp) {
      const __m512 z = bf16x16_avx512(zp + g * kTile);
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(dss[r]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
}

template <int MR>
QK_AVX512 void tile_int8_avx512(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock;
  const uint8_t* qw = m.qw + t * nb * 512;
  __m512 fs[MR];
  for (int r = 0; r < MR; ++r) fs[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = qw + b * 512;
    __m512i w[8];
    for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(p + 64 * c);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = a[r].q + b * kBlock;
      __m512i i[4];
      for (int j = 0; j < 4; ++j)
        i[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
      for (int j = 0; j < 4; ++j)
        i[j] = _mm512_dpbusd_epi32(i[j], w[j + 4], _mm512_set1_epi32(load_i32(xq + 4 * j + 16)));
      __m512i is = _mm512_add_epi32(_mm512_add_epi32(i[0], i[1]), _mm512_add_epi32(i[2], i[3]));
      is = _mm512_sub_epi32(is, _mm512_set1_epi32(128 * a[r].s[b]));
      fs[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(a[r].d[b]), fs[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps(static_cast<const float*>(m.scales) + t * kTile);
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * kTile, _mm512_mul_ps(s, fs[r]));
}

// x ~ q * d per block of 32, rounding to nearest even like std::nearbyint (the scalar version's result)
QK_AVX512 void quantize_row_avx512(const float* x, int64_t k, int8_t* q, float* d, int32_t* s, float* ds) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * kBlock), x1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float dd = amax / 127.f;
    const __m512 id = _mm512_set1_ps(dd > 0.f ? 1.f / dd : 0.f);
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x0, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x1, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    d[b] = dd;
    s[b] = sum;
    ds[b] = dd * static_cast<float>(sum);
  }
}

// out[i] = silu(g[i]) * u[i] for 32 values
QK_AVX512 void silu_mul32_avx512(const float* g, const float* u, float* out) {
  for (int h = 0; h < 2; ++h) {
    _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(silu_avx512(_mm512_loadu_ps(g + 16 * h)), _mm512_loadu_ps(u + 16 * h)));
  }
}

// sum of n floats (n % 64 == 0) with four independent chains: a plain streaming read
QK_AVX512 double sum_f32_avx512(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// ---------------------------------------------------------------- AVX2 (+FMA)
#define QK_AVX2 __attribute__((target("avx2,fma")))

QK_AVX2 inline __m256 bf16x8_avx2(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The 16-row tile as two 8-row halves (the low and high 32 bytes of each 64-byte row of codes).
template <int MR>
QK_AVX2 void tile_int4_avx2(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock, bpg = m.group / kBlock, ng = m.k / m.group;
  const uint8_t* qw = m.qw + t * nb * 256;
  const uint16_t* sc = static_cast<const uint16_t*>(m.scales) + t * ng * kTile;
  const uint16_t* zp = m.zeros ? m.zeros + t * ng * kTile : nullptr;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m256 fs[MR];
      float zs[MR];
      for (int r = 0; r < MR; ++r) { fs[r] = _mm256_setzero_ps(); zs[r] = 0.f; }
      for (int64_t bb = 0; bb < bpg; ++bb) {
        const int64_t b = g * bpg + bb;
        const uint8_t* p = qw + b * 256 + 32 * h;
        // 16-bit sums: each vpmaddubsw lane is at most 2 * 15 * 127 and a block adds 8 of them (30480)
        __m256i s16[MR];
        for (int r = 0; r < MR; ++r) s16[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c));
          __m256i lo = _mm256_and_si256(v, mask);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
          for (int r = 0; r < MR; ++r) {
            const int8_t* xq = a[r].q + b * kBlock + 8 * c;
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xq))));
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xq + 4))));
          }
        }
        for (int r = 0; r < MR; ++r) {
          __m256i is = _mm256_sub_epi32(_mm256_madd_epi16(s16[r], ones), _mm256_set1_epi32(8 * a[r].s[b]));
          fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(a[r].d[b]), fs[r]);
          zs[r] += a[r].ds[b];
        }
      }
      const __m256 s = bf16x8_avx2(sc + g * kTile + 8 * h);
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(s, fs[r], acc[r]);
      if (zp) {
        const __m256 z = bf16x8_avx2(zp + g * kTile + 8 * h);
        for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(zs[r]), acc[r]);
      }
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * kTile + 8 * h, acc[r]);
  }
}

template <int MR>
QK_AVX2 void tile_int8_avx2(const QMat& m, int64_t t, const QAct* a, float* out) {
  const int64_t nb = m.k / kBlock;
  const uint8_t* qw = m.qw + t * nb * 512;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 fs[MR];
    for (int r = 0; r < MR; ++r) fs[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = qw + b * 512 + 32 * h;
      __m256i i32[MR];
      for (int r = 0; r < MR; ++r) i32[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        // back to the signed code, then |w| x sign(x, w): vpmaddubsw's u8 x s8 cannot overflow (2*128*127)
        __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c)), flip);
        __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < MR; ++r) {
          __m256i x = _mm256_set1_epi32(load_i32(a[r].q + b * kBlock + 4 * c));
          i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones));
        }
      }
      for (int r = 0; r < MR; ++r)
        fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[r]), _mm256_set1_ps(a[r].d[b]), fs[r]);
    }
    const __m256 s = _mm256_loadu_ps(static_cast<const float*>(m.scales) + t * kTile + 8 * h);
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * kTile + 8 * h, _mm256_mul_ps(s, fs[r]));
  }
}

// ---------------------------------------------------------------- dispatch

template <int MR>
void tile_mr(const QMat& m, int64_t t, const QAct* a, float* out) {
  if (isa() == 2) {
    if (m.fmt == 4) tile_int4_avx512<MR>(m, t, a, out); else tile_int8_avx512<MR>(m, t, a, out);
  } else {
    if (m.fmt == 4) tile_int4_avx2<MR>(m, t, a, out); else tile_int8_avx2<MR>(m, t, a, out);
  }
}

// rows of `a` in chunks of up to 4 (AVX2: 2, its 16 registers); out [rows][16]
void tile(const QMat& m, int64_t t, const QAct* a, int64_t rows, float* out) {
  if (m.fmt == 16) {
    for (int64_t r = 0; r < rows; ++r) tile_bf16(m, t, a[r], out + r * kTile);
    return;
  }
  const int64_t step = isa() == 2 ? 4 : 2;
  for (int64_t r = 0; r < rows; r += step) {
    const int64_t n = std::min(step, rows - r);
    switch (n) {
      case 1: tile_mr<1>(m, t, a + r, out + r * kTile); break;
      case 2: tile_mr<2>(m, t, a + r, out + r * kTile); break;
      case 3: tile_mr<3>(m, t, a + r, out + r * kTile); break;
      default: tile_mr<4>(m, t, a + r, out + r * kTile); break;
    }
  }
}

QMat mat_from(const torch::Tensor& qw, const torch::Tensor& scales, const c10::optional<torch::Tensor>& zeros,
              int64_t fmt, int64_t group, int64_t n, int64_t k) {
  TORCH_CHECK(fmt == 4 || fmt == 8, "qk: format must be 4 or 8");
  TORCH_CHECK(k % kBlock == 0 && k > 0, "qk: in_features must be a multiple of 32");
  TORCH_CHECK(fmt == 8 || (group % kBlock == 0 && k % group == 0 && ((group / kBlock) & (group / kBlock - 1)) == 0),
              "qk: the int4 group size must be 32 x a power of two dividing in_features");
  TORCH_CHECK(qw.is_contiguous() && qw.scalar_type() == torch::kUInt8, "qk: qw must be contiguous uint8");
  const int64_t nt = (n + kTile - 1) / kTile;
  TORCH_CHECK(qw.numel() == nt * k * (fmt == 4 ? 8 : 16), "qk: qw has the wrong size");
  QMat m;
  m.qw = qw.data_ptr<uint8_t>();
  if (fmt == 4) {
    TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && scales.is_contiguous() &&
                scales.numel() == nt * (k / group) * kTile, "qk: int4 scales must be bf16 [NT, G, 16]");
    if (zeros.has_value() && zeros->defined()) {
      TORCH_CHECK(zeros->scalar_type() == torch::kBFloat16 && zeros->is_contiguous() &&
                  zeros->numel() == scales.numel(), "qk: int4 zeros must match the scales");
      m.zeros = reinterpret_cast<const uint16_t*>(zeros->data_ptr());
    }
  } else {
    TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == nt * kTile,
                "qk: int8 scales must be fp32 [NT*16]");
  }
  m.scales = scales.data_ptr();
  m.fmt = fmt;
  m.group = fmt == 4 ? group : kBlock;
  m.n = n;
  m.k = k;
  return m;
}

// A matrix from one row of a descriptor table (QKernel / QBf16Kernel.descriptor() in kernels.py): qw or
// the bf16 weight, scales, zeros or 0 (pointers), format 4/8/16, group, n, k, 0
QMat mat_from_row(const int64_t* f) {
  QMat m;
  m.qw = reinterpret_cast<const uint8_t*>(f[0]);
  m.scales = reinterpret_cast<const void*>(f[1]);
  m.zeros = reinterpret_cast<const uint16_t*>(f[2]);
  m.fmt = f[3];
  m.group = f[3] == 4 ? f[4] : kBlock;
  m.n = f[5];
  m.k = f[6];
  return m;
}

void quantize_any(const float* x, int64_t k, int8_t* q, float* d, int32_t* s, float* ds) {
  if (isa() == 2) quantize_row_avx512(x, k, q, d, s, ds); else quantize_row(x, k, q, d, s, ds);
}

void silu_mul32(const float* g, const float* u, float* out) {
  if (isa() == 2) {
    silu_mul32_avx512(g, u, out);
    return;
  }
  for (int i = 0; i < kBlock; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// Tiles per thread at least: a parallel region costs a few microseconds (a fork and a barrier), so
// small matrices (in_proj_a/b: 2 tiles) run on the calling thread. `work`: bytes read (x rows) per tile.
int64_t grain(int64_t work) { return std::max<int64_t>(1, (int64_t{64} << 10) / std::max<int64_t>(work, 1)); }

void quantize_rows(const float* x, int64_t rows, int64_t k, QActBuf& buf, bool want_bf16 = false) {
  buf.resize(rows, k);
  const int64_t nb = k / kBlock;
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      quantize_any(x + r * k, k, buf.q.data() + r * k, buf.d.data() + r * nb, buf.s.data() + r * nb,
                   buf.ds.data() + r * nb);
      if (want_bf16) to_bf16_row(x + r * k, k, buf.xb.data() + r * k);
    }
  });
}

}  // namespace

int64_t qk_isa() { return isa(); }
int64_t qk_detect_isa() { return detect_isa(); }
void qk_set_isa(int64_t level) {
  TORCH_CHECK(level >= 1 && level <= detect_isa(), "qk: this CPU does not have that instruction set");
  g_isa = static_cast<int>(level);
}
bool qk_has_bf16() { return bf16_ok(); }
void qk_set_bf16(bool on) {
  TORCH_CHECK(!on || (isa() == 2 && detect_bf16()), "qk: this CPU has no AVX512-BF16");
  g_bf16_off = !on;
}

// y [M, N] = x [M, K] @ W^T for a row-major bf16 W (decode batch sizes; prefill stays with torch);
// y is bf16 for a bf16 x, fp32 otherwise
torch::Tensor qk_linear_bf16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(bf16_ok(), "qk: no AVX512-BF16 on this CPU");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() &&
              x.size(1) == w.size(1) && w.size(1) % kBlock == 0, "qk_linear_bf16: x [M, K], w bf16 [N, K], K % 32 == 0");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  torch::Tensor xb = x.to(torch::kBFloat16).contiguous();
  QMat m;
  m.qw = reinterpret_cast<const uint8_t*>(w.data_ptr());
  m.fmt = 16;
  m.n = n;
  m.k = k;
  std::vector<QAct> acts(rows);
  for (int64_t r = 0; r < rows; ++r)
    acts[r].xb = reinterpret_cast<const uint16_t*>(xb.data_ptr()) + r * k;
  const Result y(rows, n, x.scalar_type() == torch::kBFloat16);
  at::parallel_for(0, m.tiles(), grain(m.k * 2 * kTile * rows), [&](int64_t lo, int64_t hi) {
    float tmp[kTile];
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t valid = std::min<int64_t>(kTile, n - t * kTile);
      for (int64_t r = 0; r < rows; ++r) {
        tile_bf16(m, t, acts[r], tmp);
        y.put(r * n + t * kTile, tmp, valid);
      }
    }
  });
  return y.t;
}

// y [M, N] = x [M, K] @ W^T; y is bf16 for a bf16 x, fp32 otherwise
torch::Tensor qk_linear(torch::Tensor x, torch::Tensor qw, torch::Tensor scales, c10::optional<torch::Tensor> zeros,
                        int64_t fmt, int64_t group, int64_t n) {
  TORCH_CHECK(isa() > 0, "qk: no AVX2/AVX512-VNNI on this CPU");
  TORCH_CHECK(x.dim() == 2, "qk_linear: x must be [M, K]");
  const int64_t rows = x.size(0), k = x.size(1);
  QMat m = mat_from(qw, scales, zeros, fmt, group, n, k);
  std::vector<float> xbuf;
  torch::Tensor keep;
  const float* xf = f32_values(x, xbuf, keep);
  QActBuf buf;
  quantize_rows(xf, rows, k, buf);
  std::vector<QAct> acts(rows);
  for (int64_t r = 0; r < rows; ++r) acts[r] = buf.row(r, k);
  const Result y(rows, n, x.scalar_type() == torch::kBFloat16);
  const int64_t nt = m.tiles();
  // rows of x in chunks of 64 so a tile's codes are read from memory once per chunk, not once per row
  constexpr int64_t kChunk = 64;
  at::parallel_for(0, nt, grain(m.k * (m.fmt == 4 ? 8 : 16) * std::min<int64_t>(rows, kChunk)), [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(std::min(rows, kChunk) * kTile);
    for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
      const int64_t nr = std::min(kChunk, rows - r0);
      for (int64_t t = lo; t < hi; ++t) {
        tile(m, t, acts.data() + r0, nr, tmp.data());
        const int64_t valid = std::min<int64_t>(kTile, n - t * kTile);
        for (int64_t r = 0; r < nr; ++r) y.put((r0 + r) * n + t * kTile, tmp.data() + r * kTile, valid);
      }
    }
  });
  return y.t;
}

// Several matrices on one input x [M, K] (a layer's projections of the same hidden state): x is widened
// and quantized once and one parallel region runs every matrix's tiles, each tile exactly as `linear` /
// `linear_bf16` computes it. `table` int64 [P, 8]: per matrix (qw or bf16 weight ptr, scales ptr, zeros ptr
// or 0, fmt 4/8/16, group, n, k, 0), from tensors cpu_kernel.py's callers keep alive. Returns the P
// outputs [M, n], bf16 for a bf16 x, fp32 otherwise.
std::vector<torch::Tensor> qk_linear_many(torch::Tensor x, torch::Tensor table) {
  TORCH_CHECK(isa() > 0, "qk: no AVX2/AVX512-VNNI on this CPU");
  TORCH_CHECK(x.dim() == 2, "qk_linear_many: x must be [M, K]");
  TORCH_CHECK(table.scalar_type() == torch::kLong && table.dim() == 2 && table.size(1) == 8 && table.is_contiguous() &&
              table.size(0) > 0, "qk_linear_many: table must be int64 [P, 8]");
  const int64_t rows = x.size(0), k = x.size(1), np = table.size(0);
  std::vector<QMat> mats(np);
  std::vector<int64_t> first(np + 1, 0);
  bool want16 = false;
  int64_t bytes = 0;
  for (int64_t p = 0; p < np; ++p) {
    const int64_t* f = table.data_ptr<int64_t>() + p * 8;
    TORCH_CHECK(f[0] != 0 && (f[3] == 4 || f[3] == 8 || f[3] == 16) && f[5] > 0 && f[6] == k,
                "qk_linear_many: matrix ", p, " does not take this input");
    TORCH_CHECK(f[3] != 16 || bf16_ok(), "qk_linear_many: bf16 matrices need AVX512-BF16");
    const QMat& m = mats[p] = mat_from_row(f);
    want16 = want16 || m.fmt == 16;
    first[p + 1] = first[p] + m.tiles();
    bytes += m.n * m.k * (m.fmt == 4 ? 1 : m.fmt == 8 ? 2 : 4) / 2;
  }
  TORCH_CHECK(k % kBlock == 0, "qk_linear_many: in_features must be a multiple of 32");
  std::vector<float> xbuf;
  torch::Tensor keep;
  const float* xf = f32_values(x, xbuf, keep);
  QActBuf buf;
  quantize_rows(xf, rows, k, buf, want16);
  std::vector<QAct> acts(rows);
  for (int64_t r = 0; r < rows; ++r) acts[r] = buf.row(r, k);
  const bool bf = x.scalar_type() == torch::kBFloat16;
  std::vector<Result> outs;
  outs.reserve(np);
  for (int64_t p = 0; p < np; ++p) outs.emplace_back(rows, mats[p].n, bf);
  const int64_t total = first[np];
  at::parallel_for(0, total, grain(bytes / std::max<int64_t>(total, 1) * rows), [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(rows * kTile);
    int64_t p = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
    for (int64_t i = lo; i < hi; ++i) {
      while (i >= first[p + 1]) ++p;
      const QMat& m = mats[p];
      const int64_t t = i - first[p], valid = std::min<int64_t>(kTile, m.n - t * kTile);
      tile(m, t, acts.data(), rows, tmp.data());
      for (int64_t r = 0; r < rows; ++r) outs[p].put(r * m.n + t * kTile, tmp.data() + r * kTile, valid);
    }
  });
  std::vector<torch::Tensor> ys;
  for (auto& o : outs) ys.push_back(o.t);
  return ys;
}

// One token through k routed experts: y [H] fp32 = sum_slot w[slot] * down_e(silu(gate_e(x)) * up_e(x)).
// `table` int64 [E, 2, 8]: per expert, gate_up then down, each (qw ptr, scales ptr, zeros ptr or 0, fmt,
// group, n, k, 0), filled by cpu_kernel.py from tensors it keeps alive. Slots are summed in slot order.
torch::Tensor qk_moe(torch::Tensor x, torch::Tensor table, torch::Tensor ids, torch::Tensor wts) {
  TORCH_CHECK(isa() > 0, "qk: no AVX2/AVX512-VNNI on this CPU");
  TORCH_CHECK(table.scalar_type() == torch::kLong && table.dim() == 3 && table.size(1) == 2 && table.size(2) == 8 &&
              table.is_contiguous(), "qk_moe: table must be int64 [E, 2, 8]");
  const bool ids_ok = ids.scalar_type() == torch::kLong && ids.is_contiguous();
  const bool wts_ok = wts.scalar_type() == torch::kFloat && wts.is_contiguous();
  torch::Tensor idc = ids_ok ? ids : ids.to(torch::kLong).contiguous();
  torch::Tensor wc = wts_ok ? wts : wts.to(torch::kFloat).contiguous();
  const int64_t ns = idc.numel();
  TORCH_CHECK(wc.numel() == ns && ns > 0, "qk_moe: ids and weights differ in length");
  const int64_t* tb = table.data_ptr<int64_t>();
  std::vector<QMat> gu(ns), dn(ns);
  for (int64_t s = 0; s < ns; ++s) {
    const int64_t e = idc.data_ptr<int64_t>()[s];
    TORCH_CHECK(e >= 0 && e < table.size(0), "qk_moe: expert id out of range");
    for (int j = 0; j < 2; ++j) {
      const int64_t* f = tb + (e * 2 + j) * 8;
      TORCH_CHECK(f[0] != 0, "qk_moe: expert ", e, " has no fused kernel");
      const QMat& m = (j == 0 ? gu[s] : dn[s]) = mat_from_row(f);
      TORCH_CHECK(m.fmt != 16 || bf16_ok(), "qk_moe: bf16 experts need AVX512-BF16");
    }
  }
  std::vector<float> xbuf;
  torch::Tensor keep;
  const float* xf = f32_values(x, xbuf, keep);
  const int64_t hdim = x.numel(), inter = dn[0].k;
  for (int64_t s = 0; s < ns; ++s)
    TORCH_CHECK(gu[s].k == hdim && gu[s].n == 2 * inter && dn[s].k == inter && dn[s].n == hdim,
                "qk_moe: expert shapes do not match the hidden size");
  bool gu16 = false, dn16 = false;
  for (int64_t s = 0; s < ns; ++s) {
    gu16 = gu16 || gu[s].fmt == 16;
    dn16 = dn16 || dn[s].fmt == 16;
  }
  QActBuf xa;
  quantize_rows(xf, 1, hdim, xa, gu16);
  const QAct x0 = xa.row(0, hdim);
  // gate_up, SiLU x up and the int8 blocks of the result in one pass. A work item is a run of `run` tiles
  // of one expert's gate rows and the matching run of its up rows; the SiLU x up values it makes are
  // quantized per 32. The longer the runs, the less the read switches between the gate and up streams:
  // whole experts per item read 1.14x faster than runs of 2 tiles (one MoE layer, top-8 of 64, weights out
  // of cache, 60 interleaved A/B rounds on the build machine; same sums). Runs halve until every thread
  // has two items.
  TORCH_CHECK(inter % kBlock == 0, "qk_moe: the expert width must be a multiple of 32");
  const int64_t nj = inter / kBlock, ntg = inter / kTile;
  int64_t run = ntg;
  while (run % 4 == 0 && ns * (ntg / run) < 2 * at::get_num_threads()) run /= 2;
  const int64_t nrun = ntg / run;
  QActBuf aa;
  aa.resize(ns, inter);
  at::parallel_for(0, ns * nrun, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> h(2 * run * kTile);
    float act[kBlock];
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t s = i / nrun, j = i % nrun;
      for (int64_t r = 0; r < run; ++r) tile(gu[s], run * j + r, &x0, 1, h.data() + r * kTile);
      for (int64_t r = 0; r < run; ++r) tile(gu[s], ntg + run * j + r, &x0, 1, h.data() + (run + r) * kTile);
      for (int64_t c = 0; c < run / 2; ++c) {
        silu_mul32(h.data() + c * kBlock, h.data() + run * kTile + c * kBlock, act);
        const int64_t b = s * nj + j * (run / 2) + c;
        quantize_any(act, kBlock, aa.q.data() + b * kBlock, aa.d.data() + b, aa.s.data() + b, aa.ds.data() + b);
        if (dn16) to_bf16_row(act, kBlock, aa.xb.data() + b * kBlock);
      }
    }
  });
  std::vector<QAct> acts(ns);
  for (int64_t s = 0; s < ns; ++s) acts[s] = aa.row(s, inter);
  torch::Tensor y = torch::empty({hdim}, torch::kFloat);
  float* yp = y.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const int64_t nt2 = dn[0].tiles();
  // each thread owns a run of output tiles and reads each expert's rows of that run as one stream (its
  // tiles are contiguous), expert after expert: 4 KB per tile and expert, so a tile-outer loop hopped
  // between k streams and read 35% slower (measured on the build machine)
  at::parallel_for(0, nt2, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc((hi - lo) * kTile, 0.f);
    float tmp[kTile];
    for (int64_t s = 0; s < ns; ++s)
      for (int64_t t = lo; t < hi; ++t) {
        tile(dn[s], t, &acts[s], 1, tmp);
        float* a = acc.data() + (t - lo) * kTile;
        for (int r = 0; r < kTile; ++r) a[r] += wp[s] * tmp[r];
      }
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t valid = std::min<int64_t>(kTile, hdim - t * kTile);
      std::memcpy(yp + t * kTile, acc.data() + (t - lo) * kTile, valid * sizeof(float));
    }
  });
  return y;
}

// Sum of an fp32 tensor, read once at full speed on torch's pool: what the benches time as the machine's
// read bandwidth (torch's own sum reads 30-50% slower on the build machine, so it understated the bound).
double qk_stream_sum(torch::Tensor x) {
  TORCH_CHECK(isa() == 2, "qk: the streaming read needs AVX512");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.numel() % 64 == 0,
              "qk_stream_sum: x must be contiguous fp32 with a multiple of 64 elements");
  const float* p = x.data_ptr<float>();
  constexpr int64_t kSpan = 1 << 16;  // floats per work item
  const int64_t items = (x.numel() + kSpan - 1) / kSpan;
  return at::parallel_reduce(0, items, 1, 0.0, [&](int64_t lo, int64_t hi, double acc) {
    for (int64_t i = lo; i < hi; ++i)
      acc += sum_f32_avx512(p + i * kSpan, std::min(kSpan, x.numel() - i * kSpan));
    return acc;
  }, std::plus<double>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("attend", &qk_attend, "one decode token's attention over a layer's K/V buffers (bf16)");
  mod.def("rms", &qk_rms, "RMSNorm of bf16 rows with the (1 + w) multiplier precomputed");
  mod.def("add_rms", &qk_add_rms, "a residual add and the next RMSNorm: (x + a, rms(x + a))");
  mod.def("silu_mul", &qk_silu_mul, "bf16(bf16(silu(gate)) * up)");
  mod.def("route", &qk_route, "softmax, top-k and renormalisation of a router's logits: (weights, ids)");
  mod.def("moe_out", &qk_moe_out, "x + routed + sigmoid(sg) * shared, a MoE block's output on the residual");
  mod.def("gdn_step", &qk_gdn_step, "a Gated DeltaNet layer between its projections, one token");
  mod.def("attn_step", &qk_attn_step, "a gated attention layer between its projections, one token");
  mod.def("delta_step", &qk_delta_step, "one token of the gated delta rule, state updated in place");
  mod.def("stream_sum", &qk_stream_sum, "sum of an fp32 tensor at streaming speed (the read-bandwidth probe)");
  mod.def("isa", &qk_isa, "the instruction set in use: 2 AVX512-VNNI, 1 AVX2, 0 none");
  mod.def("detect_isa", &qk_detect_isa, "the best instruction set this CPU has");
  mod.def("set_isa", &qk_set_isa, "use a lower instruction set (tests, QUANTKIT_NO_AVX512)");
  mod.def("linear", &qk_linear, "y [M, N] fp32 = x [M, K] @ W^T from repacked int4/int8 tiles");
  mod.def("linear_many", &qk_linear_many, "several matrices on one input: one quantization, one parallel region");
  mod.def("moe", &qk_moe, "one token through k routed experts in one call");
  mod.def("has_bf16", &qk_has_bf16, "whether the bf16 path (AVX512-BF16) is in use");
  mod.def("set_bf16", &qk_set_bf16, "turn the bf16 path off (or back on)");
  mod.def("linear_bf16", &qk_linear_bf16, "y [M, N] fp32 = x [M, K] @ W^T, W row-major bf16");
  qk_bind_layers(mod);
}
