"""The pytorch role's wheelhouse lock script (vars/main.yml), run as the role runs it, on wheel directories.

Two versions of one project in the wheelhouse (torch's dependencies resolved against one index and the
trainer's against another can each pick another typing-extensions) would make every node's
`pip install --require-hashes` fail with ResolutionImpossible: the lock step refuses, in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.ansible.conftest import REPO_ROOT
from tests.testbed import pyindex

VARS = yaml.safe_load((REPO_ROOT / "roles/pytorch/vars/main.yml").read_text())
SCRIPT = VARS["_pytorch_wheelhouse_lock_script"]


def _lock(wheelhouse: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(wheelhouse)], capture_output=True, text=True, timeout=60
    )


def _wheels(root: Path, *dists: pyindex.Dist) -> Path:
    for d in dists:
        pyindex.wheel(root / "wheels", d)
    return root


def test_a_wheelhouse_of_one_resolution_is_locked_file_by_file(tmp_path):
    wh = _wheels(
        tmp_path,
        pyindex.Dist("torch", "2.13.0+cpu"),
        pyindex.Dist("typing_extensions", "4.16.0"),
        pyindex.Dist("Jinja2", "3.1.6"),
    )
    res = _lock(wh)
    assert res.returncode == 0, res.stderr
    lines = (wh / "requirements.txt").read_text().splitlines()
    assert [line.split(" ")[0] for line in lines] == [
        "Jinja2==3.1.6",
        "torch==2.13.0+cpu",
        "typing_extensions==4.16.0",
    ]
    assert all(line.split(" ")[1].startswith("--hash=sha256:") for line in lines)


def test_two_versions_of_one_project_fail_the_lock_in_one_line(tmp_path):
    # The two spellings PyTorch's index and PyPI use for one project: one project to pip.
    wh = _wheels(
        tmp_path,
        pyindex.Dist("torch", "2.13.0+cpu"),
        pyindex.Dist("typing_extensions", "4.15.0"),
        pyindex.Dist("typing_extensions", "4.16.0"),
        pyindex.Dist("Jinja2", "3.1.6"),
    )
    res = _lock(wh)
    assert res.returncode == 1
    assert res.stderr.strip() == (
        f"{wh / 'wheels'} holds two versions of typing-extensions (4.15.0, 4.16.0): no install could satisfy"
        " a lock of both; remove the directory and run again"
    )
    assert not (wh / "requirements.txt").exists(), "no lock: a lock means a complete, installable wheelhouse"
