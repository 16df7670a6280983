"""install.sh, README's step "1. Install": into an empty HOME, ddp-launch, ansible-playbook and
the playbooks' collections work from the bin directory alone, a command of the same name already there
is kept, and torch is the pinned 2.13.0 (on this
machine the local wheel: pip's log shows no torch download)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_install_puts_the_launcher_and_ansible_on_path(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    env = {k: v for k, v in os.environ.items() if k.startswith(("PIP_", "LANG", "LC_", "SSL_", "REQUESTS_"))}
    real_cache = Path.home() / ".cache" / "pip"  # the wheels already fetched here, not a second download
    # PIP_COMPILE=false: pip leaves out byte-compiling torch's and Ansible's files (the commands import
    # the same code; docs/testing.md, like the testbed hosts' installs)
    env |= {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin", "DDP_PYTHON": str(python),
            "PIP_LOG": str(tmp_path / "pip.log"), "PIP_CACHE_DIR": str(real_cache),
            "PIP_COMPILE": "false"}  # fmt: skip
    bin_dir = home / ".local" / "bin"
    bin_dir.mkdir(parents=True)
    theirs = bin_dir / "ansible-config"  # another install's command of the same name: kept
    theirs.write_text("#!/bin/sh\necho theirs\n")
    res = subprocess.run([str(REPO / "install.sh")], env=env, capture_output=True, text=True, timeout=1100)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"linked into {bin_dir}: ddp-launch ddp-train ansible ansible-playbook" in res.stdout
    assert f"kept what {bin_dir} already had for: ansible-config (not ours" in res.stdout
    assert not theirs.is_symlink() and theirs.read_text() == "#!/bin/sh\necho theirs\n"
    assert f"{bin_dir} is not on PATH; add it" in res.stdout

    def run(*argv: str) -> str:
        path = {**env, "PATH": f"{bin_dir}:/usr/bin:/bin"}
        p = subprocess.run(argv, env=path, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"{argv}: {p.stdout[-1000:]}{p.stderr[-2000:]}"
        return p.stdout

    assert "ddp-launch doctor" in run("ddp-launch", "--help")
    assert "ansible-playbook [core 2.19." in run("ansible-playbook", "--version")
    assert "community.general" in run("ansible-galaxy", "collection", "list", "community.general")
    venv_python = home / ".local" / "share" / "ddp-train" / "venv" / "bin" / "python"
    torch = run(str(venv_python), "-c", "import importlib.metadata as m; print(m.version('torch'))").strip()
    assert torch.split("+")[0] == "2.13.0", torch
    # the optional parts a newcomer meets first (--with bpe,plot, the default): BPE and metrics.png
    extras = run(str(venv_python), "-c", "import tokenizers, matplotlib; print('ok')").strip()
    assert extras == "ok" and "extras: bpe,plot;" in res.stdout, res.stdout
    log = (tmp_path / "pip.log").read_text(errors="replace")
    assert not re.search(r"Downloading \S*torch-", log), re.findall(r".*Downloading \S*torch-.*", log)[:3]
