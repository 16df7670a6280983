"""Role variables that are pure Jinja, rendered by the real ansible-core on localhost. In a YAML block
scalar (`>-`) a backslash is literal, so a regex_replace backreference written for a quoted string
(two backslashes) reached Jinja doubled and the role compared torch.version.cuda with the text
"\\1.\\2" instead of "13.0": every CUDA host would have failed the pytorch role's check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.ansible.conftest import REPO_ROOT, run, tool_env


def _render(tmp_path: Path, cuda: str) -> str:
    play = tmp_path / f"play-{cuda}.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n"
        f"  vars_files: [{REPO_ROOT / 'roles/pytorch/vars/main.yml'}]\n"
        f"  vars: {{pytorch_cuda: {cuda}, pytorch_index_url: '', pytorch_version: '2.13.0'}}\n"
        "  tasks:\n    - ansible.builtin.debug: {msg: 'RESULT={{ _pytorch_flavour_cuda }}'}\n",
        encoding="utf-8",
    )
    venv_bin = Path(sys.executable).parent
    proc = run(
        [str(venv_bin / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play)],
        tool_env(venv_bin, ANSIBLE_STDOUT_CALLBACK="json"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tasks = json.loads(proc.stdout)["plays"][0]["tasks"]
    return tasks[-1]["hosts"]["localhost"]["msg"].split("RESULT=", 1)[1]


def test_pytorch_flavour_cuda_is_the_cuda_version_torch_reports(tmp_path: Path) -> None:
    assert _render(tmp_path, "cu130") == "13.0"
    assert _render(tmp_path, "cu126") == "12.6"
    assert _render(tmp_path, "cpu") == "None"
