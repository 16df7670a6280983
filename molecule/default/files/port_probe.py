"""Listen on TCP ports for a while, or try to connect to one: the firewall checks of molecule/default.

python3 port_probe.py listen ADDRESS SECONDS PORT [PORT ...]  # accept and close connections
python3 port_probe.py connect HOST PORT TIMEOUT                # exit 0 if connected, 1 if not
"""

import selectors
import socket
import sys
import time


def listen(address: str, seconds: float, ports: list[int]) -> int:
    sel = selectors.DefaultSelector()
    for port in ports:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
        s.listen()
        sel.register(s, selectors.EVENT_READ)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(timeout=left):
            conn, _ = key.fileobj.accept()
            conn.close()
    return 0


def connect(host: str, port: int, timeout: float) -> int:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        print(f"{host}:{port} not reachable: {e}")
        return 1
    print(f"{host}:{port} reachable")
    return 0


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "listen":
        sys.exit(listen(args[0], float(args[1]), [int(p) for p in args[2:]]))
    sys.exit(connect(args[0], int(args[1]), float(args[2])))
