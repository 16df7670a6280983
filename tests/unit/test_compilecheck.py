"""ddp_train.compilecheck, verify.yml's check that a node compiles what `compile: true` compiles: Triton's
C compiler builds an extension against this Python's headers, in one line when it cannot."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddp_train import compilecheck


def test_the_headers_check_builds_and_imports_an_extension(tmp_path):
    assert compilecheck.check_headers(str(tmp_path)).startswith("cc=")


def test_a_node_without_python_h_is_named_with_the_package_to_install(tmp_path, monkeypatch):
    empty = tmp_path / "include"
    empty.mkdir()
    monkeypatch.setattr(compilecheck, "python_include", lambda: str(empty))
    with pytest.raises(compilecheck.CheckFailed) as e:
        compilecheck.check_headers(str(tmp_path))
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    msg = str(e.value)
    assert f"cannot build a C extension against Python {v}'s headers ({empty})" in msg
    assert "Python.h: No such file or directory" in msg
    assert f"python{v}-devel" in msg and "\n" not in msg


def test_the_compiler_is_tritons_choice_and_a_missing_one_is_one_line(tmp_path):
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc")}
    r = subprocess.run(
        [sys.executable, "-m", "ddp_train.compilecheck", "--no-torch-compile"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 1
    cc = tmp_path / "no-such-cc"
    assert r.stderr == f"ddp-compilecheck: the C compiler {cc} does not run: No such file or directory\n"
