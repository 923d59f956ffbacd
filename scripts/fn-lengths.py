#!/usr/bin/env python3
"""Counts Rust functions by length: `scripts/fn-lengths.py [DIR]` (default: the repo).

A function is a line whose code starts with `fn`, `pub fn`, `pub(...) fn`, `async fn`,
`const fn` ... and ends at the line where its braces balance again (strings, chars and
comments are skipped when counting braces). Its length is the number of lines from the
`fn` line to the closing brace, both included; doc comments and attributes are not
counted. Prints how many are longer than 70 and than 100 lines, and the longest ones.
"""
import os
import re
import sys

FN = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?((const|async|unsafe|extern\s+"[^"]*")\s+)*fn\s+(\w+)')


def strip(line, state):
    """The line's braces outside strings, chars and comments; `state` carries block
    comments and strings across lines."""
    out = []
    i = 0
    while i < len(line):
        c = line[i]
        if state["block"]:
            if line.startswith("*/", i):
                state["block"] = False
                i += 2
                continue
            i += 1
            continue
        if state["str"]:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                state["str"] = False
            i += 1
            continue
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state["block"] = True
            i += 2
            continue
        if c == '"':
            state["str"] = True
            i += 1
            continue
        if c == "'" and re.match(r"'(\\.|[^\\'])'", line[i:]):
            i += len(re.match(r"'(\\.|[^\\'])'", line[i:]).group(0))
            continue
        if c in "{}":
            out.append(c)
        i += 1
    return out


def functions(path):
    lines = open(path, encoding="utf-8").read().split("\n")
    found = []
    state = {"block": False, "str": False}
    stack = []  # (name, start line, depth at which it opened)
    depth = 0
    for n, line in enumerate(lines):
        m = None if state["block"] or state["str"] else FN.match(line)
        if m:
            stack.append([m.group(5), n, None])
        for b in strip(line, state):
            if b == "{":
                depth += 1
                for f in stack:
                    if f[2] is None:
                        f[2] = depth
            else:
                for f in list(stack):
                    if f[2] == depth:
                        found.append((f[0], f[1] + 1, n - f[1] + 1))
                        stack.remove(f)
                depth -= 1
        # a declaration without a body (`fn x();` in a trait)
        for f in list(stack):
            if f[2] is None and line.rstrip().endswith(";"):
                stack.remove(f)
    return found


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    all_fns = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("target", ".git", "node_modules")]
        for f in files:
            if f.endswith(".rs"):
                p = os.path.join(d, f)
                all_fns += [(os.path.relpath(p, root), *x) for x in functions(p)]
    over70 = [f for f in all_fns if f[3] > 70]
    over100 = [f for f in all_fns if f[3] > 100]
    print(f"functions: {len(all_fns)}, longer than 70 lines: {len(over70)}, longer than 100: {len(over100)}")
    for p, name, line, length in sorted(over100, key=lambda f: -f[3])[:15]:
        print(f"  {length:4} {p}:{line} {name}")


if __name__ == "__main__":
    main()
