#!/usr/bin/env bash
# Installs every Debian package aotgrad needs to build, test and run. Idempotent: packages
# already present are not reinstalled and the package lists are refreshed only when something
# is missing. Run as root on Debian 12.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config      # compiler, build system
  libopenblas-openmp-dev                # GEMM (OpenBLAS, OpenMP threading)
  libcmocka-dev                         # C unit tests
  libjansson-dev                        # JSON (safetensors headers, --json output)
  zlib1g-dev                            # gzip (datasets)
  graphviz                              # pictures of graphs (dot -Tsvg)
  coinor-libcbc-dev                     # ILP knapsack for the memory budget (COIN-OR CBC, EPL)
  libigraph-dev                         # max-flow reference of the tests and bench (GPL: not in libaotgrad)
  libglpk-dev                           # knapsack reference of bench_knapsack (GPL: not in libaotgrad)
  openmpi-bin libopenmpi-dev            # process groups and collectives (MPI)
  dataset-fashion-mnist                 # the main job's data
  clang libclang-rt-14-dev              # fuzzing and sanitizer runtimes; the gcc/clang graph check
  clang-format-14                       # the format check of scripts/test.sh
  python3                               # scripts/check_layers.py
  libdnnl-dev                           # oneDNN sgemm: the reference of bench/bench_sgemm only
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages: ${missing[*]}; run this script as root" >&2
  exit 1
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
