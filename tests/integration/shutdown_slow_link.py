#!/usr/bin/python3
"""Reproduces a known defect (not in ctest: it fails today). SIGTERM while a large answer travels over
a slow link: the client gets UNAVAILABLE "Socket closed" instead of its answer, and the server exits 0.

gRPC 1.51's transport closes a connection as soon as its last call ends once the connection has been
told GOAWAY, while the end of that call's answer may still be in gRPC's buffers; the close meets unread
input (the client's flow-control updates), so the kernel resets the connection and drops the rest.
attnserve's own early close of idle connections is not involved (the same happens with it disabled).
Measured 2026-11-25: a 32 MiB answer relayed at 8 MB/s, SIGTERM while computing: the client received
32,289,039 of 33,555,225 bytes. Needs a fix that keeps GOAWAY from a connection until its answers
have left, without holding a proxy on a stopping replica.

usage: shutdown_slow_link.py PATH/TO/attnserve      (exit 0 once fixed)
"""
import os
import signal
import socket
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402


class SlowLink:
    """A TCP relay that hands the server's bytes to the client at `rate` bytes/s, as a slow network
    does; counts the bytes it delivered."""

    def __init__(self, upstream_port, rate):
        self.rate, self.delivered = rate, 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.upstream_port = upstream_port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src, dst, slow):
        try:
            while data := src.recv(16 << 10):
                dst.sendall(data)
                if slow:
                    self.delivered += len(data)
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main():
    check = lib.Checks()
    pb, _ = lib.load_stubs()
    import grpc
    rng = np.random.default_rng(22)
    slow = pb.AttendRequest(model="demo", query=lib.to_wire(pb, rng.standard_normal((16, 1024, 512))))
    server = lib.Server(sys.argv[1], "--shutdown-grace", "20")
    link = SlowLink(server.port, 8 << 20)
    channel = grpc.insecure_channel(f"127.0.0.1:{link.port}", options=[("grpc.max_receive_message_length", 64 << 20)])
    future = channel.unary_unary("/attnserve.v1.AttentionService/Attend").future(slow.SerializeToString(), timeout=60)
    time.sleep(0.5)  # Accepted and computing.
    server.proc.send_signal(signal.SIGTERM)
    try:
        answer = pb.AttendResponse.FromString(future.result(timeout=60))
        check("the answer in flight arrives whole", len(answer.output.data) == 16 * 1024 * 512 * 4)
    except grpc.RpcError as e:
        check("the answer in flight arrives whole", False,
              f"{e.code()} {e.details()!r} after {link.delivered} bytes")
    server.proc.wait(timeout=60)
    return check.summary("shutdown_slow_link")


if __name__ == "__main__":
    sys.exit(main())
