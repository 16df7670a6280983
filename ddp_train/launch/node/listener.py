"""Preflight's network probe, listening side: MASTER_PORT (master only) and an OS-chosen ephemeral port;
each connection is answered with the token. Ends on stdin EOF, or after its `life` in seconds.

    listener PORT TOKEN LIFE      (PORT 0: the ephemeral port only)

prints `MASTER <port>` or `MASTER-BUSY <port> <why>`, `EPHEMERAL <port>`, then `READY`."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import time


def _listen(socks: list[socket.socket], port: int) -> int:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", port))
    s.listen(128)
    socks.append(s)
    return int(s.getsockname()[1])


def main(argv: list[str]) -> int:
    port, token, life = int(argv[0]), argv[1].encode(), float(argv[2])
    socks: list[socket.socket] = []
    if port:
        try:
            print("MASTER", _listen(socks, port), flush=True)
        except OSError as e:
            print("MASTER-BUSY", port, e.strerror, flush=True)
    print("EPHEMERAL", _listen(socks, 0), flush=True)
    print("READY", flush=True)
    end = time.time() + life
    while time.time() < end:
        ready = select.select([*socks, sys.stdin], [], [], 0.5)[0]
        for s in ready:
            if not isinstance(s, socket.socket):  # stdin: EOF ends the listener
                if not os.read(0, 4096):
                    return 0
                continue
            c, _ = s.accept()
            with contextlib.suppress(OSError):
                c.sendall(token + b"\n")
            c.close()
    return 0
