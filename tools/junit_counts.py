#!/usr/bin/env python3
"""Passed, failed and skipped tests of one ctest run, from its JUnit report (--output-junit): one
test per ctest entry, except a unit binary (ctest entry unit_ROOM, one per room of the server,
tests/CMakeLists.txt), which counts the gtest cases of the report it wrote in the build tree
(gtest-unit_ROOM.xml) this run; a unit binary that wrote none (it crashed) counts as one failure.

  tools/junit_counts.py CTEST_JUNIT TESTS_DIR NEWER_THAN_FILE   -> "PASSED FAILED SKIPPED"
"""
import os
import sys
import xml.etree.ElementTree as ET


def outcome(case):
    """passed, failed or skipped, for a ctest or gtest <testcase>."""
    if case.find("failure") is not None or case.find("error") is not None or case.get("status") == "fail":
        return "failed"
    if case.find("skipped") is not None or case.get("status") in ("notrun", "disabled") or \
            case.get("result") == "skipped":
        return "skipped"
    return "passed"


def main():
    junit, tests_dir, newer = sys.argv[1:4]
    since = os.path.getmtime(newer)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        inner = os.path.join(tests_dir, f"gtest-{name}.xml")
        if name.startswith("unit_") and os.path.exists(inner) and os.path.getmtime(inner) >= since:
            try:
                cases = list(ET.parse(inner).getroot().iter("testcase"))
            except ET.ParseError:
                cases = []
            if cases:
                for c in cases:
                    counts[outcome(c)] += 1
                if outcome(case) == "failed" and not any(outcome(c) == "failed" for c in cases):
                    counts["failed"] += 1  # The binary failed after its tests (a leak, a crash at exit).
                continue
        counts[outcome(case)] += 1
    print(counts["passed"], counts["failed"], counts["skipped"])


if __name__ == "__main__":
    main()
