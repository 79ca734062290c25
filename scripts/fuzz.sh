#!/usr/bin/env bash
# Fuzzes the graph text parser for a bounded time: builds fuzz/fuzz_parse.c with clang and
# libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer (fuzz/CMakeLists.txt, build dir
# build-fuzz), then runs it over a scratch copy of fuzz/corpus (the seeds are never modified).
# Exits non-zero when the fuzzer finds anything: a crash, a sanitizer report, a leak, a
# timeout, or a failed check in the target; the reproducer is kept in build-fuzz/artifacts/
# (replay it with build-fuzz/fuzz_parse FILE, then add it to fuzz/corpus once fixed).
#
# Usage: scripts/fuzz.sh [SECONDS]   (default 60)
#        FUZZ_JOBS=N scripts/fuzz.sh  runs N worker processes (libFuzzer -fork=N)
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
if ! [[ "$secs" =~ ^[0-9]+$ ]] || [ "$secs" -lt 1 ]; then
  echo "usage: scripts/fuzz.sh [SECONDS]" >&2
  exit 2
fi
jobs=${FUZZ_JOBS:-1}
if ! command -v clang > /dev/null; then
  echo "fuzz.sh: clang not found; install it with scripts/install-deps.sh" >&2
  exit 1
fi

build=build-fuzz
echo "== building the parser fuzzer (clang, -fsanitize=fuzzer,address,undefined) =="
cmake -S fuzz -B "$build" -DCMAKE_C_COMPILER=clang > /dev/null
cmake --build "$build" -j"$(nproc)" 2>&1 | grep -Ev '^\[ *[0-9]+%\]' || true
cmake --build "$build" -j"$(nproc)" > /dev/null

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$build/artifacts"
cp fuzz/corpus/* "$work/corpus/"

echo "== fuzzing ag_graph_parse for ${secs}s over $(ls fuzz/corpus | wc -l) seeds =="
args=(-max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=131072
      -artifact_prefix="$build/artifacts/" -print_final_stats=1 -dict=fuzz/parse.dict)
if [ "$jobs" -gt 1 ]; then
  args+=(-fork="$jobs")
fi
status=0
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=0 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$build/fuzz_parse" "${args[@]}" "$work/corpus" > "$work/log" 2>&1 || status=$?
# The last progress line: executions, coverage, corpus size (both libFuzzer modes print one).
grep -E '^#[0-9]+' "$work/log" | tail -n 1 || true
if [ "$status" -ne 0 ]; then
  tail -n 60 "$work/log"
  echo
  echo "fuzz.sh: the fuzzer found a problem (exit status $status); reproducer in $build/artifacts/" >&2
  exit 1
fi
echo "fuzz.sh: nothing found in ${secs}s"
