"""The job plan: master/rank order, MASTER_ADDR, and node commands built only from quoted parts."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_train.launch.errors import LaunchError
from ddp_train.launch.plan.inventory import Node, SshTarget
from ddp_train.launch.plan.plan import (
    PGID_MARKER,
    Options,
    build_plan,
    command,
    env_line,
    mask_text,
    shown_env,
)

HOSTILE = "$(touch {pwn}) `touch {pwn}`; touch {pwn} && echo 'single' \"double\" \\ back\nnew line $HOME *"


def node(name: str, address: str, **kw) -> Node:
    defaults = dict(
        local=False,
        ssh=SshTarget(host=address),
        venv="/opt/ddp-train/venv",
        workdir=None,
        nproc="1",
        master_port=29500,
        env={},
    )
    defaults.update(kw)
    return Node(name=name, address=address, **defaults)


def cluster(**kw) -> list[Node]:
    return [node(f"n{i}", f"10.0.0.{i + 1}", **kw) for i in range(3)]


def test_ranks_follow_inventory_order_and_master_is_first() -> None:
    plan = build_plan(cluster(), Options(job_id="j1"))
    assert [(p.node.name, p.rank) for p in plan.nodes] == [("n0", 0), ("n1", 1), ("n2", 2)]
    assert (plan.master_addr, plan.master_port) == ("10.0.0.1", 29500)
    argv = plan.nodes[2].argv
    assert argv[:11] == (
        "/opt/ddp-train/venv/bin/torchrun", "--nnodes", "3", "--nproc-per-node", "1", "--node-rank", "2",
        "--master-addr", "10.0.0.1", "--master-port", "29500",
    )  # fmt: skip
    assert argv[11:] == ("-m", "ddp_train")
    assert plan.nodes[0].env["DDP_JOB_ID"] == "j1" and plan.nodes[0].env["OMP_NUM_THREADS"] == "1"


def test_ddp_master_moves_that_node_to_rank_zero_others_keep_order() -> None:
    nodes = cluster(master="n2")
    plan = build_plan(nodes, Options(job_id="j"))
    assert [p.node.name for p in plan.nodes] == ["n2", "n0", "n1"]
    assert plan.master_addr == "10.0.0.3"
    with pytest.raises(LaunchError, match="ddp_master 'zz' is not one of the selected nodes"):
        build_plan(cluster(master="zz"), Options())


def test_options_and_trainer_args() -> None:
    opts = Options(
        job_id="j", nproc_per_node="gpu", master_port=30001, max_restarts=2, config="/home/me/train.yaml",
        overrides=("train.max_steps=5",), trainer_args=("--extra", "a b"), env={"NCCL_DEBUG": "WARN"},
        debug=True, rdzv="static",
    )  # fmt: skip
    p = build_plan(cluster(workdir="/srv/w"), opts).nodes[1]
    a = p.argv
    assert a[a.index("--nproc-per-node") + 1] == "gpu" and a[a.index("--master-port") + 1] == "30001"
    assert p.nproc == "gpu" and build_plan(cluster(nproc="4"), Options()).nodes[0].nproc == "4"
    assert a[a.index("--max-restarts") + 1] == "2"
    assert a[a.index("--config") + 1] == "/srv/w/.ddp-launch/j/train.yaml"  # shipped copy on the node
    assert a[-4:] == ("--set", "train.max_steps=5", "--extra", "a b")
    assert p.env["NCCL_DEBUG"] == "INFO"  # --debug wins over --env
    assert p.env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    local = build_plan([node("l", "127.0.0.1", local=True, ssh=None)], opts).nodes[0]
    assert local.argv[local.argv.index("--config") + 1] == "/home/me/train.yaml"


def test_master_address_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LaunchError, match="loopback address the other nodes cannot reach"):
        build_plan([node("a", "127.0.0.1"), node("b", "10.0.0.2")], Options())
    locals_ = [node(f"l{i}", "127.0.0.1", local=True, ssh=None) for i in range(2)]
    assert build_plan(locals_, Options()).master_addr == "127.0.0.1"  # fine when every node is local
    assert build_plan(cluster(master_addr="192.168.5.1"), Options()).master_addr == "192.168.5.1"
    assert build_plan([node("a", "localhost", local=True, ssh=None)], Options()).master_addr in (
        "127.0.0.1",
        "::1",
    )
    with pytest.raises(LaunchError, match="master a: ansible_host: cannot resolve 'no-such-host.invalid'"):
        build_plan([node("a", "no-such-host.invalid")], Options())


def test_job_level_variables_must_agree() -> None:
    nodes = cluster()
    nodes[1] = dataclasses.replace(nodes[1], master_port=29600)
    with pytest.raises(LaunchError, match="ddp_master_port must be the same on every node"):
        build_plan(nodes, Options())
    with pytest.raises(LaunchError, match="--job-id"):
        build_plan(cluster(), Options(job_id="bad id; rm"))
    with pytest.raises(LaunchError, match="listed twice"):
        build_plan([node("a", "10.0.0.1"), node("a", "10.0.0.2")], Options())


def fake_venv(tmp_path: Path) -> Path:
    """A venv whose torchrun reports its argv, env, cwd and process group as JSON.

    Its python is this one (so the real ddp_train.agent reads the environment from stdin and runs the
    fake torchrun, in its own process, as it runs the real one).
    """
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    torchrun = venv / "bin" / "torchrun"
    torchrun.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ), 'cwd': os.getcwd(),"
        " 'pid': os.getpid(), 'pgid': os.getpgid(0)}))\n"
    )
    torchrun.chmod(0o755)
    return venv


def run_command(plan_node) -> tuple[int, dict]:
    out = subprocess.run(
        ["/bin/sh", "-c", command(plan_node)], input=env_line(plan_node).decode(), capture_output=True,
        text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    marker, payload = out.stdout.split("\n", 1)
    assert marker.startswith(PGID_MARKER + " ")
    return int(marker.split()[1]), json.loads(payload)


def test_hostile_values_reach_the_program_verbatim_through_a_real_shell(tmp_path: Path) -> None:
    pwn = tmp_path / "pwned"
    value = HOSTILE.format(pwn=pwn)
    workdir = tmp_path / "work dir $(touch x)"
    workdir.mkdir()
    n = node("n0", "127.0.0.1", local=True, ssh=None, venv=str(fake_venv(tmp_path)), workdir=str(workdir),
             env={"HOSTILE": value, "EMPTY": ""})  # fmt: skip
    opts = Options(job_id="j-1", overrides=(f"run.name={value}",), trainer_args=(value, "--", "'"))
    pgid, seen = run_command(build_plan([n], opts).nodes[0])
    assert seen["env"]["HOSTILE"] == value and seen["env"]["EMPTY"] == ""
    assert seen["env"]["DDP_JOB_ID"] == "j-1"
    assert seen["argv"][-5:] == ["--set", f"run.name={value}", value, "--", "'"]
    assert seen["cwd"] == str(workdir)
    assert not pwn.exists() and not (workdir / "x").exists()
    # torchrun runs in its own process group, and the printed PGID is that group (and its pid: exec,
    # then the agent runs torchrun in its own process)
    assert seen["pgid"] == pgid == seen["pid"] and pgid != os.getpgid(0)
    # the environment came over stdin: the command line holds none of it
    words = shlex.split(command(build_plan([n], opts).nodes[0]))
    assert not any(w.startswith(("HOSTILE=", "EMPTY=")) for w in words)


@settings(max_examples=200, deadline=None)
@given(value=st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))))
def test_any_env_value_survives_quoting(value: str) -> None:
    n = node("n0", "10.0.0.1", env={"V": value})
    plan = build_plan([n], Options(job_id="j", trainer_args=(value,))).nodes[0]
    words = shlex.split(command(plan))
    assert words[-1] == value and not any(w.startswith("V=") for w in words)
    line = env_line(plan)
    assert line.count(b"\n") == 1 and line.endswith(b"\n")  # one line whatever the value holds
    assert json.loads(line)["V"] == value


def test_secrets_are_masked_in_the_displayed_command() -> None:
    n = node("n0", "10.0.0.1", env={"HF_TOKEN": "hf_abc123", "DB_PASSWORD": "pw-9", "PLAIN": "visible"})
    plan = build_plan([n], Options(job_id="j", overrides=("wandb.api_key=k-77", "train.lr=0.1")))
    shown = command(plan.nodes[0], masked=True)
    env_shown = shown_env(plan.nodes[0])
    for secret in ("hf_abc123", "pw-9", "k-77"):
        assert secret not in shown and secret not in env_shown
    assert "k-77" in command(plan.nodes[0])  # a --set value is an argument (mask only what is shown)
    for secret in ("hf_abc123", "pw-9"):  # env values are never in the command, only on its stdin
        assert secret not in command(plan.nodes[0]) and secret in env_line(plan.nodes[0]).decode()
    assert "wandb.api_key=***" in shown
    assert json.loads(env_shown)["HF_TOKEN"] == "***" and json.loads(env_shown)["PLAIN"] == "visible"
    assert set(plan.secrets()) == {"hf_abc123", "pw-9", "k-77"}
    assert mask_text("token hf_abc123 and pw-9", plan.secrets()) == "token *** and ***"


def test_restarts_on_several_nodes_use_c10d_with_ip_local_addrs() -> None:
    nodes = [node("a", "10.0.0.10"), node("b", "10.0.0.9"), node("c", "10.0.0.11")]
    plan = build_plan(nodes, Options(job_id="rj", max_restarts=1))
    assert plan.rdzv == "c10d" and plan.master.node.name == "a" and plan.master_addr == "10.0.0.10"
    # torchrun's c10d rendezvous ranks nodes by their --local-addr sorted as text; labels follow it
    assert [(p.node.name, p.rank) for p in plan.nodes] == [("a", 0), ("c", 1), ("b", 2)]
    for p in plan.nodes:
        a = p.argv
        assert "--node-rank" not in a and "--master-addr" not in a
        assert a[a.index("--rdzv-endpoint") + 1] == "10.0.0.10:29500" and a[a.index("--rdzv-id") + 1] == "rj"
        assert a[a.index("--local-addr") + 1] == p.node.address
        assert a[a.index("--max-restarts") + 1] == "1"
        assert p.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert build_plan(nodes, Options(max_restarts=0)).rdzv == "static"
    assert build_plan(nodes[:1], Options(max_restarts=3)).rdzv == "static"  # one node restarts alone
    locals_ = [node(f"l{i}", "127.0.0.1", local=True, ssh=None) for i in range(2)]
    plan = build_plan(locals_, Options(rdzv="c10d"))
    assert [p.argv[p.argv.index("--local-addr") + 1] for p in plan.nodes] == ["127.0.0.1", "127.0.0.2"]


def test_master_outside_the_training_network_is_refused():
    from ddp_train.launch.errors import LaunchError
    from ddp_train.launch.plan.inventory import Node
    from ddp_train.launch.plan.plan import master_address

    node = Node(
        name="gpu1",
        address="192.0.2.10",
        local=False,
        ssh=None,
        venv="/v",
        workdir=None,
        nproc="1",
        master_port=29500,
        env={},
        network_cidr="198.51.100.0/24",
    )
    with pytest.raises(LaunchError, match="outside ddp_network_cidr 198.51.100.0/24.*ddp_master_addr"):
        master_address(node, None, all_local=False)
    assert master_address(node, "198.51.100.10", all_local=False) == "198.51.100.10"


def test_token_files_and_tokenizers_are_no_secrets() -> None:
    """data.tokens.path is where the trainer's token files are: masking it hid the data path in every log
    and made `restart` refuse the recorded command; HF_TOKEN and an access_token stay secret."""
    from ddp_train.launch.plan.plan import is_secret, mask_argv

    assert not is_secret("data.tokens.path") and not is_secret("TOKENIZERS_PARALLELISM")
    assert is_secret("HF_TOKEN") and is_secret("auth.access_token") and is_secret("GITHUB_TOKEN_RO")
    argv = ["--set", "data.tokens.path=data/mine", "--env", "HF_TOKEN=hf_x"]
    assert mask_argv(argv, []) == ["--set", "data.tokens.path=data/mine", "--env", "HF_TOKEN=***"]
