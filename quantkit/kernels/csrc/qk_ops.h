// The kernel's op table: every op the decode path runs, on raw pointers, once per instruction set.
//
// Each ISA's ops are one translation unit (qk_ops_generic.cpp, qk_ops_avx2.cpp, qk_ops_avx2vnni.cpp,
// qk_ops_avx512.cpp, qk_ops_avx512bf16.cpp), all made from qk_ops_impl.h and compiled with their own -m flags by
// kernels/build.py; the torch-facing sources (qk_cpu.cpp, qk_step.cpp, qk_layers.cpp) are compiled
// for the baseline CPU and reach an ISA's code only through the table chosen once at load (qk_dispatch),
// so no CPU runs an instruction it lacks, whatever a compiler hoists. This header is plain C++ (no torch,
// no std templates): an ISA unit must not emit weak template code that the linker could pick for another.
#pragma once

#include <stdint.h>

namespace qk {

constexpr int kTile = 16;
constexpr int kBlock = 32;

// A matrix in the kernel's layout (see qk_cpu.cpp): int4 / int8 tiles, or a row-major bf16 [n, k] (fmt 16).
// (Plain aggregates only: no member functions or initialisers, so no unit emits inline code for them.)
struct QMat {
  const uint8_t* qw;
  const void* scales;     // int4: bf16 [NT, G, 16]; int8: fp32 [NT*16]
  const uint16_t* zeros;  // int4 asymmetric: bf16 [NT, G, 16], else null
  int64_t fmt;            // 4, 8 or 16
  int64_t group;
  int64_t n;  // real rows
  int64_t k;  // columns (a multiple of 32)
};

// One activation row quantized per block of 32: x ~ q * d; s = sum of the block's q; ds = d * s; xb the
// same row in bf16 (for bf16 matrices).
struct QAct {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  const float* ds;
  const uint16_t* xb;
};

// A Gated DeltaNet layer's core for one token (qk_gdn_rows's arguments as pointers, at one row).
struct GdnArgs {
  const uint16_t *qkv, *z, *b, *a;
  uint16_t* conv;  // [K, C] bf16, oldest tap first
  const float *conv_w, *neg_a, *dt_bias, *norm_w;
  bool norm_w_bf16;
  float* state;  // [Hv, Dk, Dv], updated in place by one token (gdn_rows_into reads and writes others too)
  int64_t taps, channels, hk, hv, dk, dv;
  float eps;
};

// One token of the gated delta rule on one head (delta_rows): its q, k [dk], v [dv], decay and beta; kv [dv]
// scratch; out [dv] its output
struct DeltaTok {
  const float *q, *k, *v;
  float decay, beta;
  float *kv, *out;
};
constexpr int kMaxDeltaRows = 4;      // tokens of one gdn_head_rows call at most
constexpr int kDeltaBlockCols = 64;   // columns of the state a delta_rows block spans at most (its scratch)

struct Ops {
  const char* name;  // "generic", "avx2", "avx2vnni", "avx512", "avx512bf16"
  int level;         // 0 generic, 1 avx2 (either AVX2 table), 2 avx512 (either AVX512 table)
  // matrices: x ~ q * d per block of 32 (k % 32 == 0); one 16-row tile against `rows` activation rows,
  // out [rows][16] (rows past m.n give 0)
  void (*quantize_row)(const float* x, int64_t k, int8_t* q, float* d, int32_t* s, float* ds);
  void (*tile)(const QMat& m, int64_t t, const QAct* a, int64_t rows, float* out);
  void (*to_bf16_row)(const float* x, int64_t n, uint16_t* out);
  void (*silu_mul32)(const float* g, const float* u, float* out);  // 32 values, fp32
  double (*sum_f32)(const float* p, int64_t n);                     // n % 64 == 0
  // the gated delta rule of one head: S [K, V] fp32 = the state after Sin (Sin == S: in place; `stream`: S out
  // of place is written past the cache); kv scratch of V
  void (*delta_head)(const float* Sin, float* S, int64_t K, int64_t V, const float* q, const float* k, const float* v,
                     float decay, float beta, float* kv, float* out, bool stream);
  // T rows of G query heads (1, 2, 4, 8 or 16) against one kv head's k, v [cap, hd] (bf16), each row's bits its
  // own call's: row t's at q + t * qs against rows 0..n0+t-1, its out [G, hd] bf16 at out + t * os; each block of
  // k and v read once for the T rows. s scratch of T * G * (n0 + T - 1) floats, acc of T * G * hd
  void (*attend_rows)(int G, int64_t T, const uint16_t* q, int64_t qs, const uint16_t* k, const uint16_t* v,
                      int64_t n0, int64_t hd, float scaling, float* s, float* acc, uint16_t* out, int64_t os);
  // bf16 rows, torch's roundings (qk_step.cpp states each)
  void (*rms_row)(const uint16_t* x, int64_t n, const float* scale, float eps, uint16_t* y);
  void (*add_bf16)(const uint16_t* x, const uint16_t* a, int64_t n, uint16_t* y);
  void (*silu_mul_bf16)(const uint16_t* g, const uint16_t* u, int64_t n, uint16_t* y);
  float (*exp_shifted)(const uint16_t* x, int64_t n, float mx, float* p);  // p = e^(x - mx); returns the sum
  void (*moe_out)(const uint16_t* x, const float* routed, const uint16_t* shared, float gate, int64_t n,
                  uint16_t* y);
  void (*gate_mul)(uint16_t* o, const uint16_t* g, int64_t n);  // o = bf16(o * bf16(sigmoid(g)))
  // Gated DeltaNet: the conv window's shift and taps (x [C] bf16 out), then one value head h from its state
  // s_in [Dk, Dv] to s (s == s_in: in place; `stream` as delta_head's; scratch: 2 * dk + 3 * dv floats and dv
  // bf16)
  void (*gdn_conv)(const GdnArgs& g, uint16_t* x);
  void (*gdn_head)(const GdnArgs& g, const uint16_t* x, int64_t h, const float* s_in, float* s, bool stream,
                   float* scratch, uint16_t* scratch16, uint16_t* out);
  // t (1..kMaxDeltaRows) tokens of gdn_head on head h (token j: g[j], x + j * channels, out[j]; dv a multiple of
  // 16) from s_in to s, the states between only in scratch (t * (2 * dk + 3 * dv) + dk * kDeltaBlockCols
  // floats); the same bits as t calls of gdn_head
  void (*gdn_head_rows)(const GdnArgs* g, int64_t t, const uint16_t* x, int64_t h, const float* s_in, float* s,
                        bool stream, float* scratch, uint16_t* scratch16, uint16_t* const* out);
  // RMSNorm of `rows` rows then the rotary on the first `rot` dims (nrm scratch of hd)
  void (*norm_rotate)(const uint16_t* x, int64_t stride, int64_t rows, int64_t hd, const float* scale,
                      const uint16_t* cos, const uint16_t* sin, int64_t rot, float eps, uint16_t* nrm, uint16_t* y);
  // the quantizer (qk_quant_impl.h): symmetric int4 with formats/int4.py's clip search, rows x [rows, k] (bf16
  // or fp32) -> packed [rows, k/2] (element 2j in the low nibble), scales bf16 [rows, k/g]; int8 per row, bf16
  // x -> q int8 [rows, k], scales bf16 [rows]; both add the squared error of the stored weights to sums[0] and
  // the sum of x^2 to sums[1]
  void (*quant_int4_bf16)(const uint16_t* x, int64_t rows, int64_t k, int64_t g, const float* grid, int ngrid,
                          uint8_t* packed, uint16_t* scales, double* sums);
  void (*quant_int4_f32)(const float* x, int64_t rows, int64_t k, int64_t g, const float* grid, int ngrid,
                         uint8_t* packed, uint16_t* scales, double* sums);
  void (*quant_int8)(const uint16_t* x, int64_t rows, int64_t k, int8_t* q, uint16_t* scales, double* sums);
  // the bits of n bf16 / fp32 values as signed integers: out = {max, min, max of the magnitude bits}
  // (qk_step.cpp's argmax)
  void (*bit_range16)(const uint16_t* x, int64_t n, int32_t* out);
  void (*bit_range32)(const uint32_t* x, int64_t n, int32_t* out);
};

}  // namespace qk

// One table per ISA unit; a unit the compiler could not build is absent (a weak symbol left null).
extern "C" const qk::Ops* qk_ops_generic();
extern "C" const qk::Ops* qk_ops_avx2() __attribute__((weak));
extern "C" const qk::Ops* qk_ops_avx2vnni() __attribute__((weak));
extern "C" const qk::Ops* qk_ops_avx512() __attribute__((weak));
extern "C" const qk::Ops* qk_ops_avx512bf16() __attribute__((weak));
