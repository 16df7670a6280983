"""Built-in models (an MLP classifier, a nanoGPT-style LM), the plug-in hook, and FLOPs per token.

Contract for every model: `forward(inputs, targets)` returns the scalar training loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ddp_train.config import Config, ConfigError, GPTConfig, MLPConfig
from ddp_train.plugins import call_plugin


def _fp32_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the loss: as they are under autocast, which runs the loss in fp32 by itself
    (https://pytorch.org/docs/stable/amp.html, "ops that can autocast to float32"), else as fp32.

    This saves no memory under bf16: autocast casts the logits to fp32 itself, a (B, T, V) fp32 copy
    (~3.3 GB at B=16, T=1024, V=50304) exactly like .float(): on CPU cross_entropy_loss is on the fp32
    list (aten::_to_copy of the logits, seen in the profiler); on CUDA (issue 31's reading of the
    autocast lists) log_softmax gets dtype=float32 and converts bf16 input first; only fp16 has a fused
    half-to-float log_softmax (torch 2.13
    _decomp/decompositions.py _log_softmax: half_to_float expects torch.half). bench G6 measures it.
    Avoiding the copy would take a loss computed chunk by chunk over the tokens (fused with lm_head)."""
    return logits if torch.is_autocast_enabled(logits.device.type) else logits.float()


class MLP(nn.Module):
    """Feed-forward classifier: n_layers x (Linear, GELU, Dropout), then a Linear head."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = cfg.in_dim
        for _ in range(cfg.n_layers):
            layers += [nn.Linear(width, cfg.hidden_dim), nn.GELU(), nn.Dropout(cfg.dropout)]
            width = cfg.hidden_dim
        layers.append(nn.Linear(width, cfg.n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.net(x)
        return logits if targets is None else F.cross_entropy(_fp32_logits(logits), targets)

    def flops_per_token(self) -> float:
        """Training FLOPs per sample: 6 x parameters (forward 2N, backward 4N)."""
        return 6.0 * sum(p.numel() for p in self.parameters())


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on F.scaled_dot_product_attention (flash kernels on GPU)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-shaped decoder-only LM with tied token embedding / output weights."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("attn.c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.size(1)
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        logits = _fp32_logits(logits)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def flops_per_token(self) -> float:
        """Training FLOPs per token, as nanoGPT's estimate_mfu (PaLM appendix B): 6N + 12*L*C*T.

        N counts the parameters without the position embedding (the tied token embedding stays in:
        it is the output projection's matmul).
        """
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        c = self.cfg
        return 6.0 * n + 12.0 * c.n_layer * c.n_embd * c.block_size


def flops_per_token(model: nn.Module) -> float:
    """The model's own estimate when it has one, else 6 x parameters (dense, no attention term)."""
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own())
    return 6.0 * sum(p.numel() for p in model.parameters())


def build_model(cfg: Config) -> nn.Module:
    """The model named by cfg.model (plug-ins must return an nn.Module)."""
    if cfg.model.name == "mlp":
        return MLP(cfg.model.mlp)
    if cfg.model.name == "gpt":
        return GPT(cfg.model.gpt)
    model = call_plugin("model.plugin", cfg.model.plugin or "", cfg.model.plugin_args)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "config", "model.plugin", f"{cfg.model.plugin} returned {type(model).__name__}, not an nn.Module"
        )
    return model
