#!/usr/bin/python3
"""Installs attnserve (cmake --install) into a temp prefix, builds tests/consumer against it with
find_package(attnserve), and runs it against a real server.

usage: python3 -m pytest find_package_test.py --attnserve BUILD_DIR/attnserve
       (the build tree is the binary's directory)
"""
import os
import subprocess
import sys

import pytest

import attnserve_py as lib  # tests/lib, on the path by tests/conftest.py


def run(*cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def test_a_consumer_project_finds_builds_and_calls_the_client(attnserve, tmp_path):
    build = os.path.dirname(os.path.abspath(attnserve))
    prefix, consumer_build = str(tmp_path / "prefix"), str(tmp_path / "build")
    run("cmake", "--install", build, "--prefix", prefix)
    run("cmake", "-S", os.path.dirname(os.path.abspath(__file__)), "-B", consumer_build,
        f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release")
    run("cmake", "--build", consumer_build, "-j2")
    server = lib.Server(attnserve, "--metrics-address", "", "--http-address", "")
    try:
        rc = subprocess.run([os.path.join(consumer_build, "consumer"), server.target]).returncode
    finally:
        server.stop()
    assert rc == 0, f"the consumer exited {rc}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
