#!/usr/bin/env bash
# Build the AVX2 op table of BASE (a git revision) and of the working tree with the kernel's own flags, link
# both into tile_ab, and run it:  bash benchmarks/zen1-avx2/tile-ab/tile_ab.sh BASE N K FMT ROUNDS THREADS [MAXROWS] [GROUP]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
base=$1; shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the kernel sources moved from quantkit/runtime/csrc to quantkit/kernels/csrc; BASE may predate the move
src=quantkit/kernels/csrc
git -C "$root" cat-file -e "$base:$src" 2>/dev/null || src=quantkit/runtime/csrc
git -C "$root" archive "$base" "$src" | tar -x -C "$tmp"
flags="-O3 -std=c++17 -ffp-contract=off -fno-math-errno -mavx2 -mfma"  # kernels/build.py's, AVX2 unit
g++ $flags -I"$tmp/$src" -c "$tmp/$src/qk_ops_avx2.cpp" -o "$tmp/base.o"
g++ $flags -I"$root/quantkit/kernels/csrc" -Dqk_ops_avx2=qk_ops_avx2_v -c "$root/quantkit/kernels/csrc/qk_ops_avx2.cpp" -o "$tmp/var.o"
g++ -O2 -I"$root/quantkit/kernels/csrc" "$(dirname "$0")/tile_ab.cpp" "$tmp/base.o" "$tmp/var.o" -o "$tmp/tile_ab" -lpthread
"$tmp/tile_ab" "$@"
