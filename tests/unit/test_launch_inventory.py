"""ddp-launch reads inventories with Ansible's own API: YAML and INI, group/host vars, templates, patterns."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from ddp_train.launch.errors import LaunchError
from ddp_train.launch.plan.inventory import DEFAULT_REMOTE_VENV, load_nodes, nproc_value, parse_ssh_args


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def yaml_inv(tmp_path: Path) -> Path:
    inv = tmp_path / "prod"
    write(
        inv / "hosts.yml",
        """
        all:
          children:
            gpu_nodes:
              hosts:
                gpu-b: {ansible_host: 10.9.0.2}
                gpu-a: {ansible_host: 10.9.0.1}
                gpu-c:
                  ansible_host: 10.9.0.3
                  ansible_port: 2222
            login:
              hosts:
                bastion: {ansible_host: 10.9.0.100}
          vars:
            ansible_user: trainer
            ansible_ssh_private_key_file: "{{ inventory_dir }}/keys/id_ed25519"
            ansible_ssh_common_args: -o UserKnownHostsFile=/etc/ddp/known_hosts -o StrictHostKeyChecking=yes
        """,
    )
    write(
        inv / "group_vars" / "gpu_nodes.yml",
        """
        ddp_master_port: 29511
        ddp_nproc_per_node: 8
        ddp_venv: /opt/ddp-train/venv
        ddp_workdir: "/srv/train/{{ ddp_master_port }}"
        ddp_env:
          NCCL_SOCKET_IFNAME: "=eth1"
          PORT_PLUS_ONE: "{{ ddp_master_port + 1 }}"
          HOSTILE: "$(touch /tmp/pwned) 'single' \\"double\\" `id`; rm -rf /"
        """,
    )
    write(inv / "host_vars" / "gpu-a.yml", "ddp_nproc_per_node: 4\n")
    return inv


def test_yaml_directory_group_and_host_vars_templated(yaml_inv: Path) -> None:
    nodes = load_nodes([str(yaml_inv)])
    assert [n.name for n in nodes] == ["gpu-b", "gpu-a", "gpu-c"]  # declared order, group gpu_nodes only
    b, a, c = nodes
    assert (b.address, b.ssh.port, b.ssh.user) == ("10.9.0.2", 22, "trainer")
    assert c.ssh.port == 2222
    assert b.ssh.key_files == (f"{yaml_inv}/keys/id_ed25519",)  # {{ inventory_dir }} templated
    assert b.ssh.known_hosts_files == ("/etc/ddp/known_hosts",)
    assert (a.nproc, b.nproc) == ("4", "8")  # host_vars beat group_vars
    assert b.master_port == 29511 and b.workdir == "/srv/train/29511"
    assert b.env["PORT_PLUS_ONE"] == "29512"
    assert b.env["HOSTILE"] == "$(touch /tmp/pwned) 'single' \"double\" `id`; rm -rf /"
    assert b.env["NCCL_SOCKET_IFNAME"] == "=eth1"
    assert not b.local and b.venv == "/opt/ddp-train/venv"


def test_limit_exclude_group_and_extra_vars(yaml_inv: Path) -> None:
    assert [n.name for n in load_nodes([str(yaml_inv)], limit="gpu-a:gpu-c")] == ["gpu-a", "gpu-c"]
    assert [n.name for n in load_nodes([str(yaml_inv)], exclude=["gpu-b"])] == ["gpu-a", "gpu-c"]
    assert [n.name for n in load_nodes([str(yaml_inv)], limit="gpu-*", exclude=["gpu-a,gpu-c"])] == ["gpu-b"]
    assert [n.name for n in load_nodes([str(yaml_inv)], group="login")] == ["bastion"]
    extra = ["ddp_nproc_per_node=2", '{"ddp_master_port": 30000, "ansible_port": 2022}']
    nodes = load_nodes([str(yaml_inv)], extra_vars=extra)
    assert {(n.nproc, n.master_port, n.ssh.port) for n in nodes} == {("2", 30000, 2022)}  # -e wins over all


def test_ini_inventory_with_host_vars(tmp_path: Path) -> None:
    inv = tmp_path / "ini"
    write(
        inv / "hosts",
        """
        [gpu_nodes]
        n0 ansible_host=192.168.7.10
        n1 ansible_host=192.168.7.11 ansible_port=2200

        [gpu_nodes:vars]
        ansible_user=root
        ddp_master_port=29600
        """,
    )
    write(inv / "host_vars" / "n0.yml", "ddp_env: {A: '1'}\nddp_venv: /venvs/a\n")
    n0, n1 = load_nodes([str(inv)])
    assert (n0.name, n0.ssh.port, n0.venv, dict(n0.env)) == ("n0", 22, "/venvs/a", {"A": "1"})
    assert (n1.ssh.port, n1.venv, n1.master_port) == (2200, DEFAULT_REMOTE_VENV, 29600)


def test_all_hosts_when_no_gpu_nodes_group_and_host_list(tmp_path: Path) -> None:
    inv = write(tmp_path / "hosts.ini", "a ansible_host=10.1.0.1\nb ansible_host=10.1.0.2\n")
    assert [n.name for n in load_nodes([str(inv)])] == ["a", "b"]
    assert [n.address for n in load_nodes(["10.2.0.1,10.2.0.2,"])] == ["10.2.0.1", "10.2.0.2"]


def test_local_connection_nodes(tmp_path: Path) -> None:
    inv = write(tmp_path / "local.yml", "all:\n  hosts:\n    l0: {ansible_connection: local}\n")
    (node,) = load_nodes([str(inv)])
    assert node.local and node.ssh is None and node.address == "127.0.0.1"
    assert node.venv == sys.prefix  # the launcher's own venv unless ddp_venv says otherwise


def test_repo_local_inventory_is_two_local_nodes() -> None:
    nodes = load_nodes([str(Path(__file__).resolve().parents[2] / "inventory" / "local")])
    assert [(n.name, n.local, n.nproc) for n in nodes] == [("local0", True, "1"), ("local1", True, "1")]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"hosts.yml": "all:\n  hosts:\n    a: [1\n"}, r"inv/hosts.yml:4: YAML parsing failed"),
        ({"hosts": "[gpu_nodes]\na\n[gpu_nodes:vars]\nfoo\n"}, r"inv/hosts: .*Expected key=value, got: foo"),
        (
            {"hosts.yml": "all:\n  hosts:\n    a: {ansible_port: abc}\n"},
            r"hosts.yml:3: host a: ansible_port: 'abc' is not a TCP port",
        ),
        (
            {"hosts.yml": "all:\n  hosts:\n    a: {ddp_env: {'BAD KEY': 1}}\n"},
            r"host a: ddp_env: 'BAD KEY' is not a valid environment",
        ),
        ({"hosts.yml": "all:\n  hosts:\n    a: {ddp_env: [1]}\n"}, r"ddp_env: expected a mapping"),
        (
            {"hosts.yml": "all:\n  hosts:\n    a: {ansible_connection: docker}\n"},
            r"'docker' is not supported",
        ),
        (
            {"hosts.yml": "all:\n  hosts:\n    a: {ddp_nproc_per_node: 0}\n"},
            r"ddp_nproc_per_node: 0 is not a positive",
        ),
        (
            {"hosts.yml": "all:\n  hosts:\n    a: {ddp_workdir: '{{ nope }}'}\n"},
            r"host a: ddp_workdir: .*nope",
        ),
        ({"hosts.yml": "all:\n  hosts:\n    a:\n"}, None),
    ],
)
def test_bad_inventories_are_one_line_errors(tmp_path: Path, files: dict, expected: str | None) -> None:
    for name, text in files.items():
        write(tmp_path / "inv" / name, text)
    if expected is None:
        assert [n.name for n in load_nodes([str(tmp_path / "inv")])] == ["a"]
        return
    with pytest.raises(LaunchError, match=expected) as info:
        load_nodes([str(tmp_path / "inv")])
    assert "\n" not in str(info.value)


def test_selection_errors(yaml_inv: Path, tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="no such file"):
        load_nodes([str(tmp_path / "missing")])
    with pytest.raises(LaunchError, match="no hosts in group 'gpu_nodes' matching --limit 'zzz'"):
        load_nodes([str(yaml_inv)], limit="zzz")
    with pytest.raises(LaunchError, match="no group 'nope'"):
        load_nodes([str(yaml_inv)], group="nope")
    with pytest.raises(LaunchError, match="--extra-vars"):
        load_nodes([str(yaml_inv)], extra_vars=["[1, 2]"])


def test_parse_ssh_args() -> None:
    opts = parse_ssh_args(
        "-o UserKnownHostsFile='/a/kh /b/kh' -oStrictHostKeyChecking=yes -o HostKeyAlias=gpu1 "
        "-J jump@bastion:2222 -p 2200"
    )
    assert opts["userknownhostsfile"] == ["/a/kh /b/kh"]
    assert opts["hostkeyalias"] == ["gpu1"]
    assert opts["proxyjump"] == ["jump@bastion:2222"]
    assert opts["port"] == ["2200"]
    assert opts["stricthostkeychecking"] == ["yes"]


@pytest.mark.parametrize(
    "value,want",
    [("gpu", "gpu"), ("cpu", "cpu"), ("auto", "auto"), (8, "8"), ("8", "8"), ("08", "8"), (" 2", None),
     ("+2", None), ("1_0", None), (0, None), ("0", None), (-1, None), (True, None), ("GPU", None),
     ("2.5", None), ("", None), (None, None)],
)  # fmt: skip
def test_one_nproc_validator_for_inventory_and_command_line(value: object, want: str | None) -> None:
    assert nproc_value(value) == want


def test_reading_an_inventory_leaves_the_environment_as_it_was(tmp_path: Path) -> None:
    """Its strict parsing once leaked ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED into os.environ, and so
    into every tool this process started later (a `molecule syntax` of a scenario not yet created)."""
    import os

    before = dict(os.environ)
    write(tmp_path / "inv" / "hosts", "[gpu_nodes]\na\n[gpu_nodes:vars]\nfoo\n")
    with pytest.raises(LaunchError):
        load_nodes([str(tmp_path / "inv")])
    load_nodes(["inventory/local"])
    assert dict(os.environ) == before


def test_a_vault_in_group_vars_is_read_with_ansibles_password_file_and_refused_in_one_line_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """helper review of #48: an encrypted group_vars file (a vaulted become password, README step 3) was a
    traceback; ddp-launch now reads it as ansible-playbook does with vault_password_file, never prompting."""
    from ansible import constants
    from ansible.parsing.vault import VaultLib, VaultSecret

    inv = write(
        tmp_path / "inv" / "hosts.yml", "all:\n  children:\n    gpu_nodes:\n      hosts:\n        n0: {}\n"
    )
    secret = [("default", VaultSecret(b"s3cret"))]
    vaulted = VaultLib(secret).encrypt("ddp_workdir: /srv/vaulted\n").decode()
    write(tmp_path / "inv" / "group_vars" / "all" / "vault.yml", vaulted)
    monkeypatch.setattr(constants, "DEFAULT_VAULT_PASSWORD_FILE", None)
    with pytest.raises(LaunchError) as e:
        load_nodes([str(inv)])
    assert "\n" not in str(
        e.value
    ) and "set vault_password_file in ansible.cfg or ANSIBLE_VAULT_PASSWORD_FILE" in str(e.value)
    monkeypatch.setattr(constants, "DEFAULT_VAULT_PASSWORD_FILE", str(write(tmp_path / "bad", "wrong\n")))
    with pytest.raises(LaunchError, match=r": the vault password ddp-launch was given does not open it$"):
        load_nodes([str(inv)])
    monkeypatch.setattr(constants, "DEFAULT_VAULT_PASSWORD_FILE", str(tmp_path / "gone"))
    with pytest.raises(LaunchError, match=rf"^vault_password_file {tmp_path}/gone: .*not found"):
        load_nodes([str(inv)])  # a stale setting is one line too, never a traceback
    monkeypatch.setattr(constants, "DEFAULT_VAULT_PASSWORD_FILE", str(write(tmp_path / "pw", "s3cret\n")))
    assert load_nodes([str(inv)])[0].workdir == "/srv/vaulted"


def test_inventory_host_finds_any_host_of_the_inventory_by_name(tmp_path: Path) -> None:
    """fetch --hosts and the cluster monitor's host (ddp_monitor_host) look hosts up here, outside the
    node group too (a login or monitor host)."""
    from ddp_train.launch.plan.inventory import inventory_host

    inv = write(
        tmp_path / "hosts.yml",
        "all:\n  children:\n    gpu_nodes:\n      hosts:\n        n0: {ansible_host: 10.0.0.1}\n"
        "    login:\n      hosts:\n        lg: {ansible_host: 10.0.0.9}\n",
    )
    assert (node := inventory_host("lg", [str(inv)])) is not None and node.address == "10.0.0.9"
    assert inventory_host("nope", [str(inv)]) is None
