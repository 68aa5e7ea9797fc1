// Shared by the kernel's torch-facing sources (qk_cpu.cpp: the matrices and the dispatch; qk_step.cpp: the
// decode step's other pieces; qk_layers.cpp: the one-call stack). They are compiled for the baseline CPU and
// run an instruction set's code only through `ops()`, the table qk_cpu.cpp chose at load (qk_ops.h).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#include "qk_bf16.h"
#include "qk_ops.h"

namespace qk {

// The op table in use (set once at load; lowered by set_isa / set_table in tests and benches).
const Ops& ops();

using ::bf16_value;  // qk_bf16.h's, the one definition
using ::to_bf16;

inline float through_bf16(float f) { return bf16_value(to_bf16(f)); }

inline int64_t tiles(const QMat& m) { return (m.n + kTile - 1) / kTile; }

}  // namespace qk
