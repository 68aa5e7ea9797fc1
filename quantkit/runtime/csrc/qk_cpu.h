// The matrix ops of qk_cpu.cpp that the other sources call (qk_layers.cpp composes a decode step of them).
#pragma once

#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> qk_linear_many(torch::Tensor x, torch::Tensor table);
torch::Tensor qk_moe(torch::Tensor x, torch::Tensor table, torch::Tensor ids, torch::Tensor wts);
torch::Tensor qk_moe_rows(torch::Tensor x, torch::Tensor table, torch::Tensor ids, torch::Tensor wts);
