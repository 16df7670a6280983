"""`ddp-launch fetch` and `restart` from a job's job.json: bad input is one line and exit 2; fetch copies
best/last/metrics from rank 0's (here: local) node hash-checked; restart's command drops --job-id and
--fresh, adds the given options before the script, and takes a masked --env from this shell."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from ddp_train.launch import cli
from ddp_train.launch.errors import LaunchError
from ddp_train.launch.jobs import recorded


def job(tmp_path: Path, argv: list[str], metrics: dict | None = None, job_id: str = "j1") -> dict:
    data = {"job_id": job_id, "argv": argv, "cwd": str(tmp_path), "state": "finished"}
    if metrics:
        data["metrics"] = metrics
    (tmp_path / "logs" / job_id).mkdir(parents=True)
    (tmp_path / "logs" / job_id / "job.json").write_text(json.dumps(data))
    return data


def err_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("command", ["fetch", "restart"])
def test_bad_job(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                 command: str) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert cli.main([command, "../etc"]) == 2
    assert "not a job id" in err_line(capsys)
    assert cli.main([command, "nope"]) == 2
    assert "no job 'nope' in logs/" in err_line(capsys)
    (tmp_path / "logs" / "broken").mkdir(parents=True)
    (tmp_path / "logs" / "broken" / "job.json").write_text('{"job_id": "broken"}')
    assert cli.main([command, "broken"]) == 2
    assert "field" in err_line(capsys)


@pytest.mark.parametrize("command", ["fetch", "restart"])
def test_a_job_monitored_on_the_cluster_names_its_monitor_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """Its job.json is with its monitor (--detach): the line says where, not only that logs/ lacks it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    record = tmp_path / "state" / "ddp-train" / "jobs" / "j9.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"job_id": "j9", "log_dir": "jobs", "monitor": {"name": "node2"}}))
    assert cli.main([command, "j9"]) == 2
    line = err_line(capsys)
    if command == "fetch":  # job.json is asked of the monitor host; this record cannot reach it
        assert "j9.json: not a record of a job's monitor host" in line
        assert "no job 'j9' here: its monitor and job.json are on node2 (ddp_monitor_host)" in line
    else:
        assert "no job 'j9' in logs/" in line and "on node2 (ddp_monitor_host)" in line
    if command == "restart":  # the record keeps the command (masked) and its directory: enough to restart
        argv = ["--hosts", "inv", "--detach", "--env", "HF_TOKEN=***", "--job-id", "j9"]
        record.write_text(json.dumps({"job_id": "j9", "log_dir": "jobs", "monitor": {"name": "node2"},
                                      "argv": argv, "cwd": str(tmp_path)}))  # fmt: skip
        ran: list[list[str]] = []
        monkeypatch.setattr(cli, "main", lambda a: ran.append(a) or 0)
        monkeypatch.setenv("HF_TOKEN", "t0")
        from ddp_train.launch.jobs import fetch

        data = fetch.load("j9", "logs", command=True)  # job.json is not here: the record's command
        assert data["argv"] == argv
        assert recorded.restart("j9", data, ["--exclude", "n0"], cli.main) == 0
        assert ran and "--exclude" in ran[0] and "--detach" in ran[0] and "HF_TOKEN=***" not in ran[0]


def test_fetch_what_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["fetch", "j1", "newest"])
    assert "invalid choice: 'newest'" in err_line(capsys)


def test_fetch_from_a_local_rank0(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    inv = tmp_path / "inv.yml"
    inv.write_text(
        yaml.safe_dump({"all": {"hosts": {"n0": {"ansible_connection": "local", "ddp_venv": sys.prefix}}}})
    )
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "best.pt").write_bytes(b"best weights")
    (run / "metrics.jsonl").write_text('{"step": 10}\n')
    for step in (9, 20, 10):
        (run / "checkpoints" / f"step-{step:08d}.pt").write_bytes(f"state {step}".encode())
    metrics = {"host": "n0", "path": str(run / "metrics.jsonl"), "local": True}
    job(tmp_path, ["--hosts", str(inv), "--set", "run.dir=runs", "--set", "run.name=r"], metrics)
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "out"
    for what, name, data in (("best", "best.pt", b"best weights"), ("last", "step-00000020.pt", b"state 20"),
                             ("metrics", "metrics.jsonl", b'{"step": 10}\n')):  # fmt: skip
        assert cli.main(["fetch", "j1", what, "--to", str(out_dir)]) == 0, capsys.readouterr().err
        assert (out_dir / name).read_bytes() == data
        assert f"from n0:{run}" in capsys.readouterr().out
    (run / "best.pt").unlink()
    assert cli.main(["fetch", "j1", "--to", str(out_dir)]) == 2
    assert "best on n0:" in err_line(capsys) and not list(out_dir.glob(".*part"))


def test_fetch_without_results(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    job(tmp_path, ["--hosts", "x,", "train.py"])
    monkeypatch.chdir(tmp_path)
    assert cli.main(["fetch", "j1"]) == 2
    assert "names no results (field metrics)" in err_line(capsys)


def test_restart_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--hosts", "inv", "--job-id", "old", "--fresh", "--env", "HF_TOKEN=***", "--set", "a=1",
            "--job-id=x", "train.py", "--fresh", "--job-id", "mine"]  # fmt: skip
    data = {"argv": argv, "cwd": str(tmp_path)}
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(LaunchError, match="--env HF_TOKEN is masked in job.json; export HF_TOKEN"):
        recorded.restart_argv("j", data, [])
    monkeypatch.setenv("HF_TOKEN", "value")
    assert recorded.restart_argv("j", data, ["--exclude", "node0"]) == [
        "run", "--hosts", "inv", "--secret-env", "HF_TOKEN", "--set", "a=1", "--exclude", "node0",
        "train.py", "--fresh", "--job-id", "mine",  # the script's own arguments stay as they were
    ]  # fmt: skip
    # the packaged trainer keeps the checkpoint's global batch (on fewer nodes too), unless told otherwise
    keep = ["--set", "train.global_batch=auto"]
    data["argv"] = ["run", "--hosts", "inv", "--", "--lr", "1"]
    assert recorded.restart_argv("j", data, ["--limit", "a"]) == [
        "run", "--hosts", "inv", *keep, "--limit", "a", "--", "--lr", "1",
    ]  # fmt: skip
    data["argv"] = ["run", "--monitor", "--job-id", "d1", "--hosts", "inv"]  # what a detached job records
    assert recorded.restart_argv("j", data, []) == ["run", "--hosts", "inv", "--detach", *keep]
    data["argv"] = ["run", "--hosts", "inv", "--set", "train.global_batch=96"]
    assert recorded.restart_argv("j", data, []) == ["run", "--hosts", "inv", "--set", "train.global_batch=96"]
    data["argv"] = ["--hosts", "a,", "-e", "ansible_password=***"]
    with pytest.raises(LaunchError, match="masks a secret in 'ansible_password=\\*\\*\\*'"):
        recorded.restart_argv("j", data, [])
    data["argv"] = ["stop", "j0"]
    with pytest.raises(LaunchError, match="a 'stop' command, not a launch"):
        recorded.restart_argv("j", data, [])


def _pinned_inventory(tmp_path: Path, **pins: str) -> Path:
    """inventory/prod's shape: SSH on 192.0.2.x, training on ddp_network_cidr; `pins` in group_vars."""
    inv = tmp_path / "inv"
    (inv / "group_vars" / "all").mkdir(parents=True)
    hosts = {f"n{i}": {"ansible_host": f"192.0.2.{10 + i}"} for i in range(3)}
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"gpu_nodes": {"hosts": hosts}}}}))
    (inv / "group_vars" / "all" / "ddp.yml").write_text(
        "ddp_network_cidr: 198.51.100.0/24\nddp_master_port: 29500\n"
        + "".join(f"{k}: {v}\n" for k, v in pins.items())
    )
    return inv


@pytest.mark.parametrize(
    ("pins", "extra", "refused"),
    [
        ({"ddp_master_addr": "198.51.100.10"}, ["--exclude", "n0"], "ddp_master_addr"),
        ({"ddp_master": "n0"}, ["--exclude", "n0"], "ddp_master"),
        ({"ddp_master_addr": "198.51.100.10"}, ["--limit", "n1,n2"], "ddp_master_addr"),
        ({}, ["--exclude", "n0"], None),  # README "Recover": the next node is the master, nothing to edit
        ({"ddp_master_addr": "198.51.100.10"}, ["--exclude", "n2"], None),  # the master stays
        ({"ddp_master_addr": "198.51.100.11"}, ["--exclude", "n0"], None),  # already moved to n1's address
    ],
)
def test_a_restart_without_the_pinned_master_says_what_to_edit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    pins: dict[str, str], extra: list[str], refused: str | None,
) -> None:  # fmt: skip
    """#42: a master pinned in the inventory (ddp_master, ddp_master_addr) that the restart leaves out is
    one line naming the file and variable, exit 2, before anything starts (the launch used to go ahead
    with MASTER_ADDR on the lost node and fail in preflight or at the rendezvous)."""
    inv = _pinned_inventory(tmp_path, **pins)
    data = job(tmp_path, ["--hosts", str(inv), "--job-id", "j1"])
    data.update(master="n0", master_addr="198.51.100.10",
                nodes=[{"host": f"n{i}", "rank": i} for i in range(3)])  # fmt: skip
    (tmp_path / "logs" / "j1" / "job.json").write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    launch = cli.main
    ran: list[list[str]] = []
    monkeypatch.setattr(cli, "main", lambda a: ran.append(a) or 0)  # the restarted launch itself
    code = launch(["restart", "j1", *extra])
    if refused is None:
        assert code == 0 and ran and ran[0][-len(extra) :] == extra
        return
    assert code == 2 and not ran
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    where = inv.resolve() / "group_vars" / "all" / "ddp.yml"
    assert err.startswith(f"ddp-launch restart: error: {where}:3: {refused}: "), err
    if refused == "ddp_master":
        assert "n0 is not among this restart's nodes (n1, n2); delete ddp_master there" in err
    else:
        assert "198.51.100.10 is the address of n0, the master of job j1, which this restart leaves" in err
        assert "; delete ddp_master_addr there (MASTER_ADDR then moves to n1's address in ddp_netw" in err


def test_the_jobs_master_is_kept_for_restart_in_job_json_and_in_a_cluster_monitors_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddp_train.launch.jobs import clustermon, fetch, jobstate
    from ddp_train.launch.plan.plan import Options, build_plan
    from tests.unit.test_launch_plan import node

    nodes = [node("n0", "10.0.0.1", master="n1"), node("n1", "10.0.0.2", master="n1")]
    plan = build_plan(nodes, Options(job_id="j9"))
    state = jobstate.initial_state(plan, [], False)
    assert (state["master"], state["master_addr"]) == ("n1", "10.0.0.2")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    clustermon.save_record("j9", nodes[0], "jobs", ["--hosts", "inv"], master=("n1", "10.0.0.2"))
    data = fetch.load("j9", str(tmp_path / "logs"), command=True)  # job.json is with the monitor
    assert (data["master"], data["master_addr"], data["argv"]) == ("n1", "10.0.0.2", ["--hosts", "inv"])
