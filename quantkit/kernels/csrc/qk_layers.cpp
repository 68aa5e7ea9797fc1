// A decode step's whole stack of layers in one call from Python: `Layers`, filled once per cache by
// runtime/model/model.py (Model._bound_stack) and run once per token; with `set_head`, `step` also runs the
// final norm and the head, so that everything after the embedding is that one call. `verify` runs a
// speculative verify's T tokens and `draft` the MTP layer's draft the same way.
//
// Why: on the fused route a layer is about a dozen kernel calls, and between them Python looked up the
// layer's tensors, converted each argument through pybind11 and kept the results alive (40 times over on the
// real model). Here the same ops follow each other in C++, with the same arguments in the same order, so the
// results are those of the Python loop bit for bit (tests/kernels/test_step_ops.py, tests/runtime/test_model_forward.py). They
// run on the kernel's pointer-level cores (qk_cpu.h, qk_step.h) into buffers this object owns, so a call makes
// no torch op between its matrices and allocates only what it returns. The router's matrix joins the shared
// expert's projections in one linear_many call (each of its tiles computed as linear_bf16 computes it).
//
// Every tensor a layer needs is held here (the descriptor tables point into weights the loaded model keeps);
// the conv windows, recurrent states and K/V buffers are updated in place, as on the Python route. One call
// runs at a time (a lock): the buffers are shared.

#include "qk_layers.h"

#include <algorithm>
#include <mutex>
#include <tuple>
#include <vector>

#include "qk_common.h"
#include "qk_cpu.h"
#include "qk_step.h"

using namespace qk;

namespace {

uint16_t* bf16_ptr(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

void check_table(const torch::Tensor& t, int64_t rows, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kLong && t.dim() == 2 && t.size(0) == rows && t.size(1) == 8 &&
              t.is_contiguous(), "qk Layers: ", what, " must be an int64 [", rows, ", 8] descriptor table");
}

void check_rows(const torch::Tensor& t, int64_t rows, int64_t width, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.dim() == 2 && t.size(0) == rows &&
              t.size(1) == width, "qk Layers: ", what, " must be contiguous bf16 [", rows, ", ", width, "]");
}

void check_scale(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == n, "qk Layers: ", what,
              " must be contiguous fp32 [", n, "]");
}

// A descriptor table's matrices (all on one input width k) and where each one's output starts in a buffer of
// `rows` outputs laid one after the other ([rows, n_0], then [rows, n_1], ...).
struct Mats {
  torch::Tensor table;  // kept alive
  std::vector<QMat> m;
  int64_t k = 0, width = 0;  // input width, sum of the outputs' widths
  Mats() = default;
  Mats(const torch::Tensor& t, int64_t rows, const char* what) : table(t) {
    check_table(t, rows, what);
    const int64_t* f = t.data_ptr<int64_t>();
    k = f[6];
    for (int64_t p = 0; p < rows; ++p, f += 8) {
      TORCH_CHECK(f[0] != 0 && (f[3] == 4 || f[3] == 8 || f[3] == 16) && f[5] > 0 && f[6] == k && k % 32 == 0,
                  "qk Layers: matrix ", p, " of ", what, " is not a kernel matrix on the table's input");
      m.push_back(mat_from_row(f));
      width += f[5];
    }
  }
  int64_t n(size_t p) const { return m[p].n; }
};

struct Layer {
  bool gdn = false;  // a Gated DeltaNet layer, else gated attention
  torch::Tensor pre, post;  // the two norms' (1 + w), fp32
  float eps = 0;
  Mats in, out;  // the mixer's input projections, its output projection
  // Gated DeltaNet: its tensors (kept alive; held[5] the state), their pointers, the conv trail a verify fills
  // (grown on demand; views per token count, made once); `spare`, the state buffer a verify writes its last
  // state to (the two then trade places: `spare` keeps the state before it), and what `rewind` replays the
  // verify's tokens from: their conv outputs, z, b and a rows (`replay_t` tokens; 0: nothing to replay)
  std::vector<torch::Tensor> held;
  GdnArgs g{};
  torch::Tensor conv_trail, spare;
  std::vector<torch::Tensor> conv_views;
  std::vector<uint16_t> replay;
  int64_t replay_t = 0;
  // gated attention
  AttnArgs at{};
  // the MoE block: shared gate, up, sigmoid gate and the router; the shared down; the routed experts
  Mats shared_in, shared_down;
  torch::Tensor experts;
  int64_t top_k = 0;
  bool has_moe = false;
};

// bf16 values widened to fp32 (exact)
void widen(const uint16_t* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_value(x[i]);
}

class Layers {
 public:
  void add_gdn(torch::Tensor pre, torch::Tensor post, double eps, torch::Tensor in, torch::Tensor out,
               torch::Tensor conv, torch::Tensor conv_w, torch::Tensor neg_a, torch::Tensor dt_bias,
               torch::Tensor norm_w, bool norm_w_bf16, torch::Tensor state, int64_t hk) {
    Layer L = base(pre, post, eps, in, 4, out, "a Gated DeltaNet layer's in_proj table");
    L.gdn = true;
    L.held = {conv, conv_w, neg_a, dt_bias, norm_w, state};
    L.g = gdn_layer_args(conv, conv_w, neg_a, dt_bias, norm_w, norm_w_bf16, state, hk, eps);
    TORCH_CHECK(L.in.n(0) == L.g.channels && L.in.n(1) == L.g.hv * L.g.dv && L.in.n(2) == L.g.hv &&
                L.in.n(3) == L.g.hv && L.out.k == L.g.hv * L.g.dv,
                "qk Layers: a Gated DeltaNet layer's projections do not match its state");
    layers_.push_back(std::move(L));
  }

  void add_attention(torch::Tensor pre, torch::Tensor post, double eps, torch::Tensor in, torch::Tensor out,
                     torch::Tensor qk_scale, torch::Tensor keys, torch::Tensor values, double scaling, double qk_eps) {
    Layer L = base(pre, post, eps, in, 3, out, "an attention layer's q/k/v table");
    L.held = {qk_scale, keys, values};
    L.at = attn_layer_args(qk_scale, keys, values, scaling, qk_eps, L.in.n(0));
    TORCH_CHECK(L.in.n(1) == L.at.kv * L.at.hd && L.in.n(2) == L.at.kv * L.at.hd &&
                L.out.k == L.at.heads * L.at.hd, "qk Layers: an attention layer's projections do not match its K/V");
    layers_.push_back(std::move(L));
  }

  // the MoE block of the layer added last
  void set_moe(torch::Tensor shared_in, torch::Tensor shared_down, torch::Tensor experts, int64_t top_k) {
    TORCH_CHECK(!layers_.empty(), "qk Layers: set_moe before any layer");
    TORCH_CHECK(experts.scalar_type() == torch::kLong && experts.dim() == 3 && experts.size(1) == 2 &&
                experts.size(2) == 8 && experts.is_contiguous(),
                "qk Layers: the experts' table must be qk_moe's int64 [E, 2, 8]");
    TORCH_CHECK(top_k >= 1 && top_k <= experts.size(0), "qk Layers: top_k must be in 1..", experts.size(0));
    Layer& L = layers_.back();
    L.shared_in = Mats(shared_in, 4, "the shared expert's gate/up/gate + router table");
    L.shared_down = Mats(shared_down, 1, "the shared expert's down table");
    const Mats& s = L.shared_in;
    TORCH_CHECK(s.k == hidden_ && s.n(0) == s.n(1) && s.n(2) == 1 && s.n(3) == experts.size(0) &&
                L.shared_down.k == s.n(0) && L.shared_down.n(0) == hidden_,
                "qk Layers: the MoE block's shapes do not match the layer");
    L.experts = experts;
    L.top_k = top_k;
    L.has_moe = true;
    grow(s.width, L.shared_down.k, top_k);
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // the final norm ((1 + w) fp32) and the head's descriptor table [1, 8], for `step` and `verify`
  void set_head(torch::Tensor scale, double eps, torch::Tensor table) {
    head_ = Mats(table, 1, "the head's table");
    if (!hidden_) hidden_ = head_.k;  // a stack of no layers: the final norm and the head
    check_scale(scale, hidden_, "the final norm");
    TORCH_CHECK(head_.k == hidden_, "qk Layers: the head does not take the hidden size");
    head_scale_ = scale;
    head_eps_ = static_cast<float>(eps);
    grow(0, 0, 0);
  }

  // A whole decode step after the embedding: x [1, H] bf16 through every layer, the final norm and the head;
  // the rotary's cos and sin are row `row` of the tables [R, rot]. Returns the logits [V].
  torch::Tensor step(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t row, int64_t n) {
    TORCH_CHECK(head_.k, "qk Layers: step before set_head");
    check_rows(x, 1, hidden_, "x");
    std::lock_guard<std::mutex> lock(mu_);
    return step_rows(bf16_ptr(x), cos, sin, row, n);
  }

  // `step` of a token id, its row read from the table `set_embed` gave
  torch::Tensor step_ids(const std::vector<int64_t>& ids, torch::Tensor cos, torch::Tensor sin, int64_t row,
                         int64_t n) {
    TORCH_CHECK(ids.size() == 1, "qk Layers: a step takes one token");
    std::lock_guard<std::mutex> lock(mu_);
    return step_rows(embed(ids), cos, sin, row, n);
  }

  // A speculative verify: x [T, H] bf16 (T = 2..4 tokens at positions n .. n + T - 1; their rotary rows are
  // rows row .. row + T - 1 of cos and sin [R, rot]) through every layer, the final norm and the head, with the
  // logits T calls of `step` give, bit for bit. Why here and not T steps: every matrix but the Gated DeltaNet
  // recurrence and the attention's scores is read once for the T rows (the multi-row tiles; a row's sums do
  // not depend on the others), and the routed experts once for the union of the rows' choices (moe_rows_into).
  // The mixers' cores take the T rows in one call each (gdn_rows_into, attn_rows_into: row j bit for bit its call
  // alone); norms, routing and the MoE sum run row by row as `step` runs them. Each Gated DeltaNet layer
  // writes its state after the T tokens to a second buffer, which becomes the layer's state, and keeps the one
  // before, from which `rewind` replays the tokens kept (the state after every position, written out, cost 3-
  // and 4-token verifies more: reports/mtp-verify-states/). Returns the logits [T, V], the final norm's output [T, H]
  // (what the MTP layer drafts from) and, per Gated DeltaNet layer in order, its conv inputs (the window before,
  // then the T qkv rows: [K + T, C], a view of this object's buffer, which the next verify writes again) and its
  // state tensor now (the cache's `state` from here on).
  std::vector<torch::Tensor> verify(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t row, int64_t n) {
    TORCH_CHECK(head_.k, "qk Layers: verify before set_head");
    const int64_t t = x.size(0);
    TORCH_CHECK(x.dim() == 2 && t >= 1 && t <= kMaxRows, "qk Layers: verify takes 1..", kMaxRows, " rows");
    check_rows(x, t, hidden_, "x");
    std::lock_guard<std::mutex> lock(mu_);
    return verify_rows(bf16_ptr(x), t, cos, sin, row, n);
  }

  // `verify` of token ids, their rows read from the table `set_embed` gave
  std::vector<torch::Tensor> verify_ids(const std::vector<int64_t>& ids, torch::Tensor cos, torch::Tensor sin,
                                        int64_t row, int64_t n) {
    const int64_t t = static_cast<int64_t>(ids.size());
    TORCH_CHECK(t >= 1 && t <= kMaxRows, "qk Layers: verify takes 1..", kMaxRows, " rows");
    std::lock_guard<std::mutex> lock(mu_);
    return verify_rows(embed(ids), t, cos, sin, row, n);
  }

  // the embedding table [V, H] bf16 that step_ids, verify_ids and draft_argmax read their rows from
  void set_embed(torch::Tensor table) {
    TORCH_CHECK(hidden_, "qk Layers: set_embed before any layer");
    check_rows(table, table.size(0), hidden_, "the embedding");
    embed_ = table;
  }

  // The MTP layer's own norms' (1 + w), fp32 (the two before fc, the final one), their eps and fc's table [1, 8].
  void set_draft(torch::Tensor emb_scale, torch::Tensor hid_scale, torch::Tensor final_scale, double eps,
                 torch::Tensor fc) {
    fc_ = Mats(fc, 1, "the MTP fc table");
    TORCH_CHECK(fc_.k == 2 * hidden_ && fc_.n(0) == hidden_, "qk Layers: the MTP fc does not map 2H to H");
    check_scale(emb_scale, hidden_, "the MTP embedding norm");
    check_scale(hid_scale, hidden_, "the MTP hidden norm");
    check_scale(final_scale, hidden_, "the MTP final norm");
    emb_scale_ = emb_scale;
    hid_scale_ = hid_scale;
    final_scale_ = final_scale;
    draft_eps_ = static_cast<float>(eps);
    grow(0, 2 * hidden_, 0);
  }

  // The MTP layer's draft (runtime/model/mtp.py) on a one-layer attention stack: T pairs of embedded tokens e and
  // main-model hidden states hid [T, H] bf16 at positions n .. n + T - 1 (rotary rows row .. row + T - 1 of cos
  // and sin). Every pair's norms, fc and attention run, so each writes its K/V; only the last row goes on
  // through o, the MoE block and the final norm, since nothing reads the others' outputs. Returns that row's
  // final-normed hidden [1, H], then the outputs of `head` (any linear_many table: the draft's part of the
  // vocabulary) on it.
  std::vector<torch::Tensor> draft(torch::Tensor e, torch::Tensor hid, torch::Tensor cos, torch::Tensor sin,
                                   int64_t row, int64_t n, torch::Tensor head) {
    const int64_t t = e.size(0);
    const Mats hm = draft_head(head, e.dim() == 2 ? t : 0);
    check_rows(e, t, hidden_, "e");
    check_rows(hid, t, hidden_, "hid");
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<torch::Tensor> out{torch::empty({1, hidden_}, torch::kBFloat16)};
    std::vector<uint16_t*> dst;
    for (size_t p = 0; p < hm.m.size(); ++p) {
      out.push_back(torch::empty({1, hm.n(p)}, torch::kBFloat16));
      dst.push_back(bf16_ptr(out.back()));
    }
    draft_rows(bf16_ptr(e), bf16_ptr(hid), t, cos, sin, row, n, hm, bf16_ptr(out[0]), dst.data());
    return out;
  }

  // Back to the first j (1 <= j <= T) tokens of the last verify in every Gated DeltaNet layer's recurrent state:
  // its T - j last tokens undone by replaying the first j from the state before (the conv window is the
  // caller's, from the conv inputs `verify` returned). Bit for bit the state j steps leave.
  void rewind(int64_t j) {
    std::lock_guard<std::mutex> lock(mu_);
    for (Layer& L : layers_) {
      if (!L.gdn) continue;
      const int64_t t = L.replay_t;
      TORCH_CHECK(t > 0 && j >= 1 && j <= t, "qk Layers: rewind to ", j, " tokens, but the last call was not a "
                  "verify of at least that many");
      L.replay_t = 0;
      if (j == t) continue;
      const Replay r = replay_rows(L, t);
      GdnArgs g = L.g;
      g.z = r.z;
      g.b = r.b;
      g.a = r.a;
      gdn_heads_into(g, j, r.x, L.spare.data_ptr<float>(), nullptr, w_.core.data());
    }
  }

  // `draft` of token ids (rows from the table `set_embed` gave; hid's first T rows pair with them) that returns
  // the argmax of the head's outputs taken as one row (their first maximum, as qk.argmax of their
  // concatenation) and the final-normed hidden [1, H]: a greedy draft with no torch op
  std::tuple<int64_t, torch::Tensor> draft_argmax(const std::vector<int64_t>& ids, torch::Tensor hid,
                                                  torch::Tensor cos, torch::Tensor sin, int64_t row, int64_t n,
                                                  torch::Tensor head) {
    const int64_t t = static_cast<int64_t>(ids.size());
    const Mats hm = draft_head(head, t);
    TORCH_CHECK(hid.scalar_type() == torch::kBFloat16 && hid.is_contiguous() && hid.dim() == 2 &&
                hid.size(0) >= t && hid.size(1) == hidden_, "qk Layers: hid must be contiguous bf16 [>= ", t,
                ", ", hidden_, "]");
    std::lock_guard<std::mutex> lock(mu_);
    w_.logits.resize(hm.width);
    std::vector<uint16_t*> dst;
    for (size_t p = 0, at = 0; p < hm.m.size(); at += hm.n(p), ++p) dst.push_back(w_.logits.data() + at);
    torch::Tensor h = torch::empty({1, hidden_}, torch::kBFloat16);
    draft_rows(embed(ids), bf16_ptr(hid), t, cos, sin, row, n, hm, bf16_ptr(h), dst.data());
    return {argmax_bf16(w_.logits.data(), hm.width), h};
  }

 private:
  torch::Tensor step_rows(const uint16_t* x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t row,
                          int64_t n) {
    TORCH_CHECK(head_.k, "qk Layers: step before set_head");
    const int64_t rot = rope_width(cos, sin, row, 1);
    const uint16_t* h = run(x, 1, bf16_ptr(cos) + row * rot, bf16_ptr(sin) + row * rot, rot, n, false);
    ops().rms_row(h, hidden_, head_scale_.data_ptr<float>(), head_eps_, w_.h.data());
    torch::Tensor logits = torch::empty({head_.n(0)}, torch::kBFloat16);
    linear(head_, w_.h.data(), 1, bf16_ptr(logits));
    return logits;
  }

  std::vector<torch::Tensor> verify_rows(const uint16_t* x, int64_t t, const torch::Tensor& cos,
                                         const torch::Tensor& sin, int64_t row, int64_t n) {
    TORCH_CHECK(head_.k, "qk Layers: verify before set_head");
    const int64_t rot = rope_width(cos, sin, row, t);
    std::vector<torch::Tensor> out{torch::empty({t, head_.n(0)}, torch::kBFloat16),
                                   torch::empty({t, hidden_}, torch::kBFloat16)};
    for (Layer& L : layers_)
      if (L.gdn) trail(L, t);
    const uint16_t* h = run(x, t, bf16_ptr(cos) + row * rot, bf16_ptr(sin) + row * rot, rot, n, true);
    for (Layer& L : layers_)
      if (L.gdn) {
        out.push_back(L.conv_views[t]);
        out.push_back(L.held[5]);
      }
    uint16_t* hn = bf16_ptr(out[1]);
    for (int64_t j = 0; j < t; ++j)
      ops().rms_row(h + j * hidden_, hidden_, head_scale_.data_ptr<float>(), head_eps_, hn + j * hidden_);
    linear(head_, hn, t, bf16_ptr(out[0]));
    return out;
  }

  // a draft's checks for t pairs, and the matrices of its head table
  Mats draft_head(const torch::Tensor& head, int64_t t) const {
    TORCH_CHECK(fc_.k, "qk Layers: draft before set_draft");
    TORCH_CHECK(layers_.size() == 1 && !layers_[0].gdn && layers_[0].has_moe,
                "qk Layers: draft runs a one-layer attention stack");
    TORCH_CHECK(t >= 1 && t <= kMaxRows, "qk Layers: draft takes 1..", kMaxRows, " pairs");
    Mats hm(head, head.size(0), "the draft's head table");
    TORCH_CHECK(hm.k == hidden_, "qk Layers: the draft's head does not take the hidden size");
    return hm;
  }

  // the draft of t pairs (e, hid [t, H] bf16): its final-normed hidden into hf [H], the head's outputs into dst
  void draft_rows(const uint16_t* e, const uint16_t* hid, int64_t t, const torch::Tensor& cos,
                  const torch::Tensor& sin, int64_t row, int64_t n, const Mats& hm, uint16_t* hf,
                  uint16_t* const* dst) {
    const int64_t H = hidden_, rot = rope_width(cos, sin, row, t);
    const Layer& L = layers_[0];
    const Ops& f = ops();
    uint16_t *in = w_.wide.data(), *x = w_.x[0].data(), *h = w_.h.data(), *core = w_.core.data();
    for (int64_t j = 0; j < t; ++j) {
      f.rms_row(e + j * H, H, emb_scale_.data_ptr<float>(), draft_eps_, in + j * 2 * H);
      f.rms_row(hid + j * H, H, hid_scale_.data_ptr<float>(), draft_eps_, in + j * 2 * H + H);
    }
    linear(fc_, in, t, x);
    for (int64_t j = 0; j < t; ++j) f.rms_row(x + j * H, H, L.pre.data_ptr<float>(), L.eps, h + j * H);
    linear(L.in, h, t, w_.proj.data());
    const uint16_t *q = w_.proj.data(), *k = q + t * L.in.n(0), *v = k + t * L.in.n(1);
    const uint16_t *cp = bf16_ptr(cos) + row * rot, *sp = bf16_ptr(sin) + row * rot;
    attn_rows_into(L.at, t, q, k, v, cp, sp, rot, n, core);  // every pair writes its K/V; the last one's goes on
    uint16_t* y = w_.x[1].data();
    mix_out_and_moe(L, x + (t - 1) * H, core + (t - 1) * L.out.k, 1, y);
    f.rms_row(y, H, final_scale_.data_ptr<float>(), draft_eps_, hf);
    linear(hm, hf, 1, nullptr, dst);
  }

  // the embedding rows of ids (the table `set_embed` gave) in the workspace
  const uint16_t* embed(const std::vector<int64_t>& ids) {
    TORCH_CHECK(embed_.defined(), "qk Layers: token ids before set_embed");
    const int64_t V = embed_.size(0), H = hidden_;
    TORCH_CHECK(static_cast<int64_t>(ids.size()) <= kMaxRows, "qk Layers: more than ", kMaxRows, " tokens");
    uint16_t* out = w_.emb.data();
    for (size_t j = 0; j < ids.size(); ++j) {
      TORCH_CHECK(ids[j] >= 0 && ids[j] < V, "qk Layers: token id ", ids[j], " is outside the vocabulary of ", V);
      std::memcpy(out + j * H, bf16_ptr(embed_) + ids[j] * H, H * sizeof(uint16_t));
    }
    return out;
  }

  // the fields every layer has, checked; the workspace grown for its widths
  Layer base(const torch::Tensor& pre, const torch::Tensor& post, double eps, const torch::Tensor& in, int64_t n_in,
             const torch::Tensor& out, const char* what) {
    Layer L;
    L.in = Mats(in, n_in, what);
    L.out = Mats(out, 1, "a mixer's output projection table");
    if (layers_.empty() && !hidden_) hidden_ = L.in.k;
    TORCH_CHECK(L.in.k == hidden_ && L.out.n(0) == hidden_, "qk Layers: a layer's projections do not take the "
                "hidden size ", hidden_);
    check_scale(pre, hidden_, "a layer's input norm");
    check_scale(post, hidden_, "a layer's post-attention norm");
    L.pre = pre;
    L.post = post;
    L.eps = static_cast<float>(eps);
    grow(L.in.width, L.out.k, 0);
    return L;
  }

  // the rotary width of tables cos and sin [R, rot] whose rows row .. row + t - 1 a call reads
  static int64_t rope_width(const torch::Tensor& cos, const torch::Tensor& sin, int64_t row, int64_t t) {
    TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.scalar_type() == torch::kBFloat16 &&
                sin.scalar_type() == torch::kBFloat16 && cos.is_contiguous() && sin.is_contiguous() && row >= 0 &&
                row + t <= cos.size(0), "qk Layers: rows ", row, "..", row + t - 1,
                " are not in the rotary tables (contiguous bf16 [R, rot])");
    return cos.size(1);
  }

  // the workspace for rows of `wide` projection outputs, mixer outputs of `core` and `k` experts per row
  void grow(int64_t wide, int64_t core, int64_t k) {
    Work& w = w_;
    const int64_t R = kMaxRows, H = hidden_;
    wide_ = std::max({wide_, wide, 2 * H});
    core_ = std::max({core_, core, H});
    k_ = std::max(k_, k);
    for (auto* b : {&w.x[0], &w.x[1], &w.h, &w.o, &w.res, &w.nrm, &w.shared, &w.emb}) b->resize(R * H);
    w.wide.resize(R * wide_);
    w.proj.resize(R * wide_);
    w.core.resize(R * core_);
    w.xf.resize(R * std::max(wide_, core_));
    w.routed.resize(R * H);
    w.wts.resize(R * k_);
    w.ids.resize(R * k_);
  }

  // where a verify of t tokens keeps, in a Gated DeltaNet layer, the rows `rewind` replays its tokens from
  struct Replay {
    uint16_t *x, *z, *b, *a;  // the conv's outputs [t, C], z [t, Hv * Dv], b and a [t, Hv]
  };
  static Replay replay_rows(Layer& L, int64_t t) {
    uint16_t* x = L.replay.data();
    uint16_t* z = x + t * L.g.channels;
    uint16_t* b = z + t * L.g.hv * L.g.dv;
    return {x, z, b, b + t * L.g.hv};
  }

  // the buffers a verify of t tokens fills in a Gated DeltaNet layer (allocated once, for kMaxRows tokens)
  static void trail(Layer& L, int64_t t) {
    const GdnArgs& g = L.g;
    if (!L.conv_trail.defined()) {
      L.conv_trail = torch::empty({g.taps + kMaxRows, g.channels}, torch::kBFloat16);
      L.conv_views.assign(kMaxRows + 1, torch::Tensor());
      L.spare = torch::empty_like(L.held[5]);
      L.replay.resize(kMaxRows * (g.channels + g.hv * g.dv + 2 * g.hv));
    }
    if (!L.conv_views[t].defined()) L.conv_views[t] = L.conv_trail.narrow(0, 0, g.taps + t);
  }

  // matrices M on t rows x [t, M.k] bf16 into out (their outputs one after the other) or into dst[p]
  void linear(const Mats& M, const uint16_t* x, int64_t t, uint16_t* out, uint16_t* const* dst = nullptr) {
    float* xf = w_.xf.data();
    widen(x, t * M.k, xf);
    void* outs[kMaxMats];
    int64_t at = 0;
    for (size_t p = 0; p < M.m.size(); ++p) {
      outs[p] = dst ? dst[p] : out + at;
      at += t * M.n(p);
    }
    linear_many_into(xf, t, M.k, M.m.data(), static_cast<int64_t>(M.m.size()), outs, true);
  }

  // x [t, H] bf16 through every layer (positions n .., rotary rows cos / sin [t, rot]); `keep`: a verify
  // (each Gated DeltaNet layer's trail filled). Returns the output rows (a workspace buffer).
  const uint16_t* run(const uint16_t* x, int64_t t, const uint16_t* cos, const uint16_t* sin, int64_t rot, int64_t n,
                      bool keep) {
    const Ops& f = ops();
    const int64_t H = hidden_;
    int cur = 0;
    for (Layer& L : layers_) {
      TORCH_CHECK(L.has_moe, "qk Layers: a layer has no MoE block");
      uint16_t *h = w_.h.data(), *p = w_.proj.data(), *core = w_.core.data();
      for (int64_t j = 0; j < t; ++j) f.rms_row(x + j * H, H, L.pre.data_ptr<float>(), L.eps, h + j * H);
      linear(L.in, h, t, p);
      const uint16_t *p1 = p + t * L.in.n(0), *p2 = p1 + t * L.in.n(1);
      if (L.gdn) {
        GdnArgs g = L.g;
        g.qkv = p;
        g.z = p1;
        g.b = p2;
        g.a = p2 + t * L.in.n(2);
        L.replay_t = 0;
        if (keep) {  // the window before, then the T inputs; the replay's rows; the last state into `spare`
          const int64_t C = g.channels;
          uint16_t* c = bf16_ptr(L.conv_trail);
          std::memcpy(c, g.conv, g.taps * C * sizeof(uint16_t));
          std::memcpy(c + g.taps * C, p, t * C * sizeof(uint16_t));
          const Replay r = replay_rows(L, t);
          std::memcpy(r.z, g.z, t * g.hv * g.dv * sizeof(uint16_t));
          std::memcpy(r.b, g.b, t * g.hv * sizeof(uint16_t));
          std::memcpy(r.a, g.a, t * g.hv * sizeof(uint16_t));
          g.state = L.spare.data_ptr<float>();
          gdn_rows_into(g, t, nullptr, core, L.g.state, r.x);
          std::swap(L.held[5], L.spare);
          L.g.state = L.held[5].data_ptr<float>();
          L.replay_t = t;
        } else {
          gdn_rows_into(g, t, nullptr, core);
        }
      } else {
        attn_rows_into(L.at, t, p, p1, p2, cos, sin, rot, n, core);
      }
      uint16_t* y = w_.x[cur].data();
      mix_out_and_moe(L, x, core, t, y);
      x = y;
      cur ^= 1;
    }
    return x;
  }

  // a layer after its mixer's core: out_proj, the residual add and post-attention norm, the MoE block and its
  // residual add, for t rows: x [t, H] the layer's input, core [t, out.k], y [t, H] its output
  void mix_out_and_moe(const Layer& L, const uint16_t* x, const uint16_t* core, int64_t t, uint16_t* y) {
    const Ops& f = ops();
    const int64_t H = hidden_, k = L.top_k, E = L.shared_in.n(3), I = L.shared_in.n(0);
    uint16_t *o = w_.o.data(), *res = w_.res.data(), *nrm = w_.nrm.data(), *s = w_.wide.data();
    uint16_t *act = w_.core.data(), *shared = w_.shared.data();
    linear(L.out, core, t, o);
    for (int64_t j = 0; j < t; ++j) {
      f.add_bf16(x + j * H, o + j * H, H, res + j * H);
      f.rms_row(res + j * H, H, L.post.data_ptr<float>(), L.eps, nrm + j * H);
    }
    linear(L.shared_in, nrm, t, s);  // gate, up, sigmoid gate, router
    const uint16_t *up = s + t * I, *sg = up + t * I, *router = sg + t;
    for (int64_t j = 0; j < t; ++j) f.silu_mul_bf16(s + j * I, up + j * I, I, act + j * I);
    linear(L.shared_down, act, t, shared);
    float *wts = w_.wts.data(), *routed = w_.routed.data();
    int64_t* ids = w_.ids.data();
    for (int64_t j = 0; j < t; ++j) route_into(router + j * E, E, k, wts + j * k, ids + j * k);
    float* xf = w_.xf.data();
    widen(nrm, t * H, xf);
    const int64_t* table = L.experts.data_ptr<int64_t>();
    moe_rows_into(xf, t, H, table, L.experts.size(0), ids, wts, k, routed);
    for (int64_t j = 0; j < t; ++j)
      f.moe_out(res + j * H, routed + j * H, shared + j * H, moe_gate(sg[j]), H, y + j * H);
  }

  struct Work {  // rows of up to kMaxRows tokens
    std::vector<uint16_t> x[2], h, wide, proj, core, o, res, nrm, shared, emb, logits;
    std::vector<float> xf, routed, wts;
    std::vector<int64_t> ids;
  };

  std::vector<Layer> layers_;
  int64_t hidden_ = 0, wide_ = 0, core_ = 0, k_ = 0;
  Work w_;
  std::mutex mu_;
  Mats head_, fc_;
  torch::Tensor head_scale_, emb_scale_, hid_scale_, final_scale_, embed_;
  float head_eps_ = 0, draft_eps_ = 0;
};

}  // namespace

void qk_bind_layers(pybind11::module_& mod) {
  namespace py = pybind11;
  py::class_<Layers>(mod, "Layers", "a decode step's stack of layers, run in one call (qk_layers.cpp)")
      .def(py::init<>())
      .def("add_gdn", &Layers::add_gdn, "append a Gated DeltaNet layer")
      .def("add_attention", &Layers::add_attention, "append a gated attention layer")
      .def("set_moe", &Layers::set_moe, "the MoE block of the layer added last")
      .def("__len__", &Layers::size)
      .def("set_head", &Layers::set_head, "the final norm and the head, for step and verify")
      .def("verify", &Layers::verify, "T tokens' logits as T steps give them, and the states to rewind to",
           py::call_guard<py::gil_scoped_release>())
      .def("rewind", &Layers::rewind, "back to the first j tokens of the last verify in the recurrent states",
           py::call_guard<py::gil_scoped_release>())
      .def("set_draft", &Layers::set_draft, "the MTP layer's pre-fc norms and fc, for draft")
      .def("draft", &Layers::draft, "the MTP layer's draft: the last pair's final-normed hidden and head outputs",
           py::call_guard<py::gil_scoped_release>())
      .def("step", &Layers::step, "x [1, H] bf16 through every layer, the final norm and the head: logits [V]",
           py::call_guard<py::gil_scoped_release>())
      .def("set_embed", &Layers::set_embed, "the bf16 embedding table the *_ids calls read rows from")
      .def("step_ids", &Layers::step_ids, "step of one token id", py::call_guard<py::gil_scoped_release>())
      .def("verify_ids", &Layers::verify_ids, "verify of token ids", py::call_guard<py::gil_scoped_release>())
      .def("draft_argmax", &Layers::draft_argmax, "a greedy draft of token ids: (argmax of the head's outputs, "
           "the final-normed hidden)", py::call_guard<py::gil_scoped_release>());
}
