"""ddp-launch on the namespace testbed: real SSH (host keys checked), real torchrun, real gloo.

Every test drives the installed `ddp-launch` console script as a user would. The hosts share /work
and /tmp with this machine, so the project's own venv (sys.prefix) is each node's ddp_venv.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.trainrun import parse_finals, run_torchrun
from tests.testbed import Host, Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

LAUNCH = str(Path(sys.executable).parent / "ddp-launch")
FINAL = re.compile(
    r"^\[(node\d) r(\d)\] ddp-train: final rank=(\d+) world=(\d+) step=(\d+) .*params_sha256=(\w+)"
)
SLOW = ["--set", "train.max_steps=2000", "--set", "debug.step_delay_s=0.2"]  # minutes unless stopped


class Launcher:
    """`ddp-launch` in the background; its output is collected line by line as it arrives."""

    def __init__(self, args: list[str], cwd: Path, home: Path | None = None, env: dict | None = None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        if home is not None:
            env["HOME"] = str(home)
        self.proc = subprocess.Popen(
            [LAUNCH, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, ln) for ln in list(self.lines)):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.text}")

    def wait(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(10)
        return code

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> None:
        """If a failed test left it running: SIGTERM (it tears its job down), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def started() -> Iterator[list[Launcher]]:
    """Launchers a test started; none outlives its test, whatever the test's outcome."""
    runs: list[Launcher] = []
    yield runs
    for run in runs:
        run.stop()


def launch(args: list[str], cwd: Path, timeout: float = 300, home: Path | None = None) -> tuple[int, str]:
    run = Launcher(args, cwd, home)
    try:
        return run.wait(timeout), run.text
    finally:
        run.stop()


def make_inventory(tb: Testbed, root: Path, *, host_vars: dict | None = None, extra_hosts: dict | None = None,
                   all_vars: dict | None = None) -> Path:  # fmt: skip
    """A YAML inventory directory built on the testbed's own (same SSH vars) plus host_vars files."""
    inv = yaml.safe_load(tb.inventory.read_text())
    inv["all"]["vars"].update(ddp_venv=sys.prefix, ddp_workdir=str(root / "work"), **(all_vars or {}))
    inv["all"]["children"]["gpu_nodes"]["hosts"].update(extra_hosts or {})
    path = root / "inventory"
    (path / "host_vars").mkdir(parents=True, exist_ok=True)
    (root / "work").mkdir(exist_ok=True)
    (path / "hosts.yml").write_text(yaml.safe_dump(inv, sort_keys=False))
    for host, variables in (host_vars or {}).items():
        (path / "host_vars" / f"{host}.yml").write_text(yaml.safe_dump(variables))
    return path


def job_pids(job_id: str) -> list[tuple[int, str]]:
    """Processes anywhere on this machine (every testbed host shares its PID space) tagged with the job."""
    needle = f"DDP_JOB_ID={job_id}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                found.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:
            continue
    return found


def kill_job(job_id: str) -> None:
    """Test cleanup: SIGKILL every process tagged with the job, by PID (never the thing tested), and
    remove the job's agent directories (/tmp/ddp-agent-<job>-*: the testbed hosts share this machine's
    /tmp, and a node killed whole never removes its own)."""
    for pid, _ in job_pids(job_id):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for leftover in Path("/tmp").glob(f"ddp-agent-{job_id}-*/"):
        shutil.rmtree(leftover, ignore_errors=True)


def host_job_pids(tb: Testbed, host: Host, job_id: str) -> list[int]:
    tagged = {pid for pid, _ in job_pids(job_id)}
    return [pid for pid in tb.pids(host) if pid in tagged]


def assert_nothing_left(tb: Testbed, job_id: str) -> None:
    deadline = time.monotonic() + 5  # zombies being reaped by now-dead parents
    while job_pids(job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    for h in tb.hosts():
        assert host_job_pids(tb, h, job_id) == [], f"job processes left in {h.netns}"
    assert job_pids(job_id) == []


def workers(tb: Testbed, host: Host, job_id: str) -> list[int]:
    """The trainer worker processes (not the torchrun agent) of the job on one host."""
    pids = []
    for pid in host_job_pids(tb, host, job_id):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ddp_train" in cmd and not any(part.endswith(b"torchrun") for part in cmd):
            pids.append(pid)
    return pids


def test_three_hosts_run_to_the_end_with_identical_params(testbed: Testbed, tmp_path: Path) -> None:
    tb = testbed
    probe = tmp_path / "site"
    probe.mkdir()
    # Records, in every python process of the job, the env value as the process received it.
    (probe / "sitecustomize.py").write_text(
        "import os, socket\n"
        "if 'HOSTILE' in os.environ and 'LOCAL_RANK' in os.environ:\n"
        f"    open(os.path.join({str(probe)!r}, socket.gethostname() + '-' + str(os.getpid())), 'w')"
        ".write(os.environ['HOSTILE'])\n"
    )
    pwn = tmp_path / "pwned"
    hostile = f"$(touch {pwn}) `touch {pwn}`; touch {pwn} 'single' \"double\"  two  spaces"
    secret = "hf_Zq81_secret_value"
    env = {"PYTHONPATH": str(probe), "HOSTILE": hostile, "HF_TOKEN": secret}
    inv = make_inventory(tb, tmp_path, all_vars={"ddp_env": env})
    config = tmp_path / "train.yaml"
    config.write_text("train:\n  max_steps: 12\nrun:\n  dir: runs-test\n")

    code, out = launch(["doctor", "--hosts", str(inv)], tmp_path)
    assert code == 0, out
    assert re.search(r"^node2\s+2\s+root@[\d.]+:22\s+3\.\d+\.\d+\s+\S+.*\sok$", out, re.M), out

    code, out = launch(["--hosts", str(inv), "--job-id", "lt-ok", "--config", str(config)], tmp_path)
    assert code == 0, out
    finals = [FINAL.match(ln).groups() for ln in out.splitlines() if FINAL.match(ln)]
    assert sorted((h, r, rank, world, step) for h, r, rank, world, step, _ in finals) == [
        ("node0", "0", "0", "3", "12"), ("node1", "1", "1", "3", "12"), ("node2", "2", "2", "3", "12"),
    ]  # fmt: skip
    assert len({sha for *_, sha in finals}) == 1, "ranks ended with different parameters"
    logs = tmp_path / "logs" / "lt-ok"
    for i in range(3):
        lines = (logs / f"node{i}.log").read_text().splitlines()
        assert lines and all(f" [node{i} r{i}] " in ln for ln in lines)
        assert any("ddp-train: final" in ln for ln in lines)
    assert "no process of job lt-ok remains" in out
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["master"]["addr"] == tb.hosts()[0].ip
    assert [(n["host"], n["rank"], n["status"]) for n in summary["nodes"]] == [
        ("node0", 0, "ok"), ("node1", 1, "ok"), ("node2", 2, "ok"),
    ]  # fmt: skip
    assert (logs / "train.yaml").read_text() == config.read_text()  # the config that ran, kept with the logs
    assert_nothing_left(tb, "lt-ok")
    # the env value crossed SSH, env and torchrun unchanged and ran nothing
    seen = {p.name.split("-")[0]: p.read_text() for p in probe.iterdir() if p.name.startswith("node")}
    assert seen == {f"node{i}": hostile for i in range(3)}
    assert not pwn.exists()
    # the secret is masked on the console and in every log file
    assert secret not in out and '"HF_TOKEN": "***"' in (logs / "launcher.log").read_text()  # env: stdin
    assert all(secret.encode() not in f.read_bytes() for f in logs.iterdir())  # metrics.png is binary


def test_ini_inventory_with_host_vars_and_a_non_default_ssh_port(testbed: Testbed, tmp_path: Path) -> None:
    tb = testbed
    host = tb.hosts()[2]
    state = tb.state_dir / "hosts" / host.name
    conf = tmp_path / "sshd_2222"
    conf.write_text(
        (state / "sshd_config").read_text().replace("Port 22\n", "Port 2222\n")
        .replace(f"PidFile {state}/sshd.pid", f"PidFile {tmp_path}/sshd_2222.pid")
    )  # fmt: skip
    tb.exec(host, f"/usr/sbin/sshd -f {conf} -E {tmp_path}/sshd_2222.log")
    try:
        known = tmp_path / "known_hosts_2222"
        key = " ".join((state / "ssh_host_ed25519_key.pub").read_text().split()[:2])
        known.write_text(f"[{host.ip}]:2222 {key}\n")
        inv = tmp_path / "ini"
        (inv / "host_vars").mkdir(parents=True)
        (tmp_path / "work").mkdir()
        lines = ["[gpu_nodes]"] + [f"{h.name} ansible_host={h.ip}" for h in tb.hosts()]
        lines += [
            "", "[gpu_nodes:vars]", "ansible_user=root", f"ansible_ssh_private_key_file={tb.key_file}",
            f"ansible_ssh_common_args='-o UserKnownHostsFile={tb.known_hosts} -o StrictHostKeyChecking=yes'",
            f"ddp_venv={sys.prefix}", f"ddp_workdir={tmp_path / 'work'}",
        ]  # fmt: skip
        (inv / "hosts").write_text("\n".join(lines) + "\n")
        (inv / "host_vars" / f"{host.name}.yml").write_text(
            yaml.safe_dump({"ansible_port": 2222, "ddp_known_hosts_file": str(known)})
        )
        code, out = launch(
            ["--hosts", str(inv), "--job-id", "lt-ini", "--set", "train.max_steps=6"], tmp_path
        )
        assert code == 0, out
        assert len({m.group(6) for m in map(FINAL.match, out.splitlines()) if m}) == 1
        assert len([ln for ln in out.splitlines() if FINAL.match(ln)]) == 3
        assert "Accepted publickey for root" in (tmp_path / "sshd_2222.log").read_text()
        assert_nothing_left(tb, "lt-ini")
    finally:
        os.kill(int((tmp_path / "sshd_2222.pid").read_text()), signal.SIGTERM)


def test_killing_the_trainer_on_one_host_stops_every_host(testbed: Testbed, tmp_path: Path, started) -> None:
    tb = testbed
    inv = make_inventory(tb, tmp_path)
    run = Launcher(["--hosts", str(inv), "--job-id", "lt-kill", *SLOW], tmp_path)
    started.append(run)
    run.wait_for(r"\[node0 r0\] .*step \d+/2000", timeout=120)
    node1 = tb.hosts()[1]
    victims = workers(tb, node1, "lt-kill")
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    t0 = time.monotonic()
    code = run.wait(timeout=60)
    elapsed = time.monotonic() - t0
    assert code != 0 and elapsed < 30, (code, elapsed, run.text)
    assert re.search(r"FAILED \(first failure: node1 \(rank 1\)", run.text), run.text
    assert re.search(r"^node1\s+1\s+exit \d+\s+.*Signal 9 \(SIGKILL\)", run.text, re.M), run.text
    assert "no process of job lt-kill remains" in run.text
    assert_nothing_left(tb, "lt-kill")


def test_sigint_to_the_launcher_stops_every_host(testbed: Testbed, tmp_path: Path, started) -> None:
    tb = testbed
    inv = make_inventory(tb, tmp_path)
    run = Launcher(["--hosts", str(inv), "--job-id", "lt-int", *SLOW], tmp_path)
    started.append(run)
    run.wait_for(r"\[node0 r0\] .*step \d+/2000", timeout=120)
    assert all(workers(tb, h, "lt-int") for h in tb.hosts())
    run.proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    code = run.wait(timeout=60)
    assert code == 130 and time.monotonic() - t0 < 30, (code, run.text)
    assert "received SIGINT: every node finishes its step and saves (SIGINT to torchrun)" in run.text
    stops = re.findall(
        r"^ddp-launch: (node\d) r\d: exit 130: rank \d stopped after step (\d+)", run.text, re.M
    )
    assert sorted(h for h, _ in stops) == ["node0", "node1", "node2"], run.text
    assert len({step for _, step in stops}) == 1, run.text
    assert "Traceback" not in run.text
    assert "no process of job lt-int remains" in run.text
    assert_nothing_left(tb, "lt-int")


def test_after_ctrl_c_a_restart_with_another_rank_0_resumes_from_the_checkpoint_on_the_old_one(
    testbed: Testbed, tmp_path: Path, started
) -> None:
    """Each node has its own checkpoint.dir (no shared disk). Rank 0 (node0) saves at Ctrl-C; the next
    launch makes node1 rank 0, which has no checkpoint: the newest one is found on node0, broadcast,
    and the run ends bit-identical to an uninterrupted one."""
    tb = testbed
    work = {h: tmp_path / f"work-{h}" for h in ("node0", "node1")}
    for d in work.values():
        d.mkdir()
    inv = make_inventory(tb, tmp_path, host_vars={h: {"ddp_workdir": str(d)} for h, d in work.items()})
    train = ["--set", "train.max_steps=30", "--set", "train.decay_steps=30", "--set", "checkpoint.replicas=0",
             "--set", "checkpoint.interval_steps=0", "--set", "log.interval_steps=1"]  # fmt: skip
    base = ["--hosts", str(inv), "--limit", "node0,node1", *train]
    run = Launcher([*base, "--job-id", "lt-mv1", "--set", "debug.step_delay_s=0.4"], tmp_path)
    started.append(run)
    run.wait_for(r"\[node0 r0\] .*INFO step 8/30 ", timeout=120)
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(timeout=60) == 130, run.text
    step = int(re.search(r"job lt-mv1 stopped \(received SIGINT\) after step (\d+)", run.text).group(1))
    saved = work["node0"] / "runs" / "default" / "checkpoints" / f"step-{step:08d}.pt"
    # node1 holds no checkpoint (every rank creates the run dir for its flight-recorder dumps: issue 31)
    assert saved.is_file() and not list(work["node1"].rglob("*.pt")), run.text

    code, out = launch([*base, "--job-id", "lt-mv2", "-e", "ddp_master=node1"], tmp_path)
    assert code == 0, out
    assert re.search(rf"^\[node1 r0\] .*INFO resumed from {re.escape(str(saved))} at step {step} of job "
                     r"lt-mv1, saved .* ago \(on node0, rank 1\)$", out, re.M), out  # fmt: skip
    finals = [m.groups() for m in map(FINAL.match, out.splitlines()) if m]
    assert sorted(f[:5] for f in finals) == [
        ("node0", "1", "1", "2", "30"),
        ("node1", "0", "0", "2", "30"),
    ], out
    straight = run_torchrun([*train, "--set", f"run.dir={tmp_path / 'straight'}"], cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert {f[5] for f in finals} == {parse_finals(straight.stdout).sha}, "differs from a straight run"
    assert_nothing_left(tb, "lt-mv2")


def test_max_restarts_restarts_every_node_and_the_trainer_resumes(
    testbed: Testbed, tmp_path: Path, started
) -> None:
    tb = testbed
    inv = make_inventory(tb, tmp_path)
    args = [
        "--set",
        "train.max_steps=40",
        "--set",
        "debug.step_delay_s=0.2",
        "--set",
        "checkpoint.interval_steps=10",
    ]
    run = Launcher(["--hosts", str(inv), "--job-id", "lt-rs", "--max-restarts", "1", *args], tmp_path)
    started.append(run)
    run.wait_for(r"\[node0 r0\] .*saved .*step-00000010", timeout=120)
    os.kill(workers(tb, tb.hosts()[1], "lt-rs")[0], signal.SIGKILL)
    code = run.wait(timeout=240)
    assert code == 0, run.text
    assert re.search(r"resumed from .*step-000000[1-4]0\.pt", run.text), run.text
    finals = [m.groups() for m in map(FINAL.match, run.lines) if m]
    assert sorted(f[:5] for f in finals) == [
        ("node0", "0", "0", "3", "40"), ("node1", "1", "1", "3", "40"), ("node2", "2", "2", "3", "40"),
    ]  # fmt: skip
    assert len({f[5] for f in finals}) == 1
    assert_nothing_left(tb, "lt-rs")


def test_preflight_reports_blocked_master_port_and_torch_mismatch_before_launch(
    testbed: Testbed, tmp_path: Path
) -> None:
    tb = testbed
    fake = tmp_path / "fake-torch"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.12.0+other'\n")
    inv = make_inventory(tb, tmp_path, host_vars={"node2": {"ddp_env": {"PYTHONPATH": str(fake)}}})
    node1 = tb.hosts()[1]
    chain = "'{ type filter hook output priority 0; }'"
    tb.exec(node1, f"nft add table inet lxtest && nft add chain inet lxtest out {chain} && "
                   "nft add rule inet lxtest out tcp dport 29500 drop")  # fmt: skip
    try:
        code, out = launch(["--hosts", str(inv), "--job-id", "lt-pre", "--net-timeout", "2"], tmp_path)
    finally:
        tb.exec(node1, "nft delete table inet lxtest")
    assert code == 3, out
    assert re.search(
        r"FAIL node1: cannot reach the master node0 at [\d.]+:29500 \(MASTER_PORT\): timed out", out
    )
    assert (
        "FAIL node2: torch 2.12.0+other differs from 2.13.0" in out or "FAIL node2: torch 2.12.0+other" in out
    )
    assert "nothing was started" in out
    assert not re.search(r"^\[node\d r\d\]", out, re.M)  # no node printed anything: nothing ran
    assert not (tmp_path / "logs" / "lt-pre" / "node0.log").exists()
    assert job_pids("lt-pre") == []


def test_doctor_names_unreachable_host_unknown_host_key_and_loopback_hostname(
    testbed: Testbed, tmp_path: Path
) -> None:
    tb = testbed
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    node1, node2 = tb.hosts()[1:3]
    inv = make_inventory(
        tb, tmp_path,
        extra_hosts={"ghost": {"ansible_host": f"{tb.net}.99"}},
        host_vars={"node1": {"ansible_ssh_common_args": f"-o UserKnownHostsFile={empty}"}},
    )  # fmt: skip
    original = tb.exec(node2, "cat /etc/hosts").stdout
    tb.exec(
        node2,
        "printf '127.0.1.1\\tnode2\\n%s' \"$(cat /etc/hosts)\" > /etc/hosts.new && "
        "mv /etc/hosts.new /etc/hosts",
    )
    try:
        home = tmp_path / "home"  # no ~/.ssh/known_hosts: only the inventory's files count
        home.mkdir()
        code, out = launch(["doctor", "--hosts", str(inv), "--connect-timeout", "3"], tmp_path, home=home)
    finally:
        tb.exec(node2, f"cat > /etc/hosts <<'EOF'\n{original}EOF")
    assert code == 3, out
    assert re.search(
        r"FAIL ghost: ssh: (connection timed out after 3s|cannot connect to port 22: no route to host)", out
    ), out
    assert re.search(
        rf"FAIL node1: ssh: host key unknown: {node1.ip} is not in .*; verify the host's key out of band, "
        rf"then: ssh-keyscan -H {node1.ip} >> ~/.ssh/known_hosts", out,
    ), out  # fmt: skip
    assert "FAIL node2: hostname 'node2' resolves to 127.0.1.1" in out, out
    assert re.search(r"^node0\s+0\s+.*\sok$", out, re.M), out
