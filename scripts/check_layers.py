#!/usr/bin/env python3
"""Checks that the library's folders are its layers (docs/ARCHITECTURE.md).

A file may depend only on files in its own folder or in folders earlier in LAYERS below. A
file depends on another when it includes it (`#include "..."`) or when it names an `ag_` /
`ag__` function or variable defined in it (a non-static definition in a .c file) or an
`ag_` / `ag__` type or macro defined in it (a header). Prototypes and extern declarations in
a header are not uses: a header may declare what another file defines.

Reported, and the exit status is 1 when there are any:
  (a) every dependency that goes from a folder to a later one (an upward reference);
  (b) every cycle between files (a strongly connected component of more than one unit, where
      a .c file, the .h of the same name beside it and the .inc files it includes are one unit)
      that spans folders, except those listed in KNOWN_CYCLES. Cycles among the files of one
      folder (mutual ownership such as tensor.c <-> autograd_graph.c, the shared internal
      header's inline helpers, the tracer's helper files calling back into it) are printed but
      do not fail the check yet.

Usage: scripts/check_layers.py [-v]     -v also prints the folder-to-folder dependency counts.
Standard library only.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The layers, first to last: a folder may use its own files and those of the folders before
# it. Folders on one line (a tuple) are one layer and may use each other. Keep this order and
# the diagram of docs/ARCHITECTURE.md the same.
LAYERS = [
    "src/core",
    "src/dist",
    "src/ops",
    "src/autograd",
    "src/graph",
    "src/nn",
    "src/trace",
    "src/export",
    "src/parallel",
    "src/partition",
    "src/runtime",
    ("src/models", "src/data"),
]

# The public headers, each in the layer of the folder that implements it. The umbrella
# include/aotgrad.h includes them all and is not checked. Two are placed lower than the code
# behind their functions because their types are every layer's vocabulary: optable.h (tensor
# metadata, arguments, op definitions; its functions are src/ops's) and subclass.h (the
# subclass type an instance carries; its dispatch is src/ops's). compile.h declares the
# partitioner's options as well as the compiled runtime, so it sits with the partitioner.
# sites.h wraps entry points of every layer in call-site macros, so it sits on top.
PUBLIC_HEADERS = {
    "core.h": "src/core",
    "optable.h": "src/core",
    "subclass.h": "src/core",
    "desc.h": "src/core",
    "dist.h": "src/dist",
    "ops.h": "src/ops",
    "autograd.h": "src/autograd",
    "flex_attention.h": "src/autograd",
    "graph.h": "src/graph",
    "nn.h": "src/nn",
    "trace.h": "src/trace",
    "export.h": "src/export",
    "parallel.h": "src/parallel",
    "compile.h": "src/partition",
    "zoo.h": "src/models",
    "data.h": "src/data",
    "sites.h": "src/models",
}

# Cycles known and accepted for now, each as the set of its units' files (a unit is named by
# its .c file, or by its header when it has none).
KNOWN_CYCLES = []

IDENT = re.compile(r"\b(ag_\w+|AG_\w+)\b")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)(.*)$", re.M)


def strip(text):
    """Removes comments and the contents of string and character literals, keeping newlines."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j) or " ")
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def top_level(text):
    """Splits C text into its top-level pieces: (text before the piece's end, end char, body).

    A piece ends at ';' or at a '{' at depth 0; for '{' the body is the text up to the
    matching '}'. Preprocessor lines are dropped (handled apart)."""
    text = re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", "", text, flags=re.M)
    text = re.sub(r'\bextern\s*""\s*\{', "", text)  # C++ linkage blocks: their '}' is skipped
    pieces, start, i, n = [], 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == ";":
            pieces.append((text[start:i], ";", ""))
            start = i + 1
        elif c == "{":
            depth, j = 1, i + 1
            while j < n and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            pieces.append((text[start:i], "{", text[i + 1 : j - 1]))
            start = i = j
            continue
        elif c == "}":
            start = i + 1
        i += 1
    return pieces


FUNC_HEAD = re.compile(r"\b(ag_\w+)\s*\((?:[^()]|\([^()]*\))*\)\s*(?:__attribute__\s*\(\(.*\)\)\s*)?$", re.S)
VAR_HEAD = re.compile(r"\b(ag_\w+)\s*(?:\[[^\]]*\]\s*)*(?:=.*)?$", re.S)


def definitions(path, text):
    """Names a file defines: non-static functions and variables (.c), types and macros (.h)."""
    names = set()
    is_header = path.endswith(".h")
    for head, end, body in top_level(text):
        h = head.strip()
        first = h.split()[0] if h.split() else ""
        if h.startswith("typedef") and not is_header:
            continue  # local to the file
        if h.startswith("typedef"):
            # typedef ... name;  or typedef struct tag { ... } name;  (the name follows the body)
            names.update(re.findall(r"\b(ag_\w+)\s*$", h))
            if end == "{":
                names.update(re.findall(r"\b(?:struct|enum|union)\s+(ag_\w+)", h))
            continue
        m = re.match(r"^(?:struct|enum|union)\s+(ag_\w+)\s*$", h)
        if m and end == "{" and not is_header:
            continue  # the body of a type a header declares, or one local to the file
        if m and end == "{":
            names.add(m.group(1))
            if first == "enum" or is_header:
                names.update(re.findall(r"\b(AG_\w+)\s*(?:=|,|$)", body))
            continue
        if first == "enum" and end == "{":
            names.update(re.findall(r"\b(AG_\w+)\s*(?:=[^,]*)?(?:,|$)", body))
            continue
        if first in ("static", "extern") or "static " in h.split("(")[0]:
            continue
        if is_header:
            continue
        m = FUNC_HEAD.search(h)
        if end == "{" and m:
            names.add(m.group(1))
            continue
        m = VAR_HEAD.search(h)
        if m and "(" not in h.split(m.group(1))[0]:
            names.add(m.group(1))
    if is_header:
        # A macro that calls the function of its own name (sites.h) wraps it, defines nothing.
        names.update(n for n, body in DEFINE.findall(text)
                     if n.startswith(("ag_", "AG_")) and not re.search(rf"\b{n}\s*\(", body))
    # Enum constants and other uppercase names defined in .c files are local to them.
    if not is_header:
        names = {n for n in names if n.startswith("ag_")}
    return names


def declarations(text):
    """Names a header only declares (prototypes, extern variables): not uses of the header."""
    names = set()
    for head, end, _ in top_level(text):
        if end != ";" or head.strip().startswith("typedef"):
            continue
        m = re.match(r"^\s*(?:struct|union|enum)\s+(ag_\w+)\s*$", head)
        if m:  # a forward declaration
            names.add(m.group(1))
            continue
        m = re.search(r"\b(ag_\w+)\s*\(", head)
        if m:
            names.add(m.group(1))
        elif head.strip().startswith("extern"):
            names.update(re.findall(r"\b(ag_\w+)\s*(?:\[[^\]]*\]\s*)*$", head.strip()))
    return names


def layer_of(folder):
    for i, layer in enumerate(LAYERS):
        if folder == layer or (isinstance(layer, tuple) and folder in layer):
            return i
    return None


def collect():
    files = []
    for base in ("src", "include/aotgrad"):
        for d, _, names in os.walk(os.path.join(ROOT, base)):
            for name in sorted(names):
                if name.endswith((".c", ".h", ".inc")):
                    files.append(os.path.relpath(os.path.join(d, name), ROOT))
    return sorted(files)


def folder_of(path):
    if path.startswith("include/aotgrad/"):
        return PUBLIC_HEADERS.get(os.path.basename(path))
    return os.path.dirname(path)


def main():
    verbose = "-v" in sys.argv[1:]
    files = collect()
    raw = {f: open(os.path.join(ROOT, f), encoding="utf-8").read() for f in files}
    text = {f: strip(raw[f]) for f in files}
    problems = 0

    unknown = [f for f in files if layer_of(folder_of(f) or "") is None]
    for f in unknown:
        print(f"{f}: not in any layer: add its folder to LAYERS (or PUBLIC_HEADERS)")
        problems += 1

    # No two files share a name, whatever their folders (a .c and its own .h excepted): grep,
    # debuggers and ctags must not be ambiguous.
    by_name = {}
    for f in files:
        by_name.setdefault(os.path.basename(f), []).append(f)
    for name, fs in sorted(by_name.items()):
        if len(fs) > 1:
            print(f"same file name: {', '.join(sorted(fs))}: rename one to say what it holds")
            problems += 1

    # Units: a .c with the .h of the same name beside it and the .inc files it includes.
    unit = {f: f for f in files}
    for f in files:
        if f.endswith(".h"):
            c = f[:-2] + ".c"
            if c in unit:
                unit[f] = c
    for f in files:
        if f.endswith(".c"):
            for inc in INCLUDE.findall(raw[f]):
                p = os.path.normpath(os.path.join(os.path.dirname(f), inc))
                if p.endswith(".inc") and p in unit:
                    unit[p] = f

    definer = {}
    for f in sorted(files, key=lambda f: (f.endswith(".h"), f)):
        for name in definitions(f, text[f]):
            definer.setdefault(name, f)

    # edges[a][b] = reasons: file a depends on file b
    edges = {f: {} for f in files}
    for f in files:
        for inc in INCLUDE.findall(raw[f]):
            cands = [os.path.normpath(os.path.join(os.path.dirname(f), inc)),
                     os.path.normpath(os.path.join("include", inc)),
                     os.path.normpath(os.path.join("include/aotgrad", inc))]
            target = next((c for c in cands if c in unit), None)
            if target and target != f:
                edges[f].setdefault(target, set()).add("#include")
        declared = declarations(text[f]) if f.endswith(".h") else set()
        for name in set(IDENT.findall(text[f])):
            d = definer.get(name)
            if d is None or d == f or name in declared:
                continue
            edges[f].setdefault(d, set()).add(name)

    # (a) upward references
    up = []
    pair_counts = {}
    for a in files:
        la = layer_of(folder_of(a) or "")
        for b, why in edges[a].items():
            lb = layer_of(folder_of(b) or "")
            if la is None or lb is None:
                continue
            fa, fb = folder_of(a), folder_of(b)
            if fa != fb:
                pair_counts[(fa, fb)] = pair_counts.get((fa, fb), 0) + 1
            if lb > la:
                up.append((a, b, sorted(why)))
    for a, b, why in up:
        print(f"upward: {a} -> {b}: {', '.join(why)}")
    problems += len(up)

    # (b) cycles between units (Tarjan's strongly connected components)
    ug = {}
    for a in files:
        for b in edges[a]:
            if unit[a] != unit[b]:
                ug.setdefault(unit[a], set()).add(unit[b])
    index, low, stack, on, sccs = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        work = [(v, iter(sorted(ug.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(ug.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    sccs.append(sorted(comp))

    for v in sorted(set(unit.values())):
        if v not in index:
            visit(v)
    cycles = inner = 0
    for comp in sccs:
        known = set(comp) in KNOWN_CYCLES
        one_folder = len({folder_of(f) for f in comp}) == 1
        tag = ("known cycle (allowed)" if known else
               f"cycle within {folder_of(comp[0])} (not yet an error)" if one_folder else "cycle")
        print(f"{tag} of {len(comp)} files: {' '.join(comp)}")
        members = set(comp)
        for a in files:
            if unit[a] in members:
                for b, why in sorted(edges[a].items()):
                    if unit[b] in members and unit[b] != unit[a]:
                        print(f"    {a} -> {b}: {', '.join(sorted(why))}")
        if known:
            pass
        elif one_folder:
            inner += 1
        else:
            cycles += 1
    problems += cycles
    for k in KNOWN_CYCLES:
        if sorted(k) not in sccs:
            print(f"note: known cycle {' '.join(sorted(k))} is gone: remove it from KNOWN_CYCLES")
            problems += 1

    if verbose:
        print("folder -> folder (file pairs):")
        for (fa, fb), n in sorted(pair_counts.items(), key=lambda kv: (layer_of(kv[0][0]), kv[0])):
            print(f"    {fa} -> {fb}: {n}")
    print(f"check_layers: {len(up)} upward references, {cycles} cycles across folders,"
          f" {inner} within one folder (reported only), {len(sccs) - cycles - inner} known")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
