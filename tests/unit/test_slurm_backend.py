"""The Slurm backend without Slurm: times, the sbatch options, the batch script, torchrun's argv on a node,
preflight's lines from scontrol's output, and the inventory's bad input (launch/slurm/)."""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_train.launch.errors import LaunchError
from ddp_train.launch.plan.inventory import load_nodes
from ddp_train.launch.plan.plan import FRESH, Options, build_plan
from ddp_train.launch.slurm import driver, jobctl, protocol, recovery, settings, submit, task

PARTITIONS = (
    "PartitionName=gpu AllowGroups=ALL Default=YES MaxTime=01:00:00 State=UP TotalNodes=3 TotalCPUs=6\n"
    "PartitionName=down AllowGroups=ALL Default=NO MaxTime=UNLIMITED State=DOWN TotalNodes=1\n"
)


class FakeSession:
    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.answers, self.commands, self.stdin = answers, [], []

    def exec(self, command: str, timeout: float = 30, stdin: bytes | None = None) -> tuple[int, str]:
        self.commands.append(command)
        self.stdin.append(stdin)
        return next((v for k, v in self.answers.items() if command.startswith(k)), (1, "no answer"))


def inventory(tmp_path: Path, *, controller: bool = True, extra: str = "") -> str:
    path = tmp_path / "hosts.yml"
    ctrl = "    slurm_controller:\n      hosts:\n        n0: {}\n" if controller else ""
    path.write_text(
        "all:\n  vars:\n    ansible_connection: local\n    ddp_backend: slurm\n" + extra + "  children:\n"
        "    gpu_nodes:\n      hosts:\n        n0: {}\n        n1: {}\n" + ctrl
    )
    return str(path)


def opts(**kw: object) -> argparse.Namespace:
    base = {f"slurm_{f}": None for f in settings.FLAGS}
    base.update(backend=None, slurm_exclusive=False, requeue=False, max_requeues=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("30", 30), ("1:30", 1.5), ("02:00:00", 120), ("1-0", 1440), ("1-02:03", 1563), ("2-00:00:30", 2880.5)],
)
def test_slurm_times_in_minutes(text: str, minutes: float) -> None:
    assert settings.minutes(text) == minutes


def test_unlimited_and_bad_times() -> None:
    assert settings.minutes("UNLIMITED") is None and settings.minutes("INFINITE") is None
    with pytest.raises(ValueError, match="not a Slurm time"):
        settings.minutes("1h")


def test_ddp_backend_slurm_without_a_controller_group_is_one_line_naming_it(tmp_path: Path) -> None:
    inv = inventory(tmp_path, controller=False)
    assert settings.wanted(opts(), [inv], [])
    with pytest.raises(
        LaunchError, match=r"^ddp_backend: slurm needs a slurm_controller \(or slurm_login\) group"
    ):
        settings.load(opts(), [inv], [])


def test_the_cli_refuses_it_with_one_line_and_exit_2(tmp_path: Path) -> None:
    inv = inventory(tmp_path, controller=False)
    res = subprocess.run(
        [sys.executable, "-m", "ddp_train.launch.cli", "--hosts", inv, "--dry-run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "slurm_controller" in res.stderr and "Traceback" not in res.stderr


def test_flags_win_over_inventory_variables(tmp_path: Path) -> None:
    inv = inventory(tmp_path, extra="    slurm_partition: inv\n    slurm_time: '10'\n    slurm_qos: high\n")
    s = settings.load(opts(slurm_partition="flag", requeue=True), [inv], [])
    assert (s.partition, s.time, s.qos, s.submit.name, s.max_requeues) == ("flag", "10", "high", "n0", 1)
    o = s.sbatch_options("job1", 2)
    assert o[:3] == ["--job-name=job1", "--nodes=2", "--ntasks-per-node=1"]
    assert {"--partition=flag", "--qos=high", "--time=10", "--requeue", "--signal=B:USR1@120"} <= set(o)
    with pytest.raises(LaunchError, match="--time / slurm_time"):
        settings.load(opts(slurm_time="soon"), [inv], [])
    with pytest.raises(LaunchError, match="--nodes / slurm_nodes 0"):
        settings.load(opts(slurm_nodes=0), [inv], [])
    # a time limit shorter than the signal's lead and Slurm's up to 60 s: USR1 would come at once
    with pytest.raises(
        LaunchError, match=r"^--time 3: the time limit's USR1 comes slurm_signal_lead_s=120 s"
    ):
        settings.load(opts(slurm_time="3"), [inv], [])
    assert settings.load(opts(slurm_time="4"), [inv], []).time == "4"
    assert settings.load(opts(slurm_time="2"), [inv], ["slurm_signal_lead_s=10"]).time == "2"


def test_the_batch_script_is_python_and_carries_no_value_in_its_options(tmp_path: Path) -> None:
    inv = inventory(tmp_path)
    nodes = load_nodes([inv])
    plan = build_plan(nodes, Options(job_id="sj", env={"HF_TOKEN": "hf_secret_value"}, trainer_args=("--x",)))
    s = settings.load(opts(slurm_time="5"), [inv], [])
    text = submit.batch_script(plan, s)
    lines = text.splitlines()
    assert lines[0] == f"#!{nodes[0].venv}/bin/python"
    assert "#SBATCH --time=5" in lines and "hf_secret_value" not in "\n".join(lines[:-1])
    blob = lines[-1].split('"')[1]
    job = json.loads(base64.b64decode(blob))
    assert job["env"]["HF_TOKEN"] == "hf_secret_value" and job["argv"][-1] == "--x" and job["static"]
    assert "hf_secret_value" not in submit.shown_script(plan, s)


def test_torchrun_argv_on_a_node_takes_the_drivers_address_and_its_rank() -> None:
    template = [
        "/v/bin/torchrun",
        "--nnodes",
        "3",
        "--nproc-per-node",
        "1",
        "--node-rank",
        "0",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29500",
        "-m",
        "ddp_train",
        "--nnodes",
        "9",
    ]
    out = task.torchrun_argv(
        template, rank=2, nnodes=2, addr="10.1.0.5", port=29501, local_addr=None, static=True
    )
    assert out == [
        "/v/bin/torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        "2",
        "--master-addr",
        "10.1.0.5",
        "--master-port",
        "29501",
        "-m",
        "ddp_train",
        "--nnodes",
        "9",
    ]
    c10d = [
        "/v/bin/torchrun",
        "--nnodes",
        "3",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.0.0.1:29500",
        "--rdzv-id",
        "j",
        "--local-addr",
        "10.0.0.2",
        "x.py",
    ]
    out = task.torchrun_argv(
        c10d, rank=1, nnodes=3, addr="10.1.0.5", port=29502, local_addr="10.1.0.7", static=False
    )
    assert out[out.index("--rdzv-endpoint") + 1] == "10.1.0.5:29502"
    assert out[out.index("--local-addr") + 1] == "10.1.0.7" and "--node-rank" not in out


def test_preflight_one_line_per_problem(tmp_path: Path) -> None:
    inv = inventory(tmp_path)
    fake = FakeSession({"scontrol --oneliner show partition": (0, PARTITIONS), "sinfo": (0, "(null)\n")})
    problems = lambda s, n: submit.preflight(fake, s, n)[0]  # noqa: E731
    s = settings.load(opts(), [inv], [])
    assert problems(s, 3) == []
    s = settings.load(opts(slurm_partition="nope"), [inv], [])
    assert problems(s, 2) == ["partition 'nope' does not exist (partitions on n0: gpu, down)"]
    s = settings.load(opts(slurm_nodes=4, slurm_time="2:00:00"), [inv], [])
    assert problems(s, 2) == [
        "--nodes 4: partition gpu has 3 node(s)",
        "--time 2:00:00 is over partition gpu's MaxTime 01:00:00",
    ]
    s = settings.load(opts(slurm_partition="down"), [inv], [])
    assert problems(s, 1) == ["partition down is DOWN (scontrol show partition down)"]
    dead = FakeSession({"scontrol": (1, "slurm_load_partitions: Unable to contact slurm controller")})
    assert submit.preflight(dead, s, 1)[0] == [
        "Slurm is not reachable from n0: scontrol show partition: slurm_load_partitions: Unable to contact "
        "slurm controller"
    ]


@pytest.mark.parametrize(
    ("extra", "flags", "gres", "sbatch", "problem"),
    [
        # the default: one GPU per process, on a partition that has them (issue #48: seen in --dry-run too)
        ("    ddp_nproc_per_node: 4\n", {}, "gpu:8\ngpu:h100:4(S:0-1)\n", "--gpus-per-node=4", None),
        ("    ddp_nproc_per_node: gpu\n", {}, "gpu:a100:4,gpu:v100:2\n", "--gpus-per-node=6", None),
        # a CPU cluster: the default request is dropped, an explicit one refused
        ("    ddp_nproc_per_node: 2\n", {}, "(null)\n", None, None),
        ("", {"slurm_gpus_per_node": 2}, "(null)\n", None,
         "--gpus-per-node / slurm_gpus_per_node 2: partition gpu's nodes have no GPUs (Gres)"),
        ("    ddp_nproc_per_node: gpu\n", {}, "(null)\n", None,
         "ddp_nproc_per_node gpu: partition gpu's nodes have no GPUs (Gres)"),
        ("    ddp_nproc_per_node: 8\n", {}, "gpu:8\ngpu:4\n", None,
         "ddp_nproc_per_node 8: partition gpu's nodes have 4 GPUs (Gres); one process per GPU"),
        ("    ddp_nproc_per_node: 8\n", {"slurm_gpus_per_node": 0}, "gpu:8\n", None, None),
        ("    ddp_nproc_per_node: cpu\n", {}, "gpu:8\n", None, None),
        # a partition of GPU and CPU nodes: the default kept (Slurm then gives the job GPU nodes only)
        ("    ddp_nproc_per_node: 4\n", {}, "(null)\ngpu:h100:8\n", "--gpus-per-node=4", None),
        ("    ddp_nproc_per_node: auto\n", {}, "gpu:4\n(null)\ngpu:8\n", "--gpus-per-node=4", None),
        ("    ddp_nproc_per_node: 8\n", {}, "(null)\ngpu:4\n", None,
         "ddp_nproc_per_node 8: partition gpu's nodes have 4 GPUs (Gres); one process per GPU"),
    ],
)  # fmt: skip
def test_the_gpu_request_defaults_to_one_per_process_and_is_checked_against_gres(
    tmp_path: Path, extra: str, flags: dict, gres: str, sbatch: str | None, problem: str | None
) -> None:
    s = settings.load(opts(**flags), [inventory(tmp_path, extra=extra)], [])
    fake = FakeSession({"scontrol --oneliner show partition": (0, PARTITIONS), "sinfo": (0, gres)})
    notes: list[str] = []
    problems, resolved = submit.preflight(fake, s, 2, notes.append)
    assert problems == ([problem] if problem else [])
    if problem is None:
        asked = [o for o in resolved.sbatch_options("j", 2) if o.startswith("--gpus-per-node")]
        assert asked == ([sbatch] if sbatch else [])
    mixed = "(null)" in gres and "gpu:" in gres and sbatch is not None
    assert notes == (
        [f"partition gpu has nodes with and without GPUs (Gres): the job asks for {sbatch.split('=')[1]} "
         "GPU(s) per node, so Slurm places it on GPU nodes only (--gpus-per-node 0: a CPU job)"]
        if mixed else []
    )  # fmt: skip


def test_dry_run_shows_one_gpu_per_process_without_asking_slurm(tmp_path: Path) -> None:
    s = settings.load(opts(), [inventory(tmp_path, extra="    ddp_nproc_per_node: 8\n")], [])
    assert "--gpus-per-node=8" in s.sbatch_options("j", 2)
    assert "# --gpus-per-node" not in submit.shown_script(
        build_plan(load_nodes([s.sources[0]]), Options(job_id="sj")), s
    )
    with pytest.raises(
        LaunchError, match=r"^--gpus-per-node / slurm_gpus_per_node -1: a non-negative integer$"
    ):
        settings.load(opts(slurm_gpus_per_node=-1), [inventory(tmp_path)], [])


def test_state_from_squeue_then_scontrol_then_sacct() -> None:
    live = FakeSession({"squeue": (0, "RUNNING|None|n[0-1]|n0")})
    assert jobctl.query(live, "7") == jobctl.SlurmState("RUNNING", "None", "n[0-1]", "n0")
    ended = FakeSession(
        {
            "squeue": (0, ""),
            "scontrol": (
                0,
                "JobId=7 JobState=FAILED Reason=NonZeroExitCode NodeList=n[0-1] BatchHost=n0 ExitCode=143:0",
            ),
        }
    )
    s = jobctl.query(ended, "7")
    assert (s.state, s.exit_code, s.ended, jobctl.exit_code(s)) == ("FAILED", 143, True, 143)
    gone = FakeSession(
        {
            "squeue": (1, "Invalid job id"),
            "scontrol": (1, "Invalid job id"),
            "sacct": (0, "COMPLETED|0:0|n[0-1]"),
        }
    )
    s = jobctl.query(gone, "7")
    assert (s.state, jobctl.exit_code(s)) == ("COMPLETED", 0)
    assert jobctl._exit("0:9") == 137


def test_in_a_slurm_step_a_second_sigterm_is_the_same_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain scancel: slurmstepd and torchrun each send the worker SIGTERM; it must still save."""
    import os
    import signal

    from ddp_train.trainer import StopRequest

    monkeypatch.setenv("DDP_SLURM_STEP", "1")
    stop = StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # without DDP_SLURM_STEP this one would kill pytest
        assert stop.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        stop.restore()


class SeqSession(FakeSession):
    """squeue answers one state after another (the last one stays); scancel answers 0."""

    def __init__(self, states: list[str]) -> None:
        super().__init__({"scancel": (0, "")})
        self.states = states

    def exec(self, command: str, timeout: float = 30, stdin: bytes | None = None) -> tuple[int, str]:
        if command.startswith("squeue"):
            self.commands.append(command)
            state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            return 0, f"{state}|None|n0|n0"
        if command.startswith("scontrol"):
            self.commands.append(command)
            return 0, "JobId=7 JobState=CANCELLED Reason=None NodeList=n0 BatchHost=n0 ExitCode=0:15"
        return super().exec(command, timeout, stdin)


def scancels(fake: FakeSession) -> list[str]:
    return [c for c in fake.commands if c.startswith("scancel")]


def stop_job(monkeypatch: pytest.MonkeyPatch, fake: FakeSession) -> int:
    monkeypatch.setattr(jobctl, "_sessions", lambda slurm: (fake, {}))
    monkeypatch.setattr("time.sleep", lambda s: None)
    data = {"job_id": "sj", "state": "lost", "slurm": {"id": "7", "dir": "/x"}}
    return jobctl.command(argparse.Namespace(command="stop"), Path("."), data) or 0


def test_stop_job_cancels_a_pending_job_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = SeqSession(["PENDING", "CANCELLED"])
    assert stop_job(monkeypatch, fake) == 0
    assert scancels(fake) == ["scancel 7"]


def test_stop_job_sends_the_clean_stop_once_more_when_the_pending_job_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = SeqSession(["PENDING", "RUNNING", "RUNNING", "CANCELLED"])
    assert stop_job(monkeypatch, fake) == 0
    assert scancels(fake) == ["scancel 7", "scancel --batch --signal=TERM 7"]


def test_stop_job_gives_up_waiting_after_its_deadline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = SeqSession(["RUNNING"])
    monkeypatch.setattr(jobctl, "STOP_WAIT_S", 0.0)
    assert stop_job(monkeypatch, fake) != 0
    assert scancels(fake) == ["scancel --batch --signal=TERM 7"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "still not ended" in err and "scancel 7" in err


def backend(tmp_path: Path) -> submit.SlurmBackend:
    inv = inventory(tmp_path)
    s = settings.load(opts(), [inv], [])
    cfg = argparse.Namespace(monitor=True, connect_timeout=5, log_dir=str(tmp_path), skip_preflight=False)
    b = submit.SlurmBackend(cfg, None, s)  # type: ignore[arg-type]
    b.slurm_id, b.stop_sent = "7", True
    return b


@pytest.mark.parametrize(
    ("states", "sent"),
    [
        (["PENDING", "PENDING", "CANCELLED"], ["scancel 7"]),
        (["PENDING", "RUNNING", "RUNNING", "CANCELLED"], ["scancel 7", "scancel --batch --signal=TERM 7"]),
        (["RUNNING", "RUNNING", "CANCELLED"], ["scancel --batch --signal=TERM 7"]),
    ],
)
def test_the_launchers_stop_cancels_a_pending_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, states: list[str], sent: list[str]
) -> None:
    inv = inventory(tmp_path)
    plan = build_plan(load_nodes([inv]), Options(job_id="sj"))
    b = backend(tmp_path)
    fake = SeqSession(states)
    notes: list[str] = []
    b.log = argparse.Namespace(note=notes.append, line=lambda *a: None)  # type: ignore[assignment]
    monkeypatch.setattr(b, "_session", lambda: fake)
    monkeypatch.setattr(b.pool, "get", lambda node: fake)
    monkeypatch.setattr(submit.time, "sleep", lambda s: None)
    stopped = "".join(f"ddp-train: stopped rank={r} world=2 step=41 signal=SIGTERM\n" for r in (0, 1))
    ran = "RUNNING" in states  # a job cancelled while pending started no rank
    reads = iter([{}, {"r0-n0.log": (len(stopped), stopped)}] if ran else [])
    monkeypatch.setattr(submit.jobctl, "read_logs", lambda *a: next(reads, {}))
    res = b._follow(plan, lambda state: None)
    assert scancels(fake) == sent
    assert (res.code, res.stopped_cleanly) == (143, True), notes
    said = "Slurm job 7 stopped after step 41: every rank finished its step and saved; the same command"
    assert notes[-1].startswith(said) if ran else said not in " ".join(notes), notes


def test_the_stops_of_a_requeued_attempt_do_not_make_a_later_cancel_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """USR1 stopped and saved every rank, the driver requeued the job; the next attempt is cancelled
    with only rank 0 stopped: not a clean stop, and no 'every rank ... saved' line from the old stops."""
    inv = inventory(tmp_path)
    plan = build_plan(load_nodes([inv]), Options(job_id="sj"))
    b = backend(tmp_path)
    b.stop_sent = False
    fake = SeqSession(["RUNNING", "RUNNING", "RUNNING", "CANCELLED"])
    notes: list[str] = []
    said: list[tuple[str, ...]] = []
    b.log = argparse.Namespace(note=notes.append, line=lambda *a: said.append(a))  # type: ignore[assignment]
    monkeypatch.setattr(b, "_session", lambda: fake)
    monkeypatch.setattr(b.pool, "get", lambda node: fake)
    monkeypatch.setattr(submit.time, "sleep", lambda s: None)
    old = "".join(f"ddp-train: stopped rank={r} world=2 step=41 signal=SIGUSR1\n" for r in (0, 1))
    requeued = "ddp-slurm: job 7: requeued (1/1); it resumes from the newest checkpoint\n"
    new = "ddp-train: stopped rank=0 world=2 step=90 signal=SIGTERM\n"
    # one read: driver.log first (read_logs reads it first), the ranks' stops written before its requeue line
    reads = iter(
        [{"driver.log": (len(requeued), requeued), "r0-n0.log": (len(old), old)}, {"r0-n0.log": (99, new)}]
    )
    monkeypatch.setattr(submit.jobctl, "read_logs", lambda *a: next(reads, {}))
    res = b._follow(plan, lambda state: None)
    assert [(r.rank, r.step) for r in b.stopped] == [(0, 90)]
    assert not res.stopped_cleanly, (res, notes)
    assert not any("every rank finished its step" in n for n in notes), notes
    assert [line[1] for line in said].index("driver") == 2, said  # the ranks' lines are said first


def test_sync_needs_one_workdir_path_on_every_node_and_submits_nothing_otherwise(tmp_path: Path) -> None:
    """One batch script has one --chdir: nodes whose synced copies would lie in different directories
    are refused in one line, before any node is touched."""
    from ddp_train.launch.pipeline import Refused
    from ddp_train.launch.remote.sync import scan

    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "train.py").write_text("print('hi')\n")
    extra = (
        "    ansible_connection: ssh\n  hosts:\n    n0: {ansible_host: 10.0.0.1, ddp_workdir: /w0}\n"
        "    n1: {ansible_host: 10.0.0.2, ddp_workdir: /w1}\n"
    )
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "all:\n  vars:\n    ddp_backend: slurm\n" + extra + "  children:\n"
        "    gpu_nodes:\n      hosts:\n        n0:\n        n1:\n"
        "    slurm_controller:\n      hosts:\n        n0:\n"
    )
    plan = build_plan(load_nodes([str(inv)]), Options(job_id="sj", sync=scan(str(tmp_path / "proj"))))
    b = backend(tmp_path)
    notes: list[str] = []
    b.log = argparse.Namespace(note=notes.append, line=lambda *a: None)  # type: ignore[assignment]
    with pytest.raises(Refused) as refused:
        b.prepare(plan, lambda p: None)
    assert refused.value.code == 2 and len(notes) == 1, notes
    assert "--sync with --backend slurm: the nodes' copies would be in 2 different directories" in notes[0]
    assert (
        "/w0/.ddp-launch/sync/" in notes[0]
        and "same ddp_workdir" in notes[0]
        and "nothing was submitted" in notes[0]
    )


FAKE_SRUN = """#!{python}
# srun --label over N tasks on this machine: task i runs the command with SLURM_NODEID=i and the same
# stdin, as a host of its own name and address; task 1's probe record is changed as `rewrite` says
# (another node's torch), or dropped
import json, os, subprocess, sys
args = sys.argv[1:]
n = int(next(a for a in args if a.startswith("--ntasks=")).split("=")[1])
cmd = args[next(i for i, a in enumerate(args) if not a.startswith("--")):]
data = sys.stdin.buffer.read()
rewrite = json.loads({rewrite!r})
for i in range(n):
    out = subprocess.run(cmd, input=data, capture_output=True, env=dict(os.environ, SLURM_NODEID=str(i)))
    for line in out.stdout.decode().splitlines():
        if line.startswith("DDP-PROBE "):
            if i == 1 and rewrite == "drop":
                continue
            facts = json.loads(line[len("DDP-PROBE "):])
            facts.update(hostname=f"host{{i}}", hostname_ips=[f"10.9.0.{{i + 1}}"])
            facts.update(rewrite if i == 1 and isinstance(rewrite, dict) else {{}})
            line = "DDP-PROBE " + json.dumps(facts)
        print(f"{{i}}: {{line}}")
"""


@pytest.mark.parametrize(
    ("rewrite", "failed"),
    [
        (None, None),
        ({"torch": "2.12.0"}, r"node-b: torch 2\.12\.0 differs from 2\.13\.\S+ on node-a, node-c"),
        ("drop", r"node-b: \S+/bin/python failed: "),
    ],
)
def test_the_in_job_preflight_checks_every_allocated_node_through_srun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rewrite: object, failed: str | None
) -> None:
    """#28: inside the allocation, before training, the SSH preflight's node checks over an srun step's
    probes (here a fake srun running three tasks on this machine)."""
    import re

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable, rewrite=json.dumps(rewrite)))
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    job = {"venv": sys.prefix, "workdir": str(tmp_path), "port": 29500, "argv": ["torchrun"],
           "env": {"DDP_JOB_ID": "pf", "OMP_NUM_THREADS": "1"}, "gpu_health": "strict"}  # fmt: skip
    said: list[str] = []
    ok = driver.preflight(job, ["node-a", "node-b", "node-c"], json.dumps(job) + "\n", said.append)
    text = "\n".join(said)
    assert ok is (failed is None), text
    if failed is None:
        assert said[-1] == "ddp-slurm: preflight ok on 3 nodes (in the allocation)", text
    else:
        assert re.search(rf"^ddp-slurm: preflight failed: {failed}", text, re.M), text
        assert "node-a:" not in text.split("preflight failed:", 1)[1].split("\n")[0], text


def test_the_driver_names_the_tasks_srun_still_saw_running_after_its_wait() -> None:
    # srun 22.05's lines when node2's slurmstepd was killed and the others exited (testbed, #28)
    lines = [
        "srun: error: node0: task 0: Exited with exit code 1",
        "srun: First task exited 60s ago",
        "srun: StepId=5.1 task 2: running",
        "srun: StepId=5.1 tasks 0-1: exited abnormally",
    ]
    assert driver.stragglers(lines) == [2]
    assert driver.stragglers(["srun: StepId=9.0 tasks 1,3-4: running"]) == [1, 3, 4]
    assert driver.stragglers(lines[:2]) == []
    line = "ddp-slurm: job 5: node2 did not end with the other nodes (srun gave it 60 s): the node, ..."
    assert protocol.GONE.match(line) and protocol.DONE.match("ddp-slurm: job 5: done, exit 1")[1] == "1"


def test_a_stop_caught_before_the_training_step_is_sent_to_it_once_attached() -> None:
    said: list[str] = []
    stop = driver._Stop(said.append)
    stop.handle(10, None)  # SIGUSR1 from the batch script's prologue (a time limit's signal came at once)
    assert stop.signum == 10 and said[0].startswith("ddp-slurm: got SIGUSR1: ")
    sent: list[bytes] = []

    class Stdin:
        def write(self, data: bytes) -> None:
            sent.append(data)

        def flush(self) -> None:
            pass

    stop.attach(Stdin())  # type: ignore[arg-type]
    stop._send()  # the handler's thread, had the signal come while attach() ran
    assert sent == [protocol.STOP]


def test_a_done_batch_script_is_reported_while_slurm_still_waits_for_a_lost_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#28: node2's slurmd is gone, so the job stays COMPLETING until slurmctld marks it DOWN (300 s);
    the driver's last line already says how it ended, and names the node."""
    inv = inventory(tmp_path)
    plan = build_plan(load_nodes([inv]), Options(job_id="sd"))
    b = backend(tmp_path)
    b.stop_sent = False
    fake = SeqSession(["RUNNING", "COMPLETING"])
    notes: list[str] = []
    b.log = argparse.Namespace(note=notes.append, line=lambda *a: None)  # type: ignore[assignment]
    driver_log = (
        "ddp-slurm: job 7: srun exited 143\n"
        "ddp-slurm: job 7: node2 did not end with the other nodes (srun gave it 60 s): the node, its slurmd "
        "or its slurmstepd is gone; the other nodes' errors are its consequence\n"
        "ddp-slurm: job 7: done, exit 1\n"
    )
    reads = iter([{}, {"driver.log": (len(driver_log), driver_log)}])
    monkeypatch.setattr(b, "_session", lambda: fake)
    monkeypatch.setattr(b.pool, "get", lambda node: fake)
    monkeypatch.setattr(submit.jobctl, "read_logs", lambda *a: next(reads, {}))
    clock = iter(range(0, 10_000, 4))
    monkeypatch.setattr(submit.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(submit.time, "sleep", lambda s: None)
    res = b._follow(plan, lambda state: None)
    assert res.code == 1 and res.first_failure.startswith("node2 did not end with the other nodes"), notes
    assert (
        "Slurm job 7: the batch script ended (exit 1); Slurm still waits for n0 to confirm (COMPLETING)"
        in notes
    )
    assert notes[-1].startswith("Slurm job 7 FAILED: node2 did not end with the other nodes"), notes
    assert len([c for c in fake.commands if c.startswith("squeue")]) < 10


def test_a_first_start_moves_an_earlier_jobs_logs_of_the_same_id_aside(tmp_path: Path) -> None:
    """Slurm numbered jobs from 1 again (bench C10 on fresh hosts, a shared workdir): the launcher replayed
    the earlier job 1's `step 1/` as the new one's. A requeued start keeps appending to its own."""
    old = tmp_path / ".ddp-launch" / "slurm-1"
    old.mkdir(parents=True)
    (old / "r0-node0.log").write_text("step 1/3 of an earlier job\n")
    aside = driver._fresh_log_dir(old)
    assert aside is not None and (aside / "r0-node0.log").exists() and not old.exists()
    assert aside.name.startswith("slurm-1.before-")
    assert driver._fresh_log_dir(old) is None  # nothing there: nothing to move


@pytest.mark.parametrize(
    ("output", "failure"),
    [
        (
            "slurmstepd-n0: error: execve(): bad interpreter(/opt/ddp-train/venv/bin/python): "
            "No such file or "
            "directory\n",
            "n0 has no /opt/ddp-train/venv/bin/python, the batch script's interpreter: set ddp_venv to the "
            "training venv every node has (playbooks/pytorch.yml installs it)",
        ),
        (
            "Traceback (most recent call last):\nModuleNotFoundError: No module named 'ddp_train'\n",
            "ModuleNotFoundError: No module named 'ddp_train'",
        ),  # fmt: skip
    ],
)
def test_a_job_that_failed_before_its_driver_started_shows_the_batch_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str, failure: str
) -> None:
    """The batch script's interpreter missing on the node: Slurm says only FAILED, exit 2, and no node log
    exists; the batch output file (scontrol's StdOut) says why, and the failure names the fix."""
    inv = inventory(tmp_path)
    plan = build_plan(load_nodes([inv]), Options(job_id="sf"))
    b = backend(tmp_path)
    b.stop_sent = False
    fake = FakeSession(
        {
            "squeue": (0, ""),
            "scontrol": (
                0,
                "JobId=7 JobState=FAILED Reason=NonZeroExitCode NodeList=n0 BatchHost=n0 "
                "ExitCode=2:0 StdOut=/root/ddp-slurm-7.out",
            ),  # fmt: skip
            "tail -n 5 -- /root/ddp-slurm-7.out": (0, output),
        }
    )
    notes: list[str] = []
    lines: list[tuple[str, str, str]] = []
    b.log = argparse.Namespace(note=notes.append, line=lambda *a: lines.append(a))  # type: ignore[assignment]
    monkeypatch.setattr(b, "_session", lambda: fake)
    monkeypatch.setattr(b.pool, "get", lambda node: fake)
    monkeypatch.setattr(submit.jobctl, "read_logs", lambda *a: {})
    res = b._follow(plan, lambda state: None)
    assert (res.code, res.first_failure) == (2, failure), notes
    assert "Slurm job 7 failed before its driver started; /root/ddp-slurm-7.out on n0:" in notes
    assert [text for _, label, text in lines if label == "n0 batch"] == output.strip().splitlines()
    assert notes[-1] == f"Slurm job 7 FAILED: {failure}"


def test_sbatch_runs_with_slurm_umask_0077_and_gives_the_driver_the_submitters_umask(tmp_path: Path) -> None:
    """slurmstepd creates ddp-slurm-<id>.out with SLURM_UMASK (sbatch(1)): 0600 whatever the submitter's
    umask; the submitter's own umask reaches the batch script's environment for the driver (#44)."""
    fake = tmp_path / "sbatch"
    fake.write_text('#!/bin/sh\necho "$SLURM_UMASK $DDP_SUBMIT_UMASK $*"; cat >/dev/null\n')
    fake.chmod(0o755)
    res = subprocess.run(
        ["sh", "-c", f"umask 022; {submit.SBATCH}"], input="#!/bin/python\n", capture_output=True, text=True,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, timeout=30,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0077", "0022", "--parsable"]


def test_the_driver_narrows_its_output_file_and_puts_back_the_submitters_umask(tmp_path: Path) -> None:
    out = tmp_path / "ddp-slurm-9.out"
    out.write_text("")
    out.chmod(0o644)  # an earlier job of the same number, or a Slurm that ignored SLURM_UMASK
    with out.open("a") as f:
        driver.private_output(f.fileno())
    assert out.stat().st_mode & 0o777 == 0o600
    old = os.umask(0o077)
    try:
        driver.restore_umask({"DDP_SUBMIT_UMASK": "0022"})
        assert os.umask(0o077) == 0o022
        driver.restore_umask({})  # sbatch --export=NONE: 0077 stays
        driver.restore_umask({"DDP_SUBMIT_UMASK": "22; rm -rf /"})
        assert os.umask(0o077) == 0o077
    finally:
        os.umask(old)


def test_on_node_loss_restart_maps_onto_no_kill_and_requeue_with_a_resume_argv(tmp_path: Path) -> None:
    """#43 part 3: --no-kill (a failed node leaves the allocation alive), --requeue (the batch host's own
    loss), and the argv of a later attempt: --fresh dropped, the checkpoint's global batch kept."""
    inv = inventory(tmp_path)
    s = settings.load(opts(), [inv], [])
    plain = build_plan(load_nodes([inv]), Options(job_id="sj", overrides=(FRESH,)))
    lines = submit.batch_script(plain, s).splitlines()
    assert "#SBATCH --no-requeue" in lines and "#SBATCH --no-kill" not in lines
    assert json.loads(base64.b64decode(lines[-1].split('"')[1]))["recovery"] is None
    restart = Options(job_id="sj", overrides=(FRESH,), on_node_loss="restart", max_node_losses=1)
    plan = build_plan(load_nodes([inv]), restart)
    lines = submit.batch_script(plan, s).splitlines()
    assert {"#SBATCH --no-kill", "#SBATCH --requeue", "#SBATCH --open-mode=append"} <= set(lines)
    job = json.loads(base64.b64decode(lines[-1].split('"')[1]))
    assert job["recovery"] == {"mode": "restart", "max_losses": 1, "min_nodes": 1}
    assert FRESH in job["argv"] and FRESH not in job["resume_argv"]
    assert job["resume_argv"][-2:] == ["--set", "train.global_batch=auto"]


def test_the_driver_restarts_inside_the_allocation_without_the_nodes_that_went_away(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each lost node: a new step on the others (srun --exclude, --overlap), with the resume argv, until
    ddp_max_node_losses or ddp_min_nodes stop it; a stop or an ordinary failure restarts nothing."""
    steps: list[tuple[list[str], list[str], list[str]]] = []
    outcomes: list[tuple[int, list[str]]] = []

    def run(job, slurm_job, hosts, out_dir, say, stop, restarts, excluded=()):  # type: ignore[no-untyped-def]
        steps.append((list(hosts), list(excluded), job["argv"]))
        return outcomes.pop(0)

    def attempts(job: dict, stop: driver._Stop | None = None) -> int:
        record = recovery.Attempts(tmp_path / "attempts.json", 0)
        return driver._attempts(job, "7", hosts, tmp_path, said.append, stop or driver._Stop(said.append), 0,
                                record)  # fmt: skip

    monkeypatch.setattr(driver, "_run", run)
    said: list[str] = []
    policy = {"mode": "restart", "max_losses": 2, "min_nodes": 2}
    job = {"argv": ["a1"], "resume_argv": ["a2", "train.global_batch=auto"], "recovery": policy}
    hosts = ["n0", "n1", "n2", "n3"]
    outcomes[:] = [(1, ["n2"]), (1, ["n3"]), (0, [])]
    assert attempts(job) == 0
    resumed = ["a2", "train.global_batch=auto"]
    assert steps == [
        (hosts, [], ["a1"]),
        (["n0", "n1", "n3"], ["n2"], resumed),
        (["n0", "n1"], ["n2", "n3"], resumed),
    ]
    assert [protocol.ATTEMPT.match(s)[1] for s in said if protocol.ATTEMPT.match(s)] == ["2", "3"]
    assert said[0] == (
        "ddp-slurm: job 7: attempt 2 on n0,n1,n3 without n2 (lost 1 of ddp_max_node_losses 2): it resumes "
        "from the newest checkpoint, the global batch kept"
    )
    steps.clear(), said.clear()
    outcomes[:] = [(1, ["n2"]), (1, ["n1"])]  # the second loss would leave 2 of 4 nodes
    assert attempts({**job, "recovery": {**policy, "min_nodes": 3}}) == 1
    assert said[-1] == "ddp-slurm: job 7: giving up: 2 node(s) would remain, fewer than ddp_min_nodes 3"
    outcomes[:] = [(1, ["n2", "n3"])]  # two at once, one allowed
    assert attempts({**job, "recovery": {**policy, "max_losses": 1}}) == 1
    assert said[-1] == "ddp-slurm: job 7: giving up: 2 node(s) lost, more than ddp_max_node_losses 1"
    steps.clear()
    outcomes[:] = [(1, ["n2"])]  # ddp_on_node_loss: stop (no "recovery"): the job ends
    assert attempts({"argv": ["a1"]}) == 1
    stopped = driver._Stop(said.append)
    stopped.signum = 15
    outcomes[:] = [(143, ["n2"])]  # a stop under way: never a restart
    assert attempts(job, stopped) == 143 and len(steps) == 2
    assert driver._step(2, ["n2"])[-2:] == ["--exclude=n2", "--overlap"] and "--overlap" not in driver._step(
        3
    )
    # a user script's resume argv has no global batch to keep: the line does not claim it
    said.clear()
    outcomes[:] = [(1, ["n2"]), (0, [])]
    assert attempts({**job, "resume_argv": ["s2"]}) == 0
    assert said[0].endswith("it resumes from the newest checkpoint, its argv as given")


def test_a_requeued_allocation_counts_the_losses_before_it_and_resumes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A driver that never ended was lost with its batch host: Slurm requeued the job (--requeue), and
    the next allocation counts that loss (and the in-allocation ones before it) against
    ddp_max_node_losses, leaves those hosts out should Slurm give one back, and runs the resume argv.
    Its own time-limit requeues are the only ones --max-requeues counts."""
    calls: list[tuple[list[str], list[str], int]] = []
    results: list[tuple[int, list[str]]] = []

    def run(job, slurm_job, hosts, out_dir, say, stop, restarts, excluded=()):  # type: ignore[no-untyped-def]
        calls.append((list(hosts), list(excluded), restarts, job["argv"]))
        return results.pop(0)

    def scontrol(argv, **kw):  # type: ignore[no-untyped-def]
        return subprocess.CompletedProcess(argv, 0, os.environ["SLURM_JOB_NODELIST"].replace(",", " "), "")

    monkeypatch.setattr(driver, "_run", run)
    monkeypatch.setattr(subprocess, "run", scontrol)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the driver's handlers: not this process's
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    policy = {"mode": "restart", "max_losses": 2, "min_nodes": 2}
    job = {"argv": ["a1"], "resume_argv": ["a2"], "recovery": policy, "workdir": str(tmp_path)}
    blob = base64.b64encode(json.dumps(job).encode()).decode()
    out = Path(protocol.log_dir(str(tmp_path), "41"))

    monkeypatch.setenv("SLURM_JOB_NODELIST", "n0,n1,n2,n3")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    # n3 went away; attempt 2 ran, then n0 (the batch host, this driver) died with it: no end written
    results[:] = [(1, ["n3"]), (0, [])]
    with monkeypatch.context() as m:
        m.setattr(recovery.Attempts, "end", lambda self, usr1=False: None)
        driver.main(blob)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1,n2,n3")  # n3 resumed by an admin, n0 down
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    results[:] = [(0, [])]
    assert driver.main(blob) == 0
    assert calls[-1] == (["n1", "n2"], ["n3"], 1, ["a2"])
    text = (out / protocol.DRIVER_LOG).read_text()
    assert "attempt 3 on n1,n2 without n3,n0 (lost 2 of ddp_max_node_losses 2)" in text, text
    state = json.loads((out / recovery.ATTEMPTS_FILE).read_text())
    assert [x["host"] for x in state["lost"]] == ["n3", "n0"] and state["started"] is None
    # one more requeue after another lost batch host: over the budget, nothing runs
    state["started"] = "n1"
    (out / recovery.ATTEMPTS_FILE).write_text(json.dumps(state))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n2,n4")
    n = len(calls)
    assert driver.main(blob) == 1 and len(calls) == n
    assert (
        "giving up: 3 node(s) lost, more than ddp_max_node_losses 2 (n3, n0, n1 lost)"
        in (out / protocol.DRIVER_LOG).read_text()
    )


# ---- issue #48: a login-only inventory, no shared storage ----------------------------------------------


def login_only(tmp_path: Path, extra: str = "") -> str:
    path = tmp_path / "login.yml"
    path.write_text(
        "all:\n  vars:\n    ansible_connection: local\n    ddp_workdir: /scratch/ddp\n"
        + extra
        + "  children:\n"
        "    slurm_login:\n      hosts:\n        login0: {}\n"
    )
    return str(path)


def test_a_login_only_inventory_takes_the_node_count_from_nodes_and_says_so_in_one_line(
    tmp_path: Path,
) -> None:
    inv = login_only(tmp_path)
    with pytest.raises(LaunchError, match=r"no compute nodes, only the slurm_login host login0: .*--nodes N"):
        settings.load(opts(backend="slurm"), [inv], [])
    s = settings.load(opts(backend="slurm", slurm_nodes=4), [inv], [])
    assert (s.login_only, s.nodes, s.submit.name, s.shared_workdir) == (True, 4, "login0", True)
    s = settings.load(opts(backend="slurm"), [login_only(tmp_path, "    slurm_nodes: 3\n")], [])
    assert s.nodes == 3 and s.sbatch_options("j", 1)[1] == "--nodes=3"
    # every node's settings are the login host's: the plan's one node is the template
    plan = build_plan(load_nodes([inv]), Options(job_id="sj"))
    job = json.loads(base64.b64decode(submit.batch_script(plan, s).splitlines()[-1].split('"')[1]))
    assert job["workdir"] == "/scratch/ddp" and job["shared"] and job["logs_in"] == "/scratch/ddp"
    # the existing shape is unchanged: nodes in gpu_nodes, the count from them
    s = settings.load(opts(), [inventory(tmp_path)], [])
    assert (s.login_only, s.nodes, s.shared_workdir) == (False, None, True)


@pytest.mark.parametrize(("value", "shared"), [("false", False), ("no", False), ("true", True)])
def test_slurm_shared_workdir_false_starts_in_tmp_and_keeps_the_logs_in_ddp_workdir(
    tmp_path: Path, value: str, shared: bool
) -> None:
    inv = login_only(tmp_path)
    s = settings.load(opts(backend="slurm", slurm_nodes=2), [inv], [f"slurm_shared_workdir={value}"])
    assert s.shared_workdir is shared
    plan = build_plan(load_nodes([inv]), Options(job_id="sj"))
    lines = submit.batch_script(plan, s).splitlines()
    assert f"#SBATCH --chdir={'/scratch/ddp' if shared else '/tmp'}" in lines
    # not a predictable /tmp/ddp-slurm-<id>.out another user could make theirs first
    assert f"#SBATCH --output={'ddp-slurm-%j.out' if shared else '/dev/null'}" in lines
    job = json.loads(base64.b64decode(lines[-1].split('"')[1]))
    assert (job["shared"], job["logs_in"], job["stage"]) == (shared, "/scratch/ddp", None)
    with pytest.raises(LaunchError, match="slurm_shared_workdir 'maybe': true or false"):
        settings.load(opts(backend="slurm", slurm_nodes=2), [inv], ["slurm_shared_workdir=maybe"])


def test_without_shared_storage_ddp_workdir_must_be_an_absolute_path(tmp_path: Path) -> None:
    path = tmp_path / "h.yml"
    path.write_text("all:\n  vars:\n    ansible_host: 192.0.2.6\n  children:\n"
                    "    slurm_login:\n      hosts:\n        login0: {}\n")  # fmt: skip
    s = settings.load(opts(backend="slurm", slurm_nodes=2), [str(path)], ["slurm_shared_workdir=false"])
    plan = build_plan(load_nodes([str(path)]), Options(job_id="sj"))
    with pytest.raises(LaunchError, match="slurm_shared_workdir: false needs ddp_workdir, an absolute path"):
        submit.batch_script(plan, s)


def test_the_stage_step_unpacks_the_sync_copy_on_a_node_and_keeps_an_intact_one(tmp_path: Path) -> None:
    from ddp_train.launch.remote.sync import scan

    proj = tmp_path / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "train.py").write_text("print('hi')\n")
    (proj / "pkg" / "m.py").write_text("X = 1\n")
    manifest = scan(str(proj))
    work = tmp_path / "node" / "work"
    dest = f"{work}/.ddp-launch/sync/{manifest.name}"
    job = {"logs_in": str(work), "stage": {**submit.stage_archive(manifest), "dir": dest}}

    def run() -> str:
        res = subprocess.run(
            [sys.executable, "-m", "ddp_train.launch.slurm.task", "--stage"],
            input=(json.dumps(job) + "\n").encode(), capture_output=True, check=True,
        )  # fmt: skip
        return res.stdout.decode()

    assert "unpacked" in run()
    assert (Path(dest) / "train.py").read_text() == "print('hi')\n" and (
        Path(dest) / "pkg" / "m.py"
    ).is_file()
    assert "up to date" in run()
    job["stage"] = None  # no --sync: ddp_workdir is created all the same
    work2 = tmp_path / "other"
    job["logs_in"] = str(work2)
    run()
    assert work2.is_dir()


def test_the_driver_stages_through_one_srun_step(tmp_path: Path, monkeypatch) -> None:
    srun = tmp_path / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable, rewrite=json.dumps(None)))
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    said: list[str] = []
    job = {"venv": sys.prefix, "logs_in": str(tmp_path / "w"), "stage": None}
    assert driver.stage(job, ["node-a", "node-b"], said.append)
    assert (tmp_path / "w").is_dir()
    assert not said, said


def test_the_last_line_waits_for_a_launcher_that_reads_through_srun(tmp_path: Path) -> None:
    import threading
    import time

    (tmp_path / protocol.DRIVER_LOG).write_text("ddp-slurm: job 7: done, exit 0\n")
    size = (tmp_path / protocol.DRIVER_LOG).stat().st_size
    ack = tmp_path / protocol.ack_name(protocol.LAUNCHER)
    # a job that failed in seconds: the launcher has not read yet, and its first read comes while it waits
    later = threading.Timer(0.5, lambda: ack.write_text(str(size)))
    later.start()
    t0 = time.monotonic()
    assert driver.wait_read(tmp_path, wait_s=5) and time.monotonic() - t0 >= 0.4
    ack.unlink()
    t0 = time.monotonic()
    assert not driver.wait_read(tmp_path, wait_s=0.3) and time.monotonic() - t0 >= 0.3  # never read
    ack.write_text(str(size - 5))
    assert not driver.wait_read(tmp_path, wait_s=0.3)  # behind, and it does not catch up
    logs = tmp_path / protocol.ack_name("logs-42")
    logs.write_text(str(size))  # `logs -f` has it all: not the launcher, which still follows
    assert not driver.wait_read(tmp_path, wait_s=0.3)
    os.utime(ack, (1, 1))  # the launcher stopped reading (detached): the reader that still follows counts
    assert driver.wait_read(tmp_path, wait_s=5)
    logs.write_text(str(size - 1))
    os.utime(logs, (1, 1))
    t0 = time.monotonic()
    assert not driver.wait_read(tmp_path, wait_s=5) and time.monotonic() - t0 < 1  # nobody follows
    ack.write_text(str(size))
    assert driver.wait_read(tmp_path, wait_s=5)


def test_where_the_drivers_files_are_read() -> None:
    running = jobctl.SlurmState("RUNNING", batch_host="c17")
    assert jobctl.reader("9", running, shared=True, ssh_able=True) == ("batch", [])
    assert jobctl.reader("9", running, shared=True, ssh_able=False) == ("submit", [])
    host, through = jobctl.reader("9", running, shared=False, ssh_able=False)
    assert host == "submit" and through[:5] == [
        "srun",
        "--jobid=9",
        "--overlap",
        "--nodelist=c17",
        "--nodes=1",
    ]
    assert jobctl.reader("9", jobctl.SlurmState("COMPLETED", batch_host="c17"), False, False) is None
    assert jobctl.reader("9", jobctl.SlurmState("PENDING"), True, False) is None


def test_read_logs_through_srun_acknowledges_what_the_launcher_had(tmp_path: Path) -> None:
    (tmp_path / "driver.log").write_text("a\nb\n")
    (tmp_path / "r0-c1.log").write_text("x\n")

    class Local:
        def exec(self, command: str, timeout: float = 30, stdin: bytes | None = None) -> tuple[int, str]:
            res = subprocess.run(command, shell=True, input=stdin, capture_output=True)
            return res.returncode, res.stdout.decode()

    got = jobctl.read_logs(Local(), sys.executable, str(tmp_path), {"driver.log": 2}, through=["env"])
    assert got == {"driver.log": [4, "b\n"], "r0-c1.log": [2, "x\n"]}
    ack = tmp_path / protocol.ack_name(protocol.LAUNCHER)
    assert ack.read_text() == "4"  # what it has now, not what it had before this read
    jobctl.read_logs(Local(), sys.executable, str(tmp_path), {})  # over SSH or on shared storage: no ack
    assert ack.read_text() == "4"
    # a second reader (`logs -f`) acknowledges as itself, never as the launcher
    jobctl.read_logs(Local(), sys.executable, str(tmp_path), {}, through=["env"], reader="logs-9")
    assert (ack.read_text(), (tmp_path / protocol.ack_name("logs-9")).read_text()) == ("4", "4")
    # an offset past the file's end: a new file (the job requeued onto another batch host), from its start
    got = jobctl.read_logs(Local(), sys.executable, str(tmp_path), {"driver.log": 99}, through=["env"])
    assert got["driver.log"] == [4, "a\nb\n"] and ack.read_text() == "4"
    with pytest.raises(ValueError):
        jobctl.read_logs(Local(), sys.executable, str(tmp_path), {}, through=["env"], reader="../x")


# ---- review of #48: no shared storage, GPU request -----------------------------------------------------


def no_shared(tmp_path: Path, extra: str = "", **flags: object) -> tuple[settings.SlurmSettings, str]:
    inv = login_only(tmp_path, extra)
    s = settings.load(opts(backend="slurm", slurm_nodes=2, **flags), [inv], ["slurm_shared_workdir=false"])
    return s, inv


@pytest.mark.parametrize(
    ("extra", "flags", "what"),
    [
        ("", {"requeue": True}, "--requeue / --max-requeues / slurm_requeue"),
        ("", {"max_requeues": 2}, "--requeue / --max-requeues / slurm_requeue"),
        ("    slurm_requeue: true\n", {}, "--requeue / --max-requeues / slurm_requeue"),
        ("    ddp_on_node_loss: restart\n", {}, "ddp_on_node_loss: restart"),
    ],
)
def test_without_shared_storage_requeue_and_restart_are_refused_in_one_line(
    tmp_path: Path, extra: str, flags: dict, what: str
) -> None:
    """attempts.json and the checkpoints are on the old nodes' own disks: a requeue cannot resume."""
    s, inv = no_shared(tmp_path, extra, **flags)
    plan = build_plan(load_nodes([inv]), Options(job_id="sj"))
    with pytest.raises(LaunchError, match=rf"^{re.escape(what)} with slurm_shared_workdir: false: "):
        submit.batch_script(plan, s)
    b = backend(tmp_path)
    b.s = s
    with pytest.raises(LaunchError):  # before the preflight, the archive or sbatch
        b.prepare(plan, lambda p: None)
    shared = settings.load(opts(backend="slurm", slurm_nodes=2, **flags), [inv], [])
    assert "#SBATCH --requeue" in submit.batch_script(plan, shared)


def test_a_requeue_onto_another_batch_host_reads_its_new_files_from_their_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, inv = no_shared(tmp_path)
    plan = build_plan(load_nodes([inv]), Options(job_id="sj"))
    b = backend(tmp_path)
    b.s = s
    b.log = argparse.Namespace(note=lambda *a: None, line=lambda *a: None)  # type: ignore[assignment]
    monkeypatch.setattr(b, "_session", lambda: FakeSession({}))
    seen: list[dict] = []

    def read(session, python, directory, offsets, through):  # noqa: ANN001, ANN202
        seen.append(dict(offsets))
        return {"driver.log": [120, "x\n"]}

    monkeypatch.setattr(submit.jobctl, "read_logs", read)
    offsets: dict[str, int] = {}
    clock = iter(range(0, 10_000, 100))
    monkeypatch.setattr(submit.time, "monotonic", lambda: next(clock))
    for host in ("c1", "c1", "c2"):
        b._copy_logs(jobctl.SlurmState("RUNNING", batch_host=host), {}, plan, offsets)
    assert seen == [{}, {"driver.log": 120}, {}]


def test_reads_through_srun_back_off_while_driver_log_does_not_grow() -> None:
    """Each read through srun is a job step (MaxStepCount): every 3 s while the driver writes, 30 s at
    most while it does not."""
    pace, now, gaps = jobctl.Pace(), 0.0, []
    for grew in (True, False, False, False, False, False, False, True, False):
        while not pace.due(now):
            now += 0.5
        gaps.append(now)
        pace.done(now, grew)
    steps = [b - a for a, b in zip(gaps, gaps[1:])]
    assert steps == [3, 6, 12, 24, 30, 30, 30, 3]
    assert jobctl.grew({"driver.log": [5, "x\n"]}, {}) and not jobctl.grew({"r0-c1.log": [5, "x\n"]}, {})
    assert not jobctl.grew({"driver.log": [5, ""]}, {"driver.log": 5})


def test_gpu_or_auto_needs_gpus_per_node_with_skip_preflight_and_the_dry_run_says_where_it_comes_from(
    tmp_path: Path,
) -> None:
    from ddp_train.launch.pipeline import Refused

    inv = inventory(tmp_path, extra="    ddp_nproc_per_node: gpu\n")
    plan = build_plan(load_nodes([inv]), Options(job_id="sj"))
    s = settings.load(opts(slurm_partition="big"), [inv], [])
    assert "# --gpus-per-node: from partition big's Gres at submit" in submit.shown_script(plan, s)
    b = backend(tmp_path)
    b.s, b.cfg.skip_preflight = s, True
    notes: list[str] = []
    b.log = argparse.Namespace(note=notes.append, line=lambda *a: None)  # type: ignore[assignment]
    with pytest.raises(Refused) as refused:
        b.prepare(plan, lambda p: None)
    assert refused.value.code == 2 and len(notes) == 1 and "give --gpus-per-node N" in notes[0], notes
    b.s = settings.load(opts(slurm_gpus_per_node=2), [inv], [])
    assert "# --gpus-per-node" not in submit.shown_script(plan, b.s)


def test_a_big_sync_dir_is_refused_before_it_is_packed_and_the_script_against_max_script_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddp_train.launch.pipeline import Refused
    from ddp_train.launch.remote.sync import scan

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_bytes(os.urandom(3000))
    manifest = scan(str(proj))
    monkeypatch.setattr(submit, "STAGE_MAX_RAW", 2000)
    with pytest.raises(LaunchError, match=r"--sync .*: 2\.9 KiB in 1 file\(s\); .* at most 2\.0 KiB before"):
        submit.stage_archive(manifest)
    monkeypatch.setattr(submit, "STAGE_MAX_RAW", 1 << 20)
    monkeypatch.setattr(submit, "SCRIPT_MAX_BYTES", 5000)  # the archive is small, the script is not
    s, inv = no_shared(tmp_path)
    plan = build_plan(load_nodes([inv]), Options(job_id="sj", sync=manifest))
    b = backend(tmp_path)
    b.s, b.cfg.skip_preflight = s, True
    fake = FakeSession({})
    monkeypatch.setattr(b, "_session", lambda: fake)
    notes: list[str] = []
    b.log = argparse.Namespace(note=notes.append, line=lambda *a: None)  # type: ignore[assignment]
    with pytest.raises(Refused) as refused:
        b.prepare(plan, lambda p: None)
    assert refused.value.code == 2 and "over Slurm's max_script_size" in notes[-1], notes
    assert not fake.commands  # nothing was submitted


def test_the_stage_step_refuses_a_workdir_of_another_user_or_writable_by_others(tmp_path: Path) -> None:
    """No shared storage: ddp_workdir under a world-writable /scratch could be made by someone else first,
    who could then swap the --sync copy: refused in one line naming the node, no traceback."""
    work = tmp_path / "scratch" / "ddp"
    work.mkdir(parents=True)
    work.chmod(0o777)

    def run(job: dict) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ddp_train.launch.slurm.task", "--stage"],
            input=(json.dumps(job) + "\n").encode(), capture_output=True,
        )  # fmt: skip

    res = run({"logs_in": str(work), "stage": None})
    out = res.stdout.decode()
    host = __import__("socket").gethostname()
    assert res.returncode == 1 and out.count("\n") == 1 and not res.stderr, (out, res.stderr)
    assert out.startswith(f"ddp-slurm: stage: {host}: {work}: writable by group or others"), out
    with pytest.raises(Exception, match="writable by group or others"):
        driver.own_workdir(str(work))
    work.chmod(0o755)
    if os.geteuid() == 0:  # another user's directory
        os.chown(work, 65534, 65534)
        out = run({"logs_in": str(work), "stage": None}).stdout.decode()
        assert "belongs to uid 65534" in out and out.count("\n") == 1, out
        os.chown(work, 0, 0)
    # a broken archive: one line, exit 1, nothing left behind
    bad = {"name": "n", "digest": "d" * 64, "tar": base64.b64encode(b"not a tar").decode()}
    res = run({"logs_in": str(work), "stage": {**bad, "dir": f"{work}/.ddp-launch/sync/n"}})
    out = res.stdout.decode()
    assert res.returncode == 1 and out.count("\n") == 1 and not res.stderr, (out, res.stderr)
    assert out.startswith(f"ddp-slurm: stage: {host}: ReadError"), out
    assert os.listdir(work / ".ddp-launch" / "sync") == []


def test_the_driver_says_the_stage_tasks_own_line_as_is(tmp_path: Path, monkeypatch) -> None:
    srun = tmp_path / "srun"
    srun.write_text(
        "#!/bin/sh\necho '1: ddp-slurm: stage: node-b: /w: writable by group or others'\nexit 1\n"
    )
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    said: list[str] = []
    assert not driver.stage({"venv": sys.prefix, "logs_in": "/w"}, ["node-a", "node-b"], said.append)
    assert said == [
        "ddp-slurm: stage: node-b: /w: writable by group or others",
        "ddp-slurm: stage: the step exited 1",
    ]


def test_without_shared_storage_a_job_that_failed_unread_says_what_to_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its batch output is /dev/null: instead of the batch output's tail, one line naming what to check."""
    s, inv = no_shared(tmp_path)
    plan = build_plan(load_nodes([inv]), Options(job_id="sj"))
    b = backend(tmp_path)
    b.s, b.stop_sent = s, False
    ended = "JobId=7 JobState=FAILED Reason=NonZeroExitCode NodeList=c[1-2] BatchHost=c1 ExitCode=2:0"
    fake = FakeSession({"squeue": (0, ""), "scontrol": (0, ended)})
    notes: list[str] = []
    b.log = argparse.Namespace(note=notes.append, line=lambda *a: None)  # type: ignore[assignment]
    monkeypatch.setattr(b, "_session", lambda: fake)
    res = b._follow(plan, lambda state: None)
    assert res.code == 2 and "tail" not in " ".join(fake.commands), fake.commands
    why = res.first_failure or ""
    assert why.startswith("the job failed before the launcher read a line of its driver"), res
    assert "c1 has ddp_venv" in why and "ddp_workdir /scratch/ddp there is yours" in why
