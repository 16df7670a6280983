"""Preflight's network probe, connecting side: every target in parallel, ok or the error for each.

    connector TARGETS-JSON TOKEN TIMEOUT      (targets: [[key, ip, port], ...])

A failed connect is tried once more before it counts (one dropped SYN under load must not fail a
launch). An OSError is reported as "ERRNO-NAME strerror" so the launcher can tell no route
(EHOSTUNREACH) from refused. Prints `DDP-CONNECT {key: result}`."""

from __future__ import annotations

import errno
import json
import socket
import threading

MARK = "DDP-CONNECT "


def attempt(ip: str, port: int, token: str, timeout: float) -> str:
    try:
        with socket.create_connection((ip, port), timeout=timeout) as s:
            s.settimeout(timeout)
            got = s.makefile().readline().strip()
        return "ok" if got == token else "answered by another program (not the ddp-launch probe)"
    except socket.timeout:
        return f"timed out after {timeout:g}s"
    except OSError as e:
        return "{} {}".format(errno.errorcode.get(e.errno or 0, "OSError"), e.strerror or e)


def main(argv: list[str]) -> int:
    targets, token, timeout = json.loads(argv[0]), argv[1], float(argv[2])
    out: dict[str, str] = {}

    def probe(key: str, ip: str, port: int) -> None:
        first = attempt(ip, port, token, timeout)
        if first == "ok" or first.startswith("answered"):
            out[key] = first
            return
        second = attempt(ip, port, token, timeout)
        out[key] = second if second == "ok" else f"{second} (twice)"

    threads = [threading.Thread(target=probe, args=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(MARK + json.dumps(out), flush=True)
    return 0
