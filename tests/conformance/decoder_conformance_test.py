"""Decoder layers against transformers' attention modules under pytest (decoder_conformance.py has
the checks and is the command-line runner bench/gpu_quick.sh uses).

usage: python -m pytest decoder_conformance_test.py --attnserve PATH/TO/attnserve [--random N --seed S]
(with a Python that has transformers: tools/torch2-env.sh's)
"""
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decoder_conformance  # noqa: E402


def test_decoder_layers_match_transformers(attnserve, request, checks):
    opt = request.config.getoption
    decoder_conformance.run(types.SimpleNamespace(
        binary=attnserve, server_args=opt("--server-args"), tolerance=opt("--tolerance") or decoder_conformance.TOL,
        random=opt("--random"), seed=opt("--seed"), banner_excludes=opt("--banner-excludes")), checks)
