"""Helpers for the Ansible tests: run ansible-playbook/molecule from the repo with the venv's tools."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tool_env(venv_bin: Path, fact_cache: Path | None = None, **extra: str) -> dict[str, str]:
    """Environment for ansible tools: the venv first on PATH, the project's ansible.cfg, no colour."""
    env = dict(os.environ)
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    env["ANSIBLE_CONFIG"] = str(REPO_ROOT / "ansible.cfg")
    env["ANSIBLE_NOCOLOR"] = "1"
    env["ANSIBLE_FORCE_COLOR"] = "0"
    env["NO_COLOR"] = "1"
    if fact_cache is not None:  # testbeds reuse host names: never share cached facts between them
        env["ANSIBLE_CACHE_PLUGIN_CONNECTION"] = str(fact_cache)
    env.update(extra)
    return env


def run(
    argv: list[str], env: dict[str, str], timeout: float = 600, merge: bool = False
) -> subprocess.CompletedProcess:
    """Run a tool from the repo root; with merge, stderr goes into stdout in order (molecule logs there)."""
    err = subprocess.STDOUT if merge else subprocess.PIPE
    return subprocess.run(
        argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout
    )


@pytest.fixture
def playbook(venv_bin, tmp_path):
    """Run ansible-playbook from the repo root; returns the CompletedProcess (stdout+stderr in .out)."""

    def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        env = tool_env(venv_bin, tmp_path / "facts")
        res = run([str(venv_bin / "ansible-playbook"), *args], env, timeout)
        res.out = res.stdout + res.stderr
        return res

    return _run


def write_inventory(source: Path, dest_dir: Path, edit) -> Path:
    """Copy a testbed inventory with `edit(inventory)` applied; returns the new hosts.yml."""
    inv = yaml.safe_load(source.read_text())
    edit(inv)
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / "hosts.yml"
    dest.write_text(yaml.safe_dump(inv, sort_keys=False))
    return dest


def molecule_test(scenario: str, venv_bin: Path, *args: str) -> str:
    """`molecule test -s <scenario> <args>` from the repo root; returns its output without colours, after
    asserting it passed."""
    start = time.monotonic()
    res = run(
        [str(venv_bin / "molecule"), "test", "-s", scenario, *args], tool_env(venv_bin), 1700, merge=True
    )
    out = ANSI.sub("", res.stdout)
    print(f"molecule test -s {scenario}: rc={res.returncode} in {(time.monotonic() - start) / 60:.1f} min")
    assert res.returncode == 0, out[-6000:]
    return out


def molecule_step(out: str, scenario: str, step: str) -> str:
    """The part of molecule's output for one step of the scenario's sequence."""
    m = re.search(rf"\[{scenario} > {step}\] Executing(.*?)\[{scenario} > {step}\] Executed", out, re.S)
    assert m, f"molecule did not run {step}"
    return m.group(1)


def recaps(out: str) -> dict[str, int]:
    """changed= of each nodeN in an ansible-playbook run's recap."""
    return {h: int(c) for h, c in re.findall(r"(node\d)\s+: ok=\d+\s+changed=(\d+)", out)}
