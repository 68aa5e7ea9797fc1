// The avx512 unit of the op table (AVX512 F/BW/VL/VNNI): compiled with its own flags by kernels/build.py.
#define QK_TARGET 2
#include "qk_ops_impl.h"
