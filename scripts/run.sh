#!/usr/bin/env bash
# The main job: installs dependencies, builds aotgrad (Release) and runs `aotgrad train`.
# Extra arguments go to `aotgrad train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DAG_BUILD_TESTS=OFF > build.log 2>&1 || { cat build.log; exit 1; }
cmake --build build -j"$(nproc)" >> build.log 2>&1 || { tail -50 build.log; exit 1; }
# With 2 cores shared with other work, OpenMP threads that spin at barriers stall each other
# and OpenBLAS (docs/PERFORMANCE.md measured up to 10x on small steps); sleep instead.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
exec ./build/aotgrad train "$@"
