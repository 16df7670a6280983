"""Models (MLP, GPT), FLOPs per token and MFU, the warmup + cosine schedule, optimizer groups, plug-ins."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from ddp_train.config import ConfigError, GPTConfig, OptimConfig, load_config
from ddp_train.metrics import PEAK_BF16_TFLOPS, mfu, peak_flops
from ddp_train.models import GPT, MLP, build_model, flops_per_token
from ddp_train.optim import build_optimizer, build_scheduler, lr_at
from ddp_train.plugins import call_plugin, load_callable

# --- models -------------------------------------------------------------------------------------------


def test_gpt_ties_weights_and_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11))
    assert model.wte.weight is model.lm_head.weight
    idx = torch.randint(11, (2, 8))
    logits = model(idx)
    assert logits.shape == (2, 8, 11)
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 11  # the future must not change the past
    torch.testing.assert_close(model(changed)[:, :5], logits[:, :5])
    assert not torch.allclose(model(changed)[:, 5:], logits[:, 5:])
    loss = model(idx, idx)
    assert loss.dim() == 0 and abs(loss.item() - math.log(11)) < 0.5  # small init: near uniform
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_gpt_flops_per_token_is_6n_plus_attention():
    c = GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=16, vocab_size=50, bias=False)
    model = GPT(c)
    # per block: qkv 3C^2 + proj C^2 + mlp 8C^2 + two LayerNorm weights 2C; then ln_f C and wte V*C
    n = c.n_layer * (12 * c.n_embd**2 + 2 * c.n_embd) + c.n_embd + c.vocab_size * c.n_embd
    assert sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel() == n
    assert model.flops_per_token() == 6 * n + 12 * c.n_layer * c.n_embd * c.block_size
    assert flops_per_token(model) == model.flops_per_token()


def test_gpt2_small_shape_matches_the_known_size():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304))
    non_embedding = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    assert non_embedding == 12 * (12 * 768**2 + 2 * 768) + 768 + 50304 * 768 == 123_587_328  # "124M"
    assert model.flops_per_token() == pytest.approx(6 * non_embedding + 12 * 12 * 768 * 1024)


def test_mlp_and_generic_flops():
    mlp = MLP(load_config(None).model.mlp)
    n = sum(p.numel() for p in mlp.parameters())
    assert flops_per_token(mlp) == 6 * n
    assert flops_per_token(torch.nn.Linear(3, 2)) == 6 * 8  # models without an estimate: 6N
    x, y = torch.randn(4, 32), torch.tensor([0, 1, 2, 3])
    assert mlp(x).shape == (4, 8) and mlp(x, y).dim() == 0


def test_mfu_and_peak_table():
    assert mfu(tokens_per_s=1e5, flops_per_token=1e9, peak_per_device=1e15, world_size=1) == pytest.approx(
        0.1
    )
    assert mfu(2e5, 1e9, 1e15, world_size=2) == pytest.approx(0.1)  # per-device utilisation
    assert peak_flops("NVIDIA H200") == pytest.approx(989.5e12)
    assert peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.5e12)
    assert peak_flops("NVIDIA H100 PCIe") == pytest.approx(756.5e12)
    assert peak_flops("NVIDIA H100 NVL") == pytest.approx(835.5e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert peak_flops("Tesla T4") is None
    assert peak_flops("Tesla T4", override_tflops=65) == pytest.approx(65e12)
    assert peak_flops("NVIDIA H200", override_tflops=500) == pytest.approx(500e12)
    assert {name for name, _ in PEAK_BF16_TFLOPS} >= {"H100", "H200", "A100"}


# --- schedule and optimizer ---------------------------------------------------------------------------


def test_warmup_then_cosine_to_min_lr():
    c = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=24)
    assert [lr_at(s, c) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, c) == 1.0  # cosine starts at the peak
    assert lr_at(14, c) == pytest.approx(0.55)  # half way: (lr + min_lr) / 2
    decay = [lr_at(s, c) for s in range(4, 25)]
    assert all(a > b for a, b in zip(decay, decay[1:-1]))  # strictly decreasing until the end
    assert lr_at(24, c) == pytest.approx(0.1) and lr_at(1000, c) == 0.1
    pinned = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=10, decay_steps=20)
    assert lr_at(10, pinned) == pytest.approx(0.5)  # decay_steps, not max_steps, sets the curve


def test_scheduler_drives_the_optimizer_along_lr_at():
    c = OptimConfig(lr=0.5, min_lr=0.05, warmup_steps=3, max_steps=12)
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, c, torch.device("cpu"))
    sched = build_scheduler(opt, c)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, c) for s in range(12)])


def test_weight_decay_only_on_matrices_and_sgd():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and [p.shape for p in decayed["params"]] == [(4, 4)]
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 3
    assert opt.defaults.get("fused") in (None, False)  # fused only on CUDA
    sgd = build_optimizer(model, OptimConfig(optimizer="sgd", momentum=0.8), torch.device("cpu"))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.8


# --- plug-ins -----------------------------------------------------------------------------------------

PLUGIN = """
import torch

class Linear(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = torch.nn.Linear(dim, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x).squeeze(-1), y)

def build_model(dim=4):
    return Linear(dim)

def build_dataset(n=64, dim=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1))

NOT_CALLABLE = 3

def not_a_module():
    return "nope"
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "myplug.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.chdir(tmp_path)  # plug-ins are found in the working directory
    yield tmp_path


def test_plugins_from_the_working_directory(plugin_dir):
    cfg = load_config(
        None, ["model.name=plugin", "model.plugin=myplug:build_model", "model.plugin_args.dim=3"]
    )
    model = build_model(cfg)
    assert model.fc.in_features == 3
    ds = call_plugin("data.plugin", "myplug:build_dataset", {"n": 10})
    assert len(ds) == 10


@pytest.mark.parametrize(
    ("ref", "args", "message"),
    [
        ("myplug:missing", {}, "module 'myplug' has no attribute 'missing'"),
        ("myplug:NOT_CALLABLE", {}, "is a int, not a function"),
        ("no_such_module:f", {}, "cannot import 'no_such_module'"),
        ("myplug:build_model", {"width": 3}, "model.plugin_args: do not fit myplug:build_model"),
        ("nocolon", {}, "is not a 'package.module:function' reference"),
    ],
)
def test_plugin_errors_are_config_errors(plugin_dir, ref, args, message):
    with pytest.raises(ConfigError, match=message):
        call_plugin("model.plugin", ref, args)


def test_plugin_must_return_a_module(plugin_dir):
    cfg = load_config(None, ["model.name=plugin", "model.plugin=myplug:not_a_module"])
    with pytest.raises(ConfigError, match="returned str, not an nn.Module"):
        build_model(cfg)
    assert callable(load_callable("model.plugin", "myplug:build_model"))
