// A layer's pieces besides the matrices, for quantkit's rows (runtime/model/: a step is one row, a verify or a
// prompt chunk several rows of one cache, a batch rows of many). Each replaces a run of small torch ops: an op
// costs a few microseconds of dispatch on a CPU, as much as reading a small matrix, and a Qwen3.5-MoE layer ran
// about forty of them (the per-layer overhead in reports/bench-decode.md, measured with every matrix stubbed).
// Each takes any count of rows, row j bit for bit its call alone: one op for every kind of call.
// - delta_step: the Gated DeltaNet state update of one token (torch: six ops, four passes over the state);
// - rms, add_rms, silu_mul, route, moe_out: a layer's norms, the shared expert's activation, the router's
//   softmax / top-k / renormalisation and the MoE block's sum with the residual;
// - gdn_rows: a Gated DeltaNet layer between its input and output projections (conv window, SiLU, gates,
//   q/k l2-norm, state update, gated RMSNorm) for T tokens of one cache; gdn_batch: rows each on its own cache;
// - attn_rows: a gated attention layer between its projections (q/k RMSNorm, rotary, the K/V write,
//   attention, sigmoid gate) for R consecutive tokens of one cache;
// - argmax, logsumexp: the greedy token of a row of logits, and the log of its softmax's denominator.
// Every op runs on each ISA's table (qk_ops_impl.h); this file checks the tensors, splits the work over
// torch's threads and calls the table.
// They keep the torch route's dtypes and roundings (bf16 activations rounded where torch rounds them, fp32
// norms, gates and state); sums run in another order and exp / sigmoid / SiLU use the table's exp, so results
// differ from torch's in the last fp32 bit and, through a bf16 rounding, now and then in one bf16 step
// (tests/kernels/test_step_ops.py states the bounds).

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "qk_common.h"
#include "qk_step.h"

using namespace qk;

namespace {

uint16_t* bf16_ptr(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// 1 / (1 + e^-x) of one value in fp32 (torch's sigmoid, before its bf16 rounding)
inline float sigmoid1(float x) { return 1.f / (1.f + std::exp(-x)); }

}  // namespace

// The gated delta rule for one token over H heads (runtime/linear_attn.py): q, k [H, K] (normalised,
// q scaled, heads already repeated), v [H, V], decay = exp(g) and beta [H], all fp32; state [H, K, V] fp32
// updated in place; returns out [H, V] fp32. torch's route (mul_, bmm, addcmul_, bmm) passes over the
// 2 MB state of a real layer four times and costs six ops; this reads and writes it once.
torch::Tensor qk_delta_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor decay,
                            torch::Tensor beta, torch::Tensor state) {
  TORCH_CHECK(state.scalar_type() == torch::kFloat && state.is_contiguous() && state.dim() == 3,
              "qk_delta_step: state must be contiguous fp32 [H, K, V]");
  const int64_t H = state.size(0), K = state.size(1), V = state.size(2);
  for (const torch::Tensor* t : {&q, &k, &v, &decay, &beta})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous(), "qk_delta_step: inputs must be contiguous fp32");
  TORCH_CHECK(q.numel() == H * K && k.numel() == H * K && v.numel() == H * V && decay.numel() == H &&
              beta.numel() == H, "qk_delta_step: shapes do not match the state");
  torch::Tensor out = torch::empty({H, V}, torch::kFloat);
  float* sp = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Ops& f = ops();
  at::parallel_for(0, H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> kv(V);
    for (int64_t h = lo; h < hi; ++h)
      f.delta_head(sp + h * K * V, sp + h * K * V, K, V, qp + h * K, kp + h * K, vp + h * V, dp[h], bp[h], kv.data(),
                   op + h * V, false);
  });
  return out;
}

// ---------------------------------------------------------------- the lean step's fused pieces
namespace {

void check_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.device().is_cpu(), what,
              " must be a contiguous bf16 CPU tensor");
}

void check_f32(const torch::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == numel, what,
              " must be contiguous fp32 with ", numel, " values");
}

}  // namespace

// transformers' Qwen3_5MoeRMSNorm of each row of x [.., H] (bf16) with its (1 + w) multiplier `scale` fp32 [H]
torch::Tensor qk_rms(torch::Tensor x, torch::Tensor scale, double eps) {
  check_bf16(x, "qk_rms: x");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  check_f32(scale, h, "qk_rms: scale");
  torch::Tensor y = torch::empty_like(x);
  for (int64_t r = 0; r < rows; ++r)
    ops().rms_row(bf16_ptr(x) + r * h, h, scale.data_ptr<float>(), static_cast<float>(eps), bf16_ptr(y) + r * h);
  return y;
}

// (s, rms(s)) for s = x + a (one residual add rounded to bf16, then the next norm), each row [.., H] bf16 alone
std::vector<torch::Tensor> qk_add_rms(torch::Tensor x, torch::Tensor a, torch::Tensor scale, double eps) {
  check_bf16(x, "qk_add_rms: x");
  check_bf16(a, "qk_add_rms: a");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  TORCH_CHECK(a.numel() == x.numel(), "qk_add_rms: x and a differ in size");
  check_f32(scale, h, "qk_add_rms: scale");
  torch::Tensor s = torch::empty_like(x), y = torch::empty_like(x);
  ops().add_bf16(bf16_ptr(x), bf16_ptr(a), x.numel(), bf16_ptr(s));
  for (int64_t r = 0; r < rows; ++r)
    ops().rms_row(bf16_ptr(s) + r * h, h, scale.data_ptr<float>(), static_cast<float>(eps), bf16_ptr(y) + r * h);
  return {s, y};
}

// bf16(bf16(silu(gate)) * up): the shared expert's activation (F.silu(gate) * up on bf16 tensors)
torch::Tensor qk_silu_mul(torch::Tensor gate, torch::Tensor up) {
  check_bf16(gate, "qk_silu_mul: gate");
  check_bf16(up, "qk_silu_mul: up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "qk_silu_mul: gate and up differ in shape");
  torch::Tensor y = torch::empty_like(gate);
  ops().silu_mul_bf16(bf16_ptr(gate), bf16_ptr(up), gate.numel(), bf16_ptr(y));
  return y;
}

// transformers' Qwen3_5MoeTopKRouter after its linear on one row of e logits: softmax over the experts in fp32, the
// k largest (largest first, the lower id first on a tie), renormalised to sum 1, rounded to the logits' bf16, into
// w [k] fp32 and ids [k].
namespace qk {

void route_into(const uint16_t* lp, int64_t e, int64_t k, float* w, int64_t* ids) {
  thread_local std::vector<float> tl_p;
  thread_local std::vector<int64_t> tl_order;
  std::vector<float>& p = tl_p;
  std::vector<int64_t>& order = tl_order;
  p.resize(e);
  order.resize(e);
  float mx = -INFINITY;
  for (int64_t i = 0; i < e; ++i) mx = std::fmax(mx, bf16_value(lp[i]));
  const float sum = ops().exp_shifted(lp, e, mx, p.data());
  for (int64_t i = 0; i < e; ++i) p[i] /= sum;
  for (int64_t i = 0; i < e; ++i) order[i] = i;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  float top = 0.f;
  for (int64_t j = 0; j < k; ++j) top += p[order[j]];
  for (int64_t j = 0; j < k; ++j) {
    w[j] = through_bf16(p[order[j]] / top);
    ids[j] = order[j];
  }
}

float moe_gate(uint16_t sg) { return through_bf16(sigmoid1(bf16_value(sg))); }

}  // namespace qk

// route_into on each row of logits [B, E] (a step's, a verify's or a batch's; [E]: one row): (weights fp32 [B, k],
// ids int64 [B, k]), each row as it is alone
std::vector<torch::Tensor> qk_route(torch::Tensor logits, int64_t k) {
  check_bf16(logits, "qk_route: logits");
  if (logits.dim() == 1) logits = logits.view({1, -1});
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) >= 1, "qk_route: logits must be [B, E] or [E]");
  const int64_t rows = logits.size(0), e = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= e, "qk_route: top_k must be in 1..", e);
  torch::Tensor w = torch::empty({rows, k}, torch::kFloat), ids = torch::empty({rows, k}, torch::kLong);
  for (int64_t j = 0; j < rows; ++j)
    route_into(bf16_ptr(logits) + j * e, e, k, w.data_ptr<float>() + j * k, ids.data_ptr<int64_t>() + j * k);
  return {w, ids};
}

// x + bf16(bf16(routed) + bf16(bf16(sigmoid(sg)) * shared)): a MoE block's output added to the residual
// stream, row by row; x, shared [R, H] bf16, routed fp32 [R * H] (qk.moe's sums), sg [R, 1] bf16 (each row's
// shared expert gate)
torch::Tensor qk_moe_out(torch::Tensor x, torch::Tensor routed, torch::Tensor shared, torch::Tensor sg) {
  check_bf16(x, "qk_moe_out: x");
  check_bf16(shared, "qk_moe_out: shared");
  check_bf16(sg, "qk_moe_out: sg");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  check_f32(routed, x.numel(), "qk_moe_out: routed");
  TORCH_CHECK(shared.numel() == x.numel() && sg.numel() == rows, "qk_moe_out: shapes do not match");
  torch::Tensor y = torch::empty_like(x);
  for (int64_t r = 0; r < rows; ++r)
    ops().moe_out(bf16_ptr(x) + r * h, routed.data_ptr<float>() + r * h, bf16_ptr(shared) + r * h,
                  moe_gate(bf16_ptr(sg)[r]), h, bf16_ptr(y) + r * h);
  return y;
}

namespace qk {

GdnArgs gdn_layer_args(const torch::Tensor& conv, const torch::Tensor& conv_w, const torch::Tensor& neg_a,
                       const torch::Tensor& dt_bias, const torch::Tensor& norm_w, bool norm_w_bf16,
                       const torch::Tensor& state, int64_t hk, double eps) {
  check_bf16(conv, "qk_gdn: conv");
  TORCH_CHECK(state.scalar_type() == torch::kFloat && state.is_contiguous() && state.dim() == 3 && conv.dim() == 2,
              "qk_gdn: state fp32 [Hv, Dk, Dv], conv [K, C]");
  GdnArgs g{};
  g.hv = state.size(0);
  g.dk = state.size(1);
  g.dv = state.size(2);
  g.hk = hk;
  g.taps = conv.size(0);
  g.channels = conv.size(1);
  TORCH_CHECK(hk >= 1 && g.hv % hk == 0 && g.channels == 2 * hk * g.dk + g.hv * g.dv && g.taps >= 1,
              "qk_gdn: shapes do not match the layer");
  TORCH_CHECK(g.dk <= kMaxHeadDim && g.dv <= kMaxHeadDim, "qk_gdn: head dims above ", kMaxHeadDim);
  check_f32(conv_w, g.taps * g.channels, "qk_gdn: conv_w");
  check_f32(neg_a, g.hv, "qk_gdn: neg_a");
  check_f32(dt_bias, g.hv, "qk_gdn: dt_bias");
  check_f32(norm_w, g.dv, "qk_gdn: norm_w");
  g.conv = bf16_ptr(conv);
  g.conv_w = conv_w.data_ptr<float>();
  g.neg_a = neg_a.data_ptr<float>();
  g.dt_bias = dt_bias.data_ptr<float>();
  g.norm_w = norm_w.data_ptr<float>();
  g.norm_w_bf16 = norm_w_bf16;
  g.state = state.data_ptr<float>();
  g.eps = static_cast<float>(eps);
  return g;
}

void gdn_rows_into(const GdnArgs& g0, int64_t t, float* kept, uint16_t* op, const float* from, uint16_t* xs) {
  TORCH_CHECK(t >= 1, "qk_gdn_rows: no tokens");
  thread_local std::vector<uint16_t> tl_x;
  if (!xs) {
    tl_x.resize(t * g0.channels);
    xs = tl_x.data();
  }
  const Ops& f = ops();
  for (int64_t j = 0; j < t; ++j) {  // the conv window moves token by token
    GdnArgs g = g0;
    g.qkv = g0.qkv + j * g0.channels;
    f.gdn_conv(g, xs + j * g0.channels);
  }
  gdn_heads_into(g0, t, xs, from ? from : g0.state, kept, op);
}

// Each head goes through the t tokens while its state is in cache. Where no state before the last is kept, each
// block of the state's columns goes through up to kMaxDeltaRows tokens at a time in L1 (gdn_head_rows), so a
// verify writes to memory what one step writes and a prompt chunk's tokens pass the head's state in cache; a last
// state written out of place (a verify's, a replay's) streams past the cache.
void gdn_heads_into(const GdnArgs& g0, int64_t t, const uint16_t* x, const float* from, float* kept, uint16_t* op) {
  const int64_t hs = g0.dk * g0.dv, n = g0.hv * hs, od = g0.hv * g0.dv;
  TORCH_CHECK(t >= 1, "qk_gdn_rows: no tokens");
  GdnArgs stack[kMaxRows];
  std::vector<GdnArgs> heap(t > kMaxRows ? t : 0);  // a prompt chunk's rows; a verify's stay on the stack
  GdnArgs* g = t > kMaxRows ? heap.data() : stack;
  for (int64_t j = 0; j < t; ++j) {
    g[j] = g0;
    g[j].z = g0.z + j * od;
    g[j].b = g0.b + j * g0.hv;
    g[j].a = g0.a + j * g0.hv;
  }
  const Ops& f = ops();
  if (!kept && t > 1 && g0.dv % 16 == 0) {  // every block of a head's state through the tokens in L1
    std::vector<uint16_t*> outs(t);
    for (int64_t j = 0; j < t; ++j) outs[j] = op + j * od;
    const int64_t most = std::min<int64_t>(t, kMaxDeltaRows);
    at::parallel_for(0, g0.hv, 1, [&](int64_t lo, int64_t hi) {
      thread_local std::vector<float> tl_scratch;
      tl_scratch.resize(most * (2 * g0.dk + 3 * g0.dv) + g0.dk * kDeltaBlockCols);
      uint16_t ob[kMaxHeadDim];
      for (int64_t h = lo; h < hi; ++h)
        for (int64_t j = 0; j < t; j += kMaxDeltaRows) {  // the state in place between runs, in cache
          const int64_t r = std::min<int64_t>(kMaxDeltaRows, t - j);
          f.gdn_head_rows(g + j, r, x + j * g0.channels, h, j == 0 ? from + h * hs : g0.state + h * hs,
                          g0.state + h * hs, j + r == t, tl_scratch.data(), ob, outs.data() + j);
        }
    });
    return;
  }
  at::parallel_for(0, g0.hv, 1, [&](int64_t lo, int64_t hi) {
    float scratch[2 * kMaxHeadDim + 3 * kMaxHeadDim];
    uint16_t ob[kMaxHeadDim];
    thread_local std::vector<float> tl_s;
    if (!kept && t > 1) tl_s.resize(hs);
    for (int64_t h = lo; h < hi; ++h) {
      const float* in = from + h * hs;
      for (int64_t j = 0; j < t; ++j) {
        const bool last = j + 1 == t;
        float* s = last ? g0.state + h * hs : (kept ? kept + j * n + h * hs : tl_s.data());
        f.gdn_head(g[j], x + j * g0.channels, h, in, s, last && !kept, scratch, ob, op + j * od);
        in = s;
      }
    }
  });
}

}  // namespace qk

namespace {

// a Gated DeltaNet layer's arguments with its `rows` tokens' projections (qkv [rows, C], z [rows, Hv*Dv], b and
// a [rows, Hv]) checked and pointed at the first
GdnArgs gdn_args(const torch::Tensor& qkv, const torch::Tensor& z, const torch::Tensor& b, const torch::Tensor& a,
                 const torch::Tensor& conv, const torch::Tensor& conv_w, const torch::Tensor& neg_a,
                 const torch::Tensor& dt_bias, const torch::Tensor& norm_w, bool norm_w_bf16,
                 const torch::Tensor& state, int64_t hk, double eps, int64_t rows) {
  GdnArgs g = gdn_layer_args(conv, conv_w, neg_a, dt_bias, norm_w, norm_w_bf16, state, hk, eps);
  for (const auto& [t, what] : {std::pair{&qkv, "qk_gdn: qkv"}, {&z, "qk_gdn: z"}, {&b, "qk_gdn: b"},
                                {&a, "qk_gdn: a"}})
    check_bf16(*t, what);
  TORCH_CHECK(qkv.numel() == rows * g.channels && z.numel() == rows * g.hv * g.dv && b.numel() == rows * g.hv &&
              a.numel() == rows * g.hv, "qk_gdn: shapes do not match the layer");
  g.qkv = bf16_ptr(qkv);
  g.z = bf16_ptr(z);
  g.b = bf16_ptr(b);
  g.a = bf16_ptr(a);
  return g;
}

}  // namespace

// T tokens of one cache (a step's one, a verify's, a prompt chunk's) through a Gated DeltaNet layer between its
// projections: qkv [T, C], z [T, Hv*Dv], b and a [T, Hv] (bf16, the in_proj outputs); conv [K, C] bf16, the conv
// window (updated in place); conv_w fp32 [K, C]; neg_a = -exp(A_log), dt_bias fp32 [Hv]; norm_w fp32 [Dv]
// (`norm_w_bf16`: the model's weight is bf16, so w * y rounds); state fp32 [Hv, Dk, Dv] (updated in place): conv
// window, SiLU, gates, q/k l2-norm, state update, gated RMSNorm, row j bit for bit this call on row j alone after
// rows 0..j-1. Keeps the state after each token but the last in `states` [T - 1,
// Hv, Dk, Dv] fp32 (the last goes to `state`), or none (empty `states`: a step's, a verify's, a prompt chunk's).
// Why one call: each head's state goes through the T tokens while it is in cache, where T calls read and write
// the whole state from memory per token. Threads split the value heads. Returns [T, Hv*Dv] bf16.
torch::Tensor qk_gdn_rows(torch::Tensor qkv, torch::Tensor z, torch::Tensor b, torch::Tensor a, torch::Tensor conv,
                          torch::Tensor conv_w, torch::Tensor neg_a, torch::Tensor dt_bias, torch::Tensor norm_w,
                          bool norm_w_bf16, torch::Tensor state, torch::Tensor states, int64_t hk, double eps) {
  const int64_t t = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && t >= 1, "qk_gdn_rows: qkv must be [T, C], T >= 1");
  const GdnArgs g0 = gdn_args(qkv, z, b, a, conv, conv_w, neg_a, dt_bias, norm_w, norm_w_bf16, state, hk, eps, t);
  const bool keep = states.numel() > 0;
  TORCH_CHECK(!keep || (states.scalar_type() == torch::kFloat && states.is_contiguous() && states.dim() == 4 &&
                        states.size(0) == t - 1 && states.size(1) == g0.hv && states.size(2) == g0.dk &&
                        states.size(3) == g0.dv),
              "qk_gdn_rows: states must be contiguous fp32 [T - 1, Hv, Dk, Dv], or empty to keep none");
  torch::Tensor out = torch::empty({t, g0.hv * g0.dv}, torch::kBFloat16);
  gdn_rows_into(g0, t, keep ? states.data_ptr<float>() : nullptr, bf16_ptr(out));
  return out;
}

// B tokens of a decode batch through a Gated DeltaNet layer's core, each on its own cache: qkv [B, C], z [B, Hv*Dv],
// b and a [B, Hv] (bf16, row j the in_proj outputs of row j), convs[j] and states[j] row j's conv window and state
// (updated in place), the layer's other arguments as qk_gdn_rows's. Row j bit for bit qk_gdn_rows on row j alone.
// Why one call: one parallel region over every row's heads, where B calls fork and join the pool B times.
// Returns [B, Hv*Dv] bf16.
torch::Tensor qk_gdn_batch(torch::Tensor qkv, torch::Tensor z, torch::Tensor b, torch::Tensor a,
                           std::vector<torch::Tensor> convs, torch::Tensor conv_w, torch::Tensor neg_a,
                           torch::Tensor dt_bias, torch::Tensor norm_w, bool norm_w_bf16,
                           std::vector<torch::Tensor> states, int64_t hk, double eps) {
  const int64_t rows = static_cast<int64_t>(convs.size());
  TORCH_CHECK(rows >= 1 && states.size() == convs.size() && qkv.dim() == 2 && qkv.size(0) == rows,
              "qk_gdn_batch: qkv [B, C] with one conv window and one state per row");
  std::vector<GdnArgs> g(rows);
  for (int64_t j = 0; j < rows; ++j) {
    g[j] = gdn_args(qkv[j], z[j], b[j], a[j], convs[j], conv_w, neg_a, dt_bias, norm_w, norm_w_bf16, states[j], hk,
                    eps, 1);
    TORCH_CHECK(g[j].channels == g[0].channels && g[j].hv == g[0].hv && g[j].dk == g[0].dk && g[j].dv == g[0].dv,
                "qk_gdn_batch: row ", j, "'s window or state is not the layer's shape");
    for (int64_t i = 0; i < j; ++i)
      TORCH_CHECK(g[i].state != g[j].state && g[i].conv != g[j].conv, "qk_gdn_batch: rows ", i, " and ", j,
                  " share a cache (each row needs its own)");
  }
  const int64_t C = g[0].channels, hv = g[0].hv, hs = g[0].dk * g[0].dv, od = hv * g[0].dv;
  torch::Tensor out = torch::empty({rows, od}, torch::kBFloat16);
  std::vector<uint16_t> xs(rows * C);
  const Ops& f = ops();
  for (int64_t j = 0; j < rows; ++j) f.gdn_conv(g[j], xs.data() + j * C);
  uint16_t* op = bf16_ptr(out);
  at::parallel_for(0, rows * hv, 1, [&](int64_t lo, int64_t hi) {
    float scratch[2 * kMaxHeadDim + 3 * kMaxHeadDim];
    uint16_t ob[kMaxHeadDim];
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t j = i / hv, h = i % hv;
      float* s = g[j].state + h * hs;
      f.gdn_head(g[j], xs.data() + j * C, h, s, s, true, scratch, ob, op + j * od);
    }
  });
  return out;
}

// R consecutive tokens of one cache (a step's one, a verify's, a prompt chunk's) through a gated attention layer
// between its projections: qo [R, heads * 2 hd] (per head its query then its gate), ko and vo [R, kv * hd] (bf16);
// qk_scale fp32 [heads + kv, hd] (q_norm's then k_norm's (1 + w)); cos and sin bf16 [R, rot], row j at position
// n + j; the layer's K/V buffers [kv, cap, hd] bf16, where row j's K/V are written at n + j and its query attends
// over positions 0..n + j. The roundings of transformers' eager route: scores rounded to bf16, scaled in bf16,
// softmax in fp32 rounded to bf16, the weighted sum in fp32 rounded to bf16, then times bf16(sigmoid(gate)); only
// the order of fp32 sums and the exp differ. Row j is bit for bit this call on row j alone after rows 0..j-1: each
// block of keys and values is read once for a tile of rows while it is in cache (R calls would read the whole
// K/V R times). Returns [R, heads * hd] bf16, the input of o_proj.
torch::Tensor qk_attn_rows(torch::Tensor qo, torch::Tensor ko, torch::Tensor vo, torch::Tensor qk_scale,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor keys, torch::Tensor values, int64_t n,
                           double scaling, double eps) {
  for (const auto& [t, what] : {std::pair{&qo, "qk_attn_rows: q"}, {&ko, "qk_attn_rows: k"}, {&vo, "qk_attn_rows: v"},
                                {&cos, "qk_attn_rows: cos"}, {&sin, "qk_attn_rows: sin"}})
    check_bf16(*t, what);
  TORCH_CHECK(qo.dim() == 2 && qo.size(0) >= 1 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
              cos.size(0) == qo.size(0), "qk_attn_rows: q [R, heads * 2 hd] with cos and sin [R, rot]");
  const int64_t rows = qo.size(0);
  const AttnArgs at = attn_layer_args(qk_scale, keys, values, scaling, eps, qo.size(1));
  TORCH_CHECK(ko.numel() == rows * at.kv * at.hd && vo.numel() == rows * at.kv * at.hd,
              "qk_attn_rows: shapes do not fit");
  torch::Tensor out = torch::empty({rows, at.heads * at.hd}, torch::kBFloat16);
  attn_rows_into(at, rows, bf16_ptr(qo), bf16_ptr(ko), bf16_ptr(vo), bf16_ptr(cos), bf16_ptr(sin), cos.size(1), n,
                 bf16_ptr(out));
  return out;
}

namespace qk {

AttnArgs attn_layer_args(const torch::Tensor& qk_scale, const torch::Tensor& keys, const torch::Tensor& values,
                         double scaling, double eps, int64_t q_width) {
  check_bf16(keys, "qk_attn_rows: keys");
  check_bf16(values, "qk_attn_rows: values");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes(), "qk_attn_rows: keys and values [kv, cap, hd]");
  AttnArgs at{};
  at.kv = keys.size(0);
  at.cap = keys.size(1);
  at.hd = keys.size(2);
  at.heads = q_width / (2 * at.hd);
  TORCH_CHECK(at.hd % 16 == 0 && at.hd <= kMaxHeadDim && at.heads >= 1 && at.heads % at.kv == 0 &&
              q_width == at.heads * 2 * at.hd, "qk_attn_rows: shapes do not fit (head_dim a multiple of 16)");
  check_f32(qk_scale, (at.heads + at.kv) * at.hd, "qk_attn_rows: qk_scale");
  at.qk_scale = qk_scale.data_ptr<float>();
  at.keys = bf16_ptr(keys);
  at.values = bf16_ptr(values);
  at.scaling = static_cast<float>(scaling);
  at.eps = static_cast<float>(eps);
  return at;
}

void attn_rows_into(const AttnArgs& at, int64_t rows, const uint16_t* qo, const uint16_t* ko, const uint16_t* vo,
                    const uint16_t* cos, const uint16_t* sin, int64_t rot, int64_t n, uint16_t* op) {
  TORCH_CHECK(rot % 2 == 0 && rot <= at.hd && n >= 0 && rows >= 1 && n + rows <= at.cap, "qk_attn_rows: shapes do "
              "not fit (rotary width ", rot, ", positions ", n, "..", n + rows - 1, " of a capacity of ", at.cap, ")");
  const int64_t heads = at.heads, kv = at.kv, hd = at.hd, cap = at.cap, g = heads / kv;
  std::vector<uint16_t> q(rows * heads * hd);
  const Ops& f = ops();
  // every row's q and k normed and rotated, its K/V written: a row reads only positions up to its own, so the
  // writes of the rows after it change nothing it reads
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    uint16_t nrm[kMaxHeadDim], k[kMaxHeadDim];
    for (int64_t t = lo; t < hi; ++t) {
      f.norm_rotate(qo + t * heads * 2 * hd, 2 * hd, heads, hd, at.qk_scale, cos + t * rot, sin + t * rot, rot,
                    at.eps, nrm, q.data() + t * heads * hd);
      for (int64_t h = 0; h < kv; ++h) {
        f.norm_rotate(ko + (t * kv + h) * hd, hd, 1, hd, at.qk_scale + (heads + h) * hd, cos + t * rot,
                      sin + t * rot, rot, at.eps, nrm, k);
        std::memcpy(at.keys + (h * cap + n + t) * hd, k, hd * sizeof(uint16_t));
        std::memcpy(at.values + (h * cap + n + t) * hd, vo + (t * kv + h) * hd, hd * sizeof(uint16_t));
      }
    }
  });
  // query heads per kv head in groups of G (16, 8, 4, 2 or 1: the widest dividing g)
  const int G = g % 16 == 0 ? 16 : g % 8 == 0 ? 8 : g % 4 == 0 ? 4 : g % 2 == 0 ? 2 : 1;
  // work items (tile of rows, kv head, group of G query heads), the longest rows first, taken in turn by the
  // threads: the rows' costs grow with their positions, so a static split would leave one thread the last tiles
  const int64_t threads = at::get_num_threads(), groups = g / G;
  // tiles of up to kTileRows rows, smaller where that leaves a thread without two items
  constexpr int64_t kTileRows = 8;  // a tile keeps rows x heads x keys scores: smaller ones stay nearer the core
  const int64_t per = std::max<int64_t>(1, (2 * threads + kv * groups - 1) / (kv * groups));
  const int64_t tile = std::clamp<int64_t>((rows + per - 1) / per, 1, kTileRows);
  const int64_t tiles = (rows + tile - 1) / tile, items = tiles * kv * groups;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> tl_s, tl_acc;
    tl_s.resize(tile * G * (n + rows));
    tl_acc.resize(tile * G * hd);
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t tl = tiles - 1 - i / (kv * groups), h = i / groups % kv, q0 = h * g + i % groups * G;
      const int64_t t0 = tl * tile, nt = std::min(tile, rows - t0);
      f.attend_rows(G, nt, q.data() + t0 * heads * hd + q0 * hd, heads * hd, at.keys + h * cap * hd,
                    at.values + h * cap * hd, n + t0 + 1, hd, at.scaling, tl_s.data(), tl_acc.data(),
                    op + t0 * heads * hd + q0 * hd, heads * hd);
      for (int64_t t = t0; t < t0 + nt; ++t)
        for (int64_t qh = q0; qh < q0 + G; ++qh)
          f.gate_mul(op + (t * heads + qh) * hd, qo + t * heads * 2 * hd + qh * 2 * hd + hd, hd);
    }
  });
}

}  // namespace qk

// The index of the largest element of a contiguous bf16 or fp32 tensor, as torch.argmax gives it (the first of
// equal maxima, -0 equal to 0, a NaN above everything): torch reads bf16 element by element, a few percent of a
// greedy decode step on a 248k vocabulary. Read as signed integers, positive floats order as their bits and
// negative ones in reverse, so the ISA table's integer reductions per chunk (max, min, largest magnitude bits)
// say which bits the answer has: a NaN's if any, else the largest bits if one is >= 0 (with -0 as 0), else the
// smallest; then only the first chunk that holds them is searched.
namespace {
template <typename I, typename U>
int64_t argmax_bits(const U* x, int64_t n, void (*range)(const U*, int64_t, int32_t*)) {
  constexpr int64_t kChunk = 4096;
  constexpr I kMag = std::numeric_limits<I>::max(), kSign = std::numeric_limits<I>::min();
  constexpr I kInf = sizeof(I) == 2 ? I(0x7F80) : I(0x7F800000);
  const int64_t nc = (n + kChunk - 1) / kChunk;
  std::vector<int32_t> r(3 * nc);
  int32_t mx = std::numeric_limits<I>::min(), mn = kMag, ma = 0;
  for (int64_t c = 0; c < nc; ++c) {
    range(x + c * kChunk, std::min(kChunk, n - c * kChunk), &r[3 * c]);
    mx = std::max(mx, r[3 * c]);
    mn = std::min(mn, r[3 * c + 1]);
    ma = std::max(ma, r[3 * c + 2]);
  }
  // which values are the answer, and which chunks can hold one
  const bool nan = ma > kInf, zero = !nan && mx == 0;
  auto hit = [&](I v) {
    if (nan) return I(v & kMag) > kInf;
    if (zero) return v == 0 || v == kSign;
    return int32_t(v) == (mx >= 0 ? mx : mn);
  };
  for (int64_t c = 0; c < nc; ++c) {
    const int32_t* rc = &r[3 * c];
    const bool may = nan ? rc[2] > kInf : zero ? (rc[0] >= 0 || rc[1] == kSign) : mx >= 0 ? rc[0] == mx : rc[1] == mn;
    if (!may) continue;
    for (int64_t i = c * kChunk, e = std::min(n, i + kChunk); i < e; ++i)
      if (hit(static_cast<I>(x[i]))) return i;
  }
  return 0;  // not reached: the chunk of the overall range holds its value
}
}  // namespace

namespace qk {
int64_t argmax_bf16(const uint16_t* x, int64_t n) { return argmax_bits<int16_t>(x, n, ops().bit_range16); }
}  // namespace qk

int64_t qk_argmax(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.numel() > 0 && (x.scalar_type() == torch::kBFloat16 ||
              x.scalar_type() == torch::kFloat), "qk_argmax: x must be a non-empty contiguous bf16 or fp32 tensor");
  const Ops& f = ops();
  if (x.scalar_type() == torch::kBFloat16) return argmax_bits<int16_t>(bf16_ptr(x), x.numel(), f.bit_range16);
  return argmax_bits<int32_t>(reinterpret_cast<const uint32_t*>(x.data_ptr<float>()), x.numel(), f.bit_range32);
}

// log(sum(exp(x))) of each row of a contiguous bf16 tensor [B, V] (or [V], one row), fp32 [B]: the row's max
// (argmax_bf16) plus the log of the table's exp_shifted sums (per chunk, so each fp32 lane adds a few hundred
// terms; the chunks' sums in double). Why not torch.logsumexp: its vectorised exp leaves every element more than
// about 87 below the max to a scalar route, and a vocabulary's logits spread that far, so it cost the server's
// logprobs more than the rest of sampling (reports/one-engine/server-logprobs.md). The table's exp clamps there,
// and the denormal terms (far below the max: none moves the sum) are flushed while it runs. A row whose max is
// not finite gives that max (NaN; +inf; -inf where every element is -inf).
torch::Tensor qk_logsumexp(torch::Tensor x) {
  check_bf16(x, "qk_logsumexp: x");
  TORCH_CHECK(x.dim() >= 1 && x.numel() > 0, "qk_logsumexp: x must be [B, V] or [V], not empty");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  torch::Tensor out = torch::empty({rows}, torch::kFloat);
  constexpr int64_t kChunk = 4096;
  thread_local std::vector<float> tl_p;
  tl_p.resize(std::min(n, kChunk));
#if defined(__x86_64__) || defined(__i386__)
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // FTZ | DAZ on this thread, as qk_flush_denormals sets them
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = bf16_ptr(x) + r * n;
    const float mx = bf16_value(row[argmax_bf16(row, n)]);
    double sum = 0.0;
    for (int64_t i = 0; std::isfinite(mx) && i < n; i += kChunk)
      sum += ops().exp_shifted(row + i, std::min(kChunk, n - i), mx, tl_p.data());
    out.data_ptr<float>()[r] = std::isfinite(mx) ? static_cast<float>(mx + std::log(sum)) : mx;
  }
#if defined(__x86_64__) || defined(__i386__)
  _mm_setcsr(csr);
#endif
  return out;
}
