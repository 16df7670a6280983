"""Can this node compile what `compile: true` compiles? Run by playbooks/verify.yml on every node.

A node without the Python headers trains fine until the first compiled step: Triton builds its launcher
(`cuda_utils.c`, `#include <Python.h>`) with the system C compiler there, and the run dies with "Python.h:
No such file or directory" (pytorch/pytorch#129351, sgl-project/sglang#18644). Triton picks the compiler
as $CC, else gcc, else clang, and adds `sysconfig.get_paths()["include"]` (triton/runtime/build.py).
Inductor's CPU kernels need a C++ compiler instead, and no Python.h (torch 2.13: a CPU compile with the
headers hidden still runs).

Two checks, in order:
1. headers: that compiler builds a C extension against this Python's Python.h and it imports;
2. torch.compile: one small function compiled on the GPU when torch sees one (Triton), else on the CPU
   (inductor's C++), and its result compared with eager. `--no-torch-compile` leaves it out.

Both compile from scratch: the caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and TMPDIR, where
torch keeps its own) go to a private temporary directory, removed after, so a cached kernel cannot
hide a missing toolchain. Prints `ddp-compilecheck ok ...`; otherwise one line on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

_EXTENSION = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "ddp_compilecheck_ext", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_ddp_compilecheck_ext(void) { return PyModule_Create(&def); }
"""


class CheckFailed(Exception):
    """One line: what could not be compiled, and the first error."""


def c_compiler() -> str | None:
    """The C compiler Triton would use: $CC, else gcc, else clang (triton/runtime/build.py)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def python_include() -> str:
    """Where this Python's Python.h lies, as Triton asks (Debian's posix_local read as posix_prefix)."""
    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(no output)"])[0][:300]


def check_headers(workdir: str) -> str:
    """Build and import a C extension against Python.h with Triton's compiler; its description."""
    cc = c_compiler()
    include = python_include()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if cc is None:
        raise CheckFailed(
            "no C compiler (gcc or clang, or $CC): Triton builds its launcher with one at the "
            "first compiled step; install gcc"
        )
    src = os.path.join(workdir, "ddp_compilecheck_ext.c")
    so = os.path.join(workdir, "ddp_compilecheck_ext" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    with open(src, "w", encoding="utf-8") as f:
        f.write(_EXTENSION)
    try:
        r = subprocess.run(
            [cc, src, "-O1", "-shared", "-fPIC", f"-I{include}", "-o", so],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as e:
        raise CheckFailed(f"the C compiler {cc} does not run: {e.strerror}") from e
    if r.returncode != 0:
        raise CheckFailed(
            f"{cc} cannot build a C extension against Python {version}'s headers ({include}): "
            f"{_first_error(r.stderr + r.stdout)}; install the Python {version} headers "
            f"(EL: python{version}-devel or python3-devel, Debian: python{version}-dev), which "
            f"Triton needs at the first compiled step"
        )
    spec = importlib.util.spec_from_file_location("ddp_compilecheck_ext", so)
    assert spec is not None and spec.loader is not None
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except ImportError as e:
        raise CheckFailed(f"a C extension built by {cc} against {include} does not import: {e}") from e
    return f"cc={cc} headers={include}"


def check_torch_compile() -> str:
    """Compile one small function on the GPU (Triton) or the CPU (inductor's C++); its description."""
    import torch  # noqa: PLC0415 - only this check needs it

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2.0 + x.cos()

    x = torch.linspace(-3.0, 3.0, 256, device=device)
    try:
        y = torch.compile(f, dynamic=False)(x)
    except Exception as e:  # noqa: BLE001 - any compile failure is the answer, in one line
        raise CheckFailed(f"torch.compile on {device} failed: {_first_error(str(e))}") from e
    if not torch.allclose(y, f(x), atol=1e-5):
        raise CheckFailed(f"torch.compile on {device} gave another result than eager")
    return f"torch_compile={device}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_train.compilecheck", description=__doc__.split("\n")[0])
    p.add_argument(
        "--no-torch-compile", action="store_true", help="check the C compiler and the Python headers only"
    )
    args = p.parse_args(argv)
    t0 = time.monotonic()
    # 0700, this user's; inductor's compile workers may still hold files in it at the end
    with tempfile.TemporaryDirectory(prefix="ddp-compilecheck-", ignore_cleanup_errors=True) as workdir:
        for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TMPDIR"):
            os.environ[var] = os.path.join(workdir, var.lower())
            os.makedirs(os.environ[var], mode=0o700)
        tempfile.tempdir = None  # TMPDIR read again
        try:
            parts = [check_headers(workdir)]
            if not args.no_torch_compile:
                parts.append(check_torch_compile())
        except CheckFailed as e:
            print(f"ddp-compilecheck: {e}", file=sys.stderr)
            return 1
    print(f"ddp-compilecheck ok {' '.join(parts)} {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
