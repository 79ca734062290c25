#!/bin/sh
# Runs tests/mpi_failure.c's job in one mode and checks that it ends (non-zero) within a bound
# and that stderr carries the expected message.
#   mpi_failure.sh MPIEXEC PROGRAM MODE SECONDS NEEDLE
set -u
mpiexec=$1 prog=$2 mode=$3 bound=$4 needle=$5
err=$(mktemp)
start=$(date +%s)
timeout $((bound + 30)) "$mpiexec" --oversubscribe -np 2 "$prog" "$mode" 2>"$err" >/dev/null
rc=$?
took=$(($(date +%s) - start))
cat "$err" >&2
rm -f "$err.keep"
fail=0
if [ "$rc" -eq 0 ]; then echo "FAIL: the job exited 0" >&2; fail=1; fi
if [ "$rc" -eq 124 ]; then echo "FAIL: the job hung (killed after $((bound + 30)) s)" >&2; fail=1; fi
if [ "$took" -gt "$bound" ]; then echo "FAIL: the job took $took s (bound $bound s)" >&2; fail=1; fi
if ! grep -qF -- "$needle" "$err"; then echo "FAIL: stderr lacks: $needle" >&2; fail=1; fi
rm -f "$err"
[ "$fail" -eq 0 ] && echo "ok: $mode ended in $took s with exit status $rc"
exit $fail
