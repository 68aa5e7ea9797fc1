// The avx512bf16 unit of the op table (AVX512 F/BW/VL/VNNI + BF16): compiled with its own flags by kernels/build.py.
#define QK_TARGET 3
#include "qk_ops_impl.h"
