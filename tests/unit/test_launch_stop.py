"""A stop's grace period comes from the trainer's measured save and step times; the node agent's input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ddp_train import agent
from ddp_train.distributed import flight_recorder_env
from ddp_train.launch.job import STOP_GRACE_MIN_S, Job
from ddp_train.launch.logs import JobLog
from ddp_train.launch.plan import STOP_GRACE_MAX_S, Options, build_plan
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
        j._measure(line)
    assert (j.longest_save, j.longest_step) == (41.25, 2.5)
    grace, how = j._stop_grace()
    assert grace == 2 * (41.25 + 2.5) + 10 and "longest save 41.25s" in how
    j._measure("07:49:10 ddp-train[rank 0] INFO saved /c/step-00000100.pt in 5000.00s")
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
