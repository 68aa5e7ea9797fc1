// The avx2 unit of the op table (AVX2 + FMA): compiled with its own flags by kernels/build.py.
#define QK_TARGET 1
#include "qk_ops_impl.h"
