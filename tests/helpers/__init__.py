"""Shared helpers of the tests: tests/conftest.py holds the fixtures and hooks, these modules the plain
functions, constants and shared fixtures that test modules import (no test module imports another)."""
