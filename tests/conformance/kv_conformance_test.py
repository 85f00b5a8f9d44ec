"""Memories and decoding sessions against nn.MultiheadAttention under pytest (kv_conformance.py has
the checks; it is also the command-line runner bench/gpu_check.sh uses).

usage: python3 -m pytest kv_conformance_test.py --attnserve PATH/TO/attnserve [--server-args ...]
           [--tolerance T]
"""
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_conformance  # noqa: E402


def test_memories_and_sessions_match_nn_multiheadattention(attnserve, request, checks):
    opt = request.config.getoption
    kv_conformance.run(types.SimpleNamespace(binary=attnserve, server_args=opt("--server-args"),
                                             tolerance=opt("--tolerance") or kv_conformance.TOL), checks)
