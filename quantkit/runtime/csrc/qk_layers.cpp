// A decode step's whole stack of layers in one call from Python: `Layers`, filled once per cache by
// runtime/model/model.py (Model._bound_stack) and run once per token; with `set_head`, `step` also runs
// the final norm and the head, so that everything after the embedding is that one call.
//
// Why: on the fused route a layer is about a dozen kernel calls, and between them Python looked up the
// layer's tensors, converted each argument through pybind11 and kept the results alive: about 15 us per
// layer with the weights in cache (the test model's step went 1.46x faster in one call) and about 30 us
// on bench decode's int4 checkpoint (1.03x per step; both medians of alternating runs in one process on
// the build machine), 40 times over on the real model. Here the same calls follow each other in C++,
// with the same arguments in the same order, so the results are those of the Python loop bit for bit
// (tests/test_step_ops.py). The router's matrix joins the shared expert's projections in one
// linear_many call (each of its tiles computed as linear_bf16 computes it: the same logits).
//
// Every tensor a layer needs is held here (the descriptor tables point into weights the loaded model
// keeps); the conv windows, recurrent states and K/V buffers are updated in place, as on the Python route.

#include "qk_layers.h"

#include <vector>

#include "qk_cpu.h"
#include "qk_step.h"

namespace {

struct Gdn {  // a Gated DeltaNet layer's core (qk_gdn_step's arguments)
  torch::Tensor conv, conv_w, neg_a, dt_bias, norm_w, state;
  bool norm_w_bf16 = false;
  int64_t hk = 0;
};

struct Attention {  // a gated attention layer's core (qk_attn_step's arguments)
  torch::Tensor qk_scale, keys, values;
  double scaling = 0, qk_eps = 0;
};

struct Moe {  // shared gate, up, sigmoid gate and the router in one table; the shared down; the routed experts
  torch::Tensor shared_in, shared_down, experts;
  int64_t top_k = 0;
};

struct Layer {
  bool gdn = false;  // a Gated DeltaNet layer, else gated attention
  torch::Tensor pre, post;  // the two norms' (1 + w), fp32
  double eps = 0;
  torch::Tensor in, out;  // descriptor tables: the mixer's input projections, its output projection
  Gdn g;
  Attention at;
  Moe moe;
  bool has_moe = false;
};

void check_table(const torch::Tensor& t, int64_t rows, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kLong && t.dim() == 2 && t.size(0) == rows && t.size(1) == 8 &&
              t.is_contiguous(), "qk Layers: ", what, " must be an int64 [", rows, ", 8] descriptor table");
}

class Layers {
 public:
  void add_gdn(torch::Tensor pre, torch::Tensor post, double eps, torch::Tensor in, torch::Tensor out,
               torch::Tensor conv, torch::Tensor conv_w, torch::Tensor neg_a, torch::Tensor dt_bias,
               torch::Tensor norm_w, bool norm_w_bf16, torch::Tensor state, int64_t hk) {
    check_table(in, 4, "a Gated DeltaNet layer's in_proj table");
    check_table(out, 1, "a mixer's output projection table");
    Layer L{true, pre, post, eps, in, out};
    L.g = Gdn{conv, conv_w, neg_a, dt_bias, norm_w, state, norm_w_bf16, hk};
    layers_.push_back(L);
  }

  void add_attention(torch::Tensor pre, torch::Tensor post, double eps, torch::Tensor in, torch::Tensor out,
                     torch::Tensor qk_scale, torch::Tensor keys, torch::Tensor values, double scaling, double qk_eps) {
    check_table(in, 3, "an attention layer's q/k/v table");
    check_table(out, 1, "a mixer's output projection table");
    Layer L{false, pre, post, eps, in, out};
    L.at = Attention{qk_scale, keys, values, scaling, qk_eps};
    layers_.push_back(L);
  }

  // the MoE block of the layer added last
  void set_moe(torch::Tensor shared_in, torch::Tensor shared_down, torch::Tensor experts, int64_t top_k) {
    TORCH_CHECK(!layers_.empty(), "qk Layers: set_moe before any layer");
    check_table(shared_in, 4, "the shared expert's gate/up/gate + router table");
    check_table(shared_down, 1, "the shared expert's down table");
    TORCH_CHECK(experts.scalar_type() == torch::kLong && experts.dim() == 3 && experts.is_contiguous(),
                "qk Layers: the experts' table must be qk_moe's int64 [E, 2, 8]");
    TORCH_CHECK(top_k >= 1 && top_k <= experts.size(0), "qk Layers: top_k must be in 1..", experts.size(0));
    layers_.back().moe = Moe{shared_in, shared_down, experts, top_k};
    layers_.back().has_moe = true;
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // the final norm ((1 + w) fp32) and the head's descriptor table [1, 8], for `step`
  void set_head(torch::Tensor scale, double eps, torch::Tensor table) {
    check_table(table, 1, "the head's table");
    head_scale_ = scale;
    head_eps_ = eps;
    head_ = table;
  }

  // A whole decode step after the embedding: x [1, H] bf16 through every layer (`run`), the final norm
  // and the head; the rotary's cos and sin are row `row` of the tables [R, rot]. Returns the logits [V].
  torch::Tensor step(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t row, int64_t n) const {
    TORCH_CHECK(head_.defined(), "qk Layers: step before set_head");
    TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && row >= 0 && row < cos.size(0),
                "qk Layers: row ", row, " is outside the rotary tables");
    const torch::Tensor h = run(x, cos[row], sin[row], n);
    return qk_linear_many(qk_rms(h, head_scale_, head_eps_), head_)[0].view(-1);
  }

  // A speculative verify: x [T, H] bf16 (T = 2..4 tokens at positions n .. n + T - 1, cos and sin [T, rot]
  // their rotary rows) through every layer, the final norm and the head, with the logits T calls of `step`
  // give, bit for bit. Why here and not T steps: every matrix but the Gated DeltaNet recurrence and the
  // attention's scores is read once for the T rows (the multi-row tiles; a row's sums do not depend on the
  // others), and the routed experts once for the union of the rows' choices (qk_moe_rows). The mixers'
  // cores, norms, routing and the MoE sum run row by row with the calls `run` makes. Returns the logits
  // [T, V], the final norm's output [T, H] (what the MTP layer drafts from) and, per Gated DeltaNet layer in
  // order, its conv inputs (the window before, then the T qkv rows: [K + T, C]) and its state after each
  // position but the last [T - 1, Hv, Dk, Dv], for HybridCache.rewind.
  std::vector<torch::Tensor> verify(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t n) const {
    TORCH_CHECK(head_.defined(), "qk Layers: verify before set_head");
    const int64_t t = x.size(0);
    TORCH_CHECK(x.dim() == 2 && t >= 1 && cos.dim() == 2 && cos.size(0) == t && sin.sizes() == cos.sizes() &&
                cos.is_contiguous() && sin.is_contiguous(), "qk Layers: verify takes x [T, H] and cos, sin [T, rot]");
    std::vector<torch::Tensor> kept;
    for (const Layer& L : layers_) {
      TORCH_CHECK(L.has_moe, "qk Layers: a layer has no MoE block");
      const std::vector<torch::Tensor> p = qk_linear_many(qk_rms(x, L.pre, L.eps), L.in);
      std::vector<torch::Tensor> rows(t);
      torch::Tensor core;  // the mixer's output [T, ...], out_proj's input
      if (L.gdn) {
        const Gdn& g = L.g;
        kept.push_back(torch::cat({g.conv, p[0]}));
        // the state after each position but the last, which is the cache's own (a rewind to it is none)
        torch::Tensor states = torch::empty({t - 1, g.state.size(0), g.state.size(1), g.state.size(2)}, torch::kFloat);
        core = qk_gdn_rows(p[0], p[1], p[2], p[3], g.conv, g.conv_w, g.neg_a, g.dt_bias, g.norm_w, g.norm_w_bf16,
                           g.state, states, g.hk, L.eps);
        kept.push_back(states);
      } else {
        const Attention& at = L.at;
        for (int64_t j = 0; j < t; ++j)
          rows[j] = qk_attn_step(p[0][j], p[1][j], p[2][j], at.qk_scale, cos[j], sin[j], at.keys, at.values, n + j,
                                 at.scaling, at.qk_eps);
        core = torch::cat(rows);
      }
      const torch::Tensor o = qk_linear_many(core, L.out)[0];
      std::vector<torch::Tensor> res(t), nrm(t);
      for (int64_t j = 0; j < t; ++j) {
        std::vector<torch::Tensor> xs = qk_add_rms(x[j], o[j], L.post, L.eps);
        res[j] = xs[0];
        nrm[j] = xs[1];
      }
      const torch::Tensor h2 = torch::stack(nrm);
      const std::vector<torch::Tensor> s = qk_linear_many(h2, L.moe.shared_in);  // gate, up, sigmoid gate, router
      const torch::Tensor shared = qk_linear_many(qk_silu_mul(s[0], s[1]), L.moe.shared_down)[0];
      torch::Tensor wts = torch::empty({t, L.moe.top_k}, torch::kFloat);
      torch::Tensor ids = torch::empty({t, L.moe.top_k}, torch::kLong);
      for (int64_t j = 0; j < t; ++j) {
        const std::vector<torch::Tensor> r = qk_route(s[3][j], L.moe.top_k);
        wts[j].copy_(r[0]);
        ids[j].copy_(r[1]);
      }
      const torch::Tensor routed = qk_moe_rows(h2, L.moe.experts, ids, wts);
      for (int64_t j = 0; j < t; ++j) rows[j] = qk_moe_out(res[j], routed[j], shared[j], s[2][j]);
      x = torch::stack(rows);
    }
    const torch::Tensor h = qk_rms(x, head_scale_, head_eps_);
    std::vector<torch::Tensor> out{qk_linear_many(h, head_)[0], h};
    out.insert(out.end(), kept.begin(), kept.end());
    return out;
  }

  // x [1, H] bf16 through every layer; cos and sin [rot] bf16 at position n, which the attention layers
  // write into their K/V buffers and attend up to
  torch::Tensor run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t n) const {
    for (const Layer& L : layers_) {
      TORCH_CHECK(L.has_moe, "qk Layers: a layer has no MoE block");
      const torch::Tensor h = qk_rms(x, L.pre, L.eps);
      const std::vector<torch::Tensor> p = qk_linear_many(h, L.in);
      const Gdn& g = L.g;
      const Attention& at = L.at;
      const torch::Tensor core =
          L.gdn ? qk_gdn_step(p[0], p[1], p[2], p[3], g.conv, g.conv_w, g.neg_a, g.dt_bias, g.norm_w, g.norm_w_bf16,
                              g.state, g.hk, L.eps)
                : qk_attn_step(p[0], p[1], p[2], at.qk_scale, cos, sin, at.keys, at.values, n, at.scaling, at.qk_eps);
      const std::vector<torch::Tensor> xs = qk_add_rms(x, qk_linear_many(core, L.out)[0], L.post, L.eps);
      x = moe_one(L, xs[0], xs[1]);
    }
    return x;
  }

  // The MTP layer's own norms' (1 + w), fp32 (the two before fc, the final one), their eps and fc's table [1, 8].
  void set_draft(torch::Tensor emb_scale, torch::Tensor hid_scale, torch::Tensor final_scale, double eps,
                 torch::Tensor fc) {
    check_table(fc, 1, "the MTP fc table");
    emb_scale_ = emb_scale;
    hid_scale_ = hid_scale;
    final_scale_ = final_scale;
    draft_eps_ = eps;
    fc_ = fc;
  }

  // The MTP layer's draft (runtime/model/mtp.py) on a one-layer attention stack: T pairs of embedded tokens e and
  // main-model hidden states hid [T, H] bf16 at positions n .. n + T - 1 (cos, sin [T, rot]). Every pair's norms,
  // fc and attention run, so each writes its K/V; only the last row goes on through o, the MoE block and the
  // final norm, since nothing reads the others' outputs. Returns that row's final-normed hidden [1, H], then the
  // outputs of `head` (any linear_many table: the draft's part of the vocabulary) on it.
  std::vector<torch::Tensor> draft(torch::Tensor e, torch::Tensor hid, torch::Tensor cos, torch::Tensor sin, int64_t n,
                                   torch::Tensor head) const {
    TORCH_CHECK(fc_.defined(), "qk Layers: draft before set_draft");
    TORCH_CHECK(layers_.size() == 1 && !layers_[0].gdn && layers_[0].has_moe,
                "qk Layers: draft runs a one-layer attention stack");
    const int64_t t = e.size(0);
    TORCH_CHECK(e.dim() == 2 && t >= 1 && hid.sizes() == e.sizes() && cos.dim() == 2 && cos.size(0) == t &&
                sin.sizes() == cos.sizes(), "qk Layers: draft takes e, hid [T, H] and cos, sin [T, rot]");
    const Layer& L = layers_[0];
    const Attention& at = L.at;
    const torch::Tensor in = torch::cat({qk_rms(e, emb_scale_, draft_eps_), qk_rms(hid, hid_scale_, draft_eps_)}, 1);
    const torch::Tensor x = qk_linear_many(in, fc_)[0];
    const std::vector<torch::Tensor> p = qk_linear_many(qk_rms(x, L.pre, L.eps), L.in);
    torch::Tensor core;
    for (int64_t j = 0; j < t; ++j)
      core = qk_attn_step(p[0].narrow(0, j, 1), p[1].narrow(0, j, 1), p[2].narrow(0, j, 1), at.qk_scale, cos[j],
                          sin[j], at.keys, at.values, n + j, at.scaling, at.qk_eps);
    const std::vector<torch::Tensor> xs =
        qk_add_rms(x.narrow(0, t - 1, 1), qk_linear_many(core, L.out)[0], L.post, L.eps);
    const torch::Tensor h = qk_rms(moe_one(L, xs[0], xs[1]), final_scale_, draft_eps_);
    std::vector<torch::Tensor> out{h};
    for (const torch::Tensor& y : qk_linear_many(h, head)) out.push_back(y);
    return out;
  }

 private:
  // x + the MoE block of L on h2 (the post-attention norm of x), one token [1, H]
  torch::Tensor moe_one(const Layer& L, const torch::Tensor& x, const torch::Tensor& h2) const {
    const std::vector<torch::Tensor> s = qk_linear_many(h2, L.moe.shared_in);  // gate, up, sigmoid gate, router
    const torch::Tensor shared = qk_linear_many(qk_silu_mul(s[0], s[1]), L.moe.shared_down)[0];
    const std::vector<torch::Tensor> r = qk_route(s[3], L.moe.top_k);
    return qk_moe_out(x, qk_moe(h2, L.moe.experts, r[1], r[0]), shared, s[2]);
  }

  std::vector<Layer> layers_;
  torch::Tensor head_scale_, head_;
  double head_eps_ = 0;
  torch::Tensor emb_scale_, hid_scale_, final_scale_, fc_;
  double draft_eps_ = 0;
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
      .def("set_head", &Layers::set_head, "the final norm and the head, for step")
      .def("run", &Layers::run, "x [1, H] bf16 through every layer at position n",
           py::call_guard<py::gil_scoped_release>())
      .def("verify", &Layers::verify, "T tokens' logits as T steps give them, and the states to rewind to",
           py::call_guard<py::gil_scoped_release>())
      .def("set_draft", &Layers::set_draft, "the MTP layer's pre-fc norms and fc, for draft")
      .def("draft", &Layers::draft, "the MTP layer's draft: the last pair's final-normed hidden and head outputs",
           py::call_guard<py::gil_scoped_release>())
      .def("step", &Layers::step, "x [1, H] bf16 through every layer, the final norm and the head: logits [V]",
           py::call_guard<py::gil_scoped_release>());
}
