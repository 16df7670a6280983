"""A stop's grace period comes from the trainer's measured save and step times; the node agent's input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ddp_train import agent
from ddp_train.distributed import flight_recorder_env
from ddp_train.launch.plan.plan import STOP_GRACE_MAX_S, Options, build_plan
from ddp_train.launch.run.job import STOP_GRACE_MIN_S, Job
from ddp_train.launch.run.logs import JobLog
from tests.unit.test_launch_plan import node


def job(tmp_path: Path, grace: float | None = None) -> Job:
    plan = build_plan([node("n0", "10.0.0.1")], Options(job_id="j"))
    return Job(plan, JobLog(tmp_path, "j", quiet=True), grace=grace)


def test_grace_is_derived_from_the_longest_save_and_step_the_trainer_printed(tmp_path: Path) -> None:
    j = job(tmp_path)
    assert j._stop_grace()[0] == STOP_GRACE_MIN_S  # nothing measured yet: torchrun's 30 s
    for line in [
        "07:49:04 ddp-train[rank 0] INFO step 60/2000 loss 0.3574 lr 0.003 7105 tok/s 0.009 s/step",
        "07:49:07 ddp-train[rank 0] INFO saved /a b/checkpoints/step-00000074.pt in 41.25s (deleted 1 older)",
        "07:49:08 ddp-train[rank 0] INFO saved /runs/x/checkpoints/step-00000080.pt in 3.00s",
        "07:49:09 ddp-train[rank 0] INFO step 80/2000 loss 0.3 lr 0.003 7105 tok/s 2.500 s/step",
        "saved step-00000090.pt in 99.0s",  # not the trainer's log line: ignored
    ]:
        j.times.feed(line)
    assert (j.times.longest_save, j.times.longest_step) == (41.25, 2.5)
    grace, how = j._stop_grace()
    assert grace == 2 * (41.25 + 2.5) + 10 and "longest save 41.25s" in how
    j.times.feed("07:49:10 ddp-train[rank 0] INFO saved /c/step-00000100.pt in 5000.00s")
    assert j._stop_grace()[0] == STOP_GRACE_MAX_S  # never beyond what torchrun was told to wait
    assert job(tmp_path, grace=7)._stop_grace() == (7, "--grace")


def test_torchrun_waits_as_long_as_the_longest_grace() -> None:
    plan = build_plan([node("n0", "10.0.0.1")], Options(job_id="j"))
    assert plan.nodes[0].env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(STOP_GRACE_MAX_S)
    plan = build_plan([node("n0", "10.0.0.1")], Options(job_id="j", grace=12.5))
    assert plan.nodes[0].env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "13"


def test_agent_reads_one_json_line_of_strings() -> None:
    env = {"HF_TOKEN": "a\nb 'c'", "EMPTY": ""}
    assert agent.read_env(io.BytesIO(json.dumps(env).encode() + b"\nrest")) == env
    for bad in (b"", b'{"A": "1"}', b'{"A": 1}\n', b"[1]\n", b"not json\n"):
        with pytest.raises(ValueError):
            agent.read_env(io.BytesIO(bad))


def test_flight_recorder_defaults_under_the_run_dir_unless_the_user_set_them() -> None:
    assert flight_recorder_env("/r/run", {}) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": "/r/run/nccl_trace_rank_",
    }
    user = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "10",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/t_"}  # fmt: skip
    assert flight_recorder_env("/r/run", user) == {}


def test_a_node_runs_state_is_one_enum_that_status_reads(tmp_path: Path) -> None:
    from ddp_train.launch.remote.remote import LOST
    from ddp_train.launch.run.noderun import NodeState

    r = job(tmp_path).runs[0]
    assert (r.state, r.status(), r.failed) == (NodeState.PENDING, "unknown (still running?)", False)
    r.exited(0)
    assert (r.status(), r.failed) == ("ok", False)
    r.exited(143)
    r.signalled = "SIGTERM from ddp-launch"
    assert (r.status(), r.failed) == ("exit 143, after SIGTERM from ddp-launch", True)
    r.state, r.detail = NodeState.LOST, f"{LOST}: no reply"
    assert (r.status(), r.lost, r.error) == ("ssh lost", f"{LOST}: no reply", None)
    r.fail("cannot connect")
    assert (r.status(), r.error, r.lost, r.failed) == ("not started", "cannot connect", None, True)


def test_the_session_pool_closes_every_connection_it_opened_or_adopted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddp_train.launch.remote import sessionpool

    class Fake:
        def __init__(self, name: str) -> None:
            self.name, self.closed = name, 0

        def alive(self) -> bool:
            return not self.closed

        def close(self) -> None:
            self.closed += 1

    opened: list[Fake] = []
    monkeypatch.setattr(sessionpool, "open_session", lambda n, _t: opened.append(Fake(n.name)) or opened[-1])
    n0 = node("n0", "10.0.0.1")
    adopted = Fake("n1")
    with sessionpool.SessionPool() as pool:
        first = pool.get(n0)
        assert pool.get(n0) is first and len(opened) == 1  # reused while alive
        first.close()
        assert pool.get(n0) is not first and len(opened) == 2  # opened again once it dropped
        pool.adopt({"n1": adopted})
        pool.adopt({"n1": adopted})
        assert set(pool.sessions()) == {"n0", "n1"}
    assert [s.closed for s in opened] == [2, 1] and adopted.closed == 1  # each closed once by the pool


def test_the_signal_trap_counts_and_restores_the_previous_handler() -> None:
    import os
    import signal as sig

    from ddp_train.launch.run.sigtrap import SignalTrap

    before = sig.getsignal(sig.SIGUSR2)
    with SignalTrap([sig.SIGUSR2]) as trap:
        os.kill(os.getpid(), sig.SIGUSR2)
        os.kill(os.getpid(), sig.SIGUSR2)
    assert (trap.first, trap.count, trap.reason()) == (sig.SIGUSR2, 2, "received SIGUSR2")
    assert sig.getsignal(sig.SIGUSR2) == before


def test_the_node_scripts_are_package_files() -> None:
    from ddp_train.launch.run import nodecontrol

    root = Path(nodecontrol.__file__).parents[1] / "node"
    assert (root / "signal.sh").read_text() == nodecontrol.SIGNAL_SCRIPT
    assert (root / "stack.sh").read_text() == nodecontrol.STACK_SCRIPT
    assert '"launch/node/*.sh"' in (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert nodecontrol.signal_command("TERM", 7, "j").startswith("sh -c ")


FAKE_TORCHRUN = r"""
import os, signal, subprocess, sys, time

class SignalException(Exception):  # torch.distributed.elastic.multiprocessing.api's, by name and sigval
    def __init__(self, msg, sigval):
        super().__init__(msg)
        self.sigval = sigval

def handler(signum, frame):
    raise SignalException(f"got {signum}", sigval=signal.Signals(signum))

signal.signal(signal.SIGTERM, handler)
# another process: the launcher's stop reaching the node's session again while the agent ends, until the
# agent is gone (a thread of this process could not: it stops when the interpreter finalizes)
SENDER = (
    "import os, signal, sys, time\n"
    "fd = os.pidfd_open(int(sys.argv[1]))  # this process exactly, never a later one with its PID\n"
    "for _ in range(1000):\n"
    "    try:\n"
    "        signal.pidfd_send_signal(fd, signal.SIGTERM)\n"
    "    except ProcessLookupError:\n"
    "        break\n"
    "    time.sleep(0.002)\n"
)
subprocess.Popen([sys.executable, "-c", SENDER, str(os.getpid())], stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
time.sleep(30)
"""


def test_agent_ends_with_its_line_and_143_when_stop_signals_keep_coming(tmp_path: Path) -> None:
    """torchrun's handler raised on the first SIGTERM; more arrive while the agent reports and exits (CI:
    one node's agent killed by a late SIGTERM at interpreter exit, 'setsid: child did not exit normally')."""
    import subprocess
    import sys

    script = tmp_path / "torchrun"
    script.write_text(FAKE_TORCHRUN)
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-m", "ddp_train.agent", str(script)],
            input=b"{}\n",
            capture_output=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[2],
        )
        err = proc.stderr.decode()
        assert proc.returncode == 143, (proc.returncode, err)
        assert err.strip().splitlines()[-1] == (
            "ddp-agent: SIGTERM: torchrun stopped its workers (each saves first); exit 143"
        ), err
        assert "Traceback" not in err, err


def test_only_the_first_stop_signal_reaches_torchruns_handler() -> None:
    """The cause of the test above's rare failure under load: a second SIGTERM raised a second
    SignalException inside the agent's handling of the first (exit 1, a traceback). Inside the agent,
    the handlers torchrun installs for its stop signals raise for the first one only."""
    import signal as sig

    from ddp_train import agent

    def raising(signum: int, _frame: object) -> None:
        raise RuntimeError(signum)

    before = {s: sig.getsignal(s) for s in (sig.SIGTERM, sig.SIGINT)}
    real = sig.signal
    try:
        with agent._first_stop_only():
            sig.signal(sig.SIGTERM, raising)
            sig.signal(sig.SIGINT, raising)
            with pytest.raises(RuntimeError):
                sig.raise_signal(sig.SIGTERM)
            sig.raise_signal(sig.SIGTERM)  # stopping already: nothing raised
            sig.raise_signal(sig.SIGINT)
        assert sig.signal is real  # the agent's wrapper lives only while torchrun runs
    finally:
        for s, h in before.items():
            sig.signal(s, h)
