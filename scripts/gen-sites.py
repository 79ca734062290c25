#!/usr/bin/env python3
"""Regenerates include/aotgrad/sites.h: one call-site macro per public op entry point.

Every function declared `AG_API ... ag_xxx(` in include/aotgrad/ops.h gets
`#define ag_xxx(...) AG__SITE(ag_xxx(__VA_ARGS__))`, sorted by name, followed by the EXTRAS
below (factories declared in core.h, module calls from nn.h, ...), which are not in ops.h but
make graph nodes or stack frames too. tests/test_trace.c checks that the header is complete.

Usage: scripts/gen-sites.py            rewrite the header
       scripts/gen-sites.py --check    exit 1 if the header is out of date
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS_H = os.path.join(ROOT, "include", "aotgrad", "ops.h")
SITES_H = os.path.join(ROOT, "include", "aotgrad", "sites.h")

# Entry points outside ops.h that record the caller's site, in this order.
EXTRAS = [
    "ag_empty", "ag_zeros", "ag_ones", "ag_full", "ag_arange", "ag_scalar_tensor",
    "ag_from_data",  # core.h: factories (ops of the table)
    "ag_module_call", "ag_module_forward",  # nn.h: the call site becomes an outer frame
    "ag_annotate_fn",  # trace.h: likewise, the frame the annotated function runs under
    "ag_op_call", "ag_op_call1",  # optable.h: calls of any op, custom ops included
]

HEADER = """\
/* Call-site macros: each public op entry point records the caller's file, line and function
 * before the call, so traced nodes point at user code (see trace.h). Generated from the
 * declarations in ops.h; tests/test_trace.c checks that every entry point has its macro.
 * Define AG_NO_SITES before including aotgrad.h to turn them off. The function itself stays
 * callable as (ag_add)(a, b). The line recorded for a call written over several lines is
 * the compiler's __LINE__ inside the macro: its first line under GCC, its last under Clang;
 * for graphs that print the same whatever the compiler, keep each traced call on one line
 * (and, since C leaves the order of a call's arguments unspecified, never two traced calls
 * as arguments of one call). */
#ifndef AOTGRAD_SITES_H
#define AOTGRAD_SITES_H

#if !defined(AG_NO_SITES) && (!defined(AG_BUILDING_LIBRARY) || defined(AG_RECORD_SITES))
#define AG__SITE(call) (ag_site(__FILE__, __LINE__, __func__), call)
"""

FOOTER = """\
#endif

#endif
"""


def entry_points(text):
    """Names of the functions declared AG_API in a header (comments stripped)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.findall(r"\bAG_API\b[^;(]*?\b(ag_\w+)\s*\(", text)


def generate():
    with open(OPS_H) as f:
        names = sorted(set(entry_points(f.read())))
    names += [n for n in EXTRAS if n not in names]
    body = "".join(f"#define {n}(...) AG__SITE({n}(__VA_ARGS__))\n" for n in names)
    return HEADER + body + FOOTER


def main():
    text = generate()
    if sys.argv[1:] == ["--check"]:
        with open(SITES_H) as f:
            if f.read() != text:
                print(f"{SITES_H} is out of date: run scripts/gen-sites.py", file=sys.stderr)
                return 1
        return 0
    if sys.argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    with open(SITES_H, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
