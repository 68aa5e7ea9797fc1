// The matrix ops of qk_cpu.cpp that the other sources call (qk_layers.cpp composes a decode step of them):
// on tensors for Python, and the pointer-level cores beneath them, which run no torch op.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "qk_ops.h"

std::vector<torch::Tensor> qk_linear_many(torch::Tensor x, torch::Tensor table);
torch::Tensor qk_moe(torch::Tensor x, torch::Tensor table, torch::Tensor ids, torch::Tensor wts);

namespace qk {

constexpr int64_t kMaxMats = 8;  // matrices in one linear_many call (a layer's tables hold up to 4)

// a matrix from one row of a descriptor table (QKernel / QBf16Kernel.descriptor() in kernels.py)
QMat mat_from_row(const int64_t* f);
void linear_many_into(const float* xf, int64_t rows, int64_t k, const QMat* mats, int64_t np, void* const* outs,
                      bool bf16);
void moe_rows_into(const float* xf, int64_t rows, int64_t hdim, const int64_t* table, int64_t experts,
                   const int64_t* ids, const float* wts, int64_t ks, float* y);

}  // namespace qk
