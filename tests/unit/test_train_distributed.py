"""torchrun environment parsing, device/backend choice, single-process collectives, metrics plumbing."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch

from ddp_train import distributed
from ddp_train.config import ConfigError, DistConfig
from ddp_train.metrics import JsonlWriter, ProgressBar, setup_logging


def test_no_rank_means_one_process_without_a_group():
    env = distributed.read_env({})
    assert env == distributed.DistEnv() and not env.distributed and env.world_size == 1 and env.is_main
    assert distributed.init(DistConfig(), env, torch.device("cpu")) is None
    assert not distributed.active()


def test_torchrun_variables_are_read_in_one_place():
    env = distributed.read_env(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.master_addr, env.master_port, env.distributed, env.is_main) == (
        "10.0.0.1",
        29500,
        True,
        False,
    )


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK: 'x' is not an integer"),
        ({"RANK": "0"}, "WORLD_SIZE: None is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK: 2 is outside 0..WORLD_SIZE-1"),
    ],
)
def test_bad_environment_is_a_one_line_error(environ, message):
    with pytest.raises(ConfigError, match=message):
        distributed.read_env(environ)


def test_device_and_backend_choice_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectations")
    env = distributed.DistEnv()
    device = distributed.select_device(DistConfig(), env)
    assert device == torch.device("cpu")
    assert distributed.select_backend(DistConfig(), device) == "gloo"
    assert distributed.select_backend(DistConfig(backend="gloo"), device) == "gloo"
    with pytest.raises(ConfigError, match="'nccl' needs a CUDA device"):
        distributed.select_backend(DistConfig(backend="nccl"), device)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        distributed.select_device(DistConfig(device="cuda"), env)


def test_collectives_alone_are_identity():
    state = {"a": torch.arange(3), "b": [1, (2, torch.ones(2))]}
    assert distributed.broadcast_state(state, torch.device("cpu")) is state
    assert distributed.broadcast_object({"x": 1}) == {"x": 1}
    assert distributed.all_gather_objects("h") == ["h"]
    t = torch.ones(2)
    assert distributed.all_reduce_sum(t) is t and t.tolist() == [1.0, 1.0]
    distributed.barrier()
    distributed.shutdown()  # safe without a group


def test_state_splitting_round_trips():
    tensors: list[torch.Tensor] = []
    state = {"m": {"w": torch.randn(2, 2)}, "rng": [(3, (1, 2), None)], "s": 5, "t": torch.tensor(1.5)}
    skeleton = distributed._split(state, tensors)
    assert len(tensors) == 2 and "w" in skeleton["m"]
    back = distributed._join(skeleton, tensors)
    assert back["rng"] == [(3, (1, 2), None)] and back["s"] == 5
    assert torch.equal(back["m"]["w"], state["m"]["w"]) and back["t"] is state["t"]


def test_jsonl_writer_appends_flushed_lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    w = JsonlWriter(path)
    w.write({"step": 1, "loss": 2.0})
    assert json.loads(path.read_text()) == {"step": 1, "loss": 2.0}  # flushed, readable mid-run
    w.close()
    JsonlWriter(path).write({"step": 2})
    assert len(path.read_text().splitlines()) == 2
    JsonlWriter(None).write({"ignored": True})


def test_progress_bar_draws_only_when_enabled():
    buf = io.StringIO()
    bar = ProgressBar(10, enabled=True, stream=buf, width=10)
    bar.update(5, "loss 1.0")
    bar.close()
    assert buf.getvalue() == "\r\x1b[K[#####.....] 5/10 loss 1.0\n"
    quiet = io.StringIO()
    ProgressBar(10, enabled=False, stream=quiet).update(3)
    assert quiet.getvalue() == ""


def test_logging_is_rank_zero_info_and_warnings_elsewhere():
    assert setup_logging(0, "info").level == logging.INFO
    logger = setup_logging(1, "debug")
    assert logger.level == logging.WARNING
    assert "[rank 1]" in logger.handlers[-1].formatter._fmt
    assert len([h for h in logger.handlers if type(h).__name__ == "_BarAwareHandler"]) == 1
