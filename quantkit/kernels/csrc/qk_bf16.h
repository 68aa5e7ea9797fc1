// bf16 <-> fp32 in scalar C++, the one definition for every source: the op units (qk_ops_impl.h, with the
// quantizer's qk_quant_impl.h) and the torch-facing sources (through qk_common.h). Internal linkage: each unit
// compiled with its own -m flags keeps its own copy.
#pragma once

#include <stdint.h>
#include <string.h>

namespace {

// fp32 -> bf16, round to nearest even (NaN kept a NaN), as torch's .to(torch.bfloat16)
inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

}  // namespace
