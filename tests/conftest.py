"""pytest for attnserve's Python tests: the binaries under test come from command-line options,
the shared helpers from tests/lib (and tools/), and the `checks` fixture collects a test's named
checks, printing each as it goes, and fails the test with every one that did not hold."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "lib"))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))

import attnserve_py as lib  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--attnserve", help="the attnserve binary under test (build/attnserve)")
    parser.addoption("--cli", help="attnserve-cli (build/attnserve-cli), for the tests that drive it")
    parser.addoption("--bench", help="attnserve-bench (build/attnserve-bench), for the replicas test")
    parser.addoption("--busy-rounds", type=int, default=1,
                     help="shutdown_test: stops of a busy server (30 to measure the tail)")
    parser.addoption("--threads", type=int, default=6, help="replicas_test: load threads")
    # The conformance tests' (tests/conformance/conformance_test.py).
    parser.addoption("--server-args", default="", help="conformance: extra attnserve flags")
    parser.addoption("--reference", choices=["float32", "float64"], default="float32",
                     help="conformance: the reference's dtype")
    parser.addoption("--tolerance", type=float, default=None, help="conformance: output tolerance")
    parser.addoption("--weights-tolerance", type=float, default=None,
                     help="conformance: attention weights' tolerance")
    parser.addoption("--random", type=int, default=0, help="conformance: N randomized configurations")
    parser.addoption("--seed", type=int, default=1, help="conformance: their seed")
    parser.addoption("--requests", type=int, default=1200, help="varlen_load: requests")
    parser.addoption("--callers", type=int, default=16, help="varlen_load: concurrent callers")
    parser.addoption("--banner-excludes", default="",
                     help="decoder_conformance: text the server's start-up line must not hold")
    parser.addoption("--expect-backend", default="varlen_emulated",
                     help="varlen_load: a backend /metrics must count at least once (regex)")
    parser.addoption("--package-fixtures", help="python_package_test: the directory python_package_fixtures.py wrote")


@pytest.fixture(scope="session")
def attnserve(request):
    path = request.config.getoption("--attnserve")
    if not path:
        raise pytest.UsageError("--attnserve PATH/TO/attnserve is required")
    return path


def _binary(request, option):
    path = request.config.getoption(option)
    if not path:
        raise pytest.UsageError(f"{option} PATH is required by {request.node.nodeid}")
    return path


@pytest.fixture(scope="session")
def cli(request):
    return _binary(request, "--cli")


@pytest.fixture(scope="session")
def bench(request):
    return _binary(request, "--bench")


@pytest.fixture(scope="session")
def stubs():
    """attnserve.v1's generated Python stubs: (messages, services)."""
    return lib.load_stubs()


@pytest.fixture
def checks():
    return lib.Checks()


@pytest.fixture(autouse=True)
def _module_checks(request, checks, monkeypatch):
    """A test module's global `check` (its helpers call it) is the running test's `checks`."""
    if isinstance(getattr(request.module, "check", None), lib.Checks):
        monkeypatch.setattr(request.module, "check", checks)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test whose `checks` recorded failures fails, listing every one of them."""
    outcome = yield
    report = outcome.get_result()
    c = item.funcargs.get("checks") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.passed and c is not None and c.failures:
        report.outcome = "failed"
        report.longrepr = f"{len(c.failures)} of {c.passed + c.failed} checks failed:\n" + "\n".join(c.failures)
