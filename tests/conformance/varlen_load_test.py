"""Ragged small requests under concurrent load, attended as varlen groups, under pytest
(varlen_load.py has the checks; it is also the command-line runner bench/gpu_check.sh uses).

usage: python3 -m pytest varlen_load_test.py --attnserve PATH/TO/attnserve
           [--server-args "--varlen-attention emulate"] [--expect-backend varlen_emulated]
"""
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import varlen_load  # noqa: E402


def test_every_ragged_answer_is_its_own_and_batched(attnserve, request, checks):
    opt = request.config.getoption
    varlen_load.run(types.SimpleNamespace(
        binary=attnserve, server_args=opt("--server-args") or "--varlen-attention emulate",
        requests=opt("--requests"), callers=opt("--callers"), tolerance=opt("--tolerance") or 1e-5,
        expect_backend=opt("--expect-backend")), checks)
