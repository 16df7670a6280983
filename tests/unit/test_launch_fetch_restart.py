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
        assert recorded.restart("j9", data, ["--exclude", "n0"]) == 0
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
    data["argv"] = ["run", "--hosts", "inv", "--", "--lr", "1"]
    assert recorded.restart_argv("j", data, ["--limit", "a"]) == [
        "run",
        "--hosts",
        "inv",
        "--limit",
        "a",
        "--",
        "--lr",
        "1",
    ]
    data["argv"] = ["run", "--monitor", "--job-id", "d1", "--hosts", "inv"]  # what a detached job records
    assert recorded.restart_argv("j", data, []) == ["run", "--hosts", "inv", "--detach"]
    data["argv"] = ["--hosts", "a,", "-e", "ansible_password=***"]
    with pytest.raises(LaunchError, match="masks a secret in 'ansible_password=\\*\\*\\*'"):
        recorded.restart_argv("j", data, [])
    data["argv"] = ["stop", "j0"]
    with pytest.raises(LaunchError, match="a 'stop' command, not a launch"):
        recorded.restart_argv("j", data, [])
