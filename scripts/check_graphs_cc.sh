#!/usr/bin/env bash
# Graphs must not depend on the C compiler. C leaves the order in which a call's arguments are
# evaluated unspecified (`ag_sub(f(x), g(x))` may trace g before f), and __LINE__ in a call
# written over several lines is its first line under GCC, its last under Clang. This prints
# every zoo model's traced forward and joint graph (seq_nr and stack traces included), in
# every configuration and, for models with dropout, with a dropout probability too, with two
# aotgrad binaries built by different compilers, and fails on the first graph whose text
# differs, naming the model and the first differing line.
#
# The one thing normalized is how a stack-trace frame spells its file: __FILE__ is the path
# the build passed to the compiler, absolute or relative to the build directory (ccache's
# base_dir rewrites it), so frames are compared relative to the source root, and each binary
# runs in its build directory, where a relative __FILE__ finds the source line it prints.
#
# usage: scripts/check_graphs_cc.sh [AOTGRAD_A AOTGRAD_B]
#   defaults: build-test/aotgrad (gcc, scripts/test.sh) and build-clang/aotgrad (clang)
set -euo pipefail
cd "$(dirname "$0")/.."
a=${1:-build-test/aotgrad}
b=${2:-build-clang/aotgrad}
for bin in "$a" "$b"; do
    [ -x "$bin" ] || { echo "check_graphs_cc: no aotgrad binary at $bin" >&2; exit 2; }
done
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Runs `aotgrad ARGS...` with binary $1 into $work/$2 (normalized stdout) and $work/$2.err;
# returns its exit status.
run() {
    local bin=$1 side=$2
    shift 2
    local rc=0
    (cd "$(dirname "$bin")" && "./$(basename "$bin")" "$@") > "$work/$side.raw" \
        2> "$work/$side.err" || rc=$?
    sed -e "s#^\( *File \"\)$root/#\1#" -e 's#^\( *File "\)\(\.\./\)*#\1#' \
        "$work/$side.raw" > "$work/$side"
    return $rc
}

checked=0
# compare MODEL CONFIG CMD [EXTRA ARGS...]: `export` must succeed; `trace` may refuse a model
# (ag_trace takes no tensor subclasses) as long as both binaries refuse it alike.
compare() {
    local name=$1 config=$2 cmd=$3
    shift 3
    local args=("$cmd" "$name" --config "$config" "$@" --seq-nr --stack-traces)
    local what="aotgrad ${args[*]}"
    local ra=0 rb=0
    run "$a" a "${args[@]}" || ra=$?
    run "$b" b "${args[@]}" || rb=$?
    if [ $ra -ne 0 ] || [ $rb -ne 0 ]; then
        if [ "$cmd" = export ] || [ $ra -ne $rb ] || ! cmp -s "$work/a.err" "$work/b.err"; then
            echo "check_graphs_cc: FAILED: model '$name': '$what' exited $ra with $a," \
                 "$rb with $b:" >&2
            cat "$work/a.err" "$work/b.err" >&2
            exit 1
        fi
    fi
    if ! cmp -s "$work/a" "$work/b"; then
        local n
        n=$( (cmp "$work/a" "$work/b" 2>/dev/null || true) | sed -n 's/.* line \([0-9]*\).*/\1/p')
        [ -n "$n" ] || n=$(($(wc -l < "$work/a") + 1)) # one text is a prefix of the other
        echo "check_graphs_cc: FAILED: model '$name' (config $config): '$what' prints" \
             "different graphs; first difference at line $n:" >&2
        echo "  $a: $(sed -n "${n}p" "$work/a")" >&2
        echo "  $b: $(sed -n "${n}p" "$work/b")" >&2
        exit 1
    fi
    checked=$((checked + 1))
}

# `aotgrad models` prints "NAME  description [configs: c1, c2]" per model.
models=$("$a" models)
[ -n "$models" ] || { echo "check_graphs_cc: '$a models' listed no model" >&2; exit 2; }
while IFS= read -r line; do
    name=${line%% *}
    configs=default
    if [[ $line =~ \[configs:\ ([^]]*)\]$ ]]; then
        configs=${BASH_REMATCH[1]//,/}
    fi
    dropout=false # models with dropout layers take --dropout; the others refuse it
    "$a" trace "$name" --dropout 0.1 > /dev/null 2>&1 && dropout=true
    for config in $configs; do
        for cmd in trace export; do
            compare "$name" "$config" $cmd
            if $dropout; then
                compare "$name" "$config" $cmd --dropout 0.1
            fi
        done
    done
done <<< "$models"
[ $checked -gt 0 ] || { echo "check_graphs_cc: compared nothing" >&2; exit 1; }
echo "check_graphs_cc: $checked graphs print identically with $a and $b"
