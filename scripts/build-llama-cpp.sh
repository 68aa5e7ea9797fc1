#!/usr/bin/env bash
# Build llama.cpp's library (the llama-cpp-python release the tests pin) for one x86 instruction set into
# .cache/llama-cpp-NAME, for `quantkit bench engines --llama-build NAME=FOLDER`: on an AVX512 machine it
# shows what llama.cpp's own build runs on a CPU without AVX512, beside quantkit's table of the same name.
#   avx2      AVX2 + FMA + F16C + BMI2 (AMD Zen 2 / Zen 3, Intel before 12th gen)
#   avx2vnni  the same with AVX-VNNI (Intel Core 12th gen on)
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-}
case $name in
  avx2) flags="-DGGML_NATIVE=OFF -DGGML_AVX_VNNI=OFF" ;;
  avx2vnni) flags="-DGGML_NATIVE=OFF -DGGML_AVX_VNNI=ON" ;;
  *) echo "scripts/build-llama-cpp.sh: give avx2 or avx2vnni (got '$name')" >&2; exit 2 ;;
esac
dest=.cache/llama-cpp-$name
if [ ! -f "$dest/llama_cpp/lib/libllama.so" ]; then
  echo "building llama.cpp for $name (a few minutes on 2 cores)..." >&2
  rm -rf "$dest.tmp"
  CMAKE_ARGS="$flags" .venv/bin/pip install -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
    --target "$dest.tmp" "llama-cpp-python==${QUANTKIT_LLAMA_CPP:-0.3.36}"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
fi
echo "--llama-build $name=$dest"
