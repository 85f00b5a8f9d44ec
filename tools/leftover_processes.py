#!/usr/bin/env python3
"""Processes a test run left behind: every process whose environment carries the run's marker
(tools/build.sh test exports ATTNSERVE_TEST_RUN=<id> before its first stage, and every process it
starts inherits it, daemons that detach from their parent included), other than this check, the
processes it runs under and those still under ROOT (the test command itself: its pipes and the
shells of this stage; a process a test left behind has lost its parent and hangs from init). Each
one found is named (pid, command line, parent), stopped (SIGTERM, then SIGKILL after 5 s) and
counted as a failure.

  tools/leftover_processes.py MARKER [ROOT_PID]

Ends with "processes: 1 passed, 0 failed" (nothing left) or "processes: 0 passed, 1 failed".
"""
import os
import signal
import sys
import time


def parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def chain(pid):
    """pid and every process above it."""
    pids = []
    while pid > 1 and pid not in pids:
        pids.append(pid)
        pid = parent(pid)
    return pids


def ancestors():
    """This process and every process above it."""
    return set(chain(os.getpid()))


def read(pid, name):
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def marked(marker, root=0):
    needle = b"ATTNSERVE_TEST_RUN=" + marker.encode()
    mine = ancestors()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine or (root and root in chain(int(entry))):
            continue
        if needle in read(entry, "environ").split(b"\0"):
            found.append(int(entry))
    return found


def describe(pid):
    cmd = read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
    stat = read(pid, "stat").decode(errors="replace")
    parent = stat.rsplit(")", 1)[1].split()[1] if ")" in stat else "?"
    return f"pid {pid} (parent {parent}): {cmd[:300] or '[' + stat.split(' ')[1] + ']'}"


def main():
    if len(sys.argv) not in (2, 3) or not sys.argv[1]:
        print(__doc__, file=sys.stderr)
        return 2
    marker = sys.argv[1]
    root = int(sys.argv[2]) if len(sys.argv) == 3 else 0
    left = marked(marker, root)
    if not left:
        print("processes: nothing the tests started is still running")
        print("processes: 1 passed, 0 failed")
        return 0
    for pid in left:
        print(f"FAIL processes: still running after the tests: {describe(pid)}")
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        for pid in left:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and set(marked(marker, root)) & set(left):
            time.sleep(0.1)
        left = [p for p in marked(marker, root) if p in left]
        if not left:
            break
    print("processes: stopped them" + (f", but {left} would not stop" if left else ""))
    print("processes: 0 passed, 1 failed")
    return 1


if __name__ == "__main__":
    sys.exit(main())
