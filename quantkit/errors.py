"""The one exception type the CLI turns into a clean one-line error, and its two kinds for a bad argument of the
Python API: `ArgumentError` (a value out of range) is also a ValueError, `ArgumentTypeError` (a value of the
wrong type) also a TypeError, so a caller may catch either the way Python's own functions raise them."""

from __future__ import annotations


class QuantkitError(Exception):
    """A user-facing error: the message names the file or value and what to do. No traceback is shown."""


class ArgumentError(QuantkitError, ValueError):
    """An argument of the right type but a value the function cannot take; the message names the argument."""


class ArgumentTypeError(QuantkitError, TypeError):
    """An argument of the wrong type; the message names the argument and the type it takes."""
