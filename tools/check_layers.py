#!/usr/bin/env python3
"""Checks the server's includes against its rooms: a file includes only its own room's headers and
those of the rooms it links (server/CMakeLists.txt's attnserve_room BELOW lists, read from there),
gRPC's headers only in rooms that link gRPC (or sit above one that does), and no two headers
include each other
(directly or through others). Prints each violation; exit 1 when there is any.

usage: tools/check_layers.py [ROOT]
"""
import os
import re
import sys

ROOM = re.compile(r"attnserve_room\((\w+)(.*?)\)", re.S)


def rooms(root):
    """The rooms bottom up, the rooms each may use (its BELOW rooms and theirs), and the rooms that
    may include gRPC's headers (those that link gRPC themselves, and the rooms above them), read
    from server/CMakeLists.txt, the one place that says it."""
    below, order, grpc, grpc_public = {}, [], set(), set()
    text = open(os.path.join(root, "server", "CMakeLists.txt")).read()
    for m in ROOM.finditer(text):
        room, args = m.group(1), m.group(2)
        direct = set()
        if "BELOW" in args:
            words = args.split("BELOW", 1)[1].split()
            for w in words:
                if w in ("PUBLIC", "PRIVATE", "SOURCES"):
                    break
                direct.add(w.removeprefix("attnserve_"))
        below[room] = set().union(direct, *(below[r] for r in direct))
        public = args.split("PUBLIC", 1)[1].split("PRIVATE")[0] if "PUBLIC" in args else ""
        if "gRPC::grpc++" in args or direct & grpc_public:
            grpc.add(room)
        if "gRPC::grpc++" in public or direct & grpc_public:
            grpc_public.add(room)  # Its headers bring gRPC's: the rooms above may use them too.
        order.append(room)
    return order, below, grpc


# gRPC's headers are system headers (/usr/include/grpcpp), reachable from every room whatever it
# links: this check, not the compiler, keeps them out of the rooms beneath the front ends.
GRPC_INCLUDE = re.compile(r'^\s*#\s*include\s+<(grpcpp?/[^>]+)>', re.M)


INCLUDE = re.compile(r'^\s*#\s*include\s+"(server/([a-z_]+)/[^"]+)"', re.M)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    server = os.path.join(root, "server")
    ROOMS, BELOW, GRPC = rooms(root)
    edges, problems = {}, []
    for room in ROOMS:
        for name in sorted(os.listdir(os.path.join(server, room))):
            if not name.endswith((".h", ".cc")):
                continue
            path = f"server/{room}/{name}"
            text = open(os.path.join(root, path)).read()
            edges[path] = [m.group(1) for m in INCLUDE.finditer(text)]
            if room not in GRPC:
                for m in GRPC_INCLUDE.finditer(text):
                    problems.append(f"{path} includes <{m.group(1)}>: room {room} links no gRPC "
                                    "(gRPC stays in the front ends, the exporter and the process)")
            for target, target_room in ((m.group(1), m.group(2)) for m in INCLUDE.finditer(text)):
                if target_room != room and target_room not in BELOW[room]:
                    problems.append(f"{path} includes {target}: room {target_room} is not beneath {room}")
    # Cycles among the files (a header including, through others, the file that includes it).
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in edges.get(node, []):
            if state.get(nxt) == "open":
                problems.append("include cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in edges:
        if node not in state:
            visit(node, [node])
    for p in problems:
        print(p)
    print(f"layers: {len(edges)} files in {len(ROOMS)} rooms, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
