#!/usr/bin/env python3
"""The longest C++ functions (lambdas counted in the function that holds them), by Universal Ctags.

usage: tools/longest_functions.py [-n 10] [--over LINES [--allow FILE:NAME ...]] [PATH...]
                                                                    (default: server client)
Prints "lines  file:line  name", longest first. With --over, exits 1 when a function not allowed
(flag declarations, say) is longer, naming it.
"""
import argparse
import subprocess
import sys


def functions(paths):
    out = subprocess.run(["ctags", "-R", "--languages=C++", "--c++-kinds=f", "--fields=+ne",
                          "-o", "-", *paths], check=True, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        name, path, rest = line.split("\t", 2)
        fields = dict(f.split(":", 1) for f in rest.split("\t") if ":" in f and not f.startswith("/"))
        if "line" in fields and "end" in fields:
            scope = fields.get("class", "").split("::")[-1]
            name = "(a lambda)" if name.startswith("__anon") else name
            full = f"{scope}::{name}" if scope and not scope.startswith("__anon") else name
            yield int(fields["end"]) - int(fields["line"]) + 1, f"{path}:{fields['line']}", full


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="*", default=["server", "client"])
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("--over", type=int)
    ap.add_argument("--allow", nargs="*", default=[])
    a = ap.parse_args()
    found = sorted(functions(a.paths), reverse=True)
    for lines, where, name in found[:a.n]:
        print(f"{lines:5d}  {where}  {name}")
    if a.over is None:
        return
    allowed = {tuple(x.rsplit(":", 1)) for x in a.allow}
    over = [(lines, where, name) for lines, where, name in found
            if lines > a.over and (where.split(":")[0], name) not in allowed]
    for lines, where, name in over:
        print(f"over {a.over} lines: {where} {name} ({lines})")
    print(f"functions: {len(found)}, {len(over)} over {a.over} lines not allowed")
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
