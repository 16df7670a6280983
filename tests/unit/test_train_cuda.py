"""The CUDA branch of the trainer (bf16, fp16 + GradScaler, fused AdamW, compile, pinned memory, MFU, NCCL).

Skipped without a GPU (CI has none); run on a lent GPU with `pytest tests/unit/test_train_cuda.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ddp_train.config import load_config
from ddp_train.distributed import DistEnv, select_device
from ddp_train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL_GPT = [
    "model.name=gpt",
    "model.gpt.n_layer=2",
    "model.gpt.n_embd=128",
    "model.gpt.block_size=64",
    "train.batch_size=8",
    "train.max_steps=20",
    "train.lr=0.01",
    "log.interval_steps=5",
]


def trainer(tmp_path, *overrides: str) -> Trainer:
    cfg = load_config(None, [f"run.dir={tmp_path}", *SMALL_GPT, *overrides])
    env = DistEnv()
    return Trainer(cfg, env, select_device(cfg.dist, env))


def test_bf16_fused_adamw_tf32_pinned_and_mfu(tmp_path):
    t = trainer(tmp_path, "train.precision=bf16", "log.peak_tflops=100")
    assert t.device.type == "cuda"
    assert t.optimizer.defaults.get("fused") is True
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    x, _ = t.batches.next()
    assert x.is_pinned()  # so the .to(device, non_blocking=True) copies really are asynchronous
    assert t.fit() == 0
    records = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] < 1 for r in records)
    assert records[-1]["loss"] < records[0]["loss"]


def test_fp16_uses_a_grad_scaler_and_checkpoints_it(tmp_path):
    t = trainer(tmp_path, "train.precision=fp16")
    assert t.scaler.is_enabled()
    assert t.fit() == 0
    state = torch.load(t.cfg.checkpoint_dir / "step-00000020.pt", weights_only=True)
    assert state["scaler"] and state["scaler"]["scale"] > 0
    assert state["rng"][0]["cuda"] is not None


def test_compiled_bf16_model_trains_and_saves_raw_keys(tmp_path):
    t = trainer(tmp_path, "train.precision=bf16", "train.compile=true")
    assert t.fit() == 0
    keys = torch.load(t.cfg.checkpoint_dir / "step-00000020.pt", weights_only=True)["model"].keys()
    assert keys and not any("_orig_mod" in k for k in keys)


def test_torchrun_one_gpu_over_nccl(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        "-m", "ddp_train", "--set", "dist.backend=nccl", "--set", "train.precision=bf16",
        *[a for o in SMALL_GPT for a in ("--set", o)],
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "backend=nccl" in proc.stderr
    assert "ddp-train: final rank=0 world=1 step=20" in proc.stdout
