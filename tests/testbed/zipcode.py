"""Testbed hosts only: the compiled code of Ansible's module payload, cached between module runs.

Every Ansible task runs its module as a fresh `python3` that imports `ansible.module_utils` from the
zip the controller sent (AnsiballZ). Python's zipimport compiles each source file in a zip on every
import and never caches the bytecode (Lib/zipimport.py: `_compile_source`, no writer), so each task
recompiles `basic.py` and its ~40 companions: 0.12 CPU-s per `stat` here, 0.08 s with this cache.
The suite's hosts run tens of thousands of tasks on 2 cores.

`install(cache_dir)` wraps `zipimport._compile_source` for files inside an `*_payload.zip` (the
name AnsiballZ gives its zip): the code object is keyed by the Python version, the path inside
the zip and the exact source bytes, so a changed file is compiled again; the cached object gets the
current zip's path as its filename, so tracebacks read as without the cache. Anything else a
zipimport loads, and every failure to read or write the cache, takes the normal path. The testbed
loads this from each host's sitecustomize (Debian links /usr/lib/python3.11/sitecustomize.py into
/etc, which every host overlays): the system Python of the hosts, which runs Ansible's modules, and
nothing on the real machine. Stdlib only; it runs in the hosts' /usr/bin/python3.
"""

from __future__ import annotations

import marshal
import os
import sys
import types
import zipimport

PAYLOAD = "_payload.zip"


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def install(cache_dir: str) -> None:
    compile_source = zipimport._compile_source  # type: ignore[attr-defined]

    def cached(pathname: str, source: bytes) -> types.CodeType:
        inner = pathname.partition(PAYLOAD)[2]
        if not inner:
            return compile_source(pathname, source)
        import hashlib

        key = hashlib.sha256(f"{sys.version}\0{inner}\0".encode() + source).hexdigest()
        path = os.path.join(cache_dir, key)
        try:
            with open(path, "rb") as f:
                code = marshal.load(f)
            if isinstance(code, types.CodeType):
                return _renamed(code, pathname)
        except (OSError, EOFError, ValueError, TypeError):
            pass
        code = compile_source(pathname, source)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(cache_dir, mode=0o700, exist_ok=True)
            with open(tmp, "xb") as f:
                marshal.dump(code, f)
            os.replace(tmp, path)
        except OSError:
            pass
        return code

    zipimport._compile_source = cached  # type: ignore[attr-defined]


_main: bytes = b""


def take_main_from_stdin() -> None:
    """Read Ansible's pipelined module from stdin at once, and have Python run it from memory.

    With pipelining Ansible runs `/bin/sh -c '<python> && sleep 0'` and writes the AnsiballZ script
    (~180 KB, one line of base64) to its stdin; CPython 3.11 reads a main script from stdin one byte
    per read(2) (strace: 180978 reads for stat's 180977 bytes; 0.06 CPU-s). Only for that parent
    command line: the whole stdin (the script, then EOF) is read here, and fd 0 becomes a pipe that
    holds one line that runs it in __main__, so exit codes, atexit and tracebacks are Python's own.
    """
    if sys.argv != [""] or sys.flags.interactive or os.isatty(0):
        return
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().split(b"\0")
    except OSError:
        return
    if len(parent) < 3 or parent[1] != b"-c" or not parent[2].endswith(b" && sleep 0"):
        return
    global _main
    chunks = []
    while chunk := os.read(0, 1 << 20):
        chunks.append(chunk)
    _main = b"".join(chunks)
    r, w = os.pipe()
    os.write(w, b"__import__('zipcode').run_main()\n")
    os.close(w)
    os.dup2(r, 0)
    os.close(r)


def run_main() -> None:
    import __main__

    exec(compile(_main, "<stdin>", "exec", dont_inherit=True), __main__.__dict__)  # noqa: S102
