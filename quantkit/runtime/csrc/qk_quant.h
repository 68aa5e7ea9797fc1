// The quantizer's kernels (formats/int4.py, formats/int8.py): bf16 rows in, stored parts and error sums out,
// one pass per group. Plain C (no torch): runtime/quant_kernel.py builds the units into their own small
// library and calls it through ctypes, so the quantizer does not wait on the decode kernel's build.
//
// Why our own: torch's route takes some 30 passes over each chunk for int4's clip search, plus a separate
// bf16 -> fp32 copy and an fp32 norm for the error figures; the decode kernel's quant_int4_sym (qk_ops_impl.h)
// does one pass per group but in scalar min/max and packing loops, from an fp32 copy of each row, with the
// reference sum of squares still in torch. Measured on one thread with the error sums (bf16 [2048, 2048], the
// AVX512 unit): int4 g32 here does 4.2x the elements per CPU-second of the decode kernel's route and 9.3x
// torch's; int8 4.3x torch's (reports/bench-quantize.md has the file-to-file effect).
#pragma once

#include <stdint.h>

extern "C" {

struct QkQuantOps {
  const char* name;  // "generic", "avx2", "avx512"
  int level;         // 0, 1, 2 (runtime/cpu_kernel.py's ISA_LEVELS)
  // Symmetric int4 with the clip search: rows x bf16 [rows, k] -> packed [rows, k/2] (element 2j in the low
  // nibble), scales bf16 [rows, k/g]; sums[0] += squared error of the stored weights, sums[1] += sum of x^2.
  void (*int4_sym)(const uint16_t* x, int64_t rows, int64_t k, int64_t g, const float* grid, int ngrid,
                   uint8_t* packed, uint16_t* scales, double* sums);
  // int8 per row: q int8 [rows, k], scales bf16 [rows]; sums as above.
  void (*int8_row)(const uint16_t* x, int64_t rows, int64_t k, int8_t* q, uint16_t* scales, double* sums);
};

const QkQuantOps* qk_quant_generic();
const QkQuantOps* qk_quant_avx2();
const QkQuantOps* qk_quant_avx512();
int qk_quant_best_level();  // what this CPU (and its OS) can run: 0, 1 or 2
}
