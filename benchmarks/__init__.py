"""The lab: the benchmark drivers, peer comparisons and A/B scripts the reports in reports/ were measured with.

They live outside the installed package (issue 44): `quantkit bench decode|engines|serve` stay the user's
commands (measure this machine, against llama.cpp where it is installed); everything else here runs from a
checkout's root as `python -m benchmarks.NAME --help` (docs/benchmarks.md says what each measures). The
folders beside the modules hold one-off A/B drivers, run as their docstrings say.
"""
