#!/usr/bin/env python3
"""Is what a user gets with nothing set as fast as the best tuning? Runs `aotgrad bench` for
each model under a clean environment (`env -i PATH=/usr/bin:/bin`) and under the OpenMP and
OpenBLAS settings a user might try, rounds interleaved (every configuration once per round,
the order rotated between rounds) so that a drifting machine load hits all of them alike, and
prints every bench row (eager, compiled default, compiled min-cut) as the clean environment's
median over the best configuration's median.

    bench/env_sweep.py [--aotgrad build/aotgrad] [--rounds 3] [--runs 5] [MODEL...]

MODEL is mlp, cnn and/or gpt2-small (default: all three). Prints; asserts nothing. Each
`aotgrad bench` call is a fresh process (OpenMP reads its settings once, at start)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CONFIGS = [
    ("nothing set", {}),
    ("OMP_WAIT_POLICY=passive", {"OMP_WAIT_POLICY": "passive"}),
    ("OMP_WAIT_POLICY=active", {"OMP_WAIT_POLICY": "active"}),
    ("GOMP_SPINCOUNT=10000", {"GOMP_SPINCOUNT": "10000"}),
    ("OMP_PROC_BIND=true", {"OMP_PROC_BIND": "true"}),
]
ROWS = [("eager", lambda r: r["eager_step_s"]),
        ("default", lambda r: r["compiled_step_s"]["default"]),
        ("mincut", lambda r: r["compiled_step_s"]["mincut"])]


def run(aotgrad, model, runs, extra_env):
    env = {"PATH": "/usr/bin:/bin", **extra_env}
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([aotgrad, "bench", model, "--runs", str(runs), "--json", f.name],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        with open(f.name) as g:
            j = json.load(g)
    return j["results"][0], j["loadavg_start"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", metavar="MODEL")
    ap.add_argument("--aotgrad", default="build/aotgrad")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    models = a.models or ["mlp", "cnn", "gpt2-small"]
    for m in models:
        if m not in ("mlp", "cnn", "gpt2-small"):
            ap.error(f"unknown model {m!r}")
    print(f"env_sweep: {a.aotgrad}, {a.rounds} rounds x {len(CONFIGS)} configurations, "
          f"bench --runs {a.runs}; load average {os.getloadavg()[0]:.2f} at start")
    for m in models:
        times = {c: {r: [] for r, _ in ROWS} for c, _ in CONFIGS}
        for k in range(a.rounds):
            order = CONFIGS[k % len(CONFIGS):] + CONFIGS[:k % len(CONFIGS)]
            for name, env in order:
                res, _ = run(a.aotgrad, m, a.runs, env)
                for row, get in ROWS:
                    times[name][row].append(get(res))
                print(f"  {m} round {k + 1}: {name} done", file=sys.stderr, flush=True)
        print(f"\n{m}: median step seconds over {a.rounds} rounds")
        print(f"  {'configuration':<26}" + "".join(f"{r:>10}" for r, _ in ROWS))
        med = {c: {r: statistics.median(v) for r, v in rows.items()} for c, rows in times.items()}
        for c, _ in CONFIGS:
            print(f"  {c:<26}" + "".join(f"{med[c][r]:10.4f}" for r, _ in ROWS))
        line = f"  {'nothing set / best':<26}"
        for r, _ in ROWS:
            best = min(med[c][r] for c, _ in CONFIGS)
            line += f"{med['nothing set'][r] / best:9.3f}x"
        print(line)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
