// The quantizer's kernels (formats/int4.py, formats/int8.py): bf16 (int4: or fp32) rows in, stored parts and
// error sums out, one pass per group. Part of every op-table unit (qk_ops_impl.h includes this file under the
// unit's -m flags), in GCC/Clang vector extensions of 8 floats (SSE pairs in the generic unit, ymm registers
// above), so every table computes the same IEEE operations in the same order and writes the same bytes
// (-ffp-contract=off: no fused multiply-adds).
//
// Why our own: torch's route takes some 30 passes over each chunk for int4's clip search, plus a separate
// bf16 -> fp32 copy and an fp32 norm for the error figures; here the scale search runs on eight groups at once.
//
// The bytes are formats/int4.py's and formats/int8.py's (tests/kernels/test_quant_kernel.py holds them equal on every
// table this CPU runs):
// - int4: base = -m / 8 for the group's value m of largest magnitude (the first such value in index order,
//   which only matters for the sign of an all-zero group's scale); candidates bf16(base * f) for f in 1 and the
//   grid, each scored by s^2 * sum (round(clamp(x * (1/s), -8, 7)) - x * (1/s))^2 summed in 8 lanes, each in
//   turn, then pairwise (int4.py's _lane_sum); the first least error wins; codes round(clamp(x / s)) + 8.
// - int8: s = bf16(max |x| / 127), codes round(clamp(x * (1/s), -127, 127)).
// Rounding is to nearest even by adding and subtracting 1.5 * 2^23 (exact for |t| <= 2^22).
#include <string.h>

#include "qk_bf16.h"

namespace {
namespace qkq {  // apart from the op units' own vector helpers

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));

constexpr int kMaxVec = 16;  // group 128 = 16 vectors of 8

inline v8f splat(float f) { return v8f{f, f, f, f, f, f, f, f}; }

inline v8f load_bf16(const uint16_t* p) {
  v8h h;
  memcpy(&h, p, sizeof h);
  return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

inline v8f load8(const uint16_t* p) { return load_bf16(p); }

inline v8f load8(const float* p) {
  v8f f;
  memcpy(&f, p, sizeof f);
  return f;
}

inline v8f vmin(v8f a, v8f b) { return b < a ? b : a; }
inline v8f vmax(v8f a, v8f b) { return b > a ? b : a; }
inline v8f clamp(v8f t, float lo, float hi) { return t < lo ? splat(lo) : (t > hi ? splat(hi) : t); }
inline v8f round_even(v8f t) { return (t + 12582912.f) - 12582912.f; }

// ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)): addition commutes exactly, so the swapped halves give it
inline float tree8(v8f a) {
  const v8f b = a + __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6);
  const v8f c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1, 6, 7, 4, 5);
  const v8f d = c + __builtin_shufflevector(c, c, 4, 5, 6, 7, 0, 1, 2, 3);
  return d[0];
}

inline float hmin(v8f a) {
  a = vmin(a, __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3));
  a = vmin(a, __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5));
  a = vmin(a, __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6));
  return a[0];
}

inline float hmax(v8f a) {
  a = vmax(a, __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3));
  a = vmax(a, __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5));
  a = vmax(a, __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6));
  return a[0];
}

// 16 codes 0..15 (two vectors of floats) -> 8 bytes, element 2j in the low nibble of byte j
inline void pack16(v8f a, v8f b, uint8_t* out) {
  const v8f lo = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
  const v8f hi = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
  const v8b bytes = __builtin_convertvector(__builtin_convertvector(lo + hi * 16.f, v8i), v8b);
  memcpy(out, &bytes, 8);
}

// 8 vectors -> one vector whose lane j is tree8(a[j]), by the same additions in the same order
inline v8f even(v8f a, v8f b) { return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14); }
inline v8f odd(v8f a, v8f b) { return __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15); }

inline v8f tree8x8(const v8f* a) {
  v8f u[4], w[2];
  for (int p = 0; p < 4; ++p) u[p] = even(a[2 * p], a[2 * p + 1]) + odd(a[2 * p], a[2 * p + 1]);
  for (int p = 0; p < 2; ++p) w[p] = even(u[2 * p], u[2 * p + 1]) + odd(u[2 * p], u[2 * p + 1]);
  return even(w[0], w[1]) + odd(w[0], w[1]);
}

template <bool kMax>
inline v8f extreme8x8(const v8f* a) {  // lane j: the min (max) of a[j]'s lanes
  v8f u[4], w[2];
  auto f = [](v8f x, v8f y) { return kMax ? vmax(x, y) : vmin(x, y); };
  for (int p = 0; p < 4; ++p) u[p] = f(even(a[2 * p], a[2 * p + 1]), odd(a[2 * p], a[2 * p + 1]));
  for (int p = 0; p < 2; ++p) w[p] = f(even(u[2 * p], u[2 * p + 1]), odd(u[2 * p], u[2 * p + 1]));
  return f(even(w[0], w[1]), odd(w[0], w[1]));
}

inline v8u to_bf16_bits(v8f f) {  // to_bf16 lane by lane
  const v8u u = (v8u)f;
  const v8u nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? ((u >> 16) | 0x40u) : ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline v8f clamp_code(v8f t) {  // t < -8 ? -8 : (t > 7 ? 7 : t), as min/max instructions
  const v8f u = splat(7.f) < t ? splat(7.f) : t;
  return splat(-8.f) > u ? splat(-8.f) : u;
}

// Eight groups of g (g / 8 vectors each) at x, one after another: their codes, scales and sums. The scale
// search runs on all eight at once, lane j for group j. T: uint16_t (bf16 bits) or float.
template <typename T>
void int4_block8(const T* x, int n, const float* grid, int ngrid, uint8_t* packed, uint16_t* scales,
                 double* err_total, double* ref_total) {
  v8f v[8 * kMaxVec], sq[8], lo[8], hi[8];
  for (int j = 0; j < 8; ++j) {
    const T* xg = x + j * 8 * n;
    v8f s = splat(0.f);
    for (int i = 0; i < n; ++i) {
      const v8f a = load8(xg + 8 * i);
      v[j * n + i] = a;
      s += a * a;  // bf16 squares are exact in fp32 (fp32 ones rounded: the reference sum is a figure only)
    }
    sq[j] = s;
    v8f l = v[j * n], h = v[j * n];
    for (int i = 1; i < n; ++i) {
      l = vmin(l, v[j * n + i]);
      h = vmax(h, v[j * n + i]);
    }
    lo[j] = l;
    hi[j] = h;
  }
  // min and max keep the earlier operand on ties, vector by vector and lane by lane, so an all-zero group's
  // max is its first element, whose sign the scale takes, as int4.py's and the decode kernel's scans have it
  const v8f mn = extreme8x8<false>(lo), mx = extreme8x8<true>(hi);
  const v8f base = (mx >= -mn ? mx : mn) * -0.125f;
  v8f best_err = splat(0.f), best_inv = splat(0.f);
  v8u best_s = (v8u)best_err;
  for (int c = 0; c <= ngrid; ++c) {
    const v8u sb = to_bf16_bits(base * (c ? grid[c - 1] : 1.f));
    const v8f s = (v8f)(sb << 16);
    const v8f inv = s != 0.f ? 1.f / s : splat(0.f);
    float inv_a[8];
    memcpy(inv_a, &inv, sizeof inv_a);
    v8f acc[8];
    for (int j = 0; j < 8; ++j) {
      const v8f vinv = splat(inv_a[j]);
      v8f a = splat(0.f);
      for (int i = 0; i < n; ++i) {
        const v8f t = v[j * n + i] * vinv;
        const v8f d = round_even(clamp_code(t)) - t;
        a += d * d;
      }
      acc[j] = a;
    }
    const v8f e = tree8x8(acc) * (s * s);
    const auto better = c == 0 ? (e == e) | (e != e) : e < best_err;
    best_err = better ? e : best_err;
    best_s = better ? sb : best_s;
    best_inv = better ? inv : best_inv;
  }
  const v8f ref = tree8x8(sq);
  float inv_a[8];
  memcpy(inv_a, &best_inv, sizeof inv_a);
  for (int j = 0; j < 8; ++j) {
    scales[j] = static_cast<uint16_t>(best_s[j]);
    *err_total += best_err[j];
    *ref_total += ref[j];
    const v8f vinv = splat(inv_a[j]);
    uint8_t* pj = packed + j * 4 * n;
    for (int i = 0; i < n; i += 2) {
      const v8f a = round_even(clamp_code(v[j * n + i] * vinv)) + 8.f;
      const v8f b = round_even(clamp_code(v[j * n + i + 1] * vinv)) + 8.f;
      pack16(a, b, pj + 4 * i);
    }
  }
}

template <typename T>
void int4_sym(const T* x, int64_t rows, int64_t k, int64_t g, const float* grid, int ngrid,
              uint8_t* packed, uint16_t* scales, double* sums) {
  // rows are contiguous and k % g == 0, so group q of the chunk starts at x + q * g
  const int n = static_cast<int>(g / 8);
  const int64_t groups = rows * (k / g);
  double err_total = 0.0, ref_total = 0.0;
  int64_t q = 0;
  for (; q + 8 <= groups; q += 8)
    int4_block8(x + q * g, n, grid, ngrid, packed + q * (g / 2), scales + q, &err_total, &ref_total);
  if (q < groups) {  // the last few groups, through zero-padded copies (zero groups add nothing to the sums)
    T xt[8 * 8 * kMaxVec] = {0};
    uint16_t st[8];
    uint8_t pt[8 * 4 * kMaxVec];
    memcpy(xt, x + q * g, (groups - q) * g * sizeof(T));
    int4_block8(xt, n, grid, ngrid, pt, st, &err_total, &ref_total);
    memcpy(packed + q * (g / 2), pt, (groups - q) * (g / 2));
    memcpy(scales + q, st, (groups - q) * sizeof(uint16_t));
  }
  sums[0] += err_total;
  sums[1] += ref_total;
}

void int8_row(const uint16_t* x, int64_t rows, int64_t k, int8_t* q, uint16_t* scales, double* sums) {
  const v8u abs_mask = {0x7FFFFFFFu, 0x7FFFFFFFu, 0x7FFFFFFFu, 0x7FFFFFFFu,
                        0x7FFFFFFFu, 0x7FFFFFFFu, 0x7FFFFFFFu, 0x7FFFFFFFu};
  double err_total = 0.0, ref_total = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * k;
    v8f amax = splat(0.f), sq = splat(0.f);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      const v8f a = load_bf16(xr + i);
      amax = vmax(amax, (v8f)((v8u)a & abs_mask));
      sq += a * a;
    }
    float m = hmax(amax), ref = tree8(sq);
    for (; i < k; ++i) {
      const float a = bf16_value(xr[i]);
      const float b = a < 0.f ? -a : a;
      m = b > m ? b : m;
      ref += a * a;
    }
    const uint16_t sb = to_bf16(m / 127.f);
    const float s = bf16_value(sb), inv = s > 0.f ? 1.f / s : 0.f;
    scales[r] = sb;
    const v8f vinv = splat(inv);
    v8f acc = splat(0.f);
    int8_t* qr = q + r * k;
    for (i = 0; i + 8 <= k; i += 8) {
      const v8f t = load_bf16(xr + i) * vinv;
      const v8f c = round_even(clamp(t, -127.f, 127.f));
      const v8f d = c - t;
      acc += d * d;
      typedef int8_t v8s __attribute__((vector_size(8)));
      const v8s b = __builtin_convertvector(__builtin_convertvector(c, v8i), v8s);
      memcpy(qr + i, &b, 8);
    }
    float e = tree8(acc);
    for (; i < k; ++i) {
      const float t = bf16_value(xr[i]) * inv;
      float c = t < -127.f ? -127.f : (t > 127.f ? 127.f : t);
      c = (c + 12582912.f) - 12582912.f;
      e += (c - t) * (c - t);
      qr[i] = static_cast<int8_t>(c);
    }
    err_total += static_cast<double>(e) * s * s;
    ref_total += ref;
  }
  sums[0] += err_total;
  sums[1] += ref_total;
}

}  // namespace qkq
}  // namespace
