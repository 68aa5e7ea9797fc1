"""GPU catalog, forgiving names, host sizes and detection."""

from __future__ import annotations

import pytest

from quantkit.errors import QuantkitError
from quantkit.planner.hardware import (
    GIB,
    build_hardware,
    find_gpu,
    load_catalog,
    parse_bandwidth,
    parse_gpu_arg,
    parse_size,
)


def test_catalog_covers_the_issue_list() -> None:
    cat = load_catalog()
    ids = {g.id for g in cat}
    assert len(cat) >= 30
    for must in ("rtx3060", "rtx3090", "rtx4060ti-16gb", "rtx4060", "rtx4090", "rtx5060ti-16gb", "rtx5090",
                 "rtxa6000", "rtx6000ada", "rtxpro6000", "a100-40gb", "a100-80gb", "h100-sxm", "h200",
                 "l4", "l40s", "t4", "v100-32gb", "rx7900xtx"):
        assert must in ids, must
    assert {g.memory_gib for g in cat if g.family in ("ampere", "ada", "blackwell") and g.vendor == "nvidia"} >= {
        8, 16}
    assert any(g.unified and g.vendor == "apple" for g in cat)
    for g in cat:
        assert g.memory_gib > 0 and g.bandwidth_gbs > 0 and g.fp16_tflops > 0
        assert set(g.native) <= {"bf16", "fp16", "fp8", "fp4", "int8"}
    assert find_gpu("rtx4090").memory_gib == 24 and find_gpu("rtx4090").bandwidth_gbs == 1008
    assert "fp4" in find_gpu("rtx5090").native and "fp4" not in find_gpu("rtx4090").native
    assert "fp8" in find_gpu("h100").native and "bf16" not in find_gpu("t4").native


@pytest.mark.parametrize("name", ["rtx4090", "4090", "RTX 4090", "NVIDIA GeForce RTX 4090", "rtx-4090"])
def test_forgiving_names(name: str) -> None:
    assert find_gpu(name).id == "rtx4090"


def test_variants_counts_and_lists() -> None:
    assert find_gpu("rtx4060ti-16gb").memory_gib == 16
    assert find_gpu("RTX 4060 Ti 16GB").id == "rtx4060ti-16gb"
    assert find_gpu("NVIDIA H100 80GB HBM3").id == "h100-sxm"
    assert [g.id for g in parse_gpu_arg("2x3090")] == ["rtx3090", "rtx3090"]
    assert [g.id for g in parse_gpu_arg("rtx3090,rtx3060")] == ["rtx3090", "rtx3060"]
    assert [g.id for g in parse_gpu_arg("7900xtx")] == ["rx7900xtx"]
    hw = build_hardware(["2x3090", "rtx3060"], "64GB")
    assert [g.id for g in hw.gpus] == ["rtx3090", "rtx3090", "rtx3060"]


def test_ambiguous_and_unknown_names_suggest() -> None:
    with pytest.raises(QuantkitError, match="ambiguous.*rtx4060ti-8gb.*rtx4060ti-16gb"):
        find_gpu("rtx4060ti")
    with pytest.raises(QuantkitError, match="unknown GPU 'rtx4099'.*did you mean.*rtx4090"):
        find_gpu("rtx4099")


@pytest.mark.parametrize("text,nbytes", [("64GB", 64 * 10**9), ("64G", 64 * 10**9), ("64 GiB", 64 * GIB),
                                         ("65536MiB", 64 * GIB), ("64", 64 * GIB), ("1.5TB", 1.5e12),
                                         ("1.5TiB", 1536 * GIB)])
def test_parse_size(text: str, nbytes: float) -> None:
    """One rule (quantkit/sizes.py): GB = 10^9, GiB = 2^30; a bare --ram number is GiB."""
    assert parse_size(text) == int(nbytes)


@pytest.mark.parametrize("text", ["lots", "64XB", "-4GB", "0", "", "nan", "inf", "1e400GB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(QuantkitError, match="--ram"):
        parse_size(text)


def test_parse_bandwidth() -> None:
    assert parse_bandwidth("80") == parse_bandwidth("80GB/s") == parse_bandwidth("80 GB/s") == 80.0
    with pytest.raises(QuantkitError, match="bandwidth"):
        parse_bandwidth("fast")


def test_detection_reports_what_it_found() -> None:
    import torch

    hw = build_hardware(None, None)
    assert any("no --gpu given: detected" in n for n in hw.notes)
    assert any("psutil" in n for n in hw.notes)
    assert hw.host.ram_source == "detected" and hw.host.ram_bytes > 0
    if not torch.cuda.is_available():
        assert hw.gpus == () and "no GPU" in hw.describe()


def test_apple_unified_memory_is_the_ram() -> None:
    hw = build_hardware(["m4max"], None)
    assert hw.unified and hw.host.ram_bytes == 128 * GIB and hw.host.ram_source == "unified"
    assert hw.host.cpu_bandwidth_gbs == find_gpu("m4max").bandwidth_gbs
    assert find_gpu("m4max").usable_bytes == int(0.75 * 128 * GIB)


@pytest.mark.parametrize("arg", ["none", "cpu", "CPU", " none "])
def test_gpu_none_plans_the_cpu_alone(arg: str) -> None:
    hw = build_hardware([arg], "64")
    assert hw.gpus == () and "no GPU" in hw.describe() and any("CPU alone" in n for n in hw.notes)
    assert not any("detected" in n for n in hw.notes)  # not this machine's GPU: none at all


def test_custom_gpus_outside_the_catalog() -> None:
    g = parse_gpu_arg("custom:24GiB,936")
    assert len(g) == 1 and g[0].memory_bytes == 24 * GIB and g[0].bandwidth_gbs == 936.0
    assert parse_gpu_arg("custom:20")[0].memory_bytes == 20 * GIB  # a bare number is GiB, as for --ram
    two = parse_gpu_arg("2xcustom:16GB,448GB/s")
    assert [x.memory_bytes for x in two] == [16 * 10**9] * 2 and two[0].bandwidth_gbs == 448.0
    mixed = parse_gpu_arg("custom:24,936,rtx3060")
    assert [x.family for x in mixed][0] == "custom" and mixed[1].id == find_gpu("rtx3060").id
    assumed = parse_gpu_arg("custom:8")[0]
    assert assumed.bandwidth_gbs == 500.0 and "assumed" in assumed.name


@pytest.mark.parametrize("arg,needle", [
    ("custom:0", "out of range"), ("custom:-8", "not a size"), ("custom:24,0", "above 0"),
    ("custom:24,-100", "above 0"), ("custom:", "custom:VRAM"), ("none,rtx4090", "give it alone"),
])
def test_bad_gpu_specs_are_one_line(arg: str, needle: str) -> None:
    with pytest.raises(QuantkitError, match=needle) as e:
        build_hardware([arg], "64")
    assert "\n" not in str(e.value)
    with pytest.raises(QuantkitError, match="alone"):
        build_hardware(["none", "rtx4090"], "64")
