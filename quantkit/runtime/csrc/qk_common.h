// Shared by the kernel's torch-facing sources (qk_cpu.cpp: the matrices and the dispatch; qk_step.cpp: the
// decode step's other pieces; qk_layers.cpp: the one-call stack). They are compiled for the baseline CPU and
// run an instruction set's code only through `ops()`, the table qk_cpu.cpp chose at load (qk_ops.h).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#include "qk_ops.h"

namespace qk {

// The op table in use (set once at load; lowered by set_isa / set_table in tests and benches).
const Ops& ops();

// fp32 -> bf16, round to nearest even (NaN kept a NaN), as torch's .to(torch.bfloat16)
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// bf16 -> fp32 of one value (exact)
inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float through_bf16(float f) { return bf16_value(to_bf16(f)); }

inline int64_t tiles(const QMat& m) { return (m.n + kTile - 1) / kTile; }

}  // namespace qk
