"""PyTorch conformance under pytest: one test a configuration (conformance.py has the configurations,
the module, the reference and the check; it is also the command-line runner bench/gpu_check.sh uses).

usage: python3 -m pytest conformance_test.py --attnserve PATH/TO/attnserve
           [--server-args "--dtype bfloat16"] [--reference float64] [--tolerance 2e-2]
           [--weights-tolerance 1e-2] [--random N --seed S] [-k NAME]
Tolerances: conformance.py's (1e-5 float32, 1e-3 float16 on the wire, unless given).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conformance  # noqa: E402


def pytest_generate_tests(metafunc):
    if "config" in metafunc.fixturenames:
        opt = metafunc.config.getoption
        configs = conformance.CONFIGS + conformance.random_configs(opt("--random"), opt("--seed"))
        metafunc.parametrize("config", list(enumerate(configs)), ids=[c["name"] for c in configs])


@pytest.fixture(scope="module")
def served(attnserve, request):
    opt = request.config.getoption
    configs = conformance.CONFIGS + conformance.random_configs(opt("--random"), opt("--seed"))
    s = conformance.Served(attnserve, configs, opt("--server-args"))
    yield s
    s.stop()


def test_matches_nn_multiheadattention(served, config, request):
    i, c = config
    opt = request.config.getoption
    ref = torch.float64 if opt("--reference") == "float64" else torch.float32
    ok, err, werr, tol = conformance.check_config(served, i, c, ref, opt("--tolerance"),
                                                  opt("--weights-tolerance"))
    assert ok, f"{c}: output relative error {err:.2e}, weights absolute error {werr:.2e}, tolerance {tol:.0e}"
