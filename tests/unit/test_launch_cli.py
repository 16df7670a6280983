"""ddp-launch's command line: bad input is one line and exit 2; --dry-run prints each node's exact command."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_train.launch.cli import main
from ddp_train.launch.run.logs import JobLog, first_error

REPO = Path(__file__).resolve().parents[2]
LOCAL_INV = str(REPO / "inventory" / "local")


def run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own exits
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--hosts", "/nonexistent/inv"], "inventory /nonexistent/inv: no such file or directory"),
        (["--hosts", LOCAL_INV, "--config", "/nonexistent.yaml"], "--config /nonexistent.yaml: no such file"),
        (["--hosts", LOCAL_INV, "--set", "no.such.key=1"], "no.such.key"),
        (["--hosts", LOCAL_INV, "--env", "1BAD=x"], "--env '1BAD=x': expected NAME=VALUE"),
        (["--hosts", LOCAL_INV, "--master-port", "70000"], "--master-port 70000: not a TCP port"),
        (["--hosts", LOCAL_INV, "--nproc-per-node", "0"], "--nproc-per-node '0'"),
        (["--hosts", LOCAL_INV, "--max-restarts", "-1"], "--max-restarts -1: must be >= 0"),
        (
            ["--hosts", LOCAL_INV, "--limit", "nomatch"],
            "no hosts in group 'gpu_nodes' matching --limit 'nomatch'",
        ),
        (["--hosts", LOCAL_INV, "--job-id", "a b"], "--job-id 'a b'"),
        (["doctor", "--hosts", LOCAL_INV, "--", "x"], "doctor takes no trainer arguments"),
        (["doctor", "--hosts", LOCAL_INV, "stray", "--limit", "node0"], "unrecognized arguments: stray (see"),
        (["--hosts", LOCAL_INV, "--nproc-per-node", "+2"], "--nproc-per-node '+2'"),
        (["--hosts", LOCAL_INV, "-e", "ddp_master_port=abc"], "ddp_master_port: 'abc' is not a TCP port"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    code, out, err = run_main([*argv, "--dry-run"] if argv[0] != "doctor" else argv, capsys)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and err.startswith("ddp-launch: error: ")
    assert "Traceback" not in err + out


def test_bad_trainer_config_is_refused_before_any_node_is_touched(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "train.yaml"
    cfg.write_text("train:\n  max_steps: -3\n")
    code, _, err = run_main(["--hosts", LOCAL_INV, "--config", str(cfg), "--dry-run"], capsys)
    assert code == 2 and "train.max_steps" in err and str(cfg) in err


def test_dry_run_prints_every_node_command_with_secrets_masked(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    extra = json.dumps({"ddp_env": {"HF_TOKEN": "hf_secret_value", "A": "b c"}})
    code, out, _ = run_main(
        ["--hosts", LOCAL_INV, "-e", extra, "--job-id", "dry1", "--master-port", "29999", "--set",
         "train.max_steps=3", "--dry-run", "--", "--trainer-flag"],
        capsys,
    )  # fmt: skip
    assert code == 0
    commands = [ln for ln in out.splitlines() if not ln.startswith("#")]
    envs = [json.loads(ln.split(": ", 1)[1]) for ln in out.splitlines() if ln.startswith("# environment")]
    assert len(commands) == 2 and "hf_secret_value" not in out and len(envs) == 2
    assert all(e["HF_TOKEN"] == "***" and e["A"] == "b c" for e in envs)
    for rank, cmd in enumerate(commands):
        words = shlex.split(cmd)
        i = words.index("--node-rank")
        assert words[i + 1] == str(rank)
        assert words[words.index("--master-addr") + 1] == "127.0.0.1"
        assert words[words.index("--master-port") + 1] == "29999"
        assert "DDP_JOB_ID=dry1" in words and "A=b c" not in words  # the rest of the env: stdin
        assert words[: words.index("setsid")] == ["cd", "--", str(tmp_path), "&&", "exec"]
        assert words[-3:] == ["--set", "train.max_steps=3", "--trainer-flag"]
    assert not (tmp_path / "logs").exists()


def test_console_script_errors_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "inv.yml"
    bad.write_text("all:\n  hosts:\n    a: {ansible_port: [1, 2]}\n")
    res = subprocess.run(
        [str(Path(sys.executable).parent / "ddp-launch"), "--hosts", str(bad), "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    assert (
        res.stderr.strip()
        == f"ddp-launch: error: {bad}:3: host a: ansible_port: [1, 2] is not a TCP port (1-65535)"
    )


TORCHRUN_FAILURE = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "x.py", line 3, in <module>
[rank1]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:123
E1202 15:09:36.969000 31350 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  exitcode  : 1 (pid: 31371)
"""


def test_first_error_prefers_signal_then_exception_then_exit_code() -> None:
    assert first_error(TORCHRUN_FAILURE.splitlines()).startswith("[rank1]: RuntimeError: [gloo")
    killed = [
        "  exitcode  : -9 (pid: 31371)  (SIGKILL)",
        "  traceback : Signal 9 (SIGKILL) received by PID 31371",
    ]
    assert first_error(killed) == "traceback : Signal 9 (SIGKILL) received by PID 31371"
    assert first_error(["ddp-train: error: c.yaml: train.lr: must be > 0"]) == (
        "ddp-train: error: c.yaml: train.lr: must be > 0"
    )
    assert first_error(["all good", "step 5/10 loss 1.0"]) is None


def test_job_log_prefixes_lines_and_masks_secrets(tmp_path: Path) -> None:
    console = tmp_path / "console.txt"
    with console.open("w") as out:
        log = JobLog(tmp_path / "logs", "job1", secrets=["s3cr3t-v"], console=out)
        log.line("node1", "node1 r1", "token is s3cr3t-v")
        log.note("launching with s3cr3t-v")
        log.close()
    text = (tmp_path / "logs" / "job1" / "node1.log").read_text()
    assert text.rstrip().endswith("[node1 r1] token is ***")
    assert "s3cr3t-v" not in console.read_text() + text + (tmp_path / "logs/job1/launcher.log").read_text()
    assert "[node1 r1] token is ***" in console.read_text()


def test_the_documented_prod_inventory_dry_runs(capsys: pytest.CaptureFixture) -> None:
    """README's `ddp-launch --hosts inventory/prod --dry-run` works on the example as shipped: SSH on the
    management network, the rendezvous on the training network. No ddp_master_addr pins the master there
    (#42): preflight finds its address in ddp_network_cidr, so it moves to the next node after a loss."""
    prod = Path(LOCAL_INV).parent / "prod"
    code, out, err = run_main(["--hosts", str(prod), "--dry-run"], capsys)
    assert code == 0, err
    assert out.count("--master-addr 192.0.2.10") == 3  # gpu-node-0's ansible_host until preflight
    assert out.count("in ddp_network_cidr 198.51.100.0/24, found by preflight at launch") == 3
    assert out.count("--node-rank") == 3
    pinned = [ln for ln in (prod / "group_vars" / "all" / "ddp.yml").read_text().splitlines()
              if ln.startswith(("ddp_master_addr:", "ddp_master:"))]  # fmt: skip
    assert pinned == []


def test_only_the_launchers_own_writes_are_reported_as_a_failed_log_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # review #7: an unreadable --config (EACCES anywhere in _main) read as "writing the job's logs failed"
    import errno

    from ddp_train.launch import cli
    from ddp_train.launch.jobs import jobstate

    def unreadable(_argv: object) -> int:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "cfg.yaml"))

    monkeypatch.setattr(cli, "_main", unreadable)
    with pytest.raises(PermissionError):
        main([])
    assert "writing the job's logs" not in capsys.readouterr().err

    def refused_write(_argv: object) -> int:
        jobstate.write_private(tmp_path / "no-such-dir" / "job.json", b"{}")  # ENOENT: not a disk error
        return 0

    def full_disk(_argv: object) -> int:
        def enospc(*_a: object, **_k: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "j" / "job.json"))

        with monkeypatch.context() as m:
            m.setattr(jobstate.os, "open", enospc)
            jobstate.write_private(tmp_path / "j" / "job.json", b"{}")
        return 0

    monkeypatch.setattr(cli, "_main", refused_write)
    with pytest.raises(FileNotFoundError):
        main([])
    monkeypatch.setattr(cli, "_main", full_disk)
    assert main([]) == 2
    assert "writing the job's logs and state failed: No space left on device" in capsys.readouterr().err


def test_fresh_over_checkpoints_on_a_node_is_refused_as_bad_input_before_the_job_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#42: `--fresh` where a node already holds checkpoints exits 2 with one line naming the node, the
    directory and its newest step, and no trainer starts (it used to start the job, which failed: exit 1)."""
    from ddp_train.launch.jobs import jobstate
    from ddp_train.launch.run.logs import host_log_path

    monkeypatch.chdir(tmp_path)  # the local nodes' working directory
    ckpts = tmp_path / "runs" / "r1" / "checkpoints"
    ckpts.mkdir(parents=True)
    for step in (10, 20):
        (ckpts / f"step-{step:08d}.pt").write_bytes(b"not read")
    argv = ["--hosts", LOCAL_INV, "--fresh", "--skip-preflight", "--job-id", "fresh1", "--master-port",
            "29771", "--set", "run.name=r1", "--set", "train.max_steps=2"]  # fmt: skip
    code, out, err = run_main(argv, capsys)
    assert code == 2, out + err
    lines = [ln for ln in out.splitlines() if "--fresh" in ln]
    assert len(lines) == 1 and lines[0].startswith(
        f"ddp-launch: --fresh (checkpoint.resume: never) but local0:{ckpts} already holds 2 checkpoint(s), "
        "the newest of step 20 (step-00000020.pt, saved "
    ), out
    assert "(checkpoints also on local1); use another run.name" in lines[0]
    assert lines[0].endswith("without --fresh; nothing was started")
    assert "FAILED" not in out and "Traceback" not in out + err
    assert not host_log_path(tmp_path / "logs" / "fresh1", "local0").exists()  # no node ran anything
    assert (jobstate.read_state(jobstate.state_path("logs", "fresh1")) or {}).get("exit_code") == 2
    # without checkpoints there, or without --fresh, nothing is refused (checked without starting a job)
    from ddp_train.launch.node.checkpoints import main as node_main
    from ddp_train.launch.preflight.fresh import refusal

    node_main([str(tmp_path), "elsewhere"])
    none = json.loads(capsys.readouterr().out.split("DDP-CHECKPOINTS ", 1)[1])
    assert none == {"dir": str(tmp_path / "elsewhere"), "count": 0, "newest": None}
    assert refusal([("local0", none)]) is None


def test_the_fresh_check_knows_the_trainers_checkpoint_names_and_names_the_newest_node() -> None:
    from ddp_train.checkpoint import _NAME
    from ddp_train.launch.node.checkpoints import NAME
    from ddp_train.launch.preflight.fresh import refusal

    assert NAME.pattern == _NAME.pattern  # node modules are stdlib-only: the pattern is written twice
    found = [
        ("n0", {"dir": "/w/runs/a/checkpoints", "count": 1, "newest": [10, "step-00000010.pt", 0.0]}),
        ("n1", {"dir": "/w/runs/a/checkpoints", "count": 2, "newest": [30, "step-00000030.pt", 100.0]}),
        ("n2", {"dir": "/w/runs/a/checkpoints", "error": "Permission denied"}),
    ]
    line = refusal(found, now=3700.0)
    assert line == (
        "--fresh (checkpoint.resume: never) but n1:/w/runs/a/checkpoints already holds 2 checkpoint(s), "
        "the newest of step 30 (step-00000030.pt, saved 1970-01-01 00:01:40 UTC, 1h00m ago) (checkpoints "
        "also on n0); use another run.name (or checkpoint.dir), delete those directories to start over, or "
        "resume from it without --fresh; nothing was started"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["jobs"],
        ["status", "j1"],
        ["logs", "j1"],
        ["logs", "j1", "--node", "local0"],
        ["stop", "j1"],
        ["--help"],
    ],
)
def test_every_command_ends_quietly_when_its_stdout_is_a_closed_pipe(tmp_path: Path, argv: list[str]) -> None:
    """#42: `ddp-launch status JOB | head` and the like: exit 0 or 141 (a SIGPIPE death, as a shell reports
    it) and no BrokenPipeError traceback, now or at exit; `stop` has sent its signal all the same."""
    import os
    import signal
    import time

    from ddp_train.launch.jobs import jobstate
    from ddp_train.launch.run.logs import host_log_path

    monitor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the job's monitor
    try:
        log_dir = tmp_path / "logs"
        jobstate.write_state(
            jobstate.state_path(log_dir, "j1"),
            {"job_id": "j1", "pid": monitor.pid, "state": "running", "detached": True, "master_port": 29500,
             "started": time.time(), "argv": ["--hosts", "inv"], "cwd": str(tmp_path),
             "nodes": [{"host": "local0", "rank": 0}, {"host": "local1", "rank": 1}],
             **jobstate.identity(monitor.pid)},
        )  # fmt: skip
        lines = "".join(f"2026-01-02T03:04:05.000 [local0 r0] line {i}\n" for i in range(2000))
        host_log_path(log_dir / "j1", "local0").write_text(lines)
        (log_dir / "j1" / "console.log").write_text(lines)
        read, write = os.pipe()
        os.close(read)  # the reader left before the first write: every write fails (EPIPE)
        cmd = [sys.executable, "-m", "ddp_train.launch.cli", *argv]
        if argv != ["--help"]:
            cmd[4:4] = ["--log-dir", str(log_dir)]
        env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}  # no job records of this machine
        res = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, env=env,
                             cwd=tmp_path)  # fmt: skip
        os.close(write)
        assert res.returncode in (0, 141), res.stderr
        assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr
        assert "Exception ignored" not in res.stderr, res.stderr
        if argv[0] == "stop":
            assert monitor.wait(timeout=10) == -signal.SIGTERM  # the stop itself happened
    finally:
        monitor.kill()
        monitor.wait()
