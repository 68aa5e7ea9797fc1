// The decode step's pieces besides the matrices, for quantkit's lean batch-1 step
// (runtime/decode_step.py). Each replaces a run of small torch ops: an op costs a few microseconds of
// dispatch on a CPU, as much as reading a small matrix, and a Qwen3.5-MoE layer ran about forty of them
// (the per-layer overhead in reports/bench-decode.md, measured with every matrix stubbed).
// - delta_step: the Gated DeltaNet state update of one token (torch: six ops, four passes over the state);
// - attend (AVX512-BF16): one token's attention over the cached K/V;
// - rms, add_rms, silu_mul, route, moe_out: a layer's norms, the shared expert's activation, the router's
//   softmax / top-k / renormalisation and the MoE block's sum with the residual;
// - gdn_step: a Gated DeltaNet layer between its input and output projections (conv window, SiLU, gates,
//   q/k l2-norm, state update, gated RMSNorm);
// - attn_step (AVX512-BF16): a gated attention layer between its projections (q/k RMSNorm, rotary, the
//   K/V write, attention, sigmoid gate).
// They keep the torch route's dtypes and roundings (bf16 activations rounded where torch rounds them, fp32
// norms, gates and state); sums run in another order and exp / sigmoid / SiLU use exp_avx512, so results
// differ from torch's in the last fp32 bit and, through a bf16 rounding, now and then in one bf16 step
// (tests/test_decode_step.py states the bounds).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qk_common.h"
#include "qk_step.h"

// a * b + c must stay two roundings where the torch route has two (its conv taps, its norms): no FMA
// contraction in this file; the deliberate FMAs are written as _mm512_fmadd_ps
#pragma GCC optimize("fp-contract=off")

using namespace qk;

namespace {

uint16_t* bf16_ptr(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// One head of the gated delta rule for one token, state S [K, V] fp32 updated in place:
// S *= decay; kv = k^T S; S += k (beta (v - kv))^T; out = q^T S. Two passes over S (the second from L2).
QK_AVX512 void delta_head_avx512(float* S, int64_t K, int64_t V, const float* q, const float* k, const float* v,
                                 float decay, float beta, float* kv, float* out) {
  const __m512 dv = _mm512_set1_ps(decay);
  for (int64_t j = 0; j < V; j += 16) _mm512_storeu_ps(kv + j, _mm512_setzero_ps());
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V;
    const __m512 ki = _mm512_set1_ps(k[i]);
    for (int64_t j = 0; j < V; j += 16) {
      const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(row + j), dv);
      _mm512_storeu_ps(row + j, sv);
      _mm512_storeu_ps(kv + j, _mm512_fmadd_ps(ki, sv, _mm512_loadu_ps(kv + j)));
    }
  }
  const __m512 bv = _mm512_set1_ps(beta);
  for (int64_t j = 0; j < V; j += 16) {
    _mm512_storeu_ps(kv + j, _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + j), _mm512_loadu_ps(kv + j)), bv));
    _mm512_storeu_ps(out + j, _mm512_setzero_ps());
  }
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V;
    const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
    for (int64_t j = 0; j < V; j += 16) {
      const __m512 sv = _mm512_fmadd_ps(ki, _mm512_loadu_ps(kv + j), _mm512_loadu_ps(row + j));
      _mm512_storeu_ps(row + j, sv);
      _mm512_storeu_ps(out + j, _mm512_fmadd_ps(qi, sv, _mm512_loadu_ps(out + j)));
    }
  }
}

void delta_head(float* S, int64_t K, int64_t V, const float* q, const float* k, const float* v, float decay,
                float beta, float* kv, float* out) {
  for (int64_t j = 0; j < V; ++j) kv[j] = 0.f;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) {
      S[i * V + j] *= decay;
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
}

// one head of the delta rule on the widest path this CPU and V allow
void delta_head_any(float* S, int64_t K, int64_t V, const float* q, const float* k, const float* v, float decay,
                    float beta, float* kv, float* out) {
  if (isa() == 2 && V % 16 == 0) delta_head_avx512(S, K, V, q, k, v, decay, beta, kv, out);
  else delta_head(S, K, V, q, k, v, decay, beta, kv, out);
}

// 1 / (1 + e^-x) of one value in fp32 (torch's sigmoid, before its bf16 rounding)
inline float sigmoid1(float x) { return 1.f / (1.f + std::exp(-x)); }

// lane i = the sum of v[i]'s 16 lanes: a transpose-and-add tree (15 adds for 16 sums instead of 16 reductions)
QK_BF16 inline __m512 reduce16(const __m512* v) {
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

// 16 fp32 values rounded through bf16 (nearest even, as to_bf16; a NaN stays a NaN)
QK_AVX512 inline __m512 through_bf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))),
                           _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(r);
}

// 32 bf16 values at p + d of a row of hd (a multiple of 16): the last 16 of an odd row padded with zeros
QK_BF16 inline __m512bh row32(const uint16_t* p, int64_t d, int64_t hd) {
  return (__m512bh)(d + 32 <= hd ? _mm512_loadu_si512(p + d) : _mm512_maskz_loadu_epi16(0xFFFFu, p + d));
}

// scores s [G, n] of G query heads against key rows 0..n-1: bf16(bf16(q . k) * scaling)
template <int G>
QK_BF16 void attend_scores(const uint16_t* q, const uint16_t* k, int64_t n, int64_t hd, float scaling, float* s) {
  constexpr int R = 16 / G;  // key rows per batch: 16 dot products reduced together
  const __m512 sc = _mm512_set1_ps(scaling);
  int64_t j = 0;
  for (; j + R <= n; j += R) {
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
    _mm512_storeu_ps(out, through_bf16x16(_mm512_mul_ps(through_bf16x16(reduce16(acc)), sc)));
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < G; ++h) s[h * n + j + r] = out[r * G + h];
  }
  for (; j < n; ++j)
    for (int h = 0; h < G; ++h) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; d += 32)
        a = _mm512_dpbf16_ps(a, row32(k + j * hd, d, hd), row32(q + h * hd, d, hd));
      s[h * n + j] = through_bf16(through_bf16(_mm512_reduce_add_ps(a)) * scaling);
    }
}

// in place: each row of s [G, n] -> bf16(softmax) in fp32
QK_BF16 void attend_softmax(float* s, int64_t g, int64_t n) {
  for (int64_t h = 0; h < g; ++h) {
    float* sh = s + h * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::fmax(mx, sh[j]);
    float sum = 0.f;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(sh + j), _mm512_set1_ps(mx)));
      _mm512_storeu_ps(sh + j, e);
      sum += _mm512_reduce_add_ps(e);
    }
    for (; j < n; ++j) {
      sh[j] = std::exp(sh[j] - mx);
      sum += sh[j];
    }
    const __m512 sv = _mm512_set1_ps(sum);
    for (j = 0; j + 16 <= n; j += 16)
      _mm512_storeu_ps(sh + j, through_bf16x16(_mm512_div_ps(_mm512_loadu_ps(sh + j), sv)));
    for (; j < n; ++j) sh[j] = through_bf16(sh[j] / sum);
  }
}

// acc [G, hd] = p [G, n] @ v [n, hd] in fp32, rows in order; blocks of 64 value rows stay in L1 while
// C chunks of 16 columns of the G outputs sit in registers
template <int G, int C>
QK_BF16 void attend_sum(const float* p, const uint16_t* v, int64_t n, int64_t hd, float* acc) {
  constexpr int64_t kRows = 64;
  for (int64_t i = 0; i < G * hd; ++i) acc[i] = 0.f;
  for (int64_t j0 = 0; j0 < n; j0 += kRows) {
    const int64_t j1 = std::min(n, j0 + kRows);
    for (int64_t d = 0; d < hd; d += 16 * C) {
      __m512 a[G][C];
      for (int h = 0; h < G; ++h)
        for (int c = 0; c < C; ++c) a[h][c] = _mm512_loadu_ps(acc + h * hd + d + 16 * c);
      for (int64_t j = j0; j < j1; ++j) {
        __m512 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = bf16x16_avx512(v + j * hd + d + 16 * c);
        for (int h = 0; h < G; ++h) {
          const __m512 w = _mm512_set1_ps(p[h * n + j]);
          for (int c = 0; c < C; ++c) a[h][c] = _mm512_fmadd_ps(w, vv[c], a[h][c]);
        }
      }
      for (int h = 0; h < G; ++h)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + h * hd + d + 16 * c, a[h][c]);
    }
  }
}

// One kv head of a decode token's attention (see qk_attend): G query heads q [G, hd] against rows 0..n-1
// of k and v [cap, hd]; out [G, hd] bf16. s: scratch of G * n floats, acc of G * hd.
template <int G>
QK_BF16 void attend_head(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t n, int64_t hd,
                         float scaling, float* s, float* acc, uint16_t* out) {
  attend_scores<G>(q, k, n, hd, scaling, s);
  attend_softmax(s, G, n);
  if (G <= 8 && hd % 32 == 0) attend_sum<G, 2>(s, v, n, hd, acc); else attend_sum<G, 1>(s, v, n, hd, acc);
  to_bf16_row(acc, G * hd, out);
}

// ---------------------------------------------------------------- elementwise, 16 lanes, masked tails
QK_AVX512 inline __mmask16 lanes(int64_t n, int64_t i) {
  return n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
}

QK_AVX512 inline __m512 ld16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

QK_AVX512 inline __m512 ld32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

// store rounded to bf16 (nearest even, as torch's .to(torch.bfloat16))
QK_AVX512 inline void st16(uint16_t* p, __m512 x, __mmask16 m) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(through_bf16x16(x)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

// x rounded through bf16, as a torch op on bf16 tensors rounds its fp32 result
QK_AVX512 inline __m512 rb(__m512 x) { return through_bf16x16(x); }

QK_AVX512 inline __m512 sigmoid16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// sum of squares of n bf16 values, fp32
QK_AVX512 inline float sum_sq(const uint16_t* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = ld16(x + i, lanes(n, i));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  return _mm512_reduce_add_ps(acc);
}

// y = bf16((x * rsqrt(mean(x^2) + eps)) * scale): transformers' Qwen3_5MoeRMSNorm with (1 + w) precomputed
QK_AVX512 void rms_row(const uint16_t* x, int64_t n, const float* scale, float eps, uint16_t* y) {
  const float ms = sum_sq(x, n) / static_cast<float>(n);
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(ms + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n, i);
    st16(y + i, _mm512_mul_ps(_mm512_mul_ps(ld16(x + i, m), r), ld32(scale + i, m)), m);
  }
}

// ---------------------------------------------------------------- Gated DeltaNet layer
struct GdnArgs {
  const uint16_t *qkv, *z, *b, *a;
  uint16_t* conv;  // [K, C] bf16, oldest tap first
  const float *conv_w, *neg_a, *dt_bias, *norm_w;
  bool norm_w_bf16;
  float* state;  // [Hv, Dk, Dv]
  int64_t taps, channels, hk, hv, dk, dv;
  float eps;
};

// conv window shifted by the new input, then out[c] = bf16(silu(sum_j window[j][c] * w[j][c])), taps in
// order, each product and sum rounded (torch's mul / add_ per tap)
QK_AVX512 void gdn_conv(const GdnArgs& g, uint16_t* out) {
  const int64_t K = g.taps, C = g.channels;
  std::memmove(g.conv, g.conv + C, (K - 1) * C * sizeof(uint16_t));
  std::memcpy(g.conv + (K - 1) * C, g.qkv, C * sizeof(uint16_t));
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = lanes(C, c);
    __m512 acc = _mm512_mul_ps(ld16(g.conv + c, m), ld32(g.conv_w + c, m));
    for (int64_t j = 1; j < K; ++j)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(ld16(g.conv + j * C + c, m), ld32(g.conv_w + j * C + c, m)));
    st16(out + c, silu_avx512(acc), m);
  }
}

// x * rsqrt(sum(x^2) + 1e-6) / div of one bf16 row into fp32 (the delta rule's q and k)
QK_AVX512 void l2norm_row(const uint16_t* x, int64_t n, float div, float* y) {
  const float ss = sum_sq(x, n);
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(ss + 1e-6f)), dv = _mm512_set1_ps(div);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n, i);
    __m512 v = _mm512_mul_ps(ld16(x + i, m), r);
    if (div != 1.f) v = _mm512_div_ps(v, dv);
    _mm512_mask_storeu_ps(y + i, m, v);
  }
}

// one value head h: its q/k (of k-head h / (Hv/Hk)), v, gates, the state update, the gated RMSNorm
QK_AVX512 void gdn_head(const GdnArgs& g, const uint16_t* x, int64_t h, float* q, float* k, float* v, float* kv,
                        float* o, uint16_t* ob, uint16_t* out) {
  const int64_t kh = h / (g.hv / g.hk), key_dim = g.hk * g.dk;
  l2norm_row(x + kh * g.dk, g.dk, std::sqrt(static_cast<float>(g.dk)), q);
  l2norm_row(x + key_dim + kh * g.dk, g.dk, 1.f, k);
  const uint16_t* xv = x + 2 * key_dim + h * g.dv;
  for (int64_t i = 0; i < g.dv; ++i) v[i] = bf16_value(xv[i]);
  const float beta = through_bf16(sigmoid1(bf16_value(g.b[h])));
  const float sp = bf16_value(g.a[h]) + g.dt_bias[h];
  const float softplus = sp > 20.f ? sp : std::log1p(std::exp(sp));
  const float decay = std::exp(g.neg_a[h] * softplus);
  float* S = g.state + h * g.dk * g.dv;
  delta_head_any(S, g.dk, g.dv, q, k, v, decay, beta, kv, o);
  // gated RMSNorm: y = bf16(o * rsqrt(mean(o^2) + eps)) with o rounded to bf16 first; w * y (bf16 when w
  // is); times silu(z) in fp32; rounded to bf16
  for (int64_t i = 0; i < g.dv; ++i) ob[i] = to_bf16(o[i]);
  const float ms = sum_sq(ob, g.dv) / static_cast<float>(g.dv);
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(ms + g.eps));
  const uint16_t* zh = g.z + h * g.dv;
  for (int64_t i = 0; i < g.dv; i += 16) {
    const __mmask16 m = lanes(g.dv, i);
    const __m512 y = rb(_mm512_mul_ps(ld16(ob + i, m), r));
    __m512 wy = _mm512_mul_ps(ld32(g.norm_w + i, m), y);
    if (g.norm_w_bf16) wy = rb(wy);
    st16(out + h * g.dv + i, _mm512_mul_ps(wy, silu_avx512(ld16(zh + i, m))), m);
  }
}

// ---------------------------------------------------------------- gated attention layer
// rows [R, hd] bf16 -> RMSNorm with per-row scales [R, hd], then the rotary on the first `rot` dims:
// y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), as transformers' apply_rotary_pos_emb on bf16
QK_AVX512 void norm_rotate(const uint16_t* x, int64_t stride, int64_t rows, int64_t hd, const float* scale,
                           const uint16_t* cos, const uint16_t* sin, int64_t rot, float eps, uint16_t* y) {
  std::vector<uint16_t> nrm(hd);
  const int64_t half = rot / 2;
  for (int64_t r = 0; r < rows; ++r) {
    rms_row(x + r * stride, hd, scale + r * hd, eps, nrm.data());
    uint16_t* yr = y + r * hd;
    for (int64_t i = 0; i < rot; ++i) {
      const float xi = bf16_value(nrm[i]);
      const float other = i < half ? -bf16_value(nrm[i + half]) : bf16_value(nrm[i - half]);
      const float a = through_bf16(xi * bf16_value(cos[i])), b = through_bf16(other * bf16_value(sin[i]));
      yr[i] = to_bf16(a + b);
    }
    std::memcpy(yr + rot, nrm.data() + rot, (hd - rot) * sizeof(uint16_t));
  }
}

// heads query rows q [heads, hd] against rows 0..n-1 of keys and values [kv, cap, hd] (all bf16) into
// out [heads, hd] bf16; threads split the kv heads
void attend_heads(const uint16_t* qp, const uint16_t* kp, const uint16_t* vp, int64_t heads, int64_t kv, int64_t cap,
                  int64_t hd, int64_t n, float sc, uint16_t* op) {
  const int64_t g = heads / kv;
  // query heads per kv head in groups of G (16, 8, 4, 2 or 1: the widest dividing g)
  const int64_t G = g % 16 == 0 ? 16 : g % 8 == 0 ? 8 : g % 4 == 0 ? 4 : g % 2 == 0 ? 2 : 1;
  at::parallel_for(0, kv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s(G * n), acc(G * hd);
    for (int64_t h = lo; h < hi; ++h)
      for (int64_t q0 = h * g; q0 < (h + 1) * g; q0 += G) {
        const uint16_t *qh = qp + q0 * hd, *kh = kp + h * cap * hd, *vh = vp + h * cap * hd;
        uint16_t* oh = op + q0 * hd;
        switch (G) {
          case 16: attend_head<16>(qh, kh, vh, n, hd, sc, s.data(), acc.data(), oh); break;
          case 8: attend_head<8>(qh, kh, vh, n, hd, sc, s.data(), acc.data(), oh); break;
          case 4: attend_head<4>(qh, kh, vh, n, hd, sc, s.data(), acc.data(), oh); break;
          case 2: attend_head<2>(qh, kh, vh, n, hd, sc, s.data(), acc.data(), oh); break;
          default: attend_head<1>(qh, kh, vh, n, hd, sc, s.data(), acc.data(), oh); break;
        }
      }
  });
}

}  // namespace

// The gated delta rule for one token over H heads (runtime/linear_attn.py): q, k [H, K] (normalised,
// q scaled, heads already repeated), v [H, V], decay = exp(g) and beta [H], all fp32; state [H, K, V] fp32
// updated in place; returns out [H, V] fp32. torch's route (mul_, bmm, addcmul_, bmm) passes over the
// 2 MB state of a real layer four times and costs six ops; this reads and writes it once.
torch::Tensor qk_delta_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor decay,
                            torch::Tensor beta, torch::Tensor state) {
  TORCH_CHECK(state.scalar_type() == torch::kFloat && state.is_contiguous() && state.dim() == 3,
              "qk_delta_step: state must be contiguous fp32 [H, K, V]");
  const int64_t H = state.size(0), K = state.size(1), V = state.size(2);
  for (const torch::Tensor* t : {&q, &k, &v, &decay, &beta})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous(), "qk_delta_step: inputs must be contiguous fp32");
  TORCH_CHECK(q.numel() == H * K && k.numel() == H * K && v.numel() == H * V && decay.numel() == H &&
              beta.numel() == H, "qk_delta_step: shapes do not match the state");
  torch::Tensor out = torch::empty({H, V}, torch::kFloat);
  float* sp = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> kv(V);
    for (int64_t h = lo; h < hi; ++h)
      delta_head_any(sp + h * K * V, K, V, qp + h * K, kp + h * K, vp + h * V, dp[h], bp[h], kv.data(), op + h * V);
  });
  return out;
}

// One decode token's attention over the first n positions of a layer's K/V buffers: q [heads, hd] bf16,
// keys and values [kv, cap, hd] bf16 (contiguous), query heads h*g .. h*g+g-1 on kv head h. The roundings
// of the torch route it replaces (runtime/decode_step.attend, transformers' eager attention): scores
// rounded to bf16, scaled in bf16, softmax in fp32 rounded to bf16, the weighted sum in fp32 rounded to
// bf16; only the order of the fp32 sums and the exp differ. Each key and value row is read from memory
// once for its g query heads. Returns [heads, hd] bf16. Threads split the kv heads.
torch::Tensor qk_attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t n, double scaling) {
  TORCH_CHECK(bf16_ok(), "qk_attend: needs AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && keys.scalar_type() == torch::kBFloat16 &&
              values.scalar_type() == torch::kBFloat16 && q.is_contiguous() && keys.is_contiguous() &&
              values.is_contiguous() && q.dim() == 2 && keys.dim() == 3 && keys.sizes() == values.sizes(),
              "qk_attend: q [heads, hd], keys and values [kv, cap, hd], contiguous bf16");
  const int64_t heads = q.size(0), hd = q.size(1), kv = keys.size(0), cap = keys.size(1);
  TORCH_CHECK(keys.size(2) == hd && hd % 16 == 0 && kv > 0 && heads % kv == 0 && n >= 1 && n <= cap,
              "qk_attend: shapes do not fit (head_dim a multiple of 16, 1 <= n <= capacity)");
  torch::Tensor out = torch::empty({heads, hd}, torch::kBFloat16);
  attend_heads(bf16_ptr(q), bf16_ptr(keys), bf16_ptr(values), heads, kv, cap, hd, n, static_cast<float>(scaling),
               bf16_ptr(out));
  return out;
}

// ---------------------------------------------------------------- the lean step's fused pieces
namespace {

void check_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.device().is_cpu(), what,
              " must be a contiguous bf16 CPU tensor");
}

void check_f32(const torch::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == numel, what,
              " must be contiguous fp32 with ", numel, " values");
}

void check_avx512() { TORCH_CHECK(isa() == 2, "qk: the fused decode-step ops need AVX512"); }

}  // namespace

// transformers' Qwen3_5MoeRMSNorm of each row of x [.., H] (bf16) with its (1 + w) multiplier `scale` fp32 [H]
QK_AVX512 torch::Tensor qk_rms(torch::Tensor x, torch::Tensor scale, double eps) {
  check_avx512();
  check_bf16(x, "qk_rms: x");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  check_f32(scale, h, "qk_rms: scale");
  torch::Tensor y = torch::empty_like(x);
  for (int64_t r = 0; r < rows; ++r)
    rms_row(bf16_ptr(x) + r * h, h, scale.data_ptr<float>(), static_cast<float>(eps), bf16_ptr(y) + r * h);
  return y;
}

// (s, rms(s)) for s = x + a (one residual add rounded to bf16, then the next norm): both [1, H] bf16
QK_AVX512 std::vector<torch::Tensor> qk_add_rms(torch::Tensor x, torch::Tensor a, torch::Tensor scale, double eps) {
  check_avx512();
  check_bf16(x, "qk_add_rms: x");
  check_bf16(a, "qk_add_rms: a");
  const int64_t h = x.numel();
  TORCH_CHECK(a.numel() == h, "qk_add_rms: x and a differ in size");
  check_f32(scale, h, "qk_add_rms: scale");
  torch::Tensor s = torch::empty_like(x), y = torch::empty_like(x);
  uint16_t *sp = bf16_ptr(s), *xp = bf16_ptr(x), *ap = bf16_ptr(a);
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = lanes(h, i);
    st16(sp + i, _mm512_add_ps(ld16(xp + i, m), ld16(ap + i, m)), m);
  }
  rms_row(sp, h, scale.data_ptr<float>(), static_cast<float>(eps), bf16_ptr(y));
  return {s, y};
}

// bf16(bf16(silu(gate)) * up): the shared expert's activation (F.silu(gate) * up on bf16 tensors)
QK_AVX512 torch::Tensor qk_silu_mul(torch::Tensor gate, torch::Tensor up) {
  check_avx512();
  check_bf16(gate, "qk_silu_mul: gate");
  check_bf16(up, "qk_silu_mul: up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "qk_silu_mul: gate and up differ in shape");
  torch::Tensor y = torch::empty_like(gate);
  const int64_t n = gate.numel();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n, i);
    st16(bf16_ptr(y) + i, _mm512_mul_ps(rb(silu_avx512(ld16(bf16_ptr(gate) + i, m))), ld16(bf16_ptr(up) + i, m)), m);
  }
  return y;
}

// transformers' Qwen3_5MoeTopKRouter after its linear: softmax over the experts in fp32, the k largest
// (largest first, the lower id first on a tie), renormalised to sum 1, rounded to the logits' bf16.
// Returns (weights fp32 [k], ids int64 [k]).
QK_AVX512 std::vector<torch::Tensor> qk_route(torch::Tensor logits, int64_t k) {
  check_avx512();
  check_bf16(logits, "qk_route: logits");
  const int64_t e = logits.numel();
  TORCH_CHECK(k >= 1 && k <= e, "qk_route: top_k must be in 1..", e);
  std::vector<float> p(e);
  const uint16_t* lp = bf16_ptr(logits);
  float mx = -INFINITY;
  for (int64_t i = 0; i < e; ++i) mx = std::fmax(mx, bf16_value(lp[i]));
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < e; i += 16) {
    const __mmask16 m = lanes(e, i);
    const __m512 ex = _mm512_maskz_mov_ps(m, exp_avx512(_mm512_sub_ps(ld16(lp + i, m), _mm512_set1_ps(mx))));
    _mm512_mask_storeu_ps(p.data() + i, m, ex);
    acc = _mm512_add_ps(acc, ex);
  }
  const float sum = _mm512_reduce_add_ps(acc);
  for (int64_t i = 0; i < e; ++i) p[i] /= sum;
  std::vector<int64_t> order(e);
  for (int64_t i = 0; i < e; ++i) order[i] = i;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  torch::Tensor w = torch::empty({k}, torch::kFloat), ids = torch::empty({k}, torch::kLong);
  float top = 0.f;
  for (int64_t j = 0; j < k; ++j) top += p[order[j]];
  for (int64_t j = 0; j < k; ++j) {
    w.data_ptr<float>()[j] = through_bf16(p[order[j]] / top);
    ids.data_ptr<int64_t>()[j] = order[j];
  }
  return {w, ids};
}

// x + bf16(bf16(routed) + bf16(bf16(sigmoid(sg)) * shared)): a MoE block's output added to the residual
// stream; x, shared [1, H] bf16, routed fp32 [H] (qk.moe's sum), sg [1, 1] bf16 (the shared expert's gate)
QK_AVX512 torch::Tensor qk_moe_out(torch::Tensor x, torch::Tensor routed, torch::Tensor shared, torch::Tensor sg) {
  check_avx512();
  check_bf16(x, "qk_moe_out: x");
  check_bf16(shared, "qk_moe_out: shared");
  check_bf16(sg, "qk_moe_out: sg");
  const int64_t h = x.numel();
  check_f32(routed, h, "qk_moe_out: routed");
  TORCH_CHECK(shared.numel() == h && sg.numel() == 1, "qk_moe_out: shapes do not match");
  const float gate = through_bf16(sigmoid1(bf16_value(bf16_ptr(sg)[0])));
  const __m512 gv = _mm512_set1_ps(gate);
  torch::Tensor y = torch::empty_like(x);
  const float* rp = routed.data_ptr<float>();
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = lanes(h, i);
    const __m512 blk = rb(_mm512_add_ps(rb(ld32(rp + i, m)), rb(_mm512_mul_ps(gv, ld16(bf16_ptr(shared) + i, m)))));
    st16(bf16_ptr(y) + i, _mm512_add_ps(ld16(bf16_ptr(x) + i, m), blk), m);
  }
  return y;
}

// A Gated DeltaNet layer between its projections (runtime/decode_step.linear_mixer): qkv [1, C], z [1, Hv*Dv],
// b and a [1, Hv] (bf16, the in_proj outputs); conv [K, C] bf16, the conv window (updated in place);
// conv_w fp32 [K, C]; neg_a = -exp(A_log), dt_bias fp32 [Hv]; norm_w fp32 [Dv] (`norm_w_bf16`: the
// model's weight is bf16, so w * y rounds); state fp32 [Hv, Dk, Dv] (updated in place). Returns the
// gated-norm output [1, Hv*Dv] bf16, the input of out_proj. Threads split the value heads.
QK_AVX512 torch::Tensor qk_gdn_step(torch::Tensor qkv, torch::Tensor z, torch::Tensor b, torch::Tensor a, torch::Tensor conv,
                          torch::Tensor conv_w, torch::Tensor neg_a, torch::Tensor dt_bias, torch::Tensor norm_w,
                          bool norm_w_bf16, torch::Tensor state, int64_t hk, double eps) {
  check_avx512();
  for (const auto& [t, what] : {std::pair{&qkv, "qk_gdn_step: qkv"}, {&z, "qk_gdn_step: z"}, {&b, "qk_gdn_step: b"},
                                {&a, "qk_gdn_step: a"}, {&conv, "qk_gdn_step: conv"}})
    check_bf16(*t, what);
  TORCH_CHECK(state.scalar_type() == torch::kFloat && state.is_contiguous() && state.dim() == 3 && conv.dim() == 2,
              "qk_gdn_step: state fp32 [Hv, Dk, Dv], conv [K, C]");
  GdnArgs g;
  g.hv = state.size(0);
  g.dk = state.size(1);
  g.dv = state.size(2);
  g.hk = hk;
  g.taps = conv.size(0);
  g.channels = conv.size(1);
  TORCH_CHECK(hk >= 1 && g.hv % hk == 0 && g.channels == 2 * hk * g.dk + g.hv * g.dv && qkv.numel() == g.channels &&
              z.numel() == g.hv * g.dv && b.numel() == g.hv && a.numel() == g.hv && g.taps >= 1,
              "qk_gdn_step: shapes do not match the layer");
  check_f32(conv_w, g.taps * g.channels, "qk_gdn_step: conv_w");
  check_f32(neg_a, g.hv, "qk_gdn_step: neg_a");
  check_f32(dt_bias, g.hv, "qk_gdn_step: dt_bias");
  check_f32(norm_w, g.dv, "qk_gdn_step: norm_w");
  g.qkv = bf16_ptr(qkv);
  g.z = bf16_ptr(z);
  g.b = bf16_ptr(b);
  g.a = bf16_ptr(a);
  g.conv = bf16_ptr(conv);
  g.conv_w = conv_w.data_ptr<float>();
  g.neg_a = neg_a.data_ptr<float>();
  g.dt_bias = dt_bias.data_ptr<float>();
  g.norm_w = norm_w.data_ptr<float>();
  g.norm_w_bf16 = norm_w_bf16;
  g.state = state.data_ptr<float>();
  g.eps = static_cast<float>(eps);
  std::vector<uint16_t> x(g.channels);
  gdn_conv(g, x.data());
  torch::Tensor out = torch::empty({1, g.hv * g.dv}, torch::kBFloat16);
  uint16_t* op = bf16_ptr(out);
  at::parallel_for(0, g.hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> q(g.dk), k(g.dk), v(g.dv), kv(g.dv), o(g.dv);
    std::vector<uint16_t> ob(g.dv);
    for (int64_t h = lo; h < hi; ++h) gdn_head(g, x.data(), h, q.data(), k.data(), v.data(), kv.data(), o.data(),
                                               ob.data(), op);
  });
  return out;
}

// A gated attention layer between its projections (runtime/decode_step.LeanDecoder._attention): qo
// [1, heads * 2 hd] (per head its query then its gate), ko and vo [1, kv * hd] (bf16); qk_scale fp32
// [heads + kv, hd] (q_norm's then k_norm's (1 + w)); cos and sin bf16 [rot]; the layer's K/V buffers
// [kv, cap, hd] bf16, where position n is written; attention over positions 0..n. Returns
// bf16(attention * bf16(sigmoid(gate))) [1, heads * hd], the input of o_proj.
QK_BF16 torch::Tensor qk_attn_step(torch::Tensor qo, torch::Tensor ko, torch::Tensor vo, torch::Tensor qk_scale,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor keys, torch::Tensor values, int64_t n,
                           double scaling, double eps) {
  TORCH_CHECK(bf16_ok(), "qk_attn_step: needs AVX512-BF16");
  for (const auto& [t, what] : {std::pair{&qo, "qk_attn_step: q"}, {&ko, "qk_attn_step: k"}, {&vo, "qk_attn_step: v"},
                                {&cos, "qk_attn_step: cos"}, {&sin, "qk_attn_step: sin"},
                                {&keys, "qk_attn_step: keys"}, {&values, "qk_attn_step: values"}})
    check_bf16(*t, what);
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes(), "qk_attn_step: keys and values [kv, cap, hd]");
  const int64_t kv = keys.size(0), cap = keys.size(1), hd = keys.size(2), rot = cos.numel();
  const int64_t heads = qo.numel() / (2 * hd);
  TORCH_CHECK(hd % 16 == 0 && heads >= 1 && heads % kv == 0 && qo.numel() == heads * 2 * hd && ko.numel() == kv * hd &&
              vo.numel() == kv * hd && sin.numel() == rot && rot % 2 == 0 && rot <= hd && n >= 0 && n < cap,
              "qk_attn_step: shapes do not fit (head_dim a multiple of 16, 0 <= n < capacity)");
  check_f32(qk_scale, (heads + kv) * hd, "qk_attn_step: qk_scale");
  const float* sc = qk_scale.data_ptr<float>();
  const float e = static_cast<float>(eps);
  std::vector<uint16_t> q(heads * hd), k(kv * hd);
  norm_rotate(bf16_ptr(qo), 2 * hd, heads, hd, sc, bf16_ptr(cos), bf16_ptr(sin), rot, e, q.data());
  norm_rotate(bf16_ptr(ko), hd, kv, hd, sc + heads * hd, bf16_ptr(cos), bf16_ptr(sin), rot, e, k.data());
  uint16_t *kp = bf16_ptr(keys), *vp = bf16_ptr(values);
  for (int64_t h = 0; h < kv; ++h) {
    std::memcpy(kp + (h * cap + n) * hd, k.data() + h * hd, hd * sizeof(uint16_t));
    std::memcpy(vp + (h * cap + n) * hd, bf16_ptr(vo) + h * hd, hd * sizeof(uint16_t));
  }
  torch::Tensor out = torch::empty({1, heads * hd}, torch::kBFloat16);
  uint16_t* op = bf16_ptr(out);
  attend_heads(q.data(), kp, vp, heads, kv, cap, hd, n + 1, static_cast<float>(scaling), op);
  const uint16_t* gp = bf16_ptr(qo);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < hd; i += 16) {
      const __m512 gate = rb(sigmoid16(ld16(gp + h * 2 * hd + hd + i, 0xFFFF)));
      st16(op + h * hd + i, _mm512_mul_ps(ld16(op + h * hd + i, 0xFFFF), gate), 0xFFFF);
    }
  return out;
}
