"""Lint and syntax of the Ansible content: ansible-lint (production), yamllint, site.yml, molecule."""

from __future__ import annotations

import pytest
import yaml

from tests.ansible.conftest import REPO_ROOT, run, tool_env

# The project's Ansible content (inventory/testbed* is generated, inventory/local is the launcher's).
ANSIBLE_PATHS = ["site.yml", "playbooks", "roles", "molecule", "inventory/prod"]
YAML_PATHS = [*ANSIBLE_PATHS, ".ansible-lint", ".yamllint"]
SCENARIOS = ["default", "el9", "el10", "slurm", "monitoring"]


def test_ansible_lint_config_is_production_with_an_empty_skip_list():
    cfg = yaml.safe_load((REPO_ROOT / ".ansible-lint").read_text())
    assert cfg["profile"] == "production"
    assert cfg.get("skip_list", []) == []
    assert cfg.get("warn_list", []) == []


# The run's own limit: under the loaded `pytest -n 4` (2 cores) it took 599 s of pytest's default 600.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ansible_lint_production_profile_passes(venv_bin):
    res = run([str(venv_bin / "ansible-lint"), "--nocolor", *ANSIBLE_PATHS], tool_env(venv_bin), timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "Profile 'production' was required, and it passed" in out


def test_yamllint_strict_passes(venv_bin):
    res = run([str(venv_bin / "yamllint"), "--strict", *YAML_PATHS], tool_env(venv_bin))
    assert res.returncode == 0, res.stdout + res.stderr


def test_site_yml_syntax_check(venv_bin):
    res = run(
        [str(venv_bin / "ansible-playbook"), "--syntax-check", "-i", "inventory/prod", "site.yml"],
        tool_env(venv_bin),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "playbook: site.yml" in res.stdout


def test_site_yml_imports_the_seven_playbooks_in_order():
    plays = yaml.safe_load((REPO_ROOT / "site.yml").read_text())
    imported = [p["ansible.builtin.import_playbook"] for p in plays]
    names = ("preflight", "base", "gpu", "pytorch", "slurm", "verify", "monitoring")
    assert imported == [f"playbooks/{n}.yml" for n in names]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_molecule_syntax(venv_bin, scenario, tmp_path):
    # Not the scenario's shared working directory, where a `molecule test` on another pytest-xdist
    # worker keeps its state and inventory.
    env = tool_env(venv_bin, MOLECULE_EPHEMERAL_DIRECTORY=str(tmp_path / "molecule"))
    res = run([str(venv_bin / "molecule"), "syntax", "-s", scenario], env, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


@pytest.mark.parametrize("playbook", ["create", "prepare", "destroy", "verify"])
def test_el_scenario_playbooks_syntax(venv_bin, playbook):
    """molecule syntax checks converge only; the EL create/prepare/destroy/verify playbooks too."""
    argv = [str(venv_bin / "ansible-playbook"), "--syntax-check", "-i", "molecule/el9/inventory/"]
    argv += ["-i", "molecule/el-common/inventory/", f"molecule/el-common/{playbook}.yml"]
    res = run(argv, tool_env(venv_bin))
    assert res.returncode == 0, res.stdout + res.stderr
