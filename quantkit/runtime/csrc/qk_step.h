// The decode step's pieces besides the matrices (qk_step.cpp), bound to Python in qk_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor qk_delta_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor decay,
                            torch::Tensor beta, torch::Tensor state);
torch::Tensor qk_attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t n, double scaling);
torch::Tensor qk_rms(torch::Tensor x, torch::Tensor scale, double eps);
std::vector<torch::Tensor> qk_add_rms(torch::Tensor x, torch::Tensor a, torch::Tensor scale, double eps);
torch::Tensor qk_silu_mul(torch::Tensor gate, torch::Tensor up);
std::vector<torch::Tensor> qk_route(torch::Tensor logits, int64_t k);
torch::Tensor qk_moe_out(torch::Tensor x, torch::Tensor routed, torch::Tensor shared, torch::Tensor sg);
torch::Tensor qk_gdn_step(torch::Tensor qkv, torch::Tensor z, torch::Tensor b, torch::Tensor a, torch::Tensor conv,
                          torch::Tensor conv_w, torch::Tensor neg_a, torch::Tensor dt_bias, torch::Tensor norm_w,
                          bool norm_w_bf16, torch::Tensor state, int64_t hk, double eps);
torch::Tensor qk_gdn_rows(torch::Tensor qkv, torch::Tensor z, torch::Tensor b, torch::Tensor a, torch::Tensor conv,
                          torch::Tensor conv_w, torch::Tensor neg_a, torch::Tensor dt_bias, torch::Tensor norm_w,
                          bool norm_w_bf16, torch::Tensor state, torch::Tensor states, int64_t hk, double eps);
torch::Tensor qk_attn_step(torch::Tensor qo, torch::Tensor ko, torch::Tensor vo, torch::Tensor qk_scale,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor keys, torch::Tensor values, int64_t n,
                           double scaling, double eps);
int64_t qk_argmax(torch::Tensor x);
