"""What the docs say the project needs agrees with what it really needs.

The Python: torch's own Requires-Python (the nodes run ddp_train with the pinned torch). setuptools: the
project's `license = "Apache-2.0"` is a PEP 639 license expression, which setuptools reads from 77.0.0 on
(setuptools changelog v77.0.0, #4706); the build-system table asks for it, and so must the docs."""

from __future__ import annotations

import re
from importlib import metadata

import tomllib
from packaging.specifiers import SpecifierSet

from tests.ansible.conftest import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
ROLE_README = (REPO_ROOT / "roles/pytorch/README.md").read_text()
ROLE_DEFAULTS = (REPO_ROOT / "roles/pytorch/defaults/main.yml").read_text()


def _minimum(spec: str) -> tuple[int, ...]:
    (lower,) = [s for s in SpecifierSet(spec) if s.operator == ">="]
    return tuple(int(x) for x in lower.version.split("."))


def test_the_python_floor_is_torchs():
    torch_floor = _minimum(metadata.metadata("torch")["Requires-Python"])
    assert _minimum(PYPROJECT["project"]["requires-python"]) == torch_floor
    said = re.search(r"Python >= (\d+)\.(\d+) with venv on the nodes", ROLE_README)
    assert said and tuple(map(int, said.groups())) == torch_floor, said


def test_the_docs_ask_for_the_setuptools_the_build_needs():
    (build,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    needed = _minimum(build.removeprefix("setuptools"))
    assert needed >= (77,), "license = 'Apache-2.0' (PEP 639) needs setuptools >= 77"
    for text in (ROLE_README, ROLE_DEFAULTS):
        said = [tuple(map(int, m.split("."))) for m in re.findall(r"setuptools ?>= ?(\d+(?:\.\d+)*)", text)]
        assert said and all(s == needed for s in said), said
