"""--detach's monitor on the cluster without a cluster (launch/jobs/clustermon.py): the plan it gets
(cluster-internal key and known hosts, nothing of the controller's), the records that find a job from
any directory, the supervisor's command, and --monitor-here's warning."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time
from pathlib import Path

import pytest

from ddp_train.launch.cli import main
from ddp_train.launch.jobs import clustermon, jobstate
from ddp_train.launch.plan.inventory import Node, SshTarget
from ddp_train.launch.plan.plan import Options, build_plan


def _ssh(host: str) -> SshTarget:
    return SshTarget(host=host, key_files=("/laptop/id",), password="pw", known_hosts_files=("/laptop/kh",),
                     proxy_jump="bastion")  # fmt: skip


def _nodes(**kw: object) -> list[Node]:
    return [
        Node(name=f"n{i}", address=f"10.0.0.{i}", local=False, ssh=_ssh(f"10.0.0.{i}"), venv="/v",
             workdir=None, nproc="1", master_port=29500, env={}, **kw)  # type: ignore[arg-type]
        for i in range(1, 4)
    ]  # fmt: skip


def test_the_monitor_reaches_the_nodes_with_the_cluster_key_never_the_controllers(tmp_path: Path) -> None:
    plan = build_plan(_nodes(cluster_key="~/.ssh/k", cluster_known_hosts="/etc/ssh/ssh_known_hosts"),
                      Options(job_id="j", env={"TOKEN": "s3cret"}))  # fmt: skip
    ours = clustermon.cluster_plan(plan)
    for p in ours.nodes:
        assert p.node.ssh is not None
        assert p.node.ssh.key_files == ("~/.ssh/k",) and p.node.ssh.known_hosts_files == (
            "/etc/ssh/ssh_known_hosts",
        )
        assert (
            p.node.ssh.password is None
            and p.node.ssh.proxy_jump is None
            and p.node.ssh.host.startswith("10.0.0.")
        )
    assert [p.argv for p in ours.nodes] == [
        p.argv for p in plan.nodes
    ] and ours.master_addr == plan.master_addr
    request = tmp_path / "j" / clustermon.REQUEST_FILE
    jobstate.private_dir(request.parent)
    jobstate.write_private(request, pickle.dumps({"plan": ours}))
    assert request.stat().st_mode & 0o777 == 0o600 and request.parent.stat().st_mode & 0o777 == 0o700


def test_the_monitor_host_is_ddp_monitor_host_else_the_master_and_none_for_a_local_one() -> None:
    opts = argparse.Namespace(hosts=None, extra_vars=[])
    plan = build_plan(_nodes(), Options(job_id="j"))
    assert clustermon.monitor_node(plan, opts).name == plan.master.node.name  # type: ignore[union-attr]
    plan = build_plan(_nodes(monitor_host="n3"), Options(job_id="j"))
    assert clustermon.monitor_node(plan, opts).name == "n3"  # type: ignore[union-attr]
    local = [Node(name="l0", address="127.0.0.1", local=True, ssh=None, venv="/v", workdir="/w", nproc="1",
                  master_port=29500, env={})]  # fmt: skip
    assert clustermon.monitor_node(build_plan(local, Options(job_id="j")), opts) is None


def test_a_record_finds_the_job_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    logs = tmp_path / "checkout" / "logs"
    data = {
        "job_id": "j1",
        "pid": 0,
        "state": "finished",
        "exit_code": 0,
        "started": time.time(),
        "nodes": [],
    }
    jobstate.write_state(jobstate.state_path(logs, "j1"), data)
    clustermon.save_record("j1", None, str(logs))
    assert clustermon.record_path("j1").stat().st_mode & 0o777 == 0o600
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["status", "j1"]) == 0
    assert "job j1: finished (exit 0)" in capsys.readouterr().out
    node = _nodes()[0]
    clustermon.save_record("j2", node, ".ddp-train/jobs")
    record = clustermon.load_record("j2")
    assert (
        record
        and "password" not in record["monitor"]["ssh"]
        and "pw" not in clustermon.record_path("j2").read_text()
    )
    assert clustermon._record_node(record).ssh == SshTarget(**{**node.ssh.__dict__, "password": None})  # type: ignore[union-attr]
    assert [r["job_id"] for r in clustermon.remote_records()] == ["j2"]


def test_the_supervisor_is_a_transient_systemd_service_with_the_output_appended(tmp_path: Path) -> None:
    argv = clustermon.systemd_argv("j1", tmp_path / "console.log", ["/v/bin/python", "-m", "x"])
    assert argv[:2] == ["systemd-run", "--unit=ddp-job-j1"] and "--collect" in argv
    assert f"--property=StandardOutput=append:{tmp_path}/console.log" in argv
    assert argv[-4:] == ["--", "/v/bin/python", "-m", "x"]
    assert clustermon.systemd_booted() == os.path.isdir("/run/systemd/system")
    systemd = clustermon.systemd_booted() and os.geteuid() == 0  # a system service: root's only
    assert clustermon.supervisor() == ("systemd" if systemd else "setsid")


def test_monitor_here_warns_that_this_machine_stops_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from ddp_train.launch.jobs import jobcmds

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    seen = []
    monkeypatch.setattr(jobcmds, "detach", lambda args, job, log_dir: seen.append(args) or 0)
    assert main(["--hosts", "inv", "--detach", "--monitor-here", "--job-id", "j1"]) == 0
    assert seen == [["--hosts", "inv", "--monitor-here", "--job-id", "j1"]]
    err = capsys.readouterr().err
    assert "--monitor-here" in err and "stops the job within 30 s" in err


def _systemctl(monkeypatch: pytest.MonkeyPatch, active: int, write_state: Path | None = None) -> None:
    """systemd-run succeeds (writing job.json "starting" when asked); is-active answers `active`."""
    import subprocess

    def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        if argv[0] == "systemd-run" and write_state is not None:
            jobstate.write_private(write_state, b'{"state": "starting", "job_id": "j"}')
        return subprocess.CompletedProcess(argv, active if argv[:2] == ["systemctl", "is-active"] else 0, "")

    monkeypatch.setattr(subprocess, "run", run)


def test_a_gone_unit_is_a_failure_whatever_its_state_file_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / jobstate.STATE_FILE
    jobstate.write_private(state, b'{"state": "starting", "job_id": "j"}')
    _systemctl(monkeypatch, active=3)
    from ddp_train import exitcodes

    assert clustermon.Unit("ddp-j", state).poll() == exitcodes.NODE_FAILED
    jobstate.write_private(state, b'{"state": "finished", "exit_code": 143, "job_id": "j"}')
    assert clustermon.Unit("ddp-j", state).poll() == 143


def test_detach_stops_waiting_for_a_start_after_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    job_dir = jobstate.private_dir(tmp_path / "j")
    _systemctl(monkeypatch, active=0, write_state=job_dir / jobstate.STATE_FILE)
    monkeypatch.setattr(clustermon, "DETACH_WAIT_S", 0.5)
    t0 = time.monotonic()
    assert clustermon.start_monitor(["true"], "j", job_dir, where="", supervisor="systemd") == 0
    assert time.monotonic() - t0 < 30
    out = capsys.readouterr().out
    assert "job j is still starting after 0 s" in out and str(job_dir / jobstate.CONSOLE_FILE) in out


def _inventory(tmp_path: Path, all_vars: dict[str, object]) -> str:
    """n1..n3 in gpu_nodes (SSH), login outside it; all_vars added."""
    import yaml

    hosts = {f"n{i}": {"ansible_host": f"10.0.0.{i}"} for i in range(1, 4)}
    login = {"login": {"ansible_host": "10.0.0.9"}}
    inv = {"all": {"vars": {"ansible_user": "u", **all_vars}, "hosts": login,
                   "children": {"gpu_nodes": {"hosts": hosts}}}}  # fmt: skip
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inv))
    return str(path)


def test_a_machine_without_the_record_finds_the_monitor_host_through_the_inventory(tmp_path: Path) -> None:
    """As monitor_node picks it at launch: ddp_monitor_host (any host of the inventory), else ddp_master,
    else the first node; its ddp_monitor_dir is where the job's record is."""
    found = clustermon.found_record("j", [_inventory(tmp_path, {})], [])
    assert found and found["node"].name == "n1" and found["log_dir"] == ".ddp-train/jobs"
    found = clustermon.found_record("j", [_inventory(tmp_path, {"ddp_master": "n2"})], [])
    assert found and found["node"].name == "n2"
    inv = _inventory(tmp_path, {"ddp_monitor_host": "login", "ddp_monitor_dir": "/srv/jobs"})
    found = clustermon.found_record("j", [inv], [])
    assert found and (found["node"].name, found["node"].address) == ("login", "10.0.0.9")
    assert found["log_dir"] == "/srv/jobs"
    # the directory is the master's ddp_monitor_dir, as detach writes it, not the monitor host's own
    import yaml

    data = yaml.safe_load(Path(inv).read_text())
    data["all"]["hosts"]["login"]["ddp_monitor_dir"] = "/elsewhere"
    Path(inv).write_text(yaml.safe_dump(data))
    assert clustermon.found_record("j", [inv], [])["log_dir"] == "/srv/jobs"  # type: ignore[index]
    assert clustermon.found_record("j", None, []) is None  # no record here, no inventory
    with pytest.raises(clustermon.LaunchError, match="ddp_monitor_host 'gone': no such host"):
        clustermon.found_record("j", [_inventory(tmp_path, {"ddp_monitor_host": "gone"})], [])


def test_job_commands_ask_the_inventorys_monitor_host_for_a_job_not_known_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from ddp_train.launch.jobs import fetch

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # no record of any job
    monkeypatch.chdir(tmp_path)
    inv = _inventory(tmp_path, {"ddp_monitor_host": "login"})
    asked: list[tuple[str, str, list[str]]] = []
    job = {"job_id": "j", "state": "finished", "exit_code": 0, "argv": ["--hosts", "elsewhere/inv"],
           "cwd": "/not/here", "metrics": {"host": "n2", "path": "/w/runs/x/metrics.jsonl"}}  # fmt: skip

    def proxy(record, args, connect_timeout=10, out=None):  # type: ignore[no-untyped-def]
        node = record["node"] if "node" in record else clustermon._record_node(record)  # found or saved
        asked.append((node.name, record["log_dir"], args))
        if out is not None:
            for line in json.dumps(job, indent=1).splitlines():
                out(line)
        return 0

    monkeypatch.setattr(clustermon, "proxy", proxy)
    assert main(["status", "j", "--hosts", inv, "--json"]) == 0
    assert main(["logs", "j", "-i", inv, "--node", "n2"]) == 0
    assert main(["jobs", "--hosts", inv]) == 0
    assert asked == [
        ("login", ".ddp-train/jobs", ["status", "j", "--json"]),
        ("login", ".ddp-train/jobs", ["logs", "j", "--node", "n2"]),
        ("login", ".ddp-train/jobs", ["jobs"]),
    ]
    # fetch: job.json from the monitor host, rank 0's node from --hosts (the recorded cwd is not here)
    data = fetch.load("j", "logs", hosts=[inv], extra_vars=[])
    assert data == {**job, "cwd": None} and asked[-1][2] == ["status", "j", "--json"]  # the monitor's cwd
    # this machine's record (the launching one): its argv and directory, not the monitor's
    clustermon.save_record("j", clustermon.found_record(None, [inv], [])["node"], "jobs", ["--hosts", "inv"])
    data = fetch.load("j", "logs")
    assert (data["argv"], data["cwd"], data["metrics"]) == (["--hosts", "inv"], str(tmp_path), job["metrics"])
    assert asked[-1][:2] == ("login", "jobs")
    clustermon.record_path("j").unlink()
    with pytest.raises(fetch.LaunchError, match="rank 0's host n7 is not in"):
        fetch.fetch("j", {**job, "metrics": {"host": "n7", "path": "/w/m"}}, "metrics", str(tmp_path),
                    hosts=[inv], extra_vars=[])  # fmt: skip
    # restart from here: job.json's command, this directory, this inventory instead of the recorded one
    data = fetch.load("j", "logs", command=True, hosts=[inv], extra_vars=[])
    assert (data["argv"], data["cwd"], data["hosts"]) == (job["argv"], str(tmp_path), [inv])
    from ddp_train.launch.jobs import recorded

    argv = recorded.restart_argv("j", {**data, "argv": ["-ielsewhere/inv", "--hosts", "x", "--detach"]},
                                 ["--exclude", "n1"])  # fmt: skip
    assert argv == ["run", "--detach", "--hosts", inv, "--set", "train.global_batch=auto", "--exclude", "n1"]
    from ddp_train.launch.cliparse import build_parser

    opts = build_parser().parse_args(["restart", "--hosts", inv, "j", "--exclude", "n1"])
    assert (opts.hosts, opts.job, opts.extra) == ([inv], "j", ["--exclude", "n1"])
    capsys.readouterr()
    assert main(["status", "j"]) == 2  # neither here nor --hosts: say how
    assert "a job detached from another machine: add --hosts INVENTORY" in capsys.readouterr().err
    assert main(["jobs", "--hosts", str(tmp_path / "nothing")]) == 2
    assert "nothing: no such file or directory" in capsys.readouterr().err


def test_the_proxy_asks_for_the_directory_the_monitor_wrote_a_tilde_as_the_remote_home() -> None:
    assert clustermon.home_path("~/jobs x") == "\"$HOME\"/'jobs x'"
    assert clustermon.home_path("~") == '"$HOME"' and clustermon.home_path("/srv/j") == "/srv/j"
    assert clustermon.home_path(".ddp-train/jobs") == ".ddp-train/jobs"  # relative: to the home (cd)


def test_status_json_prints_the_record_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    data = {"job_id": "j1", "pid": 0, "state": "finished", "exit_code": 0, "started": 1.0, "nodes": [],
            "argv": ["--env", "TOKEN=***"]}  # fmt: skip
    jobstate.write_state(jobstate.state_path(tmp_path / "logs", "j1"), data)
    assert main(["status", "j1", "--log-dir", str(tmp_path / "logs"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == data
