"""verify.yml's allreduce gets ddp_env on its stdin, through the node agent, never on a command line
(issue #44): a secret in ddp_env is in no process's argv on the nodes or on the controller while it runs.

Two namespace hosts; verify.yml from its allreduce part on ("Read this node's RDMA ports": the checks
before it need provisioned hosts), with each node's training address and interface given as the
cluster_hosts role would find them. Meanwhile every /proc/PID/cmdline on this machine is sampled: the
hosts are namespaces of it, so their sudo/sh/python/torchrun/ranks are there, and the controller's ssh.
Before, Ansible's `environment:` put `HF_TOKEN=... python3` into the remote command line."""

from __future__ import annotations

import json
import secrets
import threading
from pathlib import Path

import pytest
import yaml

import tests.conftest as root_conftest
from tests.ansible.conftest import REPO_ROOT

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


class ArgvSampler:
    """Every process's argv, over and over until stopped: those holding `needle`; whether any ran `seen`."""

    def __init__(self, needle: str, seen: str) -> None:
        self.needle, self.seen = needle.encode(), seen.encode()
        self.hits: list[str] = []
        self.saw = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    argv = (proc / "cmdline").read_bytes()
                except OSError:
                    continue
                if self.needle in argv:
                    self.hits.append(argv.replace(b"\0", b" ").decode("utf-8", "replace")[:300])
                self.saw = self.saw or self.seen in argv

    def __enter__(self) -> ArgvSampler:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


def test_a_secret_in_ddp_env_is_in_no_argv_while_verify_runs(playbook, venv_bin, tmp_path) -> None:
    secret = "hf_" + secrets.token_hex(12)
    with root_conftest.private_testbed("vse", "10.213.193", 2) as tb:
        inv = yaml.safe_load(tb.inventory.read_text())
        for h in tb.hosts():  # what cluster_hosts' address tasks record on a provisioned node
            inv["all"]["children"]["gpu_nodes"]["hosts"][h.name].update(
                cluster_hosts_address=h.ip, cluster_hosts_interface="eth0"
            )
        (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inv))
        extra = {
            "ddp_venv": str(venv_bin.parent),
            "ddp_env": {"HF_TOKEN": secret, "DDP_VERIFY_NOTE": "plain"},
            "gpu_facts_nvidia_gpus": 0,
            "verify_iters": 2,
            "verify_size_mb": 1,
            "verify_timeout_s": 120,
        }
        (tmp_path / "vars.json").write_text(json.dumps(extra))  # -e @file: the secret is not in our argv
        with ArgvSampler(secret, "ddp_train.allreduce") as sampler:
            res = playbook(
                "-i", str(tmp_path / "hosts.yml"), "-e", f"@{tmp_path / 'vars.json'}",
                "--start-at-task", "Read this node's RDMA ports", str(REPO_ROOT / "playbooks" / "verify.yml"),
            )  # fmt: skip
    assert res.returncode == 0, res.out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}/2 gloo 1.0 MiB: busbw" in res.out, res.out[-3000:]
    assert sampler.saw, "the sampler never saw the allreduce's ranks: it sampled nothing of the run"
    assert sampler.hits == [], sampler.hits[:5]
