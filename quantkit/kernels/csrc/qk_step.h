// The decode step's pieces besides the matrices (qk_step.cpp), bound to Python in qk_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "qk_ops.h"

torch::Tensor qk_delta_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor decay,
                            torch::Tensor beta, torch::Tensor state);
torch::Tensor qk_rms(torch::Tensor x, torch::Tensor scale, double eps);
std::vector<torch::Tensor> qk_add_rms(torch::Tensor x, torch::Tensor a, torch::Tensor scale, double eps);
torch::Tensor qk_silu_mul(torch::Tensor gate, torch::Tensor up);
std::vector<torch::Tensor> qk_route(torch::Tensor logits, int64_t k);
torch::Tensor qk_moe_out(torch::Tensor x, torch::Tensor routed, torch::Tensor shared, torch::Tensor sg);
torch::Tensor qk_gdn_rows(torch::Tensor qkv, torch::Tensor z, torch::Tensor b, torch::Tensor a, torch::Tensor conv,
                          torch::Tensor conv_w, torch::Tensor neg_a, torch::Tensor dt_bias, torch::Tensor norm_w,
                          bool norm_w_bf16, torch::Tensor state, torch::Tensor states, int64_t hk, double eps);
torch::Tensor qk_gdn_batch(torch::Tensor qkv, torch::Tensor z, torch::Tensor b, torch::Tensor a,
                           std::vector<torch::Tensor> convs, torch::Tensor conv_w, torch::Tensor neg_a,
                           torch::Tensor dt_bias, torch::Tensor norm_w, bool norm_w_bf16,
                           std::vector<torch::Tensor> states, int64_t hk, double eps);
torch::Tensor qk_attn_rows(torch::Tensor qo, torch::Tensor ko, torch::Tensor vo, torch::Tensor qk_scale,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor keys, torch::Tensor values, int64_t n,
                           double scaling, double eps);
int64_t qk_argmax(torch::Tensor x);
torch::Tensor qk_logsumexp(torch::Tensor x);

// The pointer-level cores beneath the ops above, which run no torch op (qk_layers.cpp runs a decode step of them).
namespace qk {

constexpr int64_t kMaxRows = 4;       // tokens of one verify or draft in the kernel's stack
constexpr int64_t kMaxHeadDim = 256;  // a head's width (Gated DeltaNet key / value, attention) at most

// a gated attention layer's fixed arguments: (1 + w) of q_norm then k_norm fp32 [heads + kv, hd], its K/V
// buffers [kv, cap, hd] bf16, the scaling and the norms' eps
struct AttnArgs {
  const float* qk_scale;
  uint16_t *keys, *values;
  int64_t heads, kv, cap, hd;
  float scaling, eps;
};

AttnArgs attn_layer_args(const torch::Tensor& qk_scale, const torch::Tensor& keys, const torch::Tensor& values,
                         double scaling, double eps, int64_t q_width);
// rows tokens at positions n .. n + rows - 1 (qo, ko, vo, cos, sin their rows, contiguous): out [rows, heads * hd],
// row j its one-row call's after rows 0..j-1 (qk_attn_rows)
void attn_rows_into(const AttnArgs& at, int64_t rows, const uint16_t* qo, const uint16_t* ko, const uint16_t* vo,
                    const uint16_t* cos, const uint16_t* sin, int64_t rot, int64_t n, uint16_t* out);
// a Gated DeltaNet layer's fixed arguments (qkv, z, b, a are the caller's, per call)
GdnArgs gdn_layer_args(const torch::Tensor& conv, const torch::Tensor& conv_w, const torch::Tensor& neg_a,
                       const torch::Tensor& dt_bias, const torch::Tensor& norm_w, bool norm_w_bf16,
                       const torch::Tensor& state, int64_t hk, double eps);
// t tokens (g0's qkv, z, b, a point at the first of t contiguous rows) as qk_gdn_rows, out [t, Hv * Dv] bf16:
// the state read from `from` (nullptr: g0.state), the state after each token but the last into kept [t - 1, Hv,
// Dk, Dv] (nullptr: never written out), after the last into g0.state; xs [t, C] (if given) receives the conv's
// outputs, what `gdn_heads_into` replays the tokens from
void gdn_rows_into(const GdnArgs& g0, int64_t t, float* kept, uint16_t* out, const float* from = nullptr,
                   uint16_t* xs = nullptr);
// the heads of t tokens whose conv outputs are x [t, C] (g0's z, b, a at their rows), as gdn_rows_into
void gdn_heads_into(const GdnArgs& g0, int64_t t, const uint16_t* x, const float* from, float* kept, uint16_t* out);
// qk_route on one row of e bf16 logits: w [k] fp32, ids [k]
void route_into(const uint16_t* logits, int64_t e, int64_t k, float* w, int64_t* ids);
// the shared expert's gate bf16(sigmoid(sg)) as qk_moe_out applies it
float moe_gate(uint16_t sg);
// qk_argmax of n bf16 values
int64_t argmax_bf16(const uint16_t* x, int64_t n);

}  // namespace qk
