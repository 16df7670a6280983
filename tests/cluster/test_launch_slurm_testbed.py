"""`ddp-launch --backend slurm` on the namespace testbed with real Slurm 22.05 (the slurm role converged
by molecule/slurm's prepare and converge playbooks on hosts of this module's own): the packaged trainer on
three nodes through sbatch/srun, status RUNNING then COMPLETED, `ddp-launch stop JOB` (every rank saves,
exit 143; the stop tests on two of the three nodes, `--nodes 2`) and preflight's refusals. The hosts share
/tmp with this machine: the project's venv and the run's directory are the same path on every node (the
run's checkpoints are on "shared storage")."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from ddp_train import checkpoint
from tests.ansible.conftest import REPO_ROOT, tool_env
from tests.cluster.test_launch_sync_testbed import HELPER, SEED_FINAL, SEED_SCRIPT, launch_user_script
from tests.cluster.test_launch_testbed import FINAL, SLOW, Launcher, assert_nothing_left, kill_job
from tests.conftest import private_testbed
from tests.integration.trainrun import parse_finals, run_torchrun
from tests.testbed import Testbed, worker_net, worker_prefix
from tests.usershape import trainer_args

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

LAUNCH = str(Path(sys.executable).parent / "ddp-launch")
PREFIX, NET = worker_prefix("slb"), worker_net("10.213.187")
PCI = f"/tmp/ddp-{PREFIX}-pci"
# MaxTime for preflight's --time refusal; a requeued job waits cred_expire + 1 s before it starts again
# (120 s by default, slurm.conf(5) AuthInfo). No allreduce at the end of the converge: molecule/slurm
# asserts that one (test_molecule_slurm), and test_three_nodes submits through the same backend here.
CONVERGE_VARS = {
    "molecule_pci_root": PCI,
    "slurm_partition_max_time": 60,
    "slurm_extra_config": {"AuthInfo": "cred_expire=10"},
    "slurm_verify_allreduce": False,
}
STOPPED = re.compile(
    r"^\[(node\d) r\d\] ddp-train: stopped rank=(\d+) world=(\d+) step=(\d+) signal=SIGTERM", re.M
)
# The stop tests (stop, scancel, USR1, the time limit) run on two of the three nodes (`--nodes 2`, Slurm
# picks which): a stop reaching every node and each rank saving needs no third; test_three_nodes, the
# synced script and the node-loss tests keep the fan-out to three.
STOP_NODES = 2
R0 = r"\[node\d r0\]"  # rank 0's lines, on whichever node Slurm made the allocation's first


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Testbed, Path]]:
    missing = [
        b for b in ("slurmctld", "slurmd", "srun", "munged") if not shutil.which(b, path="/usr/sbin:/usr/bin")
    ]
    if missing:
        pytest.skip(f"Slurm is not installed here ({', '.join(missing)}): bash .ci/setup --with-testbed")
    root = tmp_path_factory.mktemp("slurm")
    with private_testbed(PREFIX, NET, 3) as tb:
        venv_bin = Path(sys.executable).parent
        env = tool_env(venv_bin, root / "facts", MOLECULE_PROJECT_DIRECTORY=str(REPO_ROOT))
        argv = [
            str(venv_bin / "ansible-playbook"),
            "-i",
            str(tb.inventory),
            "-i",
            "molecule/slurm/inventory",
            "-e",
            yaml.safe_dump(CONVERGE_VARS, default_flow_style=True).strip(),
            "molecule/slurm/prepare.yml",
            "molecule/slurm/converge.yml",
        ]
        t0 = time.monotonic()
        res = subprocess.run(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=1500,
        )
        print(f"slurm converge on {PREFIX}: rc={res.returncode} in {time.monotonic() - t0:.0f}s")
        assert res.returncode == 0, res.stdout[-5000:]
        inv = yaml.safe_load(tb.inventory.read_text())
        inv["all"]["vars"].update(ddp_venv=sys.prefix, ddp_workdir=str(root / "work"))
        inv["all"]["children"]["slurm_controller"] = {"hosts": {"node0": None}}
        (root / "work").mkdir()
        (root / "inventory").mkdir()
        (root / "inventory" / "hosts.yml").write_text(yaml.safe_dump(inv, sort_keys=False))
        try:
            yield tb, root
        finally:
            shutil.rmtree(PCI, ignore_errors=True)
            shutil.rmtree(f"{PCI}-work", ignore_errors=True)


def ddp_launch(args: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str]:
    res = subprocess.run(
        [LAUNCH, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    return res.returncode, res.stdout


def test_three_nodes_through_sbatch_finish_with_identical_params(cluster) -> None:
    tb, root = cluster
    inv = str(root / "inventory")
    code, out = ddp_launch(
        [
            "--backend",
            "slurm",
            "--hosts",
            inv,
            "--job-id",
            "sl-ok",
            "--time",
            "10",
            "--set",
            "train.max_steps=12",
            "--set",
            "run.dir=runs-sl-ok",
        ],
        root,
    )
    assert code == 0, out
    finals = [FINAL.match(ln).groups() for ln in out.splitlines() if FINAL.match(ln)]
    assert sorted((h, r, rank, world, step) for h, r, rank, world, step, _ in finals) == [
        ("node0", "0", "0", "3", "12"),
        ("node1", "1", "1", "3", "12"),
        ("node2", "2", "2", "3", "12"),
    ], out
    assert len({sha for *_, sha in finals}) == 1, "ranks ended with different parameters"
    slurm_id = re.search(r"submitted Slurm job (\d+) on node0", out).group(1)
    states = re.findall(rf"Slurm job {slurm_id}: (\w+)", out)
    assert "RUNNING" in states and states[-1] == "COMPLETED", out
    assert states.index("RUNNING") < states.index("COMPLETED")
    assert f"MASTER_ADDR={tb.hosts()[0].ip}" in out  # node 0's own address in ddp_network_cidr
    # the batch output (the driver's and every node's lines) is the submitter's alone, whatever the umask
    batch_out = root / "work" / f"ddp-slurm-{slurm_id}.out"
    assert stat.S_IMODE(batch_out.stat().st_mode) == 0o600, oct(batch_out.stat().st_mode)
    code, status = ddp_launch(["status", "sl-ok"], root, 120)
    assert code == 0 and f"Slurm job {slurm_id}: COMPLETED" in status and "exit 0" in status, status
    logs = root / "logs" / "sl-ok"
    for i in range(3):
        lines = (logs / f"node{i}.log").read_text().splitlines()
        assert any(f" [node{i} r{i}] ddp-train: final" in ln for ln in lines), lines[-5:]


def test_a_synced_user_script_runs_through_sbatch_with_identical_params(cluster, tmp_path: Path) -> None:
    """--sync with the Slurm backend: the project reaches every node before sbatch (here the nodes share
    ddp_workdir, as /tmp is shared: three copies race into one directory and one wins), the batch script
    starts in the copy, and the README's own script finishes on three nodes."""
    tb, root = cluster
    project = tmp_path / "my project"
    project.mkdir()
    (project / "train.py").write_text(SEED_SCRIPT)
    (project / "mymodel.py").write_text(HELPER)
    inv = str(root / "inventory")

    def args(again: str) -> list[str]:
        job = ["--backend", "slurm", "--hosts", inv, "--job-id", f"sl-sync{again}", "--time", "10"]
        return [*job, "--sync", str(project), "train.py", "--epochs", "2"]

    code, out = launch_user_script(args, root, 3)
    assert code == 0, out
    assert len(re.findall(r"^ddp-launch: sync: node\d: ", out, re.M)) == 3, out
    finals = SEED_FINAL.findall(out)
    assert sorted((h, r, rank, w) for h, r, rank, w, _ in finals) == [
        ("node0", "0", "0", "3"), ("node1", "1", "1", "3"), ("node2", "2", "2", "3"),
    ]  # fmt: skip
    assert len({sha for *_, sha in finals}) == 1, "ranks ended with different parameters"
    copies = list((root / "work" / ".ddp-launch" / "sync").iterdir())
    assert [c for c in copies if ".tmp-" not in c.name] and not [c for c in copies if ".tmp-" in c.name]


def stopped_step(text: str, world: int) -> int:
    """Every rank of a `world`-node job stopped by SIGTERM, each on its own node, all after the same step:
    that step."""
    stops = STOPPED.findall(text)
    assert sorted(int(rank) for _, rank, _, _ in stops) == list(range(world)), text
    assert {w for _, _, w, _ in stops} == {str(world)} and len({h for h, *_ in stops}) == world, text
    assert len({step for *_, step in stops}) == 1, text
    return int(stops[0][3])


def finals_sha(text: str, world: int, step: int) -> str:
    """Every rank of a `world`-node run finished at `step`, each on its own node, with the same
    parameters: their digest."""
    finals = [FINAL.match(ln).groups() for ln in text.splitlines() if FINAL.match(ln)]
    got = sorted((int(rank), int(w), int(s)) for _, _, rank, w, s, _ in finals)
    assert got == [(rank, world, step) for rank in range(world)], text
    assert len({h for h, *_ in finals}) == world, text
    assert len({sha for *_, sha in finals}) == 1, "ranks ended with different parameters"
    return finals[0][-1]


def stopped_cleanly(cluster, job_id: str, run_dir: str, stop: Callable[[str], None]) -> str:
    """A slow job started through sbatch on two nodes, `stop(slurm_id)` once rank 0 steps: the launcher
    exits 143, every node's rank stopped at the same step, no traceback, rank 0 saved a checkpoint. Its
    output."""
    tb, root = cluster
    job = ["--backend", "slurm", "--hosts", str(root / "inventory"), "--job-id", job_id]
    job += ["--nodes", str(STOP_NODES)]
    run = Launcher([*job, "--set", f"run.dir={run_dir}", *SLOW], root)
    try:
        run.wait_for(rf"{R0} .*step \d+/2000", timeout=180)
        stop(re.search(r"submitted Slurm job (\d+)", run.text).group(1))
        assert run.wait(120) == 143, run.text
    finally:
        run.stop()
    stopped_step(run.text, STOP_NODES)
    assert "Traceback" not in run.text
    assert list((root / "work" / run_dir).rglob("*.pt")), "rank 0 saved no checkpoint"
    return run.text


def test_stop_job_saves_on_every_rank_and_exits_143(cluster) -> None:
    def stop(_slurm_id: str) -> None:
        code, out = ddp_launch(["stop", "sl-stop"], cluster[1], 180)
        assert code == 0, out

    text = stopped_cleanly(cluster, "sl-stop", "runs-sl-stop", stop)
    assert "scancel --batch --signal=TERM" in text
    assert re.search(r"Slurm job \d+: FAILED .*exit 143", text), text


def test_a_plain_scancel_in_the_users_shape_saves_ends_143_and_the_same_command_resumes(
    cluster, users_tokens: Path
) -> None:
    """The user's own `scancel JOB` (not `ddp-launch stop`) on the configuration users train with
    (tests/usershape.py: gpt-tiny on prepared tokens, a loader worker per rank, ~5 MB checkpoints,
    replicas), on two nodes: Slurm signals every process of the step at once, the loader workers included,
    and each rank gets SIGTERM from slurmstepd and from torchrun (trainer.StopRequest: DDP_SLURM_STEP).
    Each rank still finishes its step and saves; the job ends CANCELLED, reported as 143, with no traceback
    and no process left; the same command then resumes from that step and finishes."""
    tb, root = cluster
    job = ["--backend", "slurm", "--hosts", str(root / "inventory"), "--job-id", "sl-scancel", "--time", "10"]
    job += ["--nodes", str(STOP_NODES)]
    # The scancel must land before step 30: rank 0's line for step 3-9 reaches this test through srun and
    # the launcher, then scancel goes over SSH, while the ranks go on stepping. A step takes at least
    # step_delay_s, so 0.5 s leaves >= 10 s for that on a loaded machine (0.2 s left 4 s); the ranks sleep
    # through it, so it costs wall, not CPU.
    train = [*trainer_args(users_tokens, steps=30), "--set", "debug.step_delay_s=0.5"]
    command = [*job, *train, "--set", "run.dir=runs-sl-sc"]
    ckpts = root / "work" / "runs-sl-sc" / "gpt-tiny" / "checkpoints"
    run = Launcher(command, root)
    try:
        run.wait_for(rf"{R0} .*INFO step [3-9]/30", timeout=180)
        slurm_id = re.search(r"submitted Slurm job (\d+)", run.text).group(1)
        tb.ssh(tb.hosts()[0], f"scancel {slurm_id}")
        code = run.wait(120)
    finally:
        run.stop()
    assert code == 143, run.text
    assert re.search(rf"Slurm job {slurm_id}: CANCELLED", run.text), run.text
    step = stopped_step(run.text, STOP_NODES)
    assert 3 <= step < 30, run.text
    said = f"Slurm job {slurm_id} stopped after step {step}: every rank finished its step and saved"
    assert said in run.text, run.text
    assert re.search(rf"{R0} .*stopped by SIGTERM after step {step}, checkpoint saved", run.text)
    assert "Traceback" not in run.text and "DataLoader worker" not in run.text, run.text
    assert checkpoint.list_checkpoints(ckpts)[-1][0] == step and not list(ckpts.glob("*.tmp"))
    assert_nothing_left(tb, "sl-scancel")

    again = Launcher(command, root)
    try:
        code = again.wait(300)
    finally:
        again.stop()
    assert code == 0, again.text
    resumed_at = rf"{R0} .*INFO resumed from \S+step-{step:08d}\.pt at step {step}\b"
    assert re.search(resumed_at, again.text), again.text
    finals_sha(again.text, STOP_NODES, 30)
    assert re.findall(r"Slurm job \d+: (\w+)", again.text)[-1] == "COMPLETED", again.text
    assert checkpoint.list_checkpoints(ckpts)[-1][0] == 30
    assert_nothing_left(tb, "sl-scancel")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--partition", "nope"],
            r"preflight failed: partition 'nope' does not exist \(partitions on node0: gpu\)",
        ),
        (["--nodes", "4"], r"preflight failed: --nodes 4: partition gpu has 3 node\(s\)"),
        (
            ["--time", "2-00:00:00"],
            r"preflight failed: --time 2-00:00:00 is over partition gpu's MaxTime 01:00:00",
        ),
    ],
)
def test_preflight_refuses_and_submits_nothing(cluster, args: list[str], line: str) -> None:
    tb, root = cluster
    inv = str(root / "inventory")
    code, out = ddp_launch(["--backend", "slurm", "--hosts", inv, *args], root, 120)
    assert code == 3, out
    assert re.search(line, out), out
    assert "nothing was submitted" in out and "submitted Slurm job" not in out
    queue = tb.ssh(tb.hosts()[0], "squeue --noheader", check=False).stdout
    assert queue.strip() == "", queue


def test_the_in_job_preflight_refuses_a_node_whose_name_resolves_to_loopback(cluster) -> None:
    """Compute nodes may refuse SSH outside a job (pam_slurm_adopt): the node checks run inside the
    allocation as an srun step. node2's own name on 127.0.1.1 (Debian's installer line) stops the job
    before any rank starts, in one line naming node2, exit 3."""
    tb, root = cluster
    node2 = tb.hosts()[2]
    before = tb.exec(node2, "cat /etc/hosts").stdout
    name = tb.exec(node2, "hostname").stdout.strip()
    tb.exec(node2, f"printf '%s\\n' {shlex.quote(f'127.0.1.1 {name}')} | cat - /etc/hosts > /etc/hosts.new")
    tb.exec(node2, "cat /etc/hosts.new > /etc/hosts && rm /etc/hosts.new")
    try:
        inv = str(root / "inventory")
        code, out = ddp_launch(
            ["--backend", "slurm", "--hosts", inv, "--job-id", "sl-pf", "--time", "5"], root
        )
    finally:
        tb.exec(node2, f"printf '%s' {shlex.quote(before)} > /etc/hosts")
    assert code == 3, out
    assert re.search(rf"preflight failed: node2: hostname '{name}' resolves to 127\.0\.1\.1", out), out
    assert not re.search(r"preflight failed: node[01]", out), out
    assert "ddp-train" not in out and "torchrun" not in out, out


def test_usr1_before_the_time_limit_with_requeue_saves_requeues_and_resumes(cluster) -> None:
    """What --signal=B:USR1@lead does before the time limit, sent at once with `scancel --batch
    --signal=USR1` (as the time limit would, up to a minute early: sbatch(1) --signal), on two nodes: every
    rank saves, the job is requeued, resumes from that step and ends with the parameters of an
    uninterrupted run."""
    tb, root = cluster
    inv = str(root / "inventory")
    # The USR1 must land mid-run: it is sent once step 10 (the first log line) is out, and the 90 steps
    # left take at least 18 s (debug.step_delay_s is a floor, not a pace); in the last full runs (three
    # nodes, the loaded 2-core machine) the ranks stopped 2-3 s after the line reached the test, at step 20
    # or 25.
    train = ["--set", "train.max_steps=100", "--set", "debug.step_delay_s=0.2", "--set", "run.dir=runs-sl-rq"]
    job = ["--backend", "slurm", "--hosts", inv, "--job-id", "sl-rq", "--nodes", str(STOP_NODES), "--requeue"]
    run = Launcher([*job, *train], root)
    try:
        run.wait_for(rf"{R0} .*step \d+/100", timeout=180)
        slurm_id = re.search(r"submitted Slurm job (\d+)", run.text).group(1)
        tb.ssh(tb.hosts()[0], f"scancel --batch --signal=USR1 {slurm_id}")
        code = run.wait(400)
    finally:
        run.stop()
    assert code == 0, run.text
    step = stopped_step(run.text, STOP_NODES)
    assert "requeued (1/1)" in run.text, run.text
    assert re.search(rf"resumed from \S+ at step {step}\b", run.text), run.text
    sha = finals_sha(run.text, STOP_NODES, 100)
    assert re.findall(rf"Slurm job {slurm_id}: (\w+)", run.text)[-1] == "COMPLETED", run.text
    # #28: the same parameters as an uninterrupted run: as many ranks of the same trainer under torchrun
    # here (debug.step_delay_s changes no number)
    straight_dir = ["--set", f"run.dir={root / 'runs-sl-rq-straight'}"]
    straight = run_torchrun(train[:2] + straight_dir, root, nproc=STOP_NODES)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert sha == parse_finals(straight.stdout).sha[:16], (sha, straight.stdout[-1000:])


def test_the_real_time_limit_stops_saves_and_the_requeued_job_resumes(cluster, users_tokens: Path) -> None:
    """No signal by hand, on the configuration users train with (tests/usershape.py: a loader worker per
    rank, ~5 MB checkpoints, replicas), on two nodes: `--time 2` with slurm_signal_lead_s=10 renders
    --signal=B:USR1@10, and Slurm itself signals the batch script 10 s before the limit, or up to 60 s
    earlier (sbatch(1) --signal): 50-110 s into the allocation. Every rank saves, the job is requeued and
    resumes from that step; `ddp-launch stop` then ends it (143) after a later step, saved, never killed
    by the limit (TIMEOUT), with no traceback and no process left."""
    tb, root = cluster
    inv = str(root / "inventory")
    job = ["--backend", "slurm", "--hosts", inv, "--job-id", "sl-tl", "--nodes", str(STOP_NODES)]
    limit = ["--time", "2", "--requeue", "-e", "slurm_signal_lead_s=10", "--max-requeues", "1"]
    # Slow steps: fewer of them before the USR1. A rank's stop lands within three step delays (the flag
    # goes out with the next step's all-reduce, is read a step later, and one more delay passes before the
    # save): 3 s here. slurmctld sends the USR1 and ends a job at its limit from the same check, run every
    # PERIODIC_TIMEOUT (30 s; job_time_limit() in Slurm 22.05), so the limit comes 30 s or more after the
    # USR1; the requeue came 5-8 s after it in the last runs (0.5 s delays).
    slow = [*trainer_args(users_tokens, steps=2000), "--set", "debug.step_delay_s=1.0"]
    ckpts = root / "work" / "runs-sl-tl" / "gpt-tiny" / "checkpoints"
    run = Launcher([*job, *limit, *slow, "--set", "run.dir=runs-sl-tl"], root)
    try:
        run.wait_for(r"requeued \(1/1\)", timeout=240)
        run.wait_for(rf"{R0} .*resumed from \S+ at step \d+\b", timeout=180)
        resumed = re.search(rf"{R0} .*resumed from (\S+) at step (\d+)\b", run.text)
        run.wait_for(rf"{R0} .*INFO step {int(resumed.group(2)) + 2}/2000", timeout=120)
        code, out = ddp_launch(["stop", "sl-tl"], root, 180)
        assert code == 0, out
        code = run.wait(180)
    finally:
        run.stop()
    assert code == 143, run.text
    first_stop, requeued = run.text.split("requeued (1/1)", 1)
    assert "ddp-slurm: got SIGUSR1" in first_stop and "got SIGTERM" not in first_stop, run.text
    step = stopped_step(first_stop, STOP_NODES)
    assert re.search(rf"{R0} .*stopped by SIGTERM after step {step}, checkpoint saved", first_stop)
    assert resumed.group(1).endswith(f"step-{step:08d}.pt") and resumed.group(2) == str(step), run.text
    later = stopped_step(requeued, STOP_NODES)
    assert later >= step + 2, run.text
    assert checkpoint.list_checkpoints(ckpts)[-1][0] == later and not list(ckpts.glob("*.tmp"))
    assert "Traceback" not in run.text and "DataLoader worker" not in run.text, run.text
    slurm_id = re.search(r"submitted Slurm job (\d+)", run.text).group(1)
    assert "TIMEOUT" not in re.findall(rf"Slurm job {slurm_id}: (\w+)", run.text), run.text
    assert_nothing_left(tb, "sl-tl")


def test_a_node_whose_slurmd_dies_fails_the_job_fast_and_named(cluster) -> None:
    """node2 crashes mid-job: its slurmd, slurmstepd and the job's processes are SIGKILLed at once (its
    sshd and munged stay, so the test can bring the node back). The job fails in about srun's --wait
    (60 s), naming node2, instead of waiting for slurmctld's SlurmdTimeout (300 s) with the job
    COMPLETING. Last in this module; node2 is resumed at the end."""
    tb, root = cluster
    job = ["--backend", "slurm", "--hosts", str(root / "inventory"), "--job-id", "sl-dead", "--time", "10"]
    run = Launcher([*job, "--set", "run.dir=runs-sl-dead", *SLOW], root)
    try:
        run.wait_for(r"\[node0 r0\] .*step \d+/2000", timeout=180)
        crash_node2(tb)
        t0 = time.monotonic()
        code = run.wait(240)
        took = time.monotonic() - t0
    finally:
        run.stop()
        bring_back_node2(tb, "sl-dead")
    assert code == 1 and took < 120, (took, run.text)
    assert re.search(rf"^ddp-launch: Slurm job \d+ FAILED: {re.escape(NODE2_GONE)}", run.text, re.M), run.text


NODE2_GONE = "node2 did not end with the other nodes (srun gave it 60 s): the node, its slurmd or its"


def test_with_on_node_loss_restart_the_allocation_goes_on_without_a_dead_node(cluster, users_tokens) -> None:
    """#43 part 3, as users train (prepared tokens, a loader worker, replicas, global batch 24 on three
    nodes): node2 crashes after the step-10 checkpoint. sbatch --no-kill keeps the allocation; the driver
    names node2, starts attempt 2 on node0 and node1 as a new step (srun --exclude=node2, preflight
    first), which resumes from the newest checkpoint with the global batch kept and finishes."""
    tb, root = cluster
    job = ["--backend", "slurm", "--hosts", str(root / "inventory"), "--job-id", "sl-heal", "--time", "10",
           "--on-node-loss", "restart", "--max-node-losses", "1"]  # fmt: skip
    train = [*trainer_args(users_tokens, steps=40), "--set", "train.batch_size=8", "--set",
             "debug.step_delay_s=0.3", "--set", "run.dir=runs-sl-heal"]  # fmt: skip
    run = Launcher([*job, *train], root)
    try:
        run.wait_for(r"\[node0 r0\] .*INFO step 12/40", timeout=240)
        crash_node2(tb)
        lost_at = time.monotonic()
        run.wait_for(r"attempt 2 on node0,node1 without node2", timeout=150)
        run.wait_for(r"\[node0 r0\] .*resumed from \S+ at step \d+", timeout=120)
        went_on = time.monotonic() - lost_at
        code = run.wait(300)
    finally:
        run.stop()
        bring_back_node2(tb, "sl-heal")
    assert code == 0, run.text
    text = run.text
    assert NODE2_GONE in text and "(lost 1 of ddp_max_node_losses 1)" in text, text
    before, after = text.split("attempt 2 on node0,node1 without node2", 1)
    last = max(int(s) for s in re.findall(r"\[node0 r0\] .*INFO step (\d+)/40", before))
    resumed = int(re.search(r"\[node0 r0\] .*resumed from \S+ at step (\d+)", after).group(1))
    assert resumed >= 10 and last - resumed <= 10, (last, resumed)  # at most a checkpoint interval lost
    kept = r"\[node0 r0\] .*INFO global batch 24 kept: 8 x 3 rank\(s\) x 1 now 6 x 2 x 2"
    assert re.search(kept, after), after
    finals = [FINAL.match(ln).groups() for ln in after.splitlines() if FINAL.match(ln)]
    assert sorted((h, world, step) for h, _, _, world, step, _ in finals) == [
        ("node0", "2", "40"),
        ("node1", "2", "40"),
    ], after
    assert len({sha for *_, sha in finals}) == 1
    assert went_on < 150, went_on  # srun's --wait (60 s) to name node2, then the new step
    print(f"sl-heal: training went on {went_on:.0f}s after node2's crash; steps lost {last - resumed}")


def crash_node2(tb: Testbed) -> None:
    """node2's slurmd, slurmstepd and the job's processes SIGKILLed at once (its sshd and munged stay, so
    the test can bring the node back)."""
    for pid in [p for p in tb.pids(tb.hosts()[2]) if _comm(p) not in ("sshd", "munged", "")]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def bring_back_node2(tb: Testbed, job_id: str) -> None:
    kill_job(job_id)  # node2's agent directory: its agent was killed with the node
    tb.exec(tb.hosts()[2], "/usr/sbin/slurmd", check=False)
    tb.ssh(tb.hosts()[0], "scontrol update nodename=node2 state=resume", check=False)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_a_login_only_inventory_without_shared_storage_runs_the_trainer_and_a_user_script(
    cluster, tmp_path: Path
) -> None:
    """Issue #48: the cluster as its admins run it. The inventory names only a login host (node2, no
    gpu_nodes: --nodes gives the count, the login host's variables every node's), and ddp_workdir is each
    node's own disk (/srv, which every testbed host overlays; slurm_shared_workdir: false). The trainer
    and a --sync'd user script (inside the batch script, unpacked on every node by the driver's first
    step) run to the end on node0 and node1; the launcher reads their lines through srun on node2."""
    tb, root = cluster
    base = yaml.safe_load((root / "inventory" / "hosts.yml").read_text())["all"]
    login = base["children"]["gpu_nodes"]["hosts"]["node2"]
    workdir = f"/srv/ddp-lo-{os.getpid()}"
    inv = tmp_path / "login-only"
    inv.mkdir()
    variables = {**base["vars"], "ddp_workdir": workdir, "slurm_shared_workdir": False, "slurm_nodes": 2}
    doc = {"all": {"children": {"slurm_login": {"hosts": {"node2": login}}}, "vars": variables}}
    (inv / "hosts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    job = ["--backend", "slurm", "--hosts", str(inv), "--time", "10"]
    t0 = time.monotonic()
    code, out = ddp_launch(
        [*job, "--job-id", "sl-lo", "--set", "train.max_steps=4", "--set", "run.dir=r"], root
    )
    assert code == 0, out
    finals = [FINAL.match(ln).groups() for ln in out.splitlines() if FINAL.match(ln)]
    assert sorted((h, rank, world, step) for h, _, rank, world, step, _ in finals) == [
        ("node0", "0", "2", "4"), ("node1", "1", "2", "4"),
    ], out  # fmt: skip
    assert len({sha for *_, sha in finals}) == 1, "ranks ended with different parameters"
    assert re.search(r"Slurm job \d+: COMPLETED", out) and "ddp-slurm: job" in out, out
    for i in range(2):  # the checkpoints on each node's own disk, nothing on the login host's
        assert tb.exec(tb.hosts()[i], f"test -d {workdir}/r", check=False).returncode == 0
    assert tb.exec(tb.hosts()[2], f"test -e {workdir}/r", check=False).returncode != 0
    assert not Path(workdir).exists()
    print(f"login-only trainer: {time.monotonic() - t0:.0f}s")

    project = tmp_path / "my project"
    project.mkdir()
    (project / "train.py").write_text(SEED_SCRIPT)
    (project / "mymodel.py").write_text(HELPER)

    def args(again: str) -> list[str]:
        return [*job, "--job-id", f"sl-lo-sync{again}", "--sync", str(project), "train.py", "--epochs", "1"]

    code, out = launch_user_script(args, root, 2)
    assert code == 0, out
    assert re.search(r"sync: 2 file\(s\), \d+ bytes inside the batch script", out), out
    finals = SEED_FINAL.findall(out)
    assert sorted((h, rank, w) for h, _, rank, w, _ in finals) == [
        ("node0", "0", "2"),
        ("node1", "1", "2"),
    ], out
    assert len({sha for *_, sha in finals}) == 1, "ranks ended with different parameters"
    print(f"login-only trainer and user script: {time.monotonic() - t0:.0f}s")
