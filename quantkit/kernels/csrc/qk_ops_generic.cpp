// The generic unit of the op table (plain C++ (any CPU the compiler targets)): compiled with its own flags by kernels/build.py.
#define QK_TARGET 0
#include "qk_ops_impl.h"
