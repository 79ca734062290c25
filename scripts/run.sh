#!/usr/bin/env bash
# The main job: installs dependencies, builds aotgrad (Release) and runs `aotgrad train`.
# Extra arguments go to `aotgrad train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DAG_BUILD_TESTS=OFF > build.log 2>&1 || { cat build.log; exit 1; }
cmake --build build -j"$(nproc)" >> build.log 2>&1 || { tail -50 build.log; exit 1; }
exec ./build/aotgrad train "$@"
