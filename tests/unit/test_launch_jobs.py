"""Job control pieces without a cluster: job.json state, the conflict check, step lines, the stall
watchdog's stack comparison, and the node agent's lifeline (a real agent process, a fake torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_train.launch.cli import main
from ddp_train.launch.jobs import jobstate
from ddp_train.launch.run.logs import host_log_path
from ddp_train.launch.run.progress import live_line, read_host_log
from ddp_train.launch.run.trainerlog import StepTimes, parse_step
from ddp_train.launch.run.watchdog import StallWatch, main_frames, odd_ranks, split_dumps

STEP = "12:00:01 ddp-train[rank 0] INFO step 12/30 loss 1.2345 lr 0.001 1500 tok/s 0.250 s/step"


def _job(log_dir: Path, job_id: str, pid: int, state: str = "running", port: int = 29500) -> None:
    jobstate.write_state(
        jobstate.state_path(log_dir, job_id),
        {"job_id": job_id, "pid": pid, "state": state, "master_port": port, "started": time.time(),
         "nodes": [{"host": "local0", "rank": 0}, {"host": "local1", "rank": 1}],
         **jobstate.identity(pid)},  # as the launcher records its own process
    )  # fmt: skip


def test_a_live_job_on_the_same_nodes_and_port_is_named_and_a_dead_one_is_lost(tmp_path: Path) -> None:
    _job(tmp_path, "a", os.getpid())
    line = jobstate.conflict(tmp_path, "b", ["local1", "other"], 29500)
    assert line and line.startswith("job a (pid ") and "local1" in line and "ddp-launch stop a" in line
    assert jobstate.conflict(tmp_path, "b", ["local1"], 29501) is None  # another port
    assert jobstate.conflict(tmp_path, "b", ["x"], 29500) is None  # other nodes
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _job(tmp_path, "c", dead.pid, port=29600)
    assert [(j["job_id"], j["state"]) for j in jobstate.list_jobs(tmp_path)] == [
        ("a", "running"),
        ("c", "lost"),
    ]
    assert jobstate.conflict(tmp_path, "d", ["local0"], 29600) is None  # a lost job blocks nothing


def test_step_lines_give_progress_and_eta(tmp_path: Path) -> None:
    step = parse_step(f"[local0 r0] {STEP}")
    assert step is not None and (step.step, step.total, step.tokens_per_s) == (12, 30, 1500.0)
    assert step.eta_s() == pytest.approx(18 * 0.25)
    assert live_line(step) == "step 12/30 loss 1.2345 1500 tok/s ETA 4s"
    log = host_log_path(tmp_path, "local0")
    earlier = STEP.replace("step 12/30", "step 2/30")
    lines = [
        f"03:03:55.500 [local0 r0] {earlier}",
        f"03:04:05.500 [local0 r0] {STEP}",
        "03:04:06.000 [local0 r0] other",
    ]
    log.write_text("".join(f"2026-01-02T{line}\n" for line in lines))
    got = read_host_log(log)
    assert got.last_step == step and got.last_line.endswith("other") and got.last_line_at is not None
    assert got.wall_s_per_step == pytest.approx(1.0) and got.eta_s() == pytest.approx(18.0)  # wall time
    assert parse_step("[local0 r0] ddp-train[rank 0] INFO resumed from x at step 3") is None


def test_job_commands_report_unknown_jobs_and_list_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _job(tmp_path, "j1", os.getpid())
    host_log_path(tmp_path / "j1", "local0").write_text(f"2026-01-02T03:04:05.000 [local0 r0] {STEP}\n")
    assert main(["jobs", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "j1" in out and "running" in out and "12/30" in out
    assert main(["status", "--log-dir", str(tmp_path), "j1"]) == 0
    out = capsys.readouterr().out
    assert "job j1: running" in out and "local0  0" in out and "1.2345" in out
    assert main(["status", "--log-dir", str(tmp_path), "nope"]) == 2
    assert "no job 'nope'" in capsys.readouterr().err
    assert main(["logs", "--log-dir", str(tmp_path), "j1", "--node", "zz"]) == 2


WAITER = """--- faulthandler ---
Thread 0x00007f01 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f00 (most recent call first):
  File "/x/torch/autograd/graph.py", line 824 in _engine_run_backward
  File "/x/torch/_tensor.py", line 626 in backward
  File "/x/ddp_train/trainer.py", line 370 in train_step
  File "/x/ddp_train/trainer.py", line 412 in fit
  File "/x/ddp_train/__main__.py", line 70 in <module>
"""
STUCK = WAITER.replace(
    '  File "/x/torch/autograd/graph.py", line 824 in _engine_run_backward\n'
    '  File "/x/torch/_tensor.py", line 626 in backward\n'
    '  File "/x/ddp_train/trainer.py", line 370 in train_step\n',
    '  File "/x/ddp_train/stackdump.py", line 55 in debug_stall_block\n'
    '  File "/x/ddp_train/stackdump.py", line 51 in debug_stall\n',
)


def test_the_stall_watchdog_names_the_rank_whose_stack_differs() -> None:
    out = f"WORKER 11 0\n==> r0.txt\n{WAITER.split(chr(10), 1)[1]}==> r1.txt\n{STUCK.split(chr(10), 1)[1]}"
    dumps = split_dumps(out)
    assert sorted(dumps) == [0, 1] and "debug_stall_block" in dumps[1]
    assert main_frames(dumps[1])[0] == "debug_stall_block (stackdump.py)"
    sigs = {("a", 0): main_frames(dumps[0]), ("b", 1): main_frames(dumps[1])}
    assert odd_ranks(sigs) == [("b", 1)]  # a tie: the rank not waiting in a collective
    sigs[("c", 2)] = sigs[("b", 1)]
    sigs[("d", 3)] = sigs[("b", 1)]
    assert odd_ranks(sigs) == [("a", 0)]  # the minority, whatever it does
    assert odd_ranks({("a", 0): sigs[("a", 0)]}) == []


def test_the_main_thread_is_found_below_runpy_whatever_thread_caught_the_signal() -> None:
    """`python -m ddp_train` puts runpy's frames outside `<module>`, and faulthandler lists first the thread
    that caught SIGUSR1: on a node with a checkpoint replica receiver, that thread waiting in accept()
    was taken for the main thread and its rank named as the odd one (CI, test_jobs_testbed)."""
    receiver = (
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "/usr/lib/python3.11/socket.py", line 294 in accept\n'
        '  File "/x/ddp_train/replica.py", line 90 in _serve\n'
        '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
    )
    runpy = '  File "<frozen runpy>", line 88 in _run_code\n'
    runpy += '  File "<frozen runpy>", line 198 in _run_module_as_main\n'
    main_thread = WAITER.split("\n", 1)[1].replace("Current thread", "Thread")
    dump = "--- faulthandler ---\n" + receiver + main_thread + runpy
    assert main_frames(dump)[0] == "_engine_run_backward (graph.py)"


def test_the_stall_timeout_is_derived_from_the_step_gaps_with_a_floor() -> None:
    watch = StallWatch("j", Path("/nonexistent"), None, StepTimes())
    assert watch.check() is None  # not armed before the first step line
    watch.feed(parse_step(STEP))
    assert watch.timeout() == 300.0 and watch.check() is None
    explicit = StallWatch("j", Path("/nonexistent"), 0.2, StepTimes())
    explicit.feed(parse_step(STEP))
    time.sleep(0.3)
    assert "no rank advanced past step 12" in (explicit.check() or "")
    off = StallWatch("j", Path("/nonexistent"), 0, StepTimes())
    off.feed(parse_step(STEP))
    assert off.check() is None


FAKE_TORCHRUN = """
import sys, time
print("fake torchrun running", flush=True)
for _ in range(600):
    time.sleep(0.1)
    print("tick", flush=True)
"""


def _start_agent(tmp_path: Path, torchrun: str, lifeline: str, job: str) -> subprocess.Popen:
    """The node agent over a fake torchrun script; its environment line sent, its stdin kept open."""
    script = tmp_path / "torchrun"
    script.write_text(torchrun)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddp_train.agent", str(script)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps({"DDP_LIFELINE_S": lifeline, "DDP_JOB_ID": job}) + "\n").encode())
    proc.stdin.flush()
    return proc


def _agent(tmp_path: Path, lifeline: str) -> subprocess.Popen:
    proc = _start_agent(tmp_path, FAKE_TORCHRUN, lifeline, "lt")
    assert proc.stdout is not None and proc.stdout.readline() == b"fake torchrun running\n"
    return proc


def test_the_agent_stops_its_node_when_the_launchers_stdin_closes(tmp_path: Path) -> None:
    proc = _agent(tmp_path, "30")
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()  # the launcher died
    t0 = time.monotonic()
    out = proc.stdout.read().decode()
    proc.wait(timeout=20)
    assert proc.returncode == 143 and time.monotonic() - t0 < 5, out
    assert "lost the launcher (stdin closed" in out


def test_the_agent_stops_without_heartbeats_and_keeps_its_output_when_nobody_reads(tmp_path: Path) -> None:
    proc = _agent(tmp_path, "2")
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdout.close()  # nobody reads any more; stdin stays open but silent (a vanished controller)
    t0 = time.monotonic()
    proc.wait(timeout=20)
    assert proc.returncode == 143 and 1.5 < time.monotonic() - t0 < 8
    logs = list(tmp_path.glob("ddp-agent-lt-*/agent.log"))  # the agent's private directory
    assert len(logs) == 1 and "no heartbeat from the launcher for 2s" in logs[0].read_text()
    proc.stdin.close()


def test_a_heartbeat_keeps_the_agent_running(tmp_path: Path) -> None:
    proc = _agent(tmp_path, "1")
    assert proc.stdin is not None
    try:
        for _ in range(6):
            time.sleep(0.4)
            proc.stdin.write(b"\n")
            proc.stdin.flush()
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        proc.stdin.close()
        proc.stdout.close()
    assert proc.returncode == 143


LATE_WRITER_TORCHRUN = """
import subprocess, sys
class SignalException(Exception):  # torch.distributed.elastic's, as the agent recognises it by name
    sigval = 15
late = "import sys, time; time.sleep(0.5); sys.stderr.write(f'Traceback (most recent call last):{chr(10)}')"
subprocess.Popen([sys.executable, "-c", late])  # a worker still writing after torchrun returned
raise SignalException()
"""


def test_the_agents_own_last_line_is_whole_and_last(tmp_path: Path) -> None:
    # CI (stop 37): "ddp-agent: SIGTERM: ...; exit 143Traceback (most recent call last):", a worker's
    # traceback glued onto the agent's line, which the console's traceback filter then let through
    proc = _start_agent(tmp_path, LATE_WRITER_TORCHRUN, "30", "ll")  # stdin open: the launcher is there
    assert proc.stdin is not None and proc.stdout is not None
    lines = proc.stdout.read().decode().splitlines()
    proc.wait(timeout=60)
    proc.stdin.close()
    proc.stdout.close()
    assert proc.returncode == 143, lines
    assert lines[-1] == "ddp-agent: SIGTERM: torchrun stopped its workers (each saves first); exit 143", lines
    assert "Traceback (most recent call last):" in lines, lines


def test_metrics_render_a_png_or_say_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddp_train.launch.jobs import metricsview

    records = [{"step": s, "loss": 2.0 / s, "tokens_per_s": 1000.0 + s} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "lo'
    )
    assert metricsview.read_records(tmp_path / "metrics.jsonl") == records  # a half-written line is skipped
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    line = metricsview.render_png(records, tmp_path / "metrics.png")
    assert (
        line == f"plot: matplotlib is not installed: {sys.executable} -m pip install matplotlib (install.sh: "
        "./install.sh --with plot)"
    )
    monkeypatch.undo()
    pytest.importorskip("matplotlib")  # dev extras install it (pyproject), so CI runs the rest
    assert metricsview.render_png(records, tmp_path / "metrics.png") == f"plot: {tmp_path / 'metrics.png'}"
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_events_only_when_asked(tmp_path: Path) -> None:
    from ddp_train import tbwriter
    from ddp_train.config import load_config
    from ddp_train.metrics import JsonlWriter

    cfg = load_config(None, [f"run.dir={tmp_path}"])
    plain = JsonlWriter(tmp_path / "m.jsonl")
    assert tbwriter.tee(plain, cfg, True) is plain  # off by default: the JSONL writer itself
    pytest.importorskip("tensorboard")
    cfg = load_config(None, [f"run.dir={tmp_path}", "log.tensorboard=true"])
    assert tbwriter.tee(plain, cfg, False) is plain  # rank 0 only
    writer = tbwriter.tee(plain, cfg, True)
    writer.write({"step": 3, "loss": 1.5, "val_loss": 1.7, "grad_norm": None, "tokens_per_s": 10.0})
    writer.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((cfg.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["train/loss", "train/tokens_per_s", "val/loss"]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(3, 1.5)]
    assert (tmp_path / "m.jsonl").read_text().count('"step": 3') == 1


@pytest.mark.slow
def test_without_tensorboard_asked_nothing_of_it_is_imported(tmp_path: Path) -> None:
    """A fresh interpreter: the trainer module and a default run's metrics writer import no TensorBoard."""
    code = (
        "import sys\n"
        "import ddp_train.trainer\n"
        "from ddp_train import tbwriter\n"
        "from ddp_train.config import load_config\n"
        "from ddp_train.metrics import JsonlWriter\n"
        f"cfg = load_config(None, ['run.dir={tmp_path}'])\n"
        f"tbwriter.tee(JsonlWriter(cfg.run_dir / 'm.jsonl'), cfg, True).close()\n"
        "print(sorted(m for m in sys.modules if 'tensorboard' in m))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_on_a_tty_one_live_status_line_stays_under_the_scrolling_lines(tmp_path: Path) -> None:
    import io

    from ddp_train.launch.run.logs import JobLog

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    log = JobLog(tmp_path, "j", console=tty)
    log.set_live("step 12/30 loss 1.2345 1500 tok/s ETA 4s")
    log.line("local0", "local0 r0", "hello")
    log.close()
    assert tty.getvalue() == (
        "\r\x1b[Kstep 12/30 loss 1.2345 1500 tok/s ETA 4s"
        "\r\x1b[K[local0 r0] hello\n\r\x1b[Kstep 12/30 loss 1.2345 1500 tok/s ETA 4s\r\x1b[K"
    )
    plain = io.StringIO()
    log = JobLog(tmp_path, "k", console=plain)
    log.set_live("step 1/2")
    log.line("local0", "local0 r0", "hello")
    log.close()
    assert plain.getvalue() == "[local0 r0] hello\n"  # not a TTY: no live line, no escapes


def test_detach_returns_the_monitors_failure_when_it_wrote_its_end_before_exiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The monitor writes state finished (exit 3: preflight failed) in a finally, then its interpreter
    takes a moment to exit: detach must wait for it and return 3, never say "runs detached" with 0."""
    from ddp_train.launch.jobs import jobcmds

    class Monitor:  # the state is already written; poll() says still running until wait()
        pid = 4242

        def __init__(self, argv: list[str], **kw: object) -> None:
            kw["stdout"].write(b"ddp-launch: preflight failed on 1 node(s); nothing was started\n")  # type: ignore[attr-defined]
            kw["stdout"].flush()  # type: ignore[attr-defined]
            _job(tmp_path, "j1", self.pid, state="finished")
            path = jobstate.state_path(tmp_path, "j1")
            jobstate.write_state(path, {**jobstate.read_state(path), "exit_code": 3})
            self.waited = False

        def poll(self) -> int | None:
            return 3 if self.waited else None

        def wait(self, timeout: float | None = None) -> int:
            self.waited = True
            return 3

    monkeypatch.setattr(subprocess, "Popen", Monitor)
    assert jobcmds.detach(["--hosts", "x"], "j1", str(tmp_path)) == 3
    out = capsys.readouterr().out
    assert "preflight failed" in out and "runs detached" not in out


def test_only_the_launchers_detach_is_dropped_for_the_monitor() -> None:
    from ddp_train.launch.jobs.jobcmds import without_detach

    assert without_detach(["--hosts", "inv", "--deta", "train.py", "--detach"]) == [
        "--hosts",
        "inv",
        "train.py",
        "--detach",
    ]
    assert without_detach(["--detach", "--hosts", "inv"]) == ["--hosts", "inv"]
    assert without_detach(["--hosts", "inv"]) == ["--hosts", "inv"]


def test_metrics_come_from_rank_0_even_when_it_is_not_the_rendezvous_host() -> None:
    """Under c10d torchrun ranks nodes by --local-addr, so rank 0 can be another node than plan.master."""
    from types import SimpleNamespace as NS

    from ddp_train.launch.jobs.metricsview import metrics_location

    gpu01 = NS(rank=1, cwd="/srv/w", node=NS(name="gpu01", local=False))
    gpu02 = NS(rank=0, cwd="/srv/w", node=NS(name="gpu02", local=False))
    where = metrics_location(NS(script=None, master=gpu01, nodes=[gpu01, gpu02]), None, [])
    assert where is not None and where["host"] == "gpu02" and where["path"].endswith("metrics.jsonl")


def test_a_missing_tensorboard_fails_every_rank_not_only_rank_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from ddp_train import tbwriter
    from ddp_train.config import ConfigError, load_config

    cfg = load_config(None, [f"run.dir={tmp_path}", "log.tensorboard=true"])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a)
    )
    for is_main in (True, False):
        with pytest.raises(ConfigError, match="log.tensorboard"):
            tbwriter.tee(object(), cfg, is_main)
