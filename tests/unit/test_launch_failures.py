"""#32: a failed job's console shows the cause and keeps the consequences' tracebacks in the host logs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import ddp_train.trainer as trainer
from ddp_train import agent
from ddp_train.exitcodes import NODE_FAILED, STALLED
from ddp_train.launch.plan.plan import Options, build_plan
from ddp_train.launch.run.job import Job
from ddp_train.launch.run.logs import JobLog, first_error
from ddp_train.launch.run.report import Ending, summarize
from tests.unit.test_launch_plan import node

# what rank 0 printed in the stall case of #32 (the trainer's traceback indented), then rank 1's
# c10d warning with its C++ frames as the disk-full case showed them
STALL_RANK0 = """\
[rank0]:[W1203 21:43:44.5 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=4)
Exception raised from recvBytes at /__w/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7fdc35d79b8d in libc10.so)
frame #1: c10::DistError::DistError(c10::SourceLocation, std::string) + 0x72 (0x7fdc35d7ab62 in libc10.so)
<omitting python frames>
frame #23: __libc_start_main + 0x85 (0x7fdc37245305 in /lib/x86_64-linux-gnu/libc.so.6)

Traceback (most recent call last):
  File "/w/ddp_train/trainer.py", line 633, in run
    code = trainer.fit()
           ^^^^^^^^^^^^^
  RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:64150
ddp-train: stopped: SIGTERM received during a collective, then a peer went away: RuntimeError: closed by peer
W1203 21:43:44.5 elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers
"""


def test_console_keeps_traceback_bodies_and_cpp_frames_for_the_host_log(tmp_path: Path) -> None:
    console = tmp_path / "console.txt"
    with console.open("w") as out:
        log = JobLog(tmp_path / "logs", "j", console=out)
        for line in STALL_RANK0.splitlines():
            log.line("local0", "local0 r0", line)
        log.line("local1", "local1 r1", "[rank1]: Traceback (most recent call last):")
        log.line("local1", "local1 r1", '[rank1]:   File "x.py", line 3, in <module>')
        log.line("local1", "local1 r1", "[rank1]: OSError: [Errno 28] No space left on device")
        log.close()
    shown = console.read_text().splitlines()
    assert shown == [
        "[local0 r0] [rank0]:[W1203 21:43:44.5 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on "
        "SocketImpl(fd=4)",
        "[local0 r0] ddp-train: stopped: SIGTERM received during a collective, then a peer went away: "
        "RuntimeError: closed by peer",
        "[local0 r0] W1203 21:43:44.5 elastic/agent/server/api.py:753] Received 15 death signal, shutting "
        "down workers",
        "[local1 r1] [rank1]: OSError: [Errno 28] No space left on device",
    ]
    assert log.hidden == {"local0": len(STALL_RANK0.splitlines()) - 3, "local1": 2}
    host_log = (tmp_path / "logs" / "j" / "local0.log").read_text()
    assert host_log.count("\n") == len(STALL_RANK0.splitlines()) and "frame #23:" in host_log


def test_first_error_prefers_the_trainers_own_line() -> None:
    lines = STALL_RANK0.splitlines() + ["  traceback : Signal 15 (SIGTERM) received by PID 31371"]
    assert first_error(lines).startswith("ddp-train: stopped: SIGTERM received during a collective")


def test_trainer_traceback_is_indented_and_consequences_are_named() -> None:
    try:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1. remote worker crash")
    except RuntimeError as exc:
        text, why = trainer.indented_traceback(exc), trainer.consequence(exc, None)
        sigterm = trainer.consequence(exc, 15)
    assert text.startswith("Traceback (most recent call last):\n")
    assert all(ln.startswith(" ") for ln in text.splitlines()[1:]), text
    assert why == (
        "a peer rank went away (its host log has the cause): RuntimeError: [pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:1. remote worker crash"
    )
    assert sigterm.startswith("SIGTERM received during a collective, then a peer went away: RuntimeError:")
    assert (
        trainer.consequence(ValueError("a bug of this rank"), None) is None
    )  # its own failure: traceback stays


def summary_errors(tmp_path: Path, setup) -> dict[str, str | None]:  # noqa: ANN001 - a callable
    plan = build_plan([node("n0", "10.0.0.1"), node("n1", "10.0.0.2")], Options(job_id="j"))
    j = Job(plan, JobLog(tmp_path, "j", quiet=True))
    summarize(plan, j.log, j.runs, setup(j), {}, 1.0)
    data = json.loads((tmp_path / "j" / "summary.json").read_text())
    return {n["host"]: n["first_error"] for n in data["nodes"]}


def test_first_error_of_a_consequence_names_the_failed_rank_or_the_watchdog(tmp_path: Path) -> None:
    def failed(j: Job) -> Ending:
        n0, n1 = j.runs
        j.log.line("n0", "n0 r0", "ddp-train: error: /r/best.pt: saving best.pt of step 40 failed: No space")
        j.log.line(
            "n1",
            "n1 r1",
            "[rank1]: TimeoutError: rank 0 did not finish its checkpoint I/O (DistNetworkError)",
        )
        n0.exited(2)
        n1.exited(143)
        n1.signalled, n0.ended = "SIGTERM from ddp-launch", time.monotonic()
        return Ending(NODE_FAILED, "first failure: n0", cause=n0)

    errors = summary_errors(tmp_path / "a", failed)
    assert errors == {
        "n0": "ddp-train: error: /r/best.pt: saving best.pt of step 40 failed: No space",
        "n1": "stopped: node 0 failed (n0)",
    }

    def stalled(j: Job) -> Ending:
        n0, n1 = j.runs
        j.log.line(
            "n0", "n0 r0", "[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:64150"
        )
        # the suspect's own torchrun, on the watchdog's SIGTERM (seen in the embedded stall test under load)
        j.log.line(
            "n1",
            "n1 r1",
            "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15",
        )
        n0.exited(143)
        n1.exited(143)
        n0.signalled = n1.signalled = "SIGTERM from ddp-launch"
        return Ending(STALLED, "stall", cause=n1, stalled=True)

    errors = summary_errors(tmp_path / "b", stalled)
    assert errors["n0"] == "stopped by the stall watchdog"
    assert errors["n1"].startswith("stalled")


def test_agent_reports_a_failed_worker_in_one_line_with_its_exit_code(capsys: pytest.CaptureFixture) -> None:
    failure = ProcessFailure(local_rank=0, pid=123, exitcode=2, error_file="<N/A>")
    assert agent._report(agent._failed_line(ChildFailedError("ddp_train", {3: failure}))) == 2
    assert capsys.readouterr().err == "ddp-agent: worker rank 3 (local rank 0) failed first: exit code 2\n"
    killed = ProcessFailure(local_rank=1, pid=124, exitcode=-9, error_file="<N/A>")
    code, line = agent._failed_line(ChildFailedError("ddp_train", {1: killed}))
    assert code == 137 and "Signal 9 (SIGKILL) received by PID 124" in line


def test_storage_error_finds_the_disk_error_behind_torch_saves_runtime_error(tmp_path: Path) -> None:
    from ddp_train import storage  # new in #32: the other tests here run on the old code too

    with (
        pytest.raises(storage.StorageError) as caught,
        storage.guarded("saving x", tmp_path / "x.pt", "kept"),
    ):
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 19968 vs 19920"
            ) from None
    # `from None` still keeps __context__: what torch's zip writer leaves
    assert str(caught.value).startswith(
        f"{tmp_path / 'x.pt'}: saving x failed: No space left on device (ENOSPC); "
    )
    assert str(caught.value).endswith("; kept") and " free of " in str(caught.value)
    with pytest.raises(ValueError), storage.guarded("saving x", tmp_path / "x.pt"):
        raise ValueError("not a disk's fault")


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="mounts a tmpfs (root only)")
def test_a_read_only_log_dir_is_one_line_with_its_path_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.integration.test_failures_disk import tmpfs

    repo = Path(__file__).resolve().parents[2]
    with tmpfs(tmp_path / "ro", "size=64k,ro") as ro:
        res = subprocess.run(
            [str(Path(sys.executable).parent / "ddp-launch"), "--hosts", str(repo / "inventory" / "local"),
             "--job-id", "ro-logs", "--log-dir", str(ro)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr == (
        f"ddp-launch: error: {ro}/ro-logs: writing the job's logs and state failed: Read-only file system "
        f"(EROFS); 64.0 KiB free of 64.0 KiB on {ro}\n"
    )


def test_a_consequence_failing_first_waits_briefly_for_its_cause(tmp_path: Path) -> None:
    import threading

    plan = build_plan([node("n0", "10.0.0.1"), node("n1", "10.0.0.2")], Options(job_id="j"))
    j = Job(plan, JobLog(tmp_path, "j", quiet=True))
    n0, n1 = j.runs
    n0.started = n1.started = True
    n1.exited(1)
    j.log.line("n1", "n1 r1", "ddp-train: stopped: rank 0 failed: /r/best.pt: saving best.pt failed")

    def rank0_ends() -> None:
        time.sleep(0.3)
        n0.exited(2)
        n0.done.set()

    threading.Thread(target=rank0_ends).start()
    t0 = time.monotonic()
    j._await_cause(n1)  # before the teardown: rank 0 exits 2 by itself, not by the launcher's TERM
    assert n0.done.is_set() and 0.25 < time.monotonic() - t0 < 1.5
    j.log.line("n0", "n0 r0", "ddp-train: error: /r/best.pt: saving best.pt failed")
    t0 = time.monotonic()
    j._await_cause(n0)  # its own failure: no wait
    assert time.monotonic() - t0 < 0.1


def test_a_ranks_stack_dump_file_is_removed_at_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The atexit removal got fdopen's name, the descriptor: a TypeError traceback on every rank's exit."""
    import atexit

    from ddp_train import stackdump

    private = tmp_path / "agent"
    private.mkdir(mode=0o700)
    registered: list[tuple] = []
    monkeypatch.setattr(atexit, "register", lambda f, *a: registered.append((f, a)))
    monkeypatch.setenv(stackdump.STACK_DIR_ENV, str(private))
    monkeypatch.setattr(stackdump, "_file", None)
    stackdump.install(5)
    try:
        assert (private / "r5.txt").exists() and len(registered) == 1
        func, args = registered[0]
        func(*args)
        assert not (private / "r5.txt").exists()
    finally:
        if stackdump._file is not None:
            stackdump._file.close()
        monkeypatch.setattr(stackdump, "_file", None)


def test_summary_json_stays_valid_when_a_secret_value_is_false(tmp_path: Path) -> None:
    # review #6: TOKENIZERS_PARALLELISM=false is a "secret" by name; `"detached": false` stayed JSON
    log = JobLog(tmp_path, "j", secrets=["false", "hf_abc123"], quiet=True)
    path = log.write_json("summary.json", {"detached": False, "env": {"HF_TOKEN": "hf_abc123"}, "n": 3})
    log.close()
    data = json.loads(path.read_text())
    assert data == {"detached": False, "env": {"HF_TOKEN": "***"}, "n": 3}


def test_first_error_prefers_a_real_error_over_a_bystanders_stopped_line() -> None:
    # review #2: the failing rank's traceback comes after its node peers' "stopped:" lines
    lines = [
        "[rank1]: ddp-train: stopped: a peer rank went away (its host log has the cause): RuntimeError: "
        "Connection closed by peer",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/w/ddp_train/trainer.py", line 675, in run',
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    ]
    assert first_error(lines) == lines[-1]
    assert first_error(["ddp-train: stopped: x: RuntimeError: closed by peer", "ddp-train: error: bad"]) == (
        "ddp-train: error: bad"
    )


def test_a_ranks_own_error_line_is_written_before_the_process_group_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from ddp_train import distributed, exitcodes
    from ddp_train.config import load_config

    def oom(*_a: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    seen: list[str] = []
    monkeypatch.setattr(distributed, "init", oom)
    monkeypatch.setattr(distributed, "shutdown", lambda: seen.append(capsys.readouterr().err))
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}"])
    assert trainer.run(cfg) == exitcodes.FAILURE
    assert seen and seen[0].splitlines()[-1] == (
        "ddp-train: error: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert "Traceback (most recent call last):" in seen[0]


def test_a_ranks_own_failure_is_no_consequence_even_when_it_mentions_a_peer_or_a_stop_came() -> None:
    # review #4: a plug-in's HTTP reset, or a bug during the stop's final save, is this rank's failure
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except OSError as e:
            raise RuntimeError("fetching shard 3 from https://data.example/x failed") from e
    except RuntimeError as exc:
        assert trainer.consequence(exc, None) is None
        assert trainer.consequence(exc, 15) is None
    bug = KeyError("model.step")
    assert trainer.consequence(bug, 15) is None
    store = torch.distributed.DistNetworkError("failed to recv, got 0 bytes")
    assert trainer.consequence(store, None).startswith("a peer rank went away")
    assert trainer.consequence(store, 15).startswith("SIGTERM received during a collective, then a peer went")
    backend = torch.distributed.DistBackendError("NCCL error: remote process exited")
    assert trainer.consequence(backend, 15).startswith("SIGTERM received during a collective, then it failed")


def test_agent_names_the_worker_that_failed_on_its_own_when_several_fail_in_the_same_second() -> None:
    # review #5: rank 1 exits 2 (bad token file), rank 0 exits 1 as its consequence: the node exits 2
    bad = ProcessFailure(local_rank=1, pid=124, exitcode=2, error_file="<N/A>")
    victim = ProcessFailure(local_rank=0, pid=123, exitcode=1, error_file="<N/A>")
    victim.timestamp = bad.timestamp = 1_700_000_000  # int(time.time()) at detection: a tie
    assert agent._failed_line(ChildFailedError("ddp_train", {0: victim, 1: bad})) == (
        2, "ddp-agent: 2 workers failed; rank 1 (local rank 1): exit code 2"
    )  # fmt: skip
    stopped = ProcessFailure(local_rank=2, pid=125, exitcode=143, error_file="<N/A>")
    stopped.timestamp = victim.timestamp - 1
    assert agent._failed_line(ChildFailedError("ddp_train", {2: stopped, 0: victim})) == (
        1, "ddp-agent: 2 workers failed; rank 0 (local rank 0): exit code 1"
    )  # fmt: skip


def test_traceback_bodies_stay_hidden_when_other_ranks_lines_interleave(tmp_path: Path) -> None:
    # review #3: the "inside a traceback" state was per host: any other rank's line ended the hiding
    console = tmp_path / "console.txt"
    lines = [
        "[rank0]: Traceback (most recent call last):",
        "[rank1]: ddp-train: stopped: a peer rank went away (its host log has the cause): RuntimeError: x",
        '[rank0]:   File "/w/ddp_train/trainer.py", line 675, in run',
        "[rank0]:     code = trainer.fit()",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory",
        "Traceback (most recent call last):",
        "W1203 21:43:44.5 elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers",
        '  File "/w/plugin.py", line 3, in <module>',
        "    build()",
        "ValueError: boom",
    ]
    with console.open("w") as out:
        log = JobLog(tmp_path / "logs", "j", console=out)
        for line in lines:
            log.line("n0", "n0 r0", line)
        log.close()
    assert console.read_text().splitlines() == [f"[n0 r0] {lines[i]}" for i in (1, 4, 6, 9)]


def test_a_traceback_torchs_logger_prints_line_by_line_is_hidden_but_its_exception(tmp_path: Path) -> None:
    """torchrun's agent logs its exit barrier's traceback with a glog prefix on every line (seen at the end
    of a Slurm job that had finished): only the logged error and the exception line reach the console."""
    pre = "E1205 05:50:45.545000 23051 torch/distributed/elastic/agent/server/api.py:1008] "
    lines = [
        pre + "Error waiting on exit barrier. Elapsed: 0.013287782669067383 seconds",
        pre + "Traceback (most recent call last):",
        pre + '  File "/v/torch/distributed/elastic/agent/server/api.py", line 994, in _exit_barrier',
        pre + "    store_util.barrier(",
        "W1205 05:50:45.546000 23052 torch/distributed/run.py:80] another process's line between them",
        pre + '  File "/v/torch/distributed/elastic/utils/store.py", line 201, in barrier',
        pre + "    store.wait([last_member_key])",
        pre + "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.",
    ]
    console = tmp_path / "console.txt"
    with console.open("w") as out:
        log = JobLog(tmp_path / "logs", "j", console=out)
        for line in lines:
            log.line("node2", "node2 r2", line)
        log.close()
    assert console.read_text().splitlines() == [f"[node2 r2] {lines[i]}" for i in (0, 4, 7)]
    assert log.hidden == {"node2": 5}
