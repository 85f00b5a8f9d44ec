#!/usr/bin/env python3
"""The slowest tests of a test run, from its JUnit reports (ctest's --output-junit, gtest's
--gtest_output=xml, pytest's --junitxml): one line each, slowest first, the stage named by the
report's file name.

  tools/slowest_tests.py [-n 20] [--over 30] REPORT.xml...

A ctest entry that runs a whole pytest file or gtest binary (pytest-NAME.xml or gtest-NAME.xml among
the reports, beside it in the same build tree) is replaced by the tests inside it. --over S marks
every test longer than S seconds with "over S s"; a test that must stay longer says why in the test
itself (docs/tests.md, "Slow tests").
"""
import argparse
import os
import sys
import xml.etree.ElementTree as ET


def tree_of(path):
    """The build tree a report belongs to: the LibTorch 2.x flavour's or the default one."""
    name = os.path.basename(path)
    return "torch2" if "build-torch2" in path or name.startswith("torch2") else "debian"


def inner_name(path):
    """NAME of a pytest-NAME.xml or gtest-NAME.xml report, else None."""
    stem = os.path.splitext(os.path.basename(path))[0]
    for prefix in ("pytest-", "gtest-"):
        if stem.startswith(prefix):
            return stem[len(prefix):]
    return None


def cases(path):
    stage = os.path.splitext(os.path.basename(path))[0]
    if inner_name(path) is not None and tree_of(path) == "torch2":
        stage = "torch2:" + stage
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        print(f"slowest_tests: {path}: {e}", file=sys.stderr)
        return
    for case in root.iter("testcase"):
        try:
            seconds = float(case.get("time", "0"))
        except ValueError:
            continue
        cls = case.get("classname", "")
        name = case.get("name", "")
        # ctest repeats the test's name as its class name; gtest gives the suite.
        full = name if cls in ("", name) or cls.startswith(name) else f"{cls}.{name}"
        yield seconds, stage, full


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--over", type=float, default=30.0)
    ap.add_argument("reports", nargs="*")
    a = ap.parse_args()
    expanded = {(tree_of(r), inner_name(r)) for r in a.reports if inner_name(r) is not None}
    rows = sorted((c for r in a.reports for c in cases(r)
                   if inner_name(r) is not None or (tree_of(r), c[2]) not in expanded), reverse=True)
    if not rows:
        print("slowest tests: no report")
        return 0
    total = sum(r[0] for r in rows)
    print(f"slowest tests ({len(rows)} timed, {total / 60:.1f} min of test time in all):")
    for seconds, stage, name in rows[: a.n]:
        mark = f"  over {a.over:g} s" if seconds > a.over else ""
        print(f"  {seconds:8.1f} s  {stage:<12} {name}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
