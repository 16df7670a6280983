"""The lent GPU machine's Python, as far as this machine can show it: only its packages are importable.

Put this folder first on PYTHONPATH (tests/bench/test_gpu_bench_dryrun.py does) and every import of a
package that this venv has but the GPU image lacks fails as it would there, in this process and in every
child (torchrun's ranks, `-m ddp_train`), which inherit PYTHONPATH. What is on PYTHONPATH itself (the
repository, the wheels bench/gpu.sh installs from bench/wheels) stays importable, as on the machine.

The image's package list: /work/.library/device/KINDS.md, "Python packages already there" (read
2026-11-17): Python 3.12, torch 2.11, no jsonschema, no fabric/paramiko/ansible, no network. Names here
are import names of those packages that a venv of this project can hold; a package the image has but
this list lacks only makes the simulation stricter than the machine (the test then fails, never passes
wrongly).
"""

from __future__ import annotations

import importlib.machinery
import sys
import sysconfig

IMAGE = frozenset(
    [
        *("torch", "torchgen", "functorch", "triton", "numpy", "yaml", "_yaml", "attr", "attrs"),
        *("typing_extensions", "jinja2", "markupsafe", "filelock", "fsspec", "sympy", "mpmath", "networkx"),
        *("packaging", "psutil", "pip", "setuptools", "_distutils_hack", "pkg_resources", "wheel"),
        *("tokenizers", "tiktoken", "regex", "matplotlib", "prometheus_client", "pytest", "_pytest"),
        *("pluggy", "iniconfig", "xdist", "execnet", "hypothesis", "sortedcontainers", "certifi", "idna"),
        *("urllib3", "requests", "charset_normalizer", "six", "dateutil", "tqdm", "rich", "pygments"),
        *("markdown_it", "mdurl", "click", "cloudpickle", "msgpack", "safetensors", "huggingface_hub"),
        *("nvidia", "cuda", "scipy", "pandas", "opt_einsum"),
    ]
)
_SITE = tuple({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


class _ImagePathFinder(importlib.machinery.PathFinder):
    """The usual path finder, blind to what this venv holds and the image does not: such a module is
    simply not found (importlib.util.find_spec gives None, an import raises ModuleNotFoundError)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        spec = super().find_spec(name, path, target)
        top = name.partition(".")[0]
        if spec is None or top in IMAGE or top in sys.stdlib_module_names:
            return spec
        where = [spec.origin or "", *(spec.submodule_search_locations or [])]
        return None if any(p.startswith(_SITE) for p in where if p) else spec


sys.meta_path[:] = [_ImagePathFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
