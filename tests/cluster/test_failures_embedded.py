"""#32 on the embedded cluster (inventory/local): a failed job's console names the cause in one line
with its path; the other rank's consequence is 'stopped: ...', its traceback in the host log only."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from ddp_train import checkpoint
from tests import usershape
from tests.cluster.test_launch_embedded import LAUNCH, start
from tests.cluster.test_launch_testbed import job_pids
from tests.integration.test_failures_disk import tmpfs

pytestmark = pytest.mark.slow

TABLE_ROW = re.compile(r"^(local\d)\s+(\d)\s+(exit \d+.*?)\s{2,}(.*)$", re.M)


def rows(out: str) -> dict[str, str]:
    return {m[1]: m[4] for m in TABLE_ROW.finditer(out)}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")
def test_disk_full_run_dir_is_one_line_with_its_path_and_a_short_console(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "full", "size=1m") as full:
        args = ["--set", f"run.dir={full}", "--set", "train.max_steps=200"]
        proc = start(["--job-id", "fe-full", *args], tmp_path)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 1, out
        lines = out.splitlines()
        errors = [ln for ln in lines if re.match(r"\[local0 r0\] ddp-train: error: ", ln)]
        assert len(errors) == 1, out
        assert f" free of 1.0 MiB on {full}; checkpoint step " in errors[0] and "(ENOSPC)" in errors[0], out
        kept = Path(re.search(r"checkpoint step \d+ is intact \((\S+)\)", errors[0])[1])
        assert checkpoint.load(kept)  # the previous checkpoint is intact
        assert rows(out)["local1"] == "stopped: node 0 failed (local0)", out
        assert "Traceback" not in out and "frame #" not in out, out
        # the cause, the consequences and the summary: the trainer's progress lines aside, under 20 lines
        assert len([ln for ln in lines if " INFO " not in ln]) <= 20, out
        subprocess.run(["mount", "-o", "remount,size=64m", str(full)], check=True)
        again = start(["--job-id", "fe-full2", *args], tmp_path)
        out2, _ = again.communicate(timeout=300)
        assert again.returncode == 0, out2
        assert f"resumed from {kept}" in out2, out2


def test_stall_first_error_of_the_other_rank_is_the_watchdog_not_a_traceback(
    tmp_path: Path, users_tokens: Path
) -> None:
    """In the configuration users train with (tests/usershape.py: prepared tokens, a loader worker per
    rank, ~5 MB checkpoints, replicas): rank 1 blocks after step 20; the watchdog ends the job, the
    step-20 checkpoint is kept, the same command resumes from it, no process is left (#42)."""
    train = [*usershape.trainer_args(users_tokens), "--set", f"run.dir={tmp_path / 'runs'}"]
    args = ["--job-id", "fe-stall", "--env", "DDP_DEBUG_STALL=1:20", "--stall-timeout", "15"]
    proc = start([*args, *train], tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 4, out
    ckpts = tmp_path / "runs" / "gpt-tiny" / "checkpoints"
    assert checkpoint.list_checkpoints(ckpts)[-1][0] == 20, out
    assert job_pids("fe-stall") == []
    table = rows(out)
    assert table["local0"] == "stopped by the stall watchdog", out
    assert table["local1"].startswith("stalled"), out
    assert "Traceback" not in out, out
    host_log = (tmp_path / "logs" / "fe-stall" / "local0.log").read_text()
    # Rank 0, blocked in a collective with the stalled rank, is a victim of the teardown's TERM (its whole
    # process group, then torchrun's forward): either its collective fails first and its "stopped:" line
    # follows its traceback, kept in the host log only, or one TERM runs its handler and the next ends it
    # before it prints anything (seen once, ci43c). The routing alone: tests/unit/test_launch_failures.py.
    # The console's hint to that traceback exists only in the first case: with no traceback there is
    # nothing kept off the console to point at (the second case failed the full run of stop 53 here).
    if "ddp-train: stopped: " in host_log:
        assert "Traceback (most recent call last)" in host_log, host_log
        assert "ddp-launch logs fe-stall --node local0" in out, out
    else:
        assert "Traceback" not in host_log and "ddp-launch logs fe-stall --node local0" not in out, host_log

    again = start(["--job-id", "fe-stall2", *train], tmp_path)
    out2, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out2
    assert re.search(r"\[local0 r0\] .*INFO resumed from \S+step-00000020\.pt at step 20", out2), out2
    assert job_pids("fe-stall2") == []


def test_with_on_node_loss_restart_a_stalled_node_is_left_out_and_the_job_finishes_without_it(
    tmp_path: Path, users_tokens: Path
) -> None:
    """ddp_on_node_loss: restart, as users train (tests/usershape.py), nobody touching anything: local1's
    rank blocks after step 20, the watchdog names it, and the launcher restarts the job by itself on local0
    alone as attempt 2 of the same job: it resumes from step 20 (--fresh was for attempt 1) with the same
    global batch (16 x 2 ranks x 1 now 16 x 1 x 2) and finishes; job.json and `status` show both attempts
    and the lost node."""
    train = [*usershape.trainer_args(users_tokens), "--set", f"run.dir={tmp_path / 'runs'}"]
    args = ["--job-id", "fe-heal", "--env", "DDP_DEBUG_STALL=1:20", "--stall-timeout", "15",
            "--on-node-loss", "restart", "--max-node-losses", "1", "--fresh"]  # fmt: skip
    proc = start([*args, *train], tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    restarting = (
        r"local1 lost \(stalled: the stall watchdog named it\); excluded; restarting on 1 node\(s\) as "
        r"attempt 2 of the job \(1 of ddp_max_node_losses 1 used\)"
    )
    assert re.search(restarting, out), out
    r0 = r"\[local0 r0\] .*INFO "
    assert re.search(r0 + r"resumed from \S+step-00000020\.pt at step 20 of job fe-heal", out), out
    assert re.search(r0 + r"global batch 32 kept: 16 x 2 rank\(s\) x 1 now 16 x 1 x 2", out), out
    assert re.findall(r"^\[(local\d) r0\] ddp-train: final rank=0 world=1 step=(\d+) ", out, re.M) == [
        ("local0", "30")
    ], out
    assert job_pids("fe-heal") == []
    data = json.loads((tmp_path / "logs" / "fe-heal" / "job.json").read_text())
    assert (data["state"], data["exit_code"], data["attempt"]) == ("finished", 0, 2), data
    assert [a["nodes"] for a in data["attempts"]] == [["local0", "local1"], ["local0"]], data
    assert [(a["resumed_step"], a["last_step"]) for a in data["attempts"]] == [(None, 20), (20, 30)], data
    assert [(x["host"], x["attempt"]) for x in data["lost"]] == [("local1", 1)], data
    status = subprocess.run([LAUNCH, "status", "fe-heal"], cwd=tmp_path, capture_output=True, text=True)
    attempt2 = r"^attempt 2: 1 nodes \(local0\), master local0, steps 20-30, exit 0"
    assert re.search(attempt2, status.stdout, re.M), status.stdout
    lost = r"^lost local1 at .* \(attempt 1\): stalled: .*; steps lost: 0; training went on \d+s later"
    assert re.search(lost, status.stdout, re.M), status.stdout
    print(status.stdout)
