"""`quantkit plan --routing STATS`: the GPUs take the most-routed (layer, expert) pairs first, the speed model
uses the measured traffic, the plan reports the GPU's share of routed traffic (and on held-out counts), bad
files are refused with one line, and the runtime loads the non-contiguous expert sets it makes.

Random-weight checkpoints route near-uniformly, so the profiles here are statistics files with a known skew,
written with the stats module's own writer (quantize/shards.py's ShardWriter, as `quantkit stats` assembles
its file) on the tiny model's shape (4 layers x 8 experts) or the default model's (40 x 256)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.checkpoint.reader import Checkpoint, spec_from_path
from quantkit.errors import QuantkitError
from quantkit.planner.budget import SNAPSHOTS_PER_PROMPT, RunSettings, compute_budget
from quantkit.planner.hardware import build_hardware
from quantkit.planner.placement import RECIPES, Plan, solve
from quantkit.planner.routing import (
    RoutingProfile,
    expert_order,
    gpu_traffic_share,
    layer_shares,
    read_profile,
    uniform_share,
)
from quantkit.quantize.shards import ShardLayout, ShardWriter, TensorLayout
from quantkit.quantize.stats import LM, STATS_VERSION, model_fingerprint

from helpers.cli import (
    one_line_error,
    run_cli,  # noqa: F401
)
from helpers.runtime import quantized

# 4 layers x 8 experts, 80 routed tokens per layer (40 tokens, top-2). Shares of the layer's tokens:
#   layer 0: expert 2 .625, 5 .25, 7 .0625, the rest .0125      layer 1: expert 7 .55, 0 .375, the rest .0125
#   layer 2: uniform .125                                        layer 3: expert 0 .925, 7 none, the rest .0125
SKEW = [[1, 1, 50, 1, 1, 20, 1, 5], [30, 1, 1, 1, 1, 1, 1, 44], [10] * 8, [74, 1, 1, 1, 1, 1, 1, 0]]
# With room for 8 experts on the GPU, the top 8 pairs: L3e0 .925, L0e2 .625, L1e7 .55, L1e0 .375, L0e5 .25,
# then three of layer 2's tied .125 (later layers first, then lower ids: 0, 1, 2).
ON_GPU = [[2, 5], [0, 7], [0, 1, 2], [0]]
GPU_SHARE = (0.875 + 0.925 + 0.375 + 0.925) / 4  # = 0.775
UNIFORM_SHARE = 8 / 32


def write_stats(out: Path, counts: list[list[int]], heldout: list[list[int]] | None = None,
                fingerprint: str = "synthetic", extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A statistics file holding only routing counts (and `extra` tensors), as `quantkit stats` writes it."""
    t: dict[str, torch.Tensor] = dict(extra or {})
    for L, row in enumerate(counts):
        t[f"{LM}layers.{L}.mlp.routing"] = torch.tensor(row, dtype=torch.int64)
        if heldout is not None:
            t[f"{LM}layers.{L}.mlp.heldout_routing"] = torch.tensor(heldout[L], dtype=torch.int64)
    meta = {"format": "quantkit-stats", "version": STATS_VERSION, "model_fingerprint": fingerprint,
            "layers": str(len(counts))}
    lay = ShardLayout([TensorLayout(k, tuple(v.shape), v.dtype) for k, v in t.items()], metadata=meta)
    with ShardWriter(out, lay) as w:
        for k, v in t.items():
            w.write(k, v)
        w.commit()
    return out


# ---- the arithmetic ------------------------------------------------------------------------------------

def test_shares_order_and_traffic_by_hand():
    assert expert_order([5, 1, 5, 9]) == [3, 0, 2, 1]  # ties by id
    assert layer_shares([[6, 2, 0, 0], [0, 0, 0, 0]]) == [[0.75, 0.25, 0.0, 0.0], [0.25] * 4]
    ranges = [[("cuda:0", 0, 1), ("cpu", 1, 3), ("cuda:0", 3, 4)], [("cpu", 0, 4)]]
    # layer 0: GPU holds experts 0 and 3 = (6 + 2) / 10; layer 1 all on CPU: the mean is 0.4
    assert gpu_traffic_share(ranges, [[6, 1, 1, 2], [1, 1, 1, 1]], {"cuda:0"}) == pytest.approx(0.4)
    assert uniform_share(ranges, 4, {"cuda:0"}) == 2 / 8


# ---- placement and speed on the tiny model ---------------------------------------------------------------

def _tiny_plan(tiny_model: Path, n_gpu_experts: int, routing: RoutingProfile | None = None) -> tuple[Plan, int]:
    """A bf16 plan of the tiny model on a GPU whose budget holds everything but the experts and
    `n_gpu_experts` of them (the reserve is set to make it so). Returns (plan, the reserve in bytes)."""
    spec = spec_from_path(tiny_model)
    st = RunSettings(context=4096, prefill_chunk=512, prompt_cache_snapshots=SNAPSHOTS_PER_PROMPT)  # plan's
    hw = build_hardware(["rtx4090"], "64GB", None, 1)
    b = compute_budget(spec, RECIPES["bf16"], st)
    full = solve(spec, RECIPES["bf16"], st, hw)
    g = full.gpus[0]
    assert full.where == "gpu" and g.used["experts"] == 32 * b.expert_bytes[0]
    capacity = g.used_bytes - (32 - n_gpu_experts) * b.expert_bytes[0]
    reserve = hw.gpus[0].usable_bytes - capacity
    return solve(spec, RECIPES["bf16"], st, hw, gpu_reserve=reserve, routing=routing), reserve


def _profile(tiny_model: Path, counts: list[list[int]], heldout: list[list[int]] | None = None) -> RoutingProfile:
    fp = model_fingerprint(Checkpoint.open(tiny_model))
    return RoutingProfile("skew.stats", fp, counts, heldout, "skew.stats" if heldout else "")


def test_most_routed_experts_land_on_the_gpu(tiny_model):
    plain, _ = _tiny_plan(tiny_model, 8)
    assert [plain.experts_on(L, "cuda:0") for L in range(4)] == [[], [], [], list(range(8))]
    p, _ = _tiny_plan(tiny_model, 8, _profile(tiny_model, SKEW))
    assert [p.experts_on(L, "cuda:0") for L in range(4)] == ON_GPU
    assert p.expert_ranges[0] == [("cuda:0", 2, 3), ("cuda:0", 5, 6), ("cpu", 0, 2), ("cpu", 3, 5), ("cpu", 6, 8)]
    # the same bytes on each device as the plain fill: only which experts differs
    assert [d.used for d in p.devices] == [d.used for d in plain.devices]
    assert p.routing.gpu_traffic_share == pytest.approx(GPU_SHARE)
    assert p.routing.uniform_share == UNIFORM_SHARE
    assert p.routing.held_out_coverage is None
    assert p.traffic[0] == pytest.approx({"cuda:0": 0.875, "cpu": 0.125})
    # the plan file carries the report and reads back with the same expert sets
    back = Plan.from_json(p.to_json())
    assert back.expert_ranges == p.expert_ranges
    assert back.routing.to_dict() == p.routing.to_dict()  # 4 decimals in the file


def test_held_out_coverage_is_the_placements_share_on_other_counts(tiny_model):
    # held-out text routes layer 1's tokens to expert 3 instead of 7: the GPU's layer-1 share drops to 31/80
    held = [row[:] for row in SKEW]
    held[1] = [30, 1, 1, 44, 1, 1, 1, 1]
    p, _ = _tiny_plan(tiny_model, 8, _profile(tiny_model, SKEW, held))
    assert [p.experts_on(L, "cuda:0") for L in range(4)] == ON_GPU  # placed by the calibration counts
    assert p.routing.held_out_coverage == pytest.approx((0.875 + 0.3875 + 0.375 + 0.925) / 4)
    assert p.routing.held_out_source == "skew.stats"


def test_uniform_profile_gives_todays_plan_and_speed(tiny_model):
    plain, _ = _tiny_plan(tiny_model, 11)
    p, _ = _tiny_plan(tiny_model, 11, _profile(tiny_model, [[10] * 8] * 4))
    assert p.expert_ranges == plain.expert_ranges
    assert p.speed == plain.speed
    assert p.routing.gpu_traffic_share == p.routing.uniform_share == 11 / 32


def _big_counts(seed: int, alpha: float = 0.8, n: int = 40, e: int = 256) -> list[list[int]]:
    """Zipf-like routing (share of the r-th hottest expert ~ 1/r^alpha), the hot ids scattered per layer."""
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / (torch.arange(e) + 1.0) ** alpha
    rows = []
    for _ in range(n):
        c = torch.zeros(e)
        c[torch.randperm(e, generator=g)] = w
        rows.append((c / c.sum() * 8 * 100_000).round().long().tolist())
    return rows


def test_skewed_profile_estimates_faster_decode_and_uniform_equals_today():
    spec = spec_from_path(None)  # the 35B: int4 on a 12 GB card keeps part of the experts in RAM
    st = RunSettings(context=4096)
    hw = build_hardware(["rtx3060"], "64GB", None, 1)
    plain = solve(spec, RECIPES["int4"], st, hw)
    assert plain.where == "gpu+cpu" and 0 < plain.experts_on_cpu < 40 * 256
    skew = solve(spec, RECIPES["int4"], st, hw, routing=RoutingProfile("zipf", "", _big_counts(0)))
    assert skew.routing.gpu_traffic_share > skew.routing.uniform_share + 0.1
    assert skew.speed.decode_tok_s > plain.speed.decode_tok_s * 1.03
    assert skew.speed.prefill_tok_s > plain.speed.prefill_tok_s
    assert any("routing measured (zipf)" in a for a in skew.assumptions)
    flat = solve(spec, RECIPES["int4"], st, hw, routing=RoutingProfile("flat", "", [[3] * 256] * 40))
    assert flat.speed == plain.speed and flat.expert_ranges == plain.expert_ranges


# ---- the command -----------------------------------------------------------------------------------------

def test_cli_reports_gpu_share_in_console_and_json(tiny_model, tmp_path, capsys, monkeypatch):
    held = [row[:] for row in SKEW]
    held[1] = [30, 1, 1, 44, 1, 1, 1, 1]
    f = write_stats(tmp_path / "skew.stats", SKEW, held, model_fingerprint(Checkpoint.open(tiny_model)))
    _, reserve = _tiny_plan(tiny_model, 8)
    args = ["plan", "--model", tiny_model, "--gpu", "rtx4090", "--ram", "64GB", "-s", "bf16",
            "--gpu-reserve", f"{reserve}B", "--routing", f]
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    # 77.5% rounds either way in binary: the line is checked around it, the value in the JSON below
    line = " ".join(out.split())
    assert "GPUs serve 7" in line
    assert ("% of routed traffic by the profile skew.stats (uniform placement: 25%; on held-out tokens "
            "(skew.stats): 64%)") in line
    plan_file = tmp_path / "plan.json"
    code, out, err = run_cli([*args, "--json", "--out", plan_file], capsys, monkeypatch)
    assert code == 0, err
    r = json.loads(out)["plan"]["routing"]
    assert r["gpu_traffic_share"] == 0.775 and r["uniform_share"] == 0.25 and r["held_out_coverage"] == 0.6406
    assert r["source"] == "skew.stats" and r["fingerprint"] == model_fingerprint(Checkpoint.open(tiny_model))
    layers = json.loads(plan_file.read_text())["layers"]
    assert [x["experts"]["cuda:0"] for x in layers] == ON_GPU
    # a second file of held-out text of the same corpus: its counts (all of them) measure the transfer
    f2 = write_stats(tmp_path / "other.stats", held, [[0] * 8] * 4, model_fingerprint(Checkpoint.open(tiny_model)))
    code, out, err = run_cli([*args, "--json", "--routing-heldout", f2], capsys, monkeypatch)
    assert code == 0, err
    r = json.loads(out)["plan"]["routing"]
    assert r["held_out_coverage"] == 0.6406 and r["held_out_source"] == "other.stats"


def test_cli_without_held_out_counts_says_so(tiny_model, tmp_path, capsys, monkeypatch):
    f = write_stats(tmp_path / "skew.stats", SKEW)
    code, out, err = run_cli(["plan", "--model", tiny_model, "--gpu", "rtx4090", "--ram", "64GB", "-s", "bf16",
                              "--routing", f], capsys, monkeypatch)
    assert code == 0, err
    # everything fits on the card: the GPU serves all routed traffic
    assert ("GPUs serve 100% of routed traffic by the profile skew.stats (uniform placement: 100%; no held-out "
            "counts to check how the profile transfers)") in " ".join(out.split())


def test_console_line_without_any_expert_on_a_gpu():
    from quantkit.cli.plan import routing_line
    from quantkit.planner.routing import RoutingReport

    r = RoutingReport("p.stats", "fp", 0.0, 0.0, 0.0, "p.stats")
    assert routing_line(r) == "no routed expert is on a GPU in this plan: the routing profile p.stats changes nothing"


def test_bad_routing_files_are_refused_with_one_line(tiny_model, tmp_path, capsys, monkeypatch):
    base = ["plan", "--model", tiny_model, "--gpu", "rtx4090", "--ram", "64GB", "-s", "bf16"]
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 64)
    notes = tmp_path / "notes.json"
    notes.write_text('{"routing": [1, 2, 3]}')
    no_routing = write_stats(tmp_path / "dense.stats", [], extra={"lm_head.weight.hessian": torch.zeros(2, 2)})
    three_layers = write_stats(tmp_path / "three.stats", SKEW[:3])
    wide = write_stats(tmp_path / "wide.stats", [row + row for row in SKEW])
    float_counts = tmp_path / "float.stats"
    write_stats(float_counts, [], extra={f"{LM}layers.{L}.mlp.routing": torch.ones(8) for L in range(4)})
    truncated = write_stats(tmp_path / "cut.stats", SKEW)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    cases = [
        (["--routing", truncated], ["cut.stats", "is damaged", "rerun `quantkit stats`"]),
        (["--routing", tmp_path / "missing.stats"], ["missing.stats", "no such file", "quantkit stats"]),
        (["--routing", junk], ["junk.bin", "is not a quantkit statistics file"]),
        (["--routing", notes], ["notes.json", "is not a quantkit statistics file"]),
        (["--routing", no_routing], ["dense.stats", "holds no routing counts"]),
        (["--routing", three_layers], ["three.stats", "routing counts of 3 layers, the model has 4"]),
        (["--routing", wide], ["wide.stats", "shape [16]", "8 experts"]),
        (["--routing", float_counts], ["float.stats", "not token counts"]),
        (["--routing-heldout", wide], ["--routing-heldout needs --routing"]),
        (["--routing", write_stats(tmp_path / "a.stats", SKEW, fingerprint="a"), "--routing-heldout",
          write_stats(tmp_path / "b.stats", SKEW, fingerprint="b")], ["b.stats", "another model"]),
        (["--routing", write_stats(tmp_path / "c.stats", SKEW), "--routing-heldout", three_layers],
         ["--routing-heldout", "three.stats", "3 layers"]),
    ]
    for extra, needles in cases:
        one_line_error(*run_cli([*base, *extra], capsys, monkeypatch), *needles)


def test_a_real_stats_file_gives_a_profile(tiny_stats):
    """`quantkit stats` output of the tiny model: every layer's counts sum to tokens x top-k, held out apart."""
    from quantkit.quantize.stats import Stats

    meta = Stats.open(tiny_stats).meta
    prof = read_profile(tiny_stats, 4, 8)
    assert [sum(r) for r in prof.counts] == [int(meta["tokens"]) * 2] * 4
    assert prof.heldout is not None and [sum(r) for r in prof.heldout] == [int(meta["heldout_tokens"]) * 2] * 4
    assert prof.fingerprint == meta["model_fingerprint"] and prof.heldout_source == tiny_stats.name
    with pytest.raises(QuantkitError, match="the model has 40"):
        read_profile(tiny_stats, 40, 256)


# ---- the runtime loads the placement ---------------------------------------------------------------------

@pytest.mark.usefixtures("one_thread")
def test_runtime_loads_non_contiguous_expert_sets(tiny_model):
    from quantkit.runtime import Placement, load_model
    from quantkit.runtime.generate import SamplingParams

    plan, _ = _tiny_plan(tiny_model, 8, _profile(tiny_model, SKEW))
    pl = Placement.from_plan(plan, "routing plan")
    assert [g[0] for g in pl.experts] == [("cuda:0", ids) for ids in ON_GPU]
    # no GPU on a test machine: the "GPU" groups are built on the CPU, as separate groups with the same ids
    cpu = Placement(["cpu"] * 4, [[("cpu", ids) for _d, ids in groups] for groups in pl.experts])
    q = quantized(tiny_model, "quality")
    rt = load_model(q, placement=cpu)
    for L, layer in enumerate(rt.model.layers):
        groups = layer.moe.experts.groups
        assert [g.ids for g in groups] == [ON_GPU[L], [x for x in range(8) if x not in ON_GPU[L]]]
        assert [str(g.device) for g in groups] == ["cpu", "cpu"]
    whole = load_model(q, placement=Placement.single(4, 8))
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    def tokens(r) -> list[int]:
        return [e.token for e in r.generate_ids(prompt, sp, thinking=False) if e.response is None]

    assert tokens(rt) == tokens(whole)
    ids = torch.tensor([prompt])
    assert torch.equal(rt.logits(ids), whole.logits(ids))
