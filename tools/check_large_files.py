#!/usr/bin/env python3
"""Fails on any file git tracks that is over 1 MB and not a listed fixture: benchmark output,
profiles and logs belong under the ignored bench/out-*/ folders, not in the repository.

usage: tools/check_large_files.py [ROOT]     (prints each file over the limit; exit 1 when any)
"""
import os
import subprocess
import sys

LIMIT = 1 << 20
# Files allowed over the limit, each with why (none today: the test fixtures are a few KiB).
FIXTURES = {}


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    files = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, check=True).stdout
    problems = []
    for name in filter(None, files.decode().split("\0")):
        path = os.path.join(root, name)
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        size = os.path.getsize(path)
        if size > LIMIT and name not in FIXTURES:
            problems.append(f"{name}: {size} bytes, over {LIMIT} and not a listed fixture "
                            "(tools/check_large_files.py FIXTURES); benchmark output goes under bench/out-*/")
    for p in problems:
        print(p)
    print(f"large files: {len(problems)} over {LIMIT} bytes not listed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
