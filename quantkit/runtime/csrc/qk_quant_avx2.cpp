// The avx2 unit of the quantizer's kernels: compiled with its own flags by runtime/quant_kernel.py.
#define QK_QUANT_TARGET 1
#include "qk_quant_impl.h"
