"""Builds the attnserve package: the gRPC stubs are generated from the repository's proto/ (and the
gRPC service configs copied from deploy/grpc/) into the build directory, so the wheel carries them
and the source tree stays as checked in."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def _find(*parts):
    for base in (HERE, ROOT):  # An sdist carries its own copies; a checkout has them at the root.
        path = os.path.join(base, *parts)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"attnserve: {os.path.join(*parts)} not found under {HERE} or {ROOT}")


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc

        proto = _find("proto")
        target = os.path.abspath(self.build_lib)
        include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        args = ["protoc", f"-I{proto}", f"-I{include}", f"--python_out={target}", f"--pyi_out={target}",
                f"--grpc_python_out={target}", "attnserve/v1/attention.proto"]
        if protoc.main(args) != 0:
            raise RuntimeError("attnserve: protoc failed on attnserve/v1/attention.proto")
        for name in ("service-config.json", "service-config-proxy.json"):
            shutil.copy(_find("deploy", "grpc", name), os.path.join(target, "attnserve", name))


setup(cmdclass={"build_py": BuildWithStubs})
