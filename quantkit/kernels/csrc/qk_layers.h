// The decode step's layer loop (qk_layers.cpp), bound to Python in qk_cpu.cpp's module definition.
#pragma once

#include <torch/extension.h>

void qk_bind_layers(pybind11::module_& mod);
