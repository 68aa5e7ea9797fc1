"""The llama.cpp quantizer pass: a bf16 GGUF -> a K-quant / IQ GGUF through llama.cpp's own code.

llama-cpp-python binds `llama_model_quantize(src, dst, params)`; the `gguf` package has no K-quant
quantizer, and K-quants are not written by hand here. `quantize_gguf` fills its params: the llama_ftype of
the `--type`, our recipe as `tt_overrides` (regex -> ggml type, quantkit.export.gguf_types.overrides;
output.weight and token_embd too: the params' output_tensor_type / token_embedding_type skip llama.cpp's
row-length fallback and fail its validation on a row they cannot hold), the importance data (`llama_model_imatrix_data` entries: name, mean
square input per column, expert after expert), `max_buf_size` (bytes of rows in memory at once) and the
thread count. It does not name files: the caller passes temporaries and renames.

llama.cpp logs one line per tensor ("[  i/  n] name ..."); a log callback installed for the call turns
them into progress and keeps its error lines for the one-line error (the binding's own logger is put
back after). The call runs in a daemon thread and the caller's thread waits on it, so Ctrl-C is seen at
once: the caller removes its temporaries and the process exits with the thread.

The binding is an optional extra (it builds llama.cpp from source): without it, `require_llama_cpp`
says how to install it in one line.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.export.gguf_types import GGML, INSTALL_LINE, LLAMA_TYPES, overrides

INSTALL_HINT = (f'{INSTALL_LINE}: llama-cpp-python>=0.3.36, built from source, which takes minutes; '
                'scripts/test.sh does it')
MAX_BUF_BYTES = 256 << 20
GGML_LOG_ERROR = 4  # enum ggml_log_level
_TENSOR_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)")


def require_llama_cpp(what: str) -> Any:
    """The llama_cpp module, or a one-line error naming `what` needs it and how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise QuantkitError(f"{what} runs llama.cpp's own quantizer, and llama-cpp-python is not installed: "
                            f"{INSTALL_HINT}") from None
    if not hasattr(llama_cpp, "llama_model_imatrix_data"):
        raise QuantkitError(f"{what}: llama-cpp-python {getattr(llama_cpp, '__version__', '?')} is too old "
                            f"(no per-tensor imatrix data); {INSTALL_HINT}")
    return llama_cpp


@contextmanager
def llama_log(on_line: Callable[[int, str], None]) -> Iterator[None]:
    """Route llama.cpp's log lines to `on_line(level, stripped line)` for the block, then give them back to
    the binding's own logger."""
    import llama_cpp as L
    from llama_cpp import _logger

    @L.llama_log_callback
    def cb(level: int, text: bytes, _user: Any) -> None:
        on_line(level, text.decode("utf-8", "replace").strip())

    L.llama_log_set(cb, ctypes.c_void_p(0))
    try:
        yield
    finally:
        L.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _params(L: Any, ftype: str, imatrix: dict[str, Any] | None, threads: int, keep: list[Any]) -> Any:
    p = L.llama_model_quantize_default_params()
    p.ftype = LLAMA_TYPES[ftype].ftype
    p.nthread = threads
    p.max_buf_size = MAX_BUF_BYTES
    ov = overrides(ftype)
    arr = (L.llama_model_tensor_override * (len(ov) + 1))()
    for i, (pat, ty) in enumerate(ov):
        arr[i].pattern = pat.encode()
        arr[i].type = GGML[ty].id
    arr[len(ov)].pattern = None
    p.tt_overrides = arr
    keep.append(arr)
    if imatrix:
        im = (L.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, data) in enumerate(sorted(imatrix.items())):
            im[i].name = name.encode()
            im[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            im[i].size = data.size
            keep.append(data)
        im[len(imatrix)].name = None
        p.imatrix = im
        keep.append(im)
    return p


def quantize_gguf(src: Path, dst: Path, ftype: str, imatrix: dict[str, Any] | None = None,
                  on_tensor: Callable[[str], None] | None = None, threads: int | None = None) -> None:
    """Run llama.cpp's quantizer from GGUF `src` to `dst` under llama.cpp `--type ftype`."""
    L = require_llama_cpp(f"--type {ftype}")
    keep: list[Any] = []
    params = _params(L, ftype, imatrix, threads or max(1, os.cpu_count() or 1), keep)
    errors: list[str] = []

    def log(level: int, line: str) -> None:
        if level == GGML_LOG_ERROR and line:
            errors.append(line)
        m = _TENSOR_LINE.match(line)
        if m and on_tensor is not None:
            on_tensor(m.group(1))

    result: list[int] = []

    def run() -> None:
        result.append(L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)))

    with llama_log(log):
        th = threading.Thread(target=run, name="llama-quantize", daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.2)
    if not result or result[0] != 0:
        why = next((e for e in reversed(errors) if "failed to quantize" in e), errors[-1] if errors else "")
        raise QuantkitError(f"{src}: llama.cpp's quantizer failed ({why or 'no message'}); "
                            "check the type and the --imatrix file")
