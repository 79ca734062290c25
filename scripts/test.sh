#!/usr/bin/env bash
# The whole test suite: installs dependencies, checks the format (.clang-format) and the layers
# (scripts/check_layers.py), builds with -Werror and runs every test, then
# compares the zoo's printed graphs with a clang build of the CLI, builds again with
# AddressSanitizer + UndefinedBehaviorSanitizer (separate build directory)
# and runs every test there too. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
echo "== format: every C file as .clang-format says =="
out=$(scripts/check_format.sh) || { echo "$out"; exit 1; }
echo "$out" | tail -1
echo "== layers: folders depend only on earlier folders (docs/ARCHITECTURE.md) =="
out=$(python3 scripts/check_layers.py) || { echo "$out"; exit 1; }
echo "$out" | tail -1
jobs=$(nproc)

echo "== release build (-Werror) =="
cmake -S . -B build-test -DCMAKE_BUILD_TYPE=Release -DAG_WERROR=ON > /dev/null
cmake --build build-test -j"$jobs" 2>&1 | grep -Ev '^\[ *[0-9]+%\]' || true
cmake --build build-test -j"$jobs" > /dev/null
ctest --test-dir build-test --output-on-failure -j"$jobs"

echo "== the zoo's graphs print the same with a clang build of the CLI =="
# Both builds above use the default compiler (gcc); argument evaluation order and the __LINE__
# of multi-line calls are where compilers differ (scripts/check_graphs_cc.sh).
cmake -S . -B build-clang -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Release -DAG_WERROR=ON \
  > /dev/null
cmake --build build-clang -j"$jobs" --target aotgrad_cli > /dev/null
scripts/check_graphs_cc.sh build-test/aotgrad build-clang/aotgrad

echo "== ASan + UBSan build =="
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DAG_SANITIZE=ON -DAG_WERROR=ON > /dev/null
cmake --build build-asan -j"$jobs" > /dev/null
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs"

echo "== fuzz the graph parser (bounded, 60 s) =="
scripts/fuzz.sh 60

echo "== install: pkg-config and CMake package consumers =="
stage=$(pwd)/build-test/stage
rm -rf "$stage" build-test/consumer-cmake
cmake --install build-test --prefix "$stage" > /dev/null
PKG_CONFIG_PATH="$stage/lib/pkgconfig" cc -o build-test/consumer-pc examples/consumer/main.c \
  $(PKG_CONFIG_PATH="$stage/lib/pkgconfig" pkg-config --cflags --libs aotgrad)
LD_LIBRARY_PATH="$stage/lib" ./build-test/consumer-pc
cmake -S examples/consumer -B build-test/consumer-cmake -DCMAKE_PREFIX_PATH="$stage" > /dev/null
cmake --build build-test/consumer-cmake > /dev/null
LD_LIBRARY_PATH="$stage/lib" ./build-test/consumer-cmake/consumer
# examples/small_resnet uses the public API only: it builds and passes against the shared
# library, which exports nothing but ag_ symbols.
PKG_CONFIG_PATH="$stage/lib/pkgconfig" cc -o build-test/small_resnet-pc examples/small_resnet/main.c \
  $(PKG_CONFIG_PATH="$stage/lib/pkgconfig" pkg-config --cflags --libs aotgrad) -lm
LD_LIBRARY_PATH="$stage/lib" ./build-test/small_resnet-pc examples/small_resnet > /dev/null
# The build tree without install: pkg-config finds build-test/aotgrad-uninstalled.pc.
cc -o build-test/consumer-uninstalled examples/consumer/main.c \
  $(PKG_CONFIG_PATH=build-test pkg-config --cflags --libs aotgrad)
LD_LIBRARY_PATH=build-test ./build-test/consumer-uninstalled
# No GPL library linked in, and no igraph/libxml2 include directories in consumers' flags.
if readelf -d build-test/libaotgrad.so | grep -iE 'igraph|glpk'; then
  echo "libaotgrad.so links igraph or GLPK (GPL)"; exit 1
fi
if PKG_CONFIG_PATH="$stage/lib/pkgconfig" pkg-config --cflags --libs --static aotgrad | grep -iE 'igraph|glpk|libxml2'; then
  echo "aotgrad.pc names igraph, GLPK or libxml2"; exit 1
fi
echo "exported symbols all start with ag_: $(nm -D --defined-only "$stage"/lib/libaotgrad.so | awk '{print $3}' | grep -Ev '^(ag_|_init|_fini|__bss_start|_edata|_end)' | wc -l) others"
nm -D --defined-only "$stage"/lib/libaotgrad.so | awk '{print $3}' | grep -Ev '^(ag_|_init|_fini|__bss_start|_edata|_end)' && { echo "unexpected exported symbols"; exit 1; }

echo "== CLI smoke test =="
./build-test/aotgrad ops --json > /dev/null
./build-test/aotgrad train --steps 50 > /dev/null
echo "all tests passed"
