"""Issue #24 on the controller: no secret in a recorded argv or a world-readable file, job ids checked at
every entry, the widened secret rule, stale pids never signalled, teardown scoped to its own session."""

from __future__ import annotations

import getpass
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddp_train.launch.cli import main
from ddp_train.launch.jobs import jobcmds, jobstate
from tests.unit.test_launch_plan import fake_venv

SECRET_ENV = {
    "DB_PASSWD": "pw-Zq83-passwd",
    "GIT_CREDENTIALS": "cred-Zq83-git",
    "PROXY_AUTH": "auth-Zq83-proxy",
    "MIRROR_URL": "https://bob:pw-Zq83-in-url@mirror.example/simple",
    "PLAIN_NAME": "marked-Zq83-secret",  # named like nothing: ddp_secret_env marks it
}


def run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def inventory(tmp_path: Path, **variables: object) -> Path:
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"local0": None}, "vars": {
        "ansible_connection": "local", "ansible_host": "127.0.0.1", "ddp_workdir": str(tmp_path),
        "ddp_venv": str(fake_venv(tmp_path)), "ddp_master_port": 29977, **variables}}}))  # fmt: skip
    return inv


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---- item 3: the secret rule ----------------------------------------------------------------------


def test_dry_run_masks_widened_names_url_passwords_and_marked_variables(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = inventory(tmp_path, ddp_env=SECRET_ENV, ddp_secret_env=["PLAIN_NAME"])
    monkeypatch.setenv("FROM_SHELL", "shell-Zq83-value")
    code, out, err = run_main(
        ["--hosts", str(inv), "--job-id", "sec-dry", "--secret-env", "FROM_SHELL", "--env", "VISIBLE=v1",
         "--dry-run", "--", "--mirror=https://u:pw-Zq83-set@host/x"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    for secret in [*SECRET_ENV.values(), "shell-Zq83-value", "pw-Zq83-set"]:
        assert secret not in out + err, secret
    line = next(ln for ln in out.splitlines() if ln.startswith("# environment"))
    shown = json.loads(line.split(": ", 1)[1])
    names = [*SECRET_ENV, "FROM_SHELL"]
    assert {k: shown[k] for k in names} == dict.fromkeys(names, "***")
    assert shown["VISIBLE"] == "v1"


# Real-world names (issue #44): passwords, personal access tokens and credentials under their short
# names, and Azure/ADO connection strings whose secret is in the value; and names that only look alike.
SHOULD_MASK = [
    "DB_PASS", "SMTP_PASS", "MYSQL_PASS", "REDIS_PASS2", "dbPass", "db.pass", "PGPASSWORD", "DB_PW",
    "GITHUB_PAT", "GH_PAT", "AZURE_DEVOPS_PAT", "githubPat", "AWS_CREDS", "GCP_CREDS", "APP_CRED",
    "HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "GIT_CREDENTIALS",
]  # fmt: skip
SHOULD_NOT_MASK = [
    "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "TOKENIZERS_PARALLELISM", "data.tokens.path", "PASSTHROUGH",
    "NCCL_PASS_THROUGH", "NUM_PASSES", "BYPASS_CACHE", "COMPASS_DIR", "EARLY_STOP_PATIENCE", "SPATIAL_DIMS",
    "CREDIT_LIMIT", "MASTER_ADDR", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "HF_HOME", "OMP_NUM_THREADS",
]  # fmt: skip
CONNECTION_STRINGS = [
    "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=Zq83k==;EndpointSuffix=core.windows.net",
    "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=send;SharedAccessKey=Zq83k=",
    "BlobEndpoint=https://acct.blob.core.windows.net/;SharedAccessSignature=sv=2022-11-02&sig=Zq83",
    "https://acct.blob.core.windows.net/c/x.bin?sv=2022-11-02&se=2030-01-01&sp=r&sig=Zq83%2Bk%3D",
    "Server=db.example;Database=runs;User Id=ddp;Password=Zq83pw;",
    "Driver={PostgreSQL};Server=db;Uid=ddp;Pwd=Zq83pw",
]


@pytest.mark.parametrize("name", SHOULD_MASK)
def test_names_of_passwords_pats_and_credentials_are_secret(name: str) -> None:
    from ddp_train.launch.plan.plan import is_secret

    assert is_secret(name, "v")


@pytest.mark.parametrize("name", SHOULD_NOT_MASK)
def test_names_that_only_look_like_secrets_are_shown(name: str) -> None:
    from ddp_train.launch.plan.plan import is_secret

    assert not is_secret(name, "/usr/bin:/bin")


@pytest.mark.parametrize("value", CONNECTION_STRINGS)
def test_a_connection_string_with_a_key_or_password_is_secret_whatever_its_name(value: str) -> None:
    from ddp_train.launch.plan.plan import is_secret

    assert is_secret("STORAGE", value)
    assert not is_secret("STORAGE", "AccountName=acct;EndpointSuffix=core.windows.net")


def test_dry_run_masks_db_pass_and_an_azure_connection_string(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    env = {"DB_PASS": "pw-Zq83-dbpass", "GITHUB_PAT": "ghp_Zq83pat", "STORAGE": CONNECTION_STRINGS[0]}
    inv = inventory(tmp_path, ddp_env={**env, "PATH": "/usr/bin:/bin"})
    code, out, err = run_main(["--hosts", str(inv), "--job-id", "sec-pass", "--dry-run"], capsys)
    assert code == 0, err
    for secret in ["pw-Zq83-dbpass", "ghp_Zq83pat", "Zq83k=="]:
        assert secret not in out + err, secret
    line = next(ln for ln in out.splitlines() if ln.startswith("# environment"))
    shown = json.loads(line.split(": ", 1)[1])
    assert {k: shown[k] for k in env} == dict.fromkeys(env, "***") and shown["PATH"] == "/usr/bin:/bin"


def test_secret_env_takes_a_name_never_a_value(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--hosts", str(inventory(tmp_path)), "--secret-env", "TOK=abc", "--dry-run"]
    code, _, err = run_main(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "--secret-env 'TOK'" in err and "abc" not in err


def test_ddp_secret_env_must_be_a_list_of_names(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run_main(["--hosts", str(inventory(tmp_path, ddp_secret_env=["1x"])), "--dry-run"], capsys)
    assert code == 2 and "ddp_secret_env" in err and err.count("\n") == 1


# ---- item 2: job.json, the job's files, the detached monitor's arguments -------------------------


def test_job_json_keeps_no_secret_and_the_jobs_files_are_its_owners_only(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "train.yaml"
    cfg.write_text("train:\n  max_steps: 3\n")
    code, out, err = run_main(
        ["--hosts", str(inventory(tmp_path)), "--job-id", "sec-files", "--skip-preflight",
         "--config", str(cfg), "--env", "HF_TOKEN=hf_Zq83-argv", "-e", "ansible_password=pw-Zq83-extra",
         "-e", json.dumps({"ddp_env": {"PLAIN_NAME": "marked-Zq83-json"}, "ddp_secret_env": ["PLAIN_NAME"]})],
        capsys,
    )  # fmt: skip
    assert code == 0, out + err
    job = tmp_path / "logs" / "sec-files"
    text = (job / "job.json").read_text()
    for secret in ("hf_Zq83-argv", "pw-Zq83-extra", "marked-Zq83-json"):
        assert secret not in text, secret
    assert "HF_TOKEN=***" in text and "ansible_password=***" in text
    assert mode(job) == 0o700
    files = [p for p in job.rglob("*") if p.is_file()]
    assert {"job.json", "launcher.log", "local0.log", "train.yaml"} <= {p.name for p in files}
    assert {p.name: mode(p) for p in files} == {p.name: 0o600 for p in files}


def test_the_detached_monitor_gets_its_arguments_in_a_private_file_not_argv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    started: list[list[str]] = []

    class Monitor:
        pid = 4243

        def __init__(self, argv: list[str], **kw: object) -> None:
            started.append(argv)
            args_file = Path(argv[-1])
            assert mode(args_file) == 0o600
            self.args = jobcmds.read_monitor_args(str(args_file))
            assert not args_file.exists()  # read once, then gone

        def poll(self) -> int:
            return 3

    monkeypatch.setattr(subprocess, "Popen", Monitor)
    args = ["--hosts", "x", "--env", "HF_TOKEN=hf_Zq83-monitor"]
    assert jobcmds.detach(args, "sec-mon", str(tmp_path)) == 3
    assert started and not any("hf_Zq83-monitor" in a for a in started[0]), started
    assert started[0][-2] == "--monitor-args-file"
    assert mode(tmp_path / "sec-mon") == 0o700 and mode(tmp_path / "sec-mon" / "console.log") == 0o600


# ---- item 6: job ids --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "logs", "attach", "stop"])
def test_job_commands_refuse_a_job_id_that_is_a_path(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    outside = tmp_path / "x"
    outside.mkdir()
    jobstate.write_state(outside / "job.json", {"job_id": "x", "pid": os.getpid(), "state": "running"})
    code, out, err = run_main([command, "--log-dir", str(tmp_path / "logs"), "../x"], capsys)
    assert code == 2 and err.count("\n") == 1 and "'../x': not a job id" in err, out + err


def test_detach_refuses_a_job_id_that_is_a_path_before_writing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    code, out, err = run_main(["--hosts", "x,", "--detach", "--job-id", "../../escaped"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--job-id '../../escaped'" in err, out + err
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name == "escaped") == []
    assert list((tmp_path / "logs").iterdir()) == []


# ---- item 5: stack files are named after the host as host logs are --------------------------------


@pytest.mark.parametrize("name", ["../../outside", "a/b", "..", ".hidden"])
def test_stack_files_stay_in_the_stacks_directory_whatever_the_host_name(tmp_path: Path, name: str) -> None:
    from types import SimpleNamespace

    from ddp_train.launch.run.trainerlog import StepTimes
    from ddp_train.launch.run.watchdog import StallWatch

    job_dir = tmp_path / "logs" / "j"
    job_dir.mkdir(parents=True)
    watch = StallWatch("j", job_dir, 10, StepTimes())
    plan = SimpleNamespace(node=SimpleNamespace(name=name), rank=0)
    dump = 'Current thread 0x01 (most recent call first):\n  File "t.py", line 1 in <module>\n'
    line = watch.collect([(plan, lambda cmd: (0, f"WORKER 1 0\n==> r0.txt\n{dump}"))])
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.parent for p in written] == [job_dir / "stacks"], (line, written)
    assert dump in written[0].read_text() and mode(written[0]) == 0o600


# ---- item 7: a stale pid in job.json is never signalled ---------------------------------------------


@pytest.mark.parametrize("record", ["other start time", "other boot", "older job.json without identity"])
def test_stop_never_signals_a_process_that_only_reuses_the_monitors_pid(
    record: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bystander = subprocess.Popen(["sleep", "60"])  # an unrelated process that got the recorded pid
    try:
        data = {"job_id": "stale", "pid": bystander.pid, "state": "running", "detached": True,
                "master_port": 29500, "nodes": [{"host": "n1", "rank": 0}]}  # fmt: skip
        # read here, not through jobstate: proc(5) /proc/PID/stat field 22, and the boot id
        start = int(Path(f"/proc/{bystander.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        if record == "other start time":
            data.update(pid_start=start - 1, boot_id=boot)
        elif record == "other boot":
            data.update(pid_start=start, boot_id="0" * 8 + boot[8:])
        jobstate.write_state(jobstate.state_path(tmp_path, "stale"), data)
        code, out, err = run_main(["stop", "--log-dir", str(tmp_path), "--no-wait", "stale"], capsys)
        assert bystander.poll() is None, "the bystander got the job's SIGTERM"
        assert code == 1 and "is gone" in out, out + err
        # and the stale job no longer refuses a new one on its nodes
        assert jobstate.conflict(tmp_path, "new", ["n1"], 29500) is None
    finally:
        bystander.kill()
        bystander.wait()


def test_the_running_monitor_is_recognised_by_its_recorded_identity(tmp_path: Path) -> None:
    data = {"job_id": "live", "pid": os.getpid(), "state": "running", **jobstate.identity(os.getpid())}
    assert jobstate.effective_state(data) == "running"


# ---- item 8: teardown keeps to this user's processes and to the job's own session ----------------


@pytest.fixture
def unprivileged_user() -> Iterator[str]:
    """A throwaway local user (the other user of a shared node), removed afterwards."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        pytest.skip("needs root, useradd and setpriv")
    name = f"ddpeve{secrets.token_hex(2)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False)


def as_user(user: str, *argv: str) -> list[str]:
    """argv to run as `user` (setpriv execs it: same pid, environment kept)."""
    return ["setpriv", "--reuid", user, "--regid", user, "--clear-groups", *argv]


def signal_node(sig: str, pgid: str, job: str, scope: str = "all") -> str:
    from ddp_train.launch.run.nodecontrol import SIGNAL_SCRIPT

    res = subprocess.run(["sh", "-c", SIGNAL_SCRIPT, "ddp-launch", sig, pgid, job, scope],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    return res.stdout


def test_teardown_spares_another_session_and_another_users_process_with_the_job_id(
    unprivileged_user: str,
) -> None:
    job = f"sec-td-{secrets.token_hex(2)}"
    env = dict(os.environ, DDP_JOB_ID=job)
    # a session of this user that is not the job's (what a .bashrc's PGID line could name)
    foreign = subprocess.Popen(["sleep", "60"], start_new_session=True)
    # another user's process that carries the same DDP_JOB_ID (anyone can set any variable)
    other = subprocess.Popen(as_user(unprivileged_user, "sleep", "60"), env=env, start_new_session=True)
    # the job's own session: its leader carries the id, as `setsid env DDP_JOB_ID=... sh` made it
    own = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    procs = (foreign, other, own)
    try:
        time.sleep(0.3)  # setpriv has exec'd sleep
        for pgid in (foreign.pid, other.pid):
            listed = signal_node("KILL", str(pgid), job)
            assert str(other.pid) not in listed, listed
        time.sleep(0.3)
        assert foreign.poll() is None, "teardown killed a session that is not the job's"
        assert other.poll() is None, "teardown killed another user's process"
        signal_node("KILL", str(own.pid), job)
        own.wait(timeout=10)  # the job's own session still goes
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    ("line", "pgid"),
    [("DDP-LAUNCH-PGID 4242", 4242), ("DDP-LAUNCH-PGID 1", None), ("DDP-LAUNCH-PGID 0", None),
     ("DDP-LAUNCH-PGID -7", None), ("DDP-LAUNCH-PGID 12 x", None), ("DDP-LAUNCH-PGID abc", None)],
)  # fmt: skip
def test_a_pgid_line_that_would_signal_every_process_is_refused(line: str, pgid: int | None) -> None:
    from ddp_train.launch.run.noderun import parse_pgid

    assert parse_pgid(line) == pgid


def test_teardown_never_signals_process_group_1(tmp_path: Path) -> None:
    """`kill -- -1` signals every process of the user: a PGID 1 given to the node script does nothing
    (run as an unprivileged kill would be, the script's own check is what keeps it from happening)."""
    from ddp_train.launch.run.nodecontrol import SIGNAL_SCRIPT

    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "kill").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/kills\n')
    (shim / "kill").chmod(0o755)
    script = SIGNAL_SCRIPT.replace("kill -s", f"{shim}/kill -s")  # record, never send
    subprocess.run(["sh", "-c", script, "ddp-launch", "TERM", "1", "nojob", "all"], timeout=30, check=True)
    assert not (tmp_path / "kills").exists()


# ---- item 9: a jump host from ~/.ssh/config is verified like the target -----------------------------

JUMP_KEY = "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


def test_a_jump_host_from_ssh_config_gets_known_hosts_and_reject_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import paramiko
    from fabric import Connection

    from ddp_train.launch.plan.inventory import SshTarget
    from ddp_train.launch.remote.remote import _connection

    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    (ssh / "config").write_text("Host target.example\n  ProxyJump hop1.example,jumper@hop2.example:2222\n")
    (ssh / "known_hosts").write_text(f"[hop2.example]:2222 ssh-ed25519 {JUMP_KEY}\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    conn = _connection(SshTarget(host="target.example"), 5, None)
    hops = []
    hop = conn.gateway
    while isinstance(hop, Connection):
        hops.append(hop)
        hop = hop.gateway
    assert [(h.host, h.port) for h in hops] == [("hop1.example", 22), ("hop2.example", 2222)]
    for h in hops:  # Fabric's own default would be AutoAddPolicy: any key, never checked
        assert isinstance(h.client._policy, paramiko.RejectPolicy), h.host
    assert "[hop2.example]:2222" in h.client.get_host_keys()
    assert isinstance(conn.client._policy, paramiko.RejectPolicy)


def test_the_agent_gives_its_ranks_a_private_stack_directory_and_removes_it(tmp_path: Path) -> None:
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(
        "import os, stat, json\nd = os.environ['DDP_STACK_DIR']\nst = os.lstat(d)\n"
        "open(os.path.join(d, 'r0.txt'), 'w').close()  # a rank killed before its atexit\n"
        "print(json.dumps([d, stat.S_IMODE(st.st_mode), st.st_uid]))\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "ddp_train.agent", str(torchrun)],
        input=json.dumps({"DDP_STACK_DIR": "/tmp/ddp-stacks-guessable"}) + "\n", capture_output=True,
        text=True, timeout=60, env=dict(os.environ, TMPDIR=str(tmp_path), DDP_JOB_ID="sec-agent"),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    directory, dir_mode, uid = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(directory).parent == tmp_path and Path(directory).name.startswith("ddp-agent-sec-agent-")
    assert (dir_mode, uid) == (0o700, os.geteuid())
    assert not Path(directory).exists()  # removed at the end, the dead rank's dump with it


def test_torchruns_log_directory_is_made_in_the_agents_private_directory_and_removed(tmp_path: Path) -> None:
    """torch's torchrun makes a torchelastic_* log directory (its ranks' error files) in the temp directory
    and never removes it: without the agent's care, one more in each node's /tmp per launch."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, tempfile\n"
        "print(json.dumps([os.environ['DDP_STACK_DIR'], os.environ['TORCHELASTIC_ERROR_FILE'],"
        " tempfile.gettempdir()]))\n"
    )
    torchrun = Path(sys.executable).parent / "torchrun"
    res = subprocess.run(
        [sys.executable, "-m", "ddp_train.agent", str(torchrun), "--standalone", "--nproc-per-node", "1",
         str(script)],
        input="{}\n", capture_output=True, text=True, timeout=120,
        env=dict(os.environ, TMPDIR=str(tmp_path), DDP_JOB_ID="sec-logs"),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    private, error_file, rank_tmp = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(error_file).is_relative_to(private) and Path(private).name.startswith("ddp-agent-sec-logs-")
    assert rank_tmp == str(tmp_path)  # the ranks keep $TMPDIR
    # nothing of the agent's is left but the ranks' compile cache, 0700 and kept for the next job (#44)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank.py", f"torchinductor_{getpass.getuser()}"]


def test_a_log_dir_given_to_torchrun_wins_over_the_agents() -> None:
    from torch.distributed.run import get_args_parser

    from ddp_train.agent import _torchrun_argv

    argv = _torchrun_argv(["/venv/bin/torchrun", "--nnodes", "1", "-m", "ddp_train"], "/tmp/ddp-agent-j-x")
    assert get_args_parser().parse_args(argv[1:]).log_dir == "/tmp/ddp-agent-j-x/torchrun"
    mine = ["/venv/bin/torchrun", "--log-dir", "/scratch/logs", "-m", "ddp_train", "--log-dir", "trainer's"]
    assert (
        get_args_parser().parse_args(_torchrun_argv(mine, "/tmp/ddp-agent-j-x")[1:]).log_dir
        == "/scratch/logs"
    )


def test_the_leftover_scan_removes_a_killed_agents_empty_private_directory_only(
    tmp_path: Path, unprivileged_user: str
) -> None:
    """A SIGKILLed agent cannot remove its 0700 directory under $TMPDIR: the scan that finds nothing of
    the job left removes its ranks' stack dump files and then the directory if that emptied it and it is
    this user's; never one with an agent.log, another job's (job "j" vs "j-b"), a symlink, another
    user's, or anything while a process of the job runs."""
    from ddp_train.agent import TORCHRUN_LOGS
    from ddp_train.launch.run.nodecontrol import SIGNAL_SCRIPT

    job = f"sec-dir-{secrets.token_hex(2)}"
    made = {name: tmp_path / f"ddp-agent-{name}-{secrets.token_hex(4)}" for name in (job, f"{job}-b")}
    for d in made.values():
        d.mkdir(mode=0o700)
        (d / "r0.txt").write_text("")  # the rank's stack dump file (ddp_train/stackdump.py), opened at start
    logs = made[job] / TORCHRUN_LOGS / "none_x1y2z3w4" / "attempt_0" / "0"
    logs.mkdir(parents=True)  # torchrun's log directory (ddp_train/agent.py), with a rank's error file
    (logs / "error.json").write_text("{}")
    kept_log = tmp_path / f"ddp-agent-{job}-{secrets.token_hex(4)}"
    kept_log.mkdir(mode=0o700)
    (kept_log / "agent.log").write_text("lost the launcher\n")
    (kept_log / "r12.txt").write_text("")
    (kept_log / "notes.txt").write_text("not ours to remove\n")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / f"ddp-agent-{job}-link0000").symlink_to(target)
    theirs = tmp_path / f"ddp-agent-{job}-theirs00"
    theirs.mkdir()
    shutil.chown(theirs, unprivileged_user, unprivileged_user)
    env = dict(os.environ, TMPDIR=str(tmp_path))

    def scan() -> str:
        return subprocess.run(["sh", "-c", SIGNAL_SCRIPT, "ddp-launch", "-", "0", job, "all"],
                              capture_output=True, text=True, timeout=30, env=env).stdout  # fmt: skip

    running = subprocess.Popen(["sleep", "60"], env=dict(env, DDP_JOB_ID=job))
    try:
        time.sleep(0.2)
        assert f"JOBPROC {running.pid} " in scan()
        assert made[job].is_dir()  # the job still runs: its directory is in use
    finally:
        running.kill()
        running.wait()
    assert scan() == ""
    assert not made[job].exists()
    assert (made[f"{job}-b"] / "r0.txt").exists() and theirs.is_dir() and target.is_dir()
    assert sorted(p.name for p in kept_log.iterdir()) == ["agent.log", "notes.txt"]
