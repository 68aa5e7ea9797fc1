"""Benchmarks that write reports/ (markdown + json); `quantkit bench <name>` runs them."""
