"""A tiny checkpoint's MTP layer trained on its own model's greedy continuations (quantkit/testing/mtp_train.py):
the torch copy of the layer computes what the runtime's `MTP.forward` does (training refuses one that does not); a
small training budget makes the drafts accepted far above the random layer's, and greedy output with drafts stays
the output without them, with drafts accepted, partly accepted (state rolled back mid-run) and rejected; only the
`mtp.*` tensors are rewritten, in place and deterministically; bad input is one line; the CLI and the bench's
trained part run it."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks import mtp as mtp_bench
from quantkit.errors import QuantkitError
from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.model.cache import HybridCache
from quantkit.testing import mtp_train
from quantkit.testing.mtp_train import EVAL_SEED, TrainOptions, agreement, chat_prompts, train_mtp
from quantkit.threads import torch_threads

from helpers.cli import one_line_error, run_cli
from helpers.runtime import quantized


@dataclass(frozen=True)
class Small(TrainOptions):
    """A test's budget (the defaults are the bench's)."""

    prompts: int = 96
    new_tokens: int = 32
    held_out: int = 8
    steps: int = 200


@dataclass(frozen=True)
class Tiny(TrainOptions):
    """Only the mechanics."""

    prompts: int = 6
    new_tokens: int = 8
    held_out: int = 2
    steps: int = 3
    batch: int = 2


SMALL, TINY = Small(), Tiny()


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _tensors(folder: Path) -> dict[str, tuple[str, torch.Tensor]]:
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for name, shard in idx["weight_map"].items():
        with safe_open(str(folder / shard), framework="pt") as f:
            out[name] = (shard, f.get_tensor(name))
    return out


@pytest.fixture(scope="module")
def trained(tiny_model_mtp: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's tiny MTP checkpoint, its layer trained on the SMALL budget."""
    with torch_threads(1):
        out = _copy(tiny_model_mtp, tmp_path_factory.mktemp("mtp-train") / "trained")
        report = train_mtp(out, SMALL)
    assert report.loss_after < report.loss_before and report.held_out_after > report.held_out_before + 0.3
    return out


def test_the_torch_layer_computes_what_the_runtime_does(tiny_model_mtp: Path, trained: Path) -> None:
    """Same weights, same pairs: the logits agree at nearly every position (a routing near-tie may pick another
    expert in either) and so do the drafts, for the random layer and the trained one."""
    for folder in (tiny_model_mtp, trained):
        a = agreement(folder)
        assert a["positions"] > 30
        assert a["close"] >= mtp_train.MIN_CLOSE and a["argmax_agreement"] >= 0.9, (folder.name, a)
        assert a["median_abs_diff"] < mtp_train.CLOSE * a["logit_std"], a


def test_training_refuses_a_copy_that_computes_another_layer(tiny_model_mtp: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs before any training: a copy with [hidden, embedding] swapped is refused in one line and the
    folder is left as it was."""
    folder = _copy(tiny_model_mtp, tmp_path / "m")
    forward = mtp_train.TorchMTP.forward
    monkeypatch.setattr(mtp_train.TorchMTP, "forward", lambda self, emb, hidden: forward(self, hidden, emb))
    with pytest.raises(QuantkitError, match="does not compute what the runtime does") as e:
        train_mtp(folder, TINY)
    assert "\n" not in str(e.value)
    for f in tiny_model_mtp.iterdir():
        assert (folder / f.name).read_bytes() == f.read_bytes(), f.name


def _decode(rt, prompts: list[list[int]], draft: int) -> tuple[list[list[int]], int, int]:
    rt.set_mtp(draft)
    toks, drafted, accepted = [], 0, 0
    for ids in prompts:
        resp = None
        for e in rt.generate_ids(ids, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True),
                                 thinking=False, stop_ids=set()):
            resp = e.response or resp
        toks.append(resp.token_ids)
        if draft:
            drafted += resp.mtp["drafted"]
            accepted += resp.mtp["accepted"]
    return toks, drafted, accepted


def test_trained_drafts_are_accepted_and_greedy_output_is_unchanged(tiny_model_mtp: Path, trained: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized by the default recipe, on prompts no training drew: the trained layer's drafts are accepted
    most of the time (the random layer's almost never); each verify keeps all, some or none of its drafts, the
    main cache rewound to the kept ones (the Gated DeltaNet states restored mid-run); the greedy tokens equal those
    of decoding without drafts for 1-3 drafts."""
    verifies: list[tuple[int, int]] = []  # (drafts kept, drafts) of every verify of the main model
    rewind = HybridCache.rewind

    def spy(self: HybridCache, n: int) -> None:
        if self.conv and self.trail:
            start = next(iter(self.trail.values())).start
            verifies.append((n - start - 1, self.n - start - 1))
        rewind(self, n)

    monkeypatch.setattr(HybridCache, "rewind", spy)
    acceptance = {}
    for name, folder in (("untrained", tiny_model_mtp), ("trained", trained)):
        rt = load_model(quantized(folder, "quality"))
        prompts = chat_prompts(rt, 6, EVAL_SEED + 5)
        want, _, _ = _decode(rt, prompts, 0)
        for draft in (1, 2, 3):
            verifies.clear()
            got, drafted, accepted = _decode(rt, prompts, draft)
            assert got == want, (name, draft)
            assert 0 <= accepted <= drafted and drafted >= len(prompts) * draft
            acceptance[name, draft] = accepted / drafted
            if name == "trained" and draft > 1:
                assert any(0 < kept < k for kept, k in verifies), verifies  # partial: rolled back mid-run
                assert any(kept == k for kept, k in verifies) and any(kept == 0 for kept, _ in verifies)
    assert all(acceptance["untrained", d] < 0.1 for d in (1, 2, 3)), acceptance
    assert acceptance["trained", 1] >= 0.5, acceptance
    assert all(acceptance["trained", d] > acceptance["untrained", d] + 0.3 for d in (1, 2, 3)), acceptance


def test_only_the_mtp_tensors_are_rewritten(tiny_model_mtp: Path, trained: Path) -> None:
    before, after = _tensors(tiny_model_mtp), _tensors(trained)
    assert (tiny_model_mtp / "model.safetensors.index.json").read_bytes() == \
        (trained / "model.safetensors.index.json").read_bytes()
    assert sorted(p.name for p in tiny_model_mtp.iterdir()) == sorted(p.name for p in trained.iterdir())
    changed = 0
    for name, (shard, t) in before.items():
        shard2, t2 = after[name]
        assert shard2 == shard and t2.dtype == t.dtype and t2.shape == t.shape, name
        if name.startswith("mtp."):
            changed += not torch.equal(t, t2)
        else:
            assert torch.equal(t, t2), name
    mtp = [n for n in before if n.startswith("mtp.")]
    assert changed >= 0.9 * len(mtp)
    for shard in {s for s, _ in before.values()}:
        with safe_open(str(trained / shard), framework="pt") as f, \
                safe_open(str(tiny_model_mtp / shard), framework="pt") as g:
            assert list(f.keys()) == list(g.keys()) and f.metadata() == g.metadata()
    side = json.loads((trained / "quantkit-tiny.json").read_text())
    assert side["mtp_trained"]["options"]["steps"] == SMALL.steps
    assert side["options"] == json.loads((tiny_model_mtp / "quantkit-tiny.json").read_text())["options"]
    assert not list(trained.parent.glob(".trained.*"))  # no temporary left beside it


def test_training_is_deterministic(tiny_model_mtp: Path, tmp_path: Path) -> None:
    a, b = _copy(tiny_model_mtp, tmp_path / "a"), _copy(tiny_model_mtp, tmp_path / "b")
    ra, rb = train_mtp(a, TINY), train_mtp(b, TINY)
    assert ra.loss_after == rb.loss_after
    for shard in sorted(p.name for p in a.glob("*.safetensors")):
        assert (a / shard).read_bytes() == (b / shard).read_bytes(), shard
    assert any((a / s.name).read_bytes() != s.read_bytes() for s in tiny_model_mtp.glob("*.safetensors"))


def test_bad_input_is_one_line(tiny_model: Path, tiny_model_mtp: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantkitError, match="has no MTP layer"):
        train_mtp(tiny_model, TINY)
    with pytest.raises(QuantkitError, match="is quantized"):
        train_mtp(quantized(tiny_model_mtp, "int4"), TINY)
    with pytest.raises(QuantkitError, match="not a checkpoint folder"):
        train_mtp(tmp_path, TINY)
    with pytest.raises(QuantkitError, match="held-out"):
        train_mtp(tiny_model_mtp, TrainOptions(prompts=2, held_out=2))


def test_cli_trains_and_refuses(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    import quantkit.cli.tiny as cli_tiny

    monkeypatch.setattr(cli_tiny, "TrainOptions", Tiny)
    code, out, err = run_cli(["tiny-model", tmp_path / "t", "--mtp-layer", "--train-mtp", "--train-steps", "2"],
                             capsys, monkeypatch)
    assert code == 0, err
    assert "MTP layer trained: 2 steps" in " ".join(out.split())
    assert json.loads((tmp_path / "t" / "quantkit-tiny.json").read_text())["mtp_trained"]["options"]["steps"] == 2
    code, out, err = run_cli(["tiny-model", tmp_path / "u", "--train-mtp"], capsys, monkeypatch)
    one_line_error(code, out, err, "--train-mtp", "--mtp")
    code, out, err = run_cli(["tiny-model", tmp_path / "u", "--mtp-layer", "--train-steps", "5"], capsys, monkeypatch)
    one_line_error(code, out, err, "--train-steps")
    assert not (tmp_path / "u").exists()


def test_cli_trains_a_realistic_shape(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--realistic --mtp-layer --train-mtp` (once a TypeError): the realistic checkpoint is written with its MTP
    layer trained on the REALISTIC budget (here cut to the mechanics), every other tensor as generated."""
    import quantkit.cli.tiny as cli_tiny
    from quantkit.testing.generated import init_tensor

    monkeypatch.setattr(cli_tiny, "REALISTIC", TINY)
    out = tmp_path / "r"
    code, text, err = run_cli(["tiny-model", out, "--realistic", "--layers", "1", "--experts", "2", "--mtp-layer",
                               "--train-mtp", "--train-steps", "2"], capsys, monkeypatch)
    assert code == 0, err
    assert "MTP layer trained: 2 steps" in " ".join(text.split())
    side = json.loads((out / "quantkit-tiny.json").read_text())
    assert side["options"]["realistic"] and side["mtp_trained"]["options"] == {**asdict(TINY), "steps": 2}
    assert side["mtp_trained"]["agreement"]["close"] >= mtp_train.MIN_CLOSE
    changed = 0
    for name, (_shard, t) in _tensors(out).items():
        same = torch.equal(t, init_tensor(name, tuple(t.shape), 0, torch.bfloat16))
        if name.startswith("mtp."):
            changed += not same
        else:
            assert same, name
    assert changed > 0
    code, text, err = run_cli(["tiny-model", tmp_path / "f", "--full-size", "--mtp-layer", "--train-mtp"], capsys,
                              monkeypatch)
    one_line_error(code, text, err, "--train-mtp", "--full-size")
    assert not (tmp_path / "f").exists()


def test_bench_trained_part_keeps_the_oracle_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`benchmarks.mtp --part trained` on a small budget: the oracle part of the report already there is kept, the
    trained section added with the measured acceptances and an estimate read off the oracle rows."""
    reports = tmp_path / "reports"
    reports.mkdir()
    shutil.copy(Path(__file__).parents[2] / "reports" / "bench-mtp.json", reports / "bench-mtp.json")
    oracle = json.loads((reports / "bench-mtp.json").read_text())
    oracle.pop("trained", None)
    monkeypatch.setattr(mtp_bench, "TrainOptions", Small)
    d = mtp_bench.run(reports, tmp_path / "work", parts=("trained",), new_tokens=16, rounds=1, log=lambda *_: None)
    assert {k: v for k, v in d.items() if k != "trained"} == oracle
    t = json.loads((reports / "bench-mtp.json").read_text())["trained"]
    assert t["training"]["options"]["steps"] == SMALL.steps and t["greedy_identical"]
    rows = {(x["layer"], x["recipe"], x["copies"]): x["rows"] for x in t["layers"]}
    name = t["recipe"]["name"]
    untrained = rows["untrained (random)", name, True][0]["acceptance"]
    for copies in (True, False):  # the layer's dense matrices held as int4 (the default) and as stored
        assert rows["trained", name, copies][0]["acceptance"] > untrained + 0.3
    md = (reports / "bench-mtp.md").read_text()
    assert "## A trained MTP layer: a real acceptance" in md and "| drafts | acceptance |" in md
    assert "MTP fc, attention, shared expert as stored | 1 |" in md and "as int4 against" in md
    assert "not measured yet" not in md and "interpolated over their accepted / drafted" in md
    assert not (reports / "bench-mtp.png").exists()  # the oracle's plot is not redrawn
