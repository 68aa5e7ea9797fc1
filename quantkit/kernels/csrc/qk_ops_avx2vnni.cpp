// The avx2vnni unit of the op table (AVX2 + FMA + AVX-VNNI): compiled with its own flags by kernels/build.py.
#define QK_TARGET 4
#include "qk_ops_impl.h"
