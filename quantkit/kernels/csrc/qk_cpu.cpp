// quantkit's CPU kernels for 4-bit and 8-bit weights at decode batch sizes.
//
// Why our own: torch 2.13's `_weight_int4pack_mm_for_cpu` is compute-bound at batch 1 (bf16 activations;
// reports/bench-kernel.md) and a MoE layer costs 16 such calls plus dozens of small ops from Python;
// kt-kernel's workers spin against torch's OpenMP pool (measured, same report). Here activations are
// quantized to int8 per block of 32 (one fp32 scale per block, as GGUF's Q8_0) and dotted against the
// stored codes with VNNI (`vpdpbusd`: u8 codes x s8 activations), AVX2 (`vpmaddubsw`) or plain C++, on
// torch's own thread pool (at::parallel_for), and the k routed experts of a MoE layer run in one call. The
// per-ISA code is in qk_ops_impl.h; this file picks its table once at load (cpuid and XGETBV) and never
// executes an instruction the CPU lacks.
//
// Weight layout (made once at load by quantkit/runtime/cpu_kernel.py's repack_*; the stored formats are unchanged):
// rows in tiles of 16 (padded with zero-scale rows), K in blocks of 32.
// - int4: qw uint8 [NT, K/32, 4, 16, 4]: byte (t, b, c, r, i) holds code(16t+r, 32b+8c+i) in its low
//   nibble and code(16t+r, 32b+8c+4+i) in its high nibble; scales (and zeros, asymmetric) bf16
//   [NT, K/g, 16]; w = (q - 8) * scale + zero, quantkit's int4 convention.
// - int8: qw uint8 [NT, K/32, 8, 16, 4]: byte (t, b, c, r, i) = q(16t+r, 32b+4c+i) + 128; scales fp32
//   [NT*16]; w = q * scale.
// - bf16 (fmt 16): the stored row-major matrix as it is, dotted with bf16 activations in fp32: by
//   AVX512-BF16 (`vdpbf16ps`) where the CPU has it, else widened to fp32 in registers.
// For one 16-row tile and one 32-block the 4 (int4) or 8 (int8) 64-byte rows are each one zmm: lane r
// holds 4 consecutive codes of row r, multiplied by the same 4 activation bytes broadcast to all lanes.
// The +8 / +128 offsets of the unsigned codes are removed with the block's activation sum.
//
// Beside the matrices: linear_many (a layer's projections of one input, quantized once, in one parallel
// region) and stream_sum (a plain streaming read, the benches' read-bandwidth probe). The lean decode
// step's other pieces are in qk_step.cpp.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <xmmintrin.h>
#endif

#include "qk_common.h"
#include "qk_cpu.h"
#include "qk_layers.h"
#include "qk_step.h"

namespace qk {

namespace {

// ---------------------------------------------------------------- what the CPU (and its OS) can run
struct Cpu {
  bool avx2 = false, avxvnni = false, avx512 = false, bf16 = false;
};

#if defined(__x86_64__) || defined(__i386__)
uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));  // xgetbv, without -mxsave
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// cpuid's feature bits, and the OS's XSAVE support for the registers they need (XCR0: SSE and AVX state
// for AVX2; also the opmask and upper-ZMM state for AVX512): a CPU feature the OS does not save is off.
Cpu detect_cpu() {
  Cpu c;
  unsigned a, b, cx, d;
  if (!__get_cpuid(1, &a, &b, &cx, &d)) return c;
  const bool osxsave = cx & (1u << 27), avx = cx & (1u << 28), fma = cx & (1u << 12);
  if (!osxsave || !avx) return c;
  const uint64_t xcr0 = xgetbv0();
  if ((xcr0 & 0x6) != 0x6) return c;
  if (!__get_cpuid_count(7, 0, &a, &b, &cx, &d)) return c;
  c.avx2 = fma && (b & (1u << 5));
  const bool f = b & (1u << 16), bw = b & (1u << 30), vl = b & (1u << 31), vnni = cx & (1u << 11);
  c.avx512 = c.avx2 && f && bw && vl && vnni && (xcr0 & 0xE6) == 0xE6;
  if (__get_cpuid_count(7, 1, &a, &b, &cx, &d)) {
    c.avxvnni = c.avx2 && (a & (1u << 4));
    c.bf16 = c.avx512 && (a & (1u << 5));
  }
  return c;
}
#else
Cpu detect_cpu() { return Cpu{}; }  // not x86: the generic unit only
#endif

const Cpu& cpu() {
  static const Cpu c = detect_cpu();
  return c;
}

// The table of a level (0 generic, 1 AVX2, 2 AVX512), with its extension (AVX-VNNI at level 1, AVX512-BF16
// at level 2) or without, where this CPU can run it and the compiler built it; null otherwise. An ISA
// unit's entry is called only after the CPU check.
const Ops* table(int level, bool extra) {
  if (level == 2 && extra) return cpu().bf16 && qk_ops_avx512bf16 ? qk_ops_avx512bf16() : nullptr;
  if (level == 2) return cpu().avx512 && qk_ops_avx512 ? qk_ops_avx512() : nullptr;
  if (level == 1 && extra) return cpu().avxvnni && qk_ops_avx2vnni ? qk_ops_avx2vnni() : nullptr;
  if (level == 1) return cpu().avx2 && qk_ops_avx2 ? qk_ops_avx2() : nullptr;
  return level == 0 && !extra ? qk_ops_generic() : nullptr;
}

int best_level() {
  for (int level = 2; level > 0; --level)
    if (table(level, false) || table(level, true)) return level;
  return 0;
}

// the best table at a level: with its extension where there is one
const Ops* best_table(int level) {
  const Ops* t = table(level, true);
  return t ? t : table(level, false);
}

const Ops* g_ops = nullptr;

}  // namespace

const Ops& ops() {
  if (!g_ops) g_ops = best_table(best_level());
  return *g_ops;
}

}  // namespace qk

using namespace qk;

namespace {

// One activation row per QAct (qk_ops.h) in one buffer of rows.
struct QActBuf {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s;
  std::vector<uint16_t> xb;
  void resize(int64_t rows, int64_t k) {
    q.resize(rows * k);
    xb.resize(rows * k);
    d.resize(rows * k / kBlock);
    ds.resize(rows * k / kBlock);
    s.resize(rows * k / kBlock);
  }
  QAct row(int64_t r, int64_t k) const {
    const int64_t nb = k / kBlock;
    return {q.data() + r * k, d.data() + r * nb, s.data() + r * nb, ds.data() + r * nb, xb.data() + r * k};
  }
};

// x's values as contiguous fp32 without a torch op for the decode dtypes (an op costs a few microseconds,
// as much as a small matrix): fp32 as it is, bf16 widened into `buf` (exact), others through torch (`keep`)
const float* f32_values(const torch::Tensor& x, std::vector<float>& buf, torch::Tensor& keep) {
  if (x.scalar_type() == torch::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  if (x.scalar_type() == torch::kBFloat16 && x.is_contiguous()) {
    const int64_t n = x.numel();
    buf.resize(n);
    const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t i = 0; i < n; ++i) buf[i] = bf16_value(p[i]);
    return buf.data();
  }
  keep = x.to(torch::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// A result [rows, n] in bf16 for bf16 inputs (rounded as torch's .to(torch.bfloat16)), fp32 otherwise.
struct Result {
  torch::Tensor t;
  float* f = nullptr;
  uint16_t* h = nullptr;
  Result(int64_t rows, int64_t n, bool bf16) {
    t = torch::empty({rows, n}, bf16 ? torch::kBFloat16 : torch::kFloat);
    if (bf16) h = reinterpret_cast<uint16_t*>(t.data_ptr()); else f = t.data_ptr<float>();
  }
  void put(int64_t at, const float* v, int64_t count) const {
    if (h) ops().to_bf16_row(v, count, h + at); else std::memcpy(f + at, v, count * sizeof(float));
  }
};

QMat mat_from(const torch::Tensor& qw, const torch::Tensor& scales, const c10::optional<torch::Tensor>& zeros,
              int64_t fmt, int64_t group, int64_t n, int64_t k) {
  TORCH_CHECK(fmt == 4 || fmt == 8, "qk: format must be 4 or 8");
  TORCH_CHECK(k % kBlock == 0 && k > 0, "qk: in_features must be a multiple of 32");
  TORCH_CHECK(fmt == 8 || (group % kBlock == 0 && k % group == 0 && ((group / kBlock) & (group / kBlock - 1)) == 0),
              "qk: the int4 group size must be 32 x a power of two dividing in_features");
  TORCH_CHECK(qw.is_contiguous() && qw.scalar_type() == torch::kUInt8, "qk: qw must be contiguous uint8");
  const int64_t nt = (n + kTile - 1) / kTile;
  TORCH_CHECK(qw.numel() == nt * k * (fmt == 4 ? 8 : 16), "qk: qw has the wrong size");
  QMat m{};
  m.qw = qw.data_ptr<uint8_t>();
  if (fmt == 4) {
    TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && scales.is_contiguous() &&
                scales.numel() == nt * (k / group) * kTile, "qk: int4 scales must be bf16 [NT, G, 16]");
    if (zeros.has_value() && zeros->defined()) {
      TORCH_CHECK(zeros->scalar_type() == torch::kBFloat16 && zeros->is_contiguous() &&
                  zeros->numel() == scales.numel(), "qk: int4 zeros must match the scales");
      m.zeros = reinterpret_cast<const uint16_t*>(zeros->data_ptr());
    }
  } else {
    TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == nt * kTile,
                "qk: int8 scales must be fp32 [NT*16]");
  }
  m.scales = scales.data_ptr();
  m.fmt = fmt;
  m.group = fmt == 4 ? group : kBlock;
  m.n = n;
  m.k = k;
  return m;
}

// Tiles per thread at least: a parallel region costs a few microseconds (a fork and a barrier), so
// small matrices (in_proj_a/b: 2 tiles) run on the calling thread. `work`: bytes read (x rows) per tile.
int64_t grain(int64_t work) { return std::max<int64_t>(1, (int64_t{64} << 10) / std::max<int64_t>(work, 1)); }

void quantize_rows(const float* x, int64_t rows, int64_t k, QActBuf& buf, bool want_bf16 = false) {
  buf.resize(rows, k);
  const int64_t nb = k / kBlock;
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      ops().quantize_row(x + r * k, k, buf.q.data() + r * k, buf.d.data() + r * nb, buf.s.data() + r * nb,
                   buf.ds.data() + r * nb);
      if (want_bf16) ops().to_bf16_row(x + r * k, k, buf.xb.data() + r * k);
    }
  });
}

}  // namespace

namespace qk {

// A matrix from one row of a descriptor table (QKernel / QBf16Kernel.descriptor() in kernels.py): qw or
// the bf16 weight, scales, zeros or 0 (pointers), format 4/8/16, group, n, k, 0
QMat mat_from_row(const int64_t* f) {
  QMat m{};
  m.qw = reinterpret_cast<const uint8_t*>(f[0]);
  m.scales = reinterpret_cast<const void*>(f[1]);
  m.zeros = reinterpret_cast<const uint16_t*>(f[2]);
  m.fmt = f[3];
  m.group = f[3] == 4 ? f[4] : kBlock;
  m.n = f[5];
  m.k = f[6];
  return m;
}

}  // namespace qk

int64_t qk_isa() { return ops().level; }
int64_t qk_detect_isa() { return best_level(); }
std::string qk_table() { return ops().name; }
void qk_set_isa(int64_t level) {
  TORCH_CHECK(level >= 0 && level <= best_level(), "qk: this CPU (or this build) has no instruction set level ", level);
  g_ops = best_table(static_cast<int>(level));
}
// the tables this CPU can run and this build holds, best first
std::vector<std::string> qk_tables() {
  std::vector<std::string> names;
  for (int level = 2; level >= 0; --level)
    for (bool extra : {true, false})
      if (const Ops* t = table(level, extra)) names.push_back(t->name);
  return names;
}
// the name of the table at the level in use without its extension ("avx2", "avx512", "generic")
std::string qk_isa_plain_name() { return table(ops().level, false) ? table(ops().level, false)->name : ops().name; }
void qk_set_table(const std::string& name) {
  for (int level = 2; level >= 0; --level)
    for (bool extra : {true, false})
      if (const Ops* t = table(level, extra); t && name == t->name) {
        g_ops = t;
        return;
      }
  TORCH_CHECK(false, "qk: no table ", name, " that this CPU can run in this build");
}
// the units this module holds ("generic", "avx2", ...), whether or not this CPU can run them
std::vector<std::string> qk_units() {
  std::vector<std::string> u{"generic"};
  if (qk_ops_avx2) u.push_back("avx2");
  if (qk_ops_avx2vnni) u.push_back("avx2vnni");
  if (qk_ops_avx512) u.push_back("avx512");
  if (qk_ops_avx512bf16) u.push_back("avx512bf16");
  return u;
}
// what this CPU and its OS can run, as detected at load
std::vector<std::string> qk_cpu_features() {
  std::vector<std::string> f;
  if (cpu().avx2) f.push_back("avx2");
  if (cpu().avxvnni) f.push_back("avxvnni");
  if (cpu().avx512) f.push_back("avx512");
  if (cpu().bf16) f.push_back("avx512bf16");
  return f;
}

// y [M, N] = x [M, K] @ W^T for a row-major bf16 W (decode batch sizes; prefill stays with torch);
// y is bf16 for a bf16 x, fp32 otherwise
torch::Tensor qk_linear_bf16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() &&
              x.size(1) == w.size(1) && w.size(1) % kBlock == 0, "qk_linear_bf16: x [M, K], w bf16 [N, K], K % 32 == 0");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  torch::Tensor xb = x.to(torch::kBFloat16).contiguous();
  QMat m{};
  m.qw = reinterpret_cast<const uint8_t*>(w.data_ptr());
  m.fmt = 16;
  m.n = n;
  m.k = k;
  std::vector<QAct> acts(rows);
  for (int64_t r = 0; r < rows; ++r)
    acts[r].xb = reinterpret_cast<const uint16_t*>(xb.data_ptr()) + r * k;
  const Result y(rows, n, x.scalar_type() == torch::kBFloat16);
  // every row of a batch in one pass over each tile (the tile's passes share its loads: ops' tile)
  at::parallel_for(0, tiles(m), grain(m.k * 2 * kTile * rows), [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(rows * kTile);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t valid = std::min<int64_t>(kTile, n - t * kTile);
      ops().tile(m, t, acts.data(), rows, tmp.data());
      for (int64_t r = 0; r < rows; ++r) y.put(r * n + t * kTile, tmp.data() + r * kTile, valid);
    }
  });
  return y.t;
}

// y [M, N] = x [M, K] @ W^T; y is bf16 for a bf16 x, fp32 otherwise
torch::Tensor qk_linear(torch::Tensor x, torch::Tensor qw, torch::Tensor scales, c10::optional<torch::Tensor> zeros,
                        int64_t fmt, int64_t group, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "qk_linear: x must be [M, K]");
  const int64_t rows = x.size(0), k = x.size(1);
  QMat m = mat_from(qw, scales, zeros, fmt, group, n, k);
  std::vector<float> xbuf;
  torch::Tensor keep;
  const float* xf = f32_values(x, xbuf, keep);
  QActBuf buf;
  quantize_rows(xf, rows, k, buf);
  std::vector<QAct> acts(rows);
  for (int64_t r = 0; r < rows; ++r) acts[r] = buf.row(r, k);
  const Result y(rows, n, x.scalar_type() == torch::kBFloat16);
  const int64_t nt = tiles(m);
  // rows of x in chunks of 64 so a tile's codes are read from memory once per chunk, not once per row
  constexpr int64_t kChunk = 64;
  at::parallel_for(0, nt, grain(m.k * (m.fmt == 4 ? 8 : 16) * std::min<int64_t>(rows, kChunk)), [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(std::min(rows, kChunk) * kTile);
    for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
      const int64_t nr = std::min(kChunk, rows - r0);
      for (int64_t t = lo; t < hi; ++t) {
        ops().tile(m, t, acts.data() + r0, nr, tmp.data());
        const int64_t valid = std::min<int64_t>(kTile, n - t * kTile);
        for (int64_t r = 0; r < nr; ++r) y.put((r0 + r) * n + t * kTile, tmp.data() + r * kTile, valid);
      }
    }
  });
  return y.t;
}

namespace qk {

// Several matrices on the same rows xf [rows, k] fp32: the rows are quantized once and one parallel region
// runs every matrix's tiles, each tile as `linear` / `linear_bf16` computes it; outs[p] [rows, n_p], bf16
// (rounded as torch's .to(torch.bfloat16)) when `bf16`, else fp32. No torch op and no allocation past the
// first calls of a thread: qk_layers.cpp runs a whole decode step of these.
void linear_many_into(const float* xf, int64_t rows, int64_t k, const QMat* mats, int64_t np, void* const* outs,
                      bool bf16) {
  TORCH_CHECK(np >= 1 && np <= kMaxMats && rows >= 1 && k % kBlock == 0, "linear_many: 1..", kMaxMats,
              " matrices on rows whose width is a multiple of 32");
  int64_t first[kMaxMats + 1] = {0};
  bool want16 = false;
  int64_t bytes = 0;
  for (int64_t p = 0; p < np; ++p) {
    const QMat& m = mats[p];
    want16 = want16 || m.fmt == 16;
    first[p + 1] = first[p] + tiles(m);
    bytes += m.n * m.k * (m.fmt == 4 ? 1 : m.fmt == 8 ? 2 : 4) / 2;
  }
  thread_local QActBuf buf;  // the calling thread's, reused; the lambda below reads only `ap`
  thread_local std::vector<QAct> acts;
  quantize_rows(xf, rows, k, buf, want16);
  acts.resize(rows);
  for (int64_t r = 0; r < rows; ++r) acts[r] = buf.row(r, k);
  const QAct* ap = acts.data();
  const int64_t total = first[np];
  const Ops& f = ops();
  at::parallel_for(0, total, grain(bytes / std::max<int64_t>(total, 1) * rows), [&](int64_t lo, int64_t hi) {
    float small[8 * kTile];
    std::vector<float> big(rows > 8 ? rows * kTile : 0);
    float* tmp = rows > 8 ? big.data() : small;
    int64_t p = std::upper_bound(first, first + np + 1, lo) - first - 1;
    for (int64_t i = lo; i < hi; ++i) {
      while (i >= first[p + 1]) ++p;
      const QMat& m = mats[p];
      const int64_t t = i - first[p], valid = std::min<int64_t>(kTile, m.n - t * kTile);
      f.tile(m, t, ap, rows, tmp);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = r * m.n + t * kTile;
        if (bf16) f.to_bf16_row(tmp + r * kTile, valid, static_cast<uint16_t*>(outs[p]) + at);
        else std::memcpy(static_cast<float*>(outs[p]) + at, tmp + r * kTile, valid * sizeof(float));
      }
    }
  });
}

}  // namespace qk

// Several matrices on one input x [M, K] (a layer's projections of the same hidden state), `linear_many_into`
// on tensors. `table` int64 [P, 8]: per matrix (qw or bf16 weight ptr, scales ptr, zeros ptr or 0, fmt 4/8/16,
// group, n, k, 0), from tensors cpu_kernel.py's callers keep alive. Returns the P outputs [M, n], bf16 for a
// bf16 x, fp32 otherwise.
std::vector<torch::Tensor> qk_linear_many(torch::Tensor x, torch::Tensor table) {
  TORCH_CHECK(x.dim() == 2, "qk_linear_many: x must be [M, K]");
  TORCH_CHECK(table.scalar_type() == torch::kLong && table.dim() == 2 && table.size(1) == 8 && table.is_contiguous() &&
              table.size(0) > 0 && table.size(0) <= kMaxMats, "qk_linear_many: table must be int64 [P, 8], P <= ",
              kMaxMats);
  const int64_t rows = x.size(0), k = x.size(1), np = table.size(0);
  TORCH_CHECK(k % kBlock == 0 && rows > 0, "qk_linear_many: in_features must be a multiple of 32");
  QMat mats[kMaxMats];
  for (int64_t p = 0; p < np; ++p) {
    const int64_t* f = table.data_ptr<int64_t>() + p * 8;
    TORCH_CHECK(f[0] != 0 && (f[3] == 4 || f[3] == 8 || f[3] == 16) && f[5] > 0 && f[6] == k,
                "qk_linear_many: matrix ", p, " does not take this input");
    mats[p] = mat_from_row(f);
  }
  std::vector<float> xbuf;
  torch::Tensor keep;
  const float* xf = f32_values(x, xbuf, keep);
  const bool bf = x.scalar_type() == torch::kBFloat16;
  std::vector<torch::Tensor> ys;
  void* outs[kMaxMats];
  for (int64_t p = 0; p < np; ++p) {
    ys.push_back(torch::empty({rows, mats[p].n}, bf ? torch::kBFloat16 : torch::kFloat));
    outs[p] = ys.back().data_ptr();
  }
  linear_many_into(xf, rows, k, mats, np, outs, bf);
  return ys;
}

namespace qk {

// T tokens xf [T, H] fp32 through their routed experts (ids, wts [T, ks]) into y [T, H] fp32 (see qk_moe).
void moe_rows_into(const float* xf, int64_t T, int64_t hdim, const int64_t* tb, int64_t experts, const int64_t* ip,
                   const float* wp, int64_t ks, float* yp) {
  TORCH_CHECK(T >= 1 && ks >= 1, "qk_moe: no rows or no experts chosen");
  const int64_t nr = T * ks;
  // the union of the rows' experts, first seen first, and per expert the (row, slot) pairs that chose it
  std::vector<int64_t> uniq, user_first{0}, users;  // users: row * ks + slot, grouped by expert
  {
    std::vector<std::vector<int64_t>> by;
    std::vector<int64_t> where(experts, -1);
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t e = ip[i];
      TORCH_CHECK(e >= 0 && e < experts, "qk_moe: expert id out of range");
      if (where[e] < 0) {
        where[e] = static_cast<int64_t>(uniq.size());
        uniq.push_back(e);
        by.emplace_back();
      }
      by[where[e]].push_back(i);
    }
    for (const auto& b : by) {
      users.insert(users.end(), b.begin(), b.end());
      user_first.push_back(static_cast<int64_t>(users.size()));
    }
  }
  const int64_t nu = static_cast<int64_t>(uniq.size());
  int64_t most = 1;  // users of one expert at most (T, unless a row chose an expert twice)
  for (int64_t u = 0; u < nu; ++u) most = std::max(most, user_first[u + 1] - user_first[u]);
  std::vector<QMat> gu(nu), dn(nu);
  for (int64_t u = 0; u < nu; ++u)
    for (int j = 0; j < 2; ++j) {
      const int64_t* f = tb + (uniq[u] * 2 + j) * 8;
      TORCH_CHECK(f[0] != 0, "qk_moe: expert ", uniq[u], " has no fused kernel");
      (j == 0 ? gu[u] : dn[u]) = mat_from_row(f);
    }
  const int64_t inter = dn[0].k;
  bool gu16 = false, dn16 = false;
  for (int64_t u = 0; u < nu; ++u) {
    TORCH_CHECK(gu[u].k == hdim && gu[u].n == 2 * inter && dn[u].k == inter && dn[u].n == hdim,
                "qk_moe: expert shapes do not match the hidden size");
    gu16 = gu16 || gu[u].fmt == 16;
    dn16 = dn16 || dn[u].fmt == 16;
  }
  TORCH_CHECK(inter % kBlock == 0, "qk_moe: the expert width must be a multiple of 32");
  // the calling thread's buffers, reused (the lambdas below read them through these references)
  thread_local QActBuf tl_xa, tl_aa;
  QActBuf &xa = tl_xa, &aa = tl_aa;
  quantize_rows(xf, T, hdim, xa, gu16);
  // per expert, the activation rows of its users (x's rows for gate_up; their SiLU x up rows for down)
  aa.resize(nr, inter);
  std::vector<QAct> xin(users.size()), ain(users.size());
  for (size_t i = 0; i < users.size(); ++i) {
    xin[i] = xa.row(users[i] / ks, hdim);
    ain[i] = aa.row(users[i], inter);
  }
  // gate_up, SiLU x up and the int8 blocks of the result in one pass. A work item is a run of `run` tiles of one
  // expert's gate rows and the matching run of its up rows, for every row that chose the expert. The longer the
  // runs, the less the read switches between the gate and up streams: whole experts per item read faster than
  // runs of 2 tiles (one MoE layer, top-8 of 64, weights out of cache, interleaved A/B rounds; same sums). Runs
  // halve until every thread has two items.
  const int64_t nj = inter / kBlock, ntg = inter / kTile;
  int64_t run = ntg;
  while (run % 4 == 0 && nu * (ntg / run) < 2 * at::get_num_threads()) run /= 2;
  const int64_t nrun = ntg / run;
  const Ops& f = ops();
  at::parallel_for(0, nu * nrun, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(most * kTile), h(most * 2 * run * kTile);  // h [user][gate run, up run]
    float act[kBlock];
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t u = i / nrun, j = i % nrun, u0 = user_first[u], m = user_first[u + 1] - u0;
      for (int half = 0; half < 2; ++half)
        for (int64_t r = 0; r < run; ++r) {
          f.tile(gu[u], half * ntg + run * j + r, xin.data() + u0, m, tmp.data());
          for (int64_t c = 0; c < m; ++c)
            std::memcpy(h.data() + (c * 2 * run + half * run + r) * kTile, tmp.data() + c * kTile, kTile * sizeof(float));
        }
      for (int64_t c = 0; c < m; ++c) {
        const float* hc = h.data() + c * 2 * run * kTile;
        const int64_t pair = users[u0 + c];  // row * ks + slot
        for (int64_t q = 0; q < run / 2; ++q) {
          f.silu_mul32(hc + q * kBlock, hc + run * kTile + q * kBlock, act);
          const int64_t b = pair * nj + j * (run / 2) + q;
          f.quantize_row(act, kBlock, aa.q.data() + b * kBlock, aa.d.data() + b, aa.s.data() + b, aa.ds.data() + b);
          if (dn16) f.to_bf16_row(act, kBlock, aa.xb.data() + b * kBlock);
        }
      }
    }
  });
  // down: each thread owns a run of output tiles; every expert's product for each of its users is kept,
  // then each row sums its slots in slot order
  const int64_t nt2 = tiles(dn[0]);
  at::parallel_for(0, nt2, 1, [&](int64_t lo, int64_t hi) {
    const int64_t span = (hi - lo) * kTile;
    std::vector<float> prod(nr * span), tmp(most * kTile), acc(span);
    for (int64_t u = 0; u < nu; ++u) {
      const int64_t u0 = user_first[u], m = user_first[u + 1] - u0;
      for (int64_t t = lo; t < hi; ++t) {
        f.tile(dn[u], t, ain.data() + u0, m, tmp.data());
        for (int64_t c = 0; c < m; ++c)
          std::memcpy(prod.data() + users[u0 + c] * span + (t - lo) * kTile, tmp.data() + c * kTile,
                      kTile * sizeof(float));
      }
    }
    for (int64_t row = 0; row < T; ++row) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < ks; ++s) {
        const float w = wp[row * ks + s];
        const float* p = prod.data() + (row * ks + s) * span;
        for (int64_t i = 0; i < span; ++i) acc[i] += w * p[i];
      }
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t valid = std::min<int64_t>(kTile, hdim - t * kTile);
        std::memcpy(yp + row * hdim + t * kTile, acc.data() + (t - lo) * kTile, valid * sizeof(float));
      }
    }
  });
}

}  // namespace qk

// T tokens (a step's row, a verify's or a batch's rows) through their routed experts: x [T, H], ids int64 and
// weights fp32 [T, k] (one row: x [H] or [1, H] with ids and weights [k]); y [T, H] fp32, row r's
// sum_slot wts[r, slot] * down_e(silu(gate_e(x[r])) * up_e(x[r])) in slot order, e = ids[r, slot]. `table`
// [experts, 2, 8]: per expert, gate_up then down, each a descriptor row (mat_from_row). Each expert of the rows'
// union is read once for all the rows that chose it, and a row's sums in a tile do not depend on the other rows,
// so row r is bit for bit its result alone (one op for every row count).
torch::Tensor qk_moe(torch::Tensor x, torch::Tensor table, torch::Tensor ids, torch::Tensor wts) {
  TORCH_CHECK(table.scalar_type() == torch::kLong && table.dim() == 3 && table.size(1) == 2 && table.size(2) == 8 &&
              table.is_contiguous(), "qk_moe: table must be int64 [E, 2, 8]");
  if (ids.dim() == 1 && wts.dim() == 1) {  // one row
    x = x.view({1, -1});
    ids = ids.view({1, -1});
    wts = wts.view({1, -1});
  }
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.sizes() == wts.sizes() && ids.size(0) == x.size(0) &&
              x.size(0) >= 1 && ids.size(1) >= 1, "qk_moe: x [T, H], ids and weights [T, k] (or [H] and [k])");
  const torch::Tensor idc = ids.to(torch::kLong).contiguous(), wc = wts.to(torch::kFloat).contiguous();
  std::vector<float> xbuf;
  torch::Tensor keep;
  const torch::Tensor xc = x.contiguous();
  const float* xf = f32_values(xc, xbuf, keep);
  torch::Tensor y = torch::empty({x.size(0), x.size(1)}, torch::kFloat);
  moe_rows_into(xf, x.size(0), x.size(1), table.data_ptr<int64_t>(), table.size(0), idc.data_ptr<int64_t>(),
                wc.data_ptr<float>(), ids.size(1), y.data_ptr<float>());
  return y;
}

// Denormal fp32 results flushed to zero and denormal inputs read as zero (MXCSR FTZ | DAZ) on the calling
// thread and every thread of torch's pool, or both cleared (`on` false); returns whether they were set on the
// calling thread before. Why: where a Gated DeltaNet head forgets fast, a prefill's decay products
// exp(cum_i - cum_j) underflow into denormals, and every operation on one takes a microcode assist (the
// chunked rule then ran several times slower). Not x86: nothing, false.
bool qk_flush_denormals(bool on) {
#if defined(__x86_64__) || defined(__i386__)
  constexpr unsigned kBits = 0x8040;  // FTZ (bit 15) | DAZ (bit 6)
  const bool was = (_mm_getcsr() & kBits) == kBits;
  const auto set = [on] { _mm_setcsr(on ? (_mm_getcsr() | kBits) : (_mm_getcsr() & ~kBits)); };
  set();
  // one index per thread: OpenMP's static split gives each thread of the team exactly one
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) set();
  });
  return was;
#else
  (void)on;
  return false;
#endif
}

// Sum of an fp32 tensor, read once at full speed on torch's pool: what the benches time as the machine's
// read bandwidth (torch's own sum reads slower, so it understated the bound).
double qk_stream_sum(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.numel() % 64 == 0,
              "qk_stream_sum: x must be contiguous fp32 with a multiple of 64 elements");
  const float* p = x.data_ptr<float>();
  constexpr int64_t kSpan = 1 << 16;  // floats per work item
  const int64_t items = (x.numel() + kSpan - 1) / kSpan;
  return at::parallel_reduce(0, items, 1, 0.0, [&](int64_t lo, int64_t hi, double acc) {
    for (int64_t i = lo; i < hi; ++i)
      acc += ops().sum_f32(p + i * kSpan, std::min(kSpan, x.numel() - i * kSpan));
    return acc;
  }, std::plus<double>());
}

// The quantizer's kernels (qk_quant_impl.h, formats/int4.py and int8.py): rows of x [R, K] into the stored parts,
// in place; returns (squared error of the stored weights, sum of x^2). One thread, the GIL released: the
// quantizer runs row chunks on its own threads. The table in use (QUANTKIT_CPU_ISA, set_table) runs them.
namespace {

void check_quant(const torch::Tensor& x, const torch::Tensor& out, const torch::Tensor& scales, int64_t out_numel,
                 int64_t scales_numel) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() && out.is_contiguous() &&
                  out.element_size() == 1 && out.numel() == out_numel && scales.scalar_type() == torch::kBFloat16 &&
                  scales.is_contiguous() && scales.numel() == scales_numel,
              "quant: x must be a contiguous matrix on the CPU, the outputs contiguous and sized for it");
}

}  // namespace

std::tuple<double, double> qk_quant_int4(torch::Tensor x, int64_t group, std::vector<double> grid,
                                         torch::Tensor packed, torch::Tensor scales) {
  const int64_t R = x.dim() == 2 ? x.size(0) : 0, K = x.dim() == 2 ? x.size(1) : 0;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat,
              "quant_int4: x must be bf16 or fp32");
  TORCH_CHECK(group % 16 == 0 && group > 0 && group <= 128 && K % group == 0 && grid.size() <= 8,
              "quant_int4: group must be 16..128 in steps of 16 and divide K; at most 8 clip factors");
  check_quant(x, packed, scales, R * K / 2, R * K / group);
  float f[8];
  for (size_t i = 0; i < grid.size(); ++i) f[i] = static_cast<float>(grid[i]);
  const qk::Ops& t = ops();
  double sums[2] = {0.0, 0.0};
  uint8_t* pk = static_cast<uint8_t*>(packed.data_ptr());
  uint16_t* sc = reinterpret_cast<uint16_t*>(scales.data_ptr<at::BFloat16>());
  const int ng = static_cast<int>(grid.size());
  pybind11::gil_scoped_release no_gil;
  if (x.scalar_type() == torch::kFloat)
    t.quant_int4_f32(x.data_ptr<float>(), R, K, group, f, ng, pk, sc, sums);
  else
    t.quant_int4_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), R, K, group, f, ng, pk, sc, sums);
  return {sums[0], sums[1]};
}

std::tuple<double, double> qk_quant_int8(torch::Tensor x, torch::Tensor q, torch::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "quant_int8: x must be bf16");
  check_quant(x, q, scales, x.numel(), x.dim() == 2 ? x.size(0) : 0);
  const qk::Ops& t = ops();
  double sums[2] = {0.0, 0.0};
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  int8_t* qp = static_cast<int8_t*>(q.data_ptr());
  uint16_t* sc = reinterpret_cast<uint16_t*>(scales.data_ptr<at::BFloat16>());
  pybind11::gil_scoped_release no_gil;
  t.quant_int8(xb, x.size(0), x.size(1), qp, sc, sums);
  return {sums[0], sums[1]};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("rms", &qk_rms, "RMSNorm of bf16 rows with the (1 + w) multiplier precomputed");
  mod.def("add_rms", &qk_add_rms, "a residual add and the next RMSNorm: (x + a, rms(x + a))");
  mod.def("silu_mul", &qk_silu_mul, "bf16(bf16(silu(gate)) * up)");
  mod.def("route", &qk_route, "softmax, top-k and renormalisation of each row of a router's logits: (weights, ids)");
  mod.def("moe_out", &qk_moe_out, "x + routed + sigmoid(sg) * shared, a MoE block's output on the residual");
  mod.def("gdn_batch", &qk_gdn_batch, "a decode batch's tokens through gdn_rows, each on its own window and state");
  mod.def("gdn_rows", &qk_gdn_rows,
          "T tokens of one cache through a Gated DeltaNet layer's core, keeping the states between (or none)");
  mod.def("attn_rows", &qk_attn_rows, "R consecutive tokens of one cache through a gated attention layer's core");
  mod.def("delta_step", &qk_delta_step, "one token of the gated delta rule, state updated in place");
  mod.def("argmax", &qk_argmax, "torch.argmax of a contiguous bf16 or fp32 tensor (its first maximum)");
  mod.def("logsumexp", &qk_logsumexp, "torch.logsumexp over the last dim of a contiguous bf16 [B, V] or [V]: fp32 [B]");
  mod.def("flush_denormals", &qk_flush_denormals, "FTZ and DAZ on every thread of torch's pool (or off): were they on");
  mod.def("stream_sum", &qk_stream_sum, "sum of an fp32 tensor at streaming speed (the read-bandwidth probe)");
  mod.def("isa", &qk_isa, "the instruction set level in use: 2 AVX512, 1 AVX2, 0 generic");
  mod.def("detect_isa", &qk_detect_isa, "the best level this CPU and this build can run");
  mod.def("set_isa", &qk_set_isa, "use a lower level (QUANTKIT_CPU_ISA, tests)");
  mod.def("table", &qk_table, "the op table in use: generic, avx2, avx2vnni, avx512 or avx512bf16");
  mod.def("tables", &qk_tables, "the tables this CPU can run in this build, best first");
  mod.def("set_table", &qk_set_table, "use this table (tests, benches)");
  mod.def("isa_plain_name", &qk_isa_plain_name, "the table of the level in use without its extension");
  mod.def("units", &qk_units, "the ISA units this module was built with");
  mod.def("cpu_features", &qk_cpu_features, "what this CPU and its OS can run: avx2, avxvnni, avx512, avx512bf16");
  mod.def("linear", &qk_linear, "y [M, N] fp32 = x [M, K] @ W^T from repacked int4/int8 tiles");
  mod.def("linear_many", &qk_linear_many, "several matrices on one input: one quantization, one parallel region");
  mod.def("moe", &qk_moe, "T tokens through their routed experts, each expert read once for its rows");
  mod.def("linear_bf16", &qk_linear_bf16, "y [M, N] fp32 = x [M, K] @ W^T, W row-major bf16");
  mod.def("quant_int4", &qk_quant_int4, "rows to symmetric int4 with the clip search: (squared error, sum x^2)");
  mod.def("quant_int8", &qk_quant_int8, "bf16 rows to int8 per row: (squared error, sum x^2)");
  qk_bind_layers(mod);
}
