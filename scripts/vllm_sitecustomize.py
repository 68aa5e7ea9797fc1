"""Installed into quantkit's vLLM check venv (scripts/vllm-check.sh) as its sitecustomize.py.

The registry's torchvision wheel is a CUDA build: on a CPU torch its C ops fail to load, and its import then dies
registering fake kernels for two ops that were never defined (`torchvision::nms`, `qnms`). vLLM's Qwen3.5 model
imports torchvision (through transformers' Qwen2-VL image processor) even for the language model alone. This hook
runs once, on the first import of torchvision: where its C ops do not load, it defines the two schemas so the
import completes (the ops stay unusable; the language-only path never calls them)."""

import importlib.abc
import importlib.util
import sys


def _define_missing_ops() -> None:
    import os

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    lib = os.path.join(os.path.dirname(spec.origin), "_C.so")
    try:
        torch.ops.load_library(lib)
        return  # a build that matches this torch: nothing to do
    except (OSError, RuntimeError):
        pass
    global _LIB
    _LIB = torch.library.Library("torchvision", "DEF")  # kept alive: the definitions live as long as it does
    for op in ("nms", "qnms"):
        _LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _OnTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ARG002 (the finder protocol)
        if name == "torchvision":
            sys.meta_path.remove(self)
            _define_missing_ops()
        return None


sys.meta_path.insert(0, _OnTorchvision())
