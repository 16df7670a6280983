"""Run as `python -c THIS SCRIPT ARGS`: read the environment as one JSON line from stdin, exec SCRIPT with it.

Stdin is read byte by byte so that the rest stays for the script; no value is ever on a command line
that `ps` shows (issue #24). Executed as source: it imports nothing of ours."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    line = b""
    while not line.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            break
        line += c
    env = dict(os.environ)
    env.update(json.loads(line or b"{}"))
    os.execve(sys.executable, [sys.executable, "-c", *sys.argv[1:]], env)  # noqa: S606 (no shell wanted)


if __name__ == "__main__":
    main()
