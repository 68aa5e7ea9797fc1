"""Kept so that quantkit.bench.serve and serve_slots keep importing `machine_info` from here until their
owner points them at quantkit.bench.machine (issue 44: the quantizer bench is benchmarks/quantize.py)."""

from quantkit.bench.machine import machine_info

__all__ = ["machine_info"]
