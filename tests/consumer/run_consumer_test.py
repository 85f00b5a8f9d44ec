#!/usr/bin/python3
"""Installs attnserve (cmake --install) into a temp prefix, builds tests/consumer against it with
find_package(attnserve), and runs it against a real server.

usage: run_consumer_test.py BUILD_DIR
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402


def run(*cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main():
    build = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="attnserve-consumer-")
    prefix, consumer_build = os.path.join(tmp, "prefix"), os.path.join(tmp, "build")
    run("cmake", "--install", build, "--prefix", prefix)
    run("cmake", "-S", os.path.dirname(os.path.abspath(__file__)), "-B", consumer_build,
        f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release")
    run("cmake", "--build", consumer_build, "-j2")
    server = lib.Server(os.path.join(build, "attnserve"), "--metrics-address", "")
    try:
        rc = subprocess.run([os.path.join(consumer_build, "consumer"), server.target]).returncode
    finally:
        server.stop()
    print(f"consumer_test: {int(rc == 0)} passed, {int(rc != 0)} failed")
    return rc


if __name__ == "__main__":
    sys.exit(main())
