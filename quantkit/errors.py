"""The one exception type the CLI turns into a clean one-line error."""

from __future__ import annotations


class QuantkitError(Exception):
    """A user-facing error: the message names the file or value and what to do. No traceback is shown."""
