"""The training loop in one process (no torchrun): GPT learns, token files, plug-ins, resume with dropout."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import struct
import textwrap
import threading

import pytest
import torch

from ddp_train import exitcodes
from ddp_train.checkpoint import params_sha256
from ddp_train.config import load_config
from ddp_train.data import markov_tokens
from ddp_train.trainer import StopRequest, run

FINAL = re.compile(
    r"^ddp-train: final rank=0 world=1 step=(\d+) loss=(\S+) params_sha256=([0-9a-f]{16})$", re.M
)


def train(tmp_path, *overrides: str) -> tuple[int, list[tuple[int, float, str]]]:
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", *overrides])
    return run(cfg), cfg


def finals(out: str) -> list[tuple[int, float, str]]:
    return [(int(s), float(loss), sha) for s, loss, sha in FINAL.findall(out)]


def metrics(tmp_path, name: str = "default") -> list[dict]:
    path = tmp_path / "runs" / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_gpt_learns_the_markov_task(tmp_path, capsys):
    code, _ = train(
        tmp_path,
        "model.name=gpt",
        "train.max_steps=40",
        "train.batch_size=16",
        "train.warmup_steps=5",
        "train.lr=0.01",
        "train.min_lr=0.001",
        "log.interval_steps=1",
    )
    out = capsys.readouterr().out
    assert code == 0
    records = metrics(tmp_path)
    assert records[0]["loss"] > 3.8  # ln(64) = 4.16 at init
    assert records[-1]["loss"] < 2.6  # the chain's entropy is ~0.94 nats
    # both rounded to 3 decimals: on a loaded machine (~10 samples/s) that is a 1e-4 relative difference
    assert records[-1]["tokens_per_s"] == pytest.approx(records[-1]["samples_per_s"] * 32, rel=1e-3)
    assert finals(out)[0][0] == 40


@pytest.mark.slow
def test_gpt_on_a_memory_mapped_token_file(tmp_path, capsys):
    ids = markov_tokens(1, 40 * 33 + 1, vocab_size=64, seed=5)[0].tolist()
    path = tmp_path / "train.bin"
    path.write_bytes(struct.pack(f"<{len(ids)}H", *ids))
    code, _ = train(
        tmp_path,
        "model.name=gpt",
        "data.name=tokens",
        f"data.tokens.path={path}",
        "train.max_steps=12",
        "train.batch_size=8",
        "train.lr=0.01",
        "log.interval_steps=1",
    )
    assert code == 0, capsys.readouterr().err
    records = metrics(tmp_path)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert records[-1]["epoch"] == 2  # 40 blocks / 8 = 5 steps per epoch


def test_plugin_model_and_dataset(tmp_path, monkeypatch, capsys):
    (tmp_path / "regress.py").write_text(
        textwrap.dedent(
            """
            import torch

            class Model(torch.nn.Module):
                def __init__(self, dim):
                    super().__init__()
                    self.fc = torch.nn.Linear(dim, 1)

                def forward(self, x, y):
                    return torch.nn.functional.mse_loss(self.fc(x).squeeze(-1), y)

            def build_model(dim):
                return Model(dim)

            def build_dataset(n, dim):
                g = torch.Generator().manual_seed(0)
                x = torch.randn(n, dim, generator=g)
                return torch.utils.data.TensorDataset(x, x.sum(1))
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    code, _ = train(
        tmp_path,
        "model.name=plugin",
        "model.plugin=regress:build_model",
        "model.plugin_args={dim: 4}",
        "data.name=plugin",
        "data.plugin=regress:build_dataset",
        "data.plugin_args={n: 256, dim: 4}",
        "train.max_steps=30",
        "train.lr=0.1",
        "train.grad_clip=0",
        "log.interval_steps=1",
    )
    assert code == 0, capsys.readouterr().err
    records = metrics(tmp_path)
    assert records[-1]["loss"] < 0.2 * records[0]["loss"]
    assert records[-1]["grad_norm"] is None  # clipping off


@pytest.mark.slow
def test_resume_is_bit_exact_with_dropout_and_accumulation(tmp_path, capsys):
    common = [
        "model.name=gpt",
        "model.gpt.dropout=0.2",  # consumes the torch RNG: the restored RNG state must be exact
        "train.batch_size=4",
        "train.grad_accum_steps=2",
        "train.decay_steps=8",
        "data.synthetic.num_samples=24",  # 3 steps per epoch: resumes mid-epoch, then crosses epochs
        "checkpoint.interval_steps=0",
    ]
    assert train(tmp_path, *common, "train.max_steps=8", "run.name=straight")[0] == 0
    assert train(tmp_path, *common, "train.max_steps=5", "run.name=split")[0] == 0
    assert train(tmp_path, *common, "train.max_steps=8", "run.name=split")[0] == 0
    out = capsys.readouterr()
    results = finals(out.out)
    assert [r[0] for r in results] == [8, 5, 8]
    assert results[0][2] == results[2][2], "resumed run diverged from the uninterrupted one"
    assert results[0][1] == results[2][1]
    assert "resumed from" in out.err and "step-00000005.pt" in out.err


def test_rerun_of_a_finished_run_trains_nothing_and_reports_the_same(tmp_path, capsys):
    assert train(tmp_path, "train.max_steps=3")[0] == 0
    assert train(tmp_path, "train.max_steps=3")[0] == 0
    out = capsys.readouterr()
    first, second = finals(out.out)
    assert first == second
    assert "nothing left to train" in out.err


def test_compiled_model_saves_the_raw_state_dict(tmp_path, monkeypatch, capsys):
    real_compile = torch.compile
    compiled: list[torch.nn.Module] = []

    def eager_compile(model, **kw):  # the real inductor build takes ~45 s on CPU; the wrapping is the same
        out = real_compile(model, backend="eager", **kw)
        compiled.append(out)
        return out

    monkeypatch.setattr(torch, "compile", eager_compile)
    code, cfg = train(tmp_path, "train.compile=true", "train.max_steps=2")
    assert code == 0, capsys.readouterr().err
    assert compiled and hasattr(compiled[0], "_orig_mod")
    state = torch.load(cfg.checkpoint_dir / "step-00000002.pt", weights_only=True)
    assert state["model"] and not any(k.startswith("_orig_mod") for k in state["model"])


def test_bf16_autocast_on_cpu(tmp_path, capsys):
    code, _ = train(tmp_path, "train.precision=bf16", "train.max_steps=3", "log.interval_steps=1")
    assert code == 0, capsys.readouterr().err
    assert all(r["loss"] == r["loss"] for r in metrics(tmp_path))  # finite, not NaN


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.precision=fp16"], "train.precision: 'fp16' needs CUDA"),
        (["dist.backend=nccl"], None),  # alone there is no process group, so the backend is unused
        (["dist.device=cuda"], "dist.device: 'cuda' requested but CUDA is not available"),
        (["data.synthetic.num_samples=4"], "train.batch_size: 32 per rank x 1 rank(s) needs at least 32"),
    ],
)
def test_runtime_input_errors_are_one_line(tmp_path, capsys, overrides, message):
    if message and "cuda" in message and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, _ = train(tmp_path, "train.max_steps=1", *overrides)
    err = capsys.readouterr().err
    if message is None:
        assert code == 0
        return
    assert code == exitcodes.BAD_INPUT
    lines = [line for line in err.splitlines() if line.startswith("ddp-train: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_resume_never_refuses_a_directory_with_checkpoints(tmp_path, capsys):
    assert train(tmp_path, "train.max_steps=1")[0] == 0
    capsys.readouterr()
    code, cfg = train(tmp_path, "train.max_steps=1", "checkpoint.resume=never")
    assert code == exitcodes.BAD_INPUT
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("ddp-train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    # one line: the field, the directory, the newest step and the ways out
    assert "checkpoint.resume: 'never' (--fresh) but" in lines[0]
    assert f"{cfg.checkpoint_dir} already holds 1 checkpoint(s), the newest of step 1" in lines[0]
    assert "use another run.name" in lines[0] and "delete that directory" in lines[0]
    assert sorted(p.name for p in cfg.checkpoint_dir.iterdir()) == ["step-00000001.pt"]  # nothing touched


def test_the_first_info_line_says_fresh_start_or_what_was_resumed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DDP_JOB_ID", "job-a")
    assert train(tmp_path, "train.max_steps=2")[0] == 0
    first = [x for x in capsys.readouterr().err.splitlines() if " INFO " in x][0]
    ckpts = tmp_path / "runs" / "default" / "checkpoints"
    assert first.endswith(f"INFO fresh start (no checkpoint in {ckpts})"), first
    monkeypatch.setenv("DDP_JOB_ID", "job-b")
    assert train(tmp_path, "train.max_steps=3")[0] == 0
    first = [x for x in capsys.readouterr().err.splitlines() if " INFO " in x][0]
    m = re.search(r"INFO resumed from (\S+) at step 2 of job job-a, saved (.+ UTC), (\d+)m\d\ds ago$", first)
    assert m, first
    assert m.group(1) == str(ckpts / "step-00000002.pt")
    assert int(m.group(3)) < 10  # saved moments ago, by the first run


def test_a_checkpoint_of_another_model_is_refused_naming_the_file(tmp_path, capsys):
    assert train(tmp_path, "train.max_steps=1")[0] == 0
    code, _ = train(tmp_path, "train.max_steps=2", "model.mlp.hidden_dim=64")
    err = capsys.readouterr().err
    assert code == exitcodes.BAD_INPUT
    line = [x for x in err.splitlines() if x.startswith("ddp-train: error:")][0]
    assert "step-00000001.pt: does not fit this model/optimizer" in line


def test_params_sha256_is_over_float32_bytes_in_named_parameters_order():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.float64)
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        values = p.detach().to(torch.float32).flatten().tolist()
        h.update(struct.pack(f"={len(values)}f", *values))
    assert params_sha256(model) == h.hexdigest()


def test_progress_bar_when_forced(tmp_path, capsys):
    assert train(tmp_path, "train.max_steps=3", "log.progress=always")[0] == 0
    err = capsys.readouterr().err
    assert "\r\x1b[K[" in err and "3/3" in err


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, exitcodes.SIGINT), (signal.SIGTERM, exitcodes.SIGTERM)]
)
def test_a_signal_mid_run_saves_and_exits_128_plus_signal(tmp_path, capsys, sig, code):
    before = signal.getsignal(sig)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), sig))
    timer.start()
    try:
        result, cfg = train(
            tmp_path, "train.max_steps=200", "debug.step_delay_s=0.05", "checkpoint.interval_steps=0"
        )
    finally:
        timer.cancel()
    out = capsys.readouterr().out
    assert result == code
    m = re.search(rf"^ddp-train: stopped rank=0 world=1 step=(\d+) signal={sig.name}$", out, re.M)
    assert m and 0 < int(m.group(1)) < 200, out
    assert (cfg.checkpoint_dir / f"step-{int(m.group(1)):08d}.pt").is_file()
    assert signal.getsignal(sig) == before  # the previous handler is back


def test_stop_flags_decode_to_one_signal_for_every_rank():
    stop = StopRequest()
    assert stop.flags() == [0.0, 0.0] and StopRequest.decode(0, 0) is None
    stop.signum = signal.SIGTERM
    assert stop.flags() == [1.0, 0.0]
    assert StopRequest.decode(3, 0) == signal.SIGTERM  # three ranks got SIGTERM
    stop.signum = signal.SIGINT
    assert stop.flags() == [0.0, 1.0]
    assert StopRequest.decode(3, 1) == signal.SIGINT  # SIGINT on one, SIGTERM on three: SIGINT wins


@pytest.mark.slow
def test_every_training_step_after_a_validation_runs_in_train_mode(tmp_path):
    """The train mode is set once; validation puts it back (dropout would stay off otherwise)."""
    from ddp_train import distributed
    from ddp_train.trainer import Trainer

    sets = ["model.name=gpt", "model.gpt.dropout=0.2", "train.max_steps=4", "eval.interval_steps=1"]
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", *sets, "checkpoint.interval_steps=0"])
    trainer = Trainer(cfg, distributed.read_env(), torch.device("cpu"))
    seen = []
    trainer.model.register_forward_pre_hook(lambda m, _: seen.append((torch.is_grad_enabled(), m.training)))
    assert trainer.fit() == 0
    assert sorted(set(seen)) == [(False, False), (True, True)], seen  # eval forwards: no grad, eval mode
    assert seen.count((True, True)) == 4
