"""GPT-style decoder: pre-norm blocks, causal attention through SDPA.

The model is deliberately plain (nanoGPT shape) so that every driver trains
the same function: islands, the in-process reference run and the simulator
all build it with :func:`build_model` from a named preset.

Invariants:
- Initialization is a pure function of ``(config, seed)``: the same seed gives
  bit-identical parameters in any process (a private ``torch.Generator`` is
  used, never the global RNG).
- Parameter names are stable; the flat-vector layout (common/flat.py) sorts
  them by name, so adding a buffer never reorders parameters.
- The token embedding and the output head are tied (one tensor).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hypertrain.common.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape of the decoder."""

    n_layer: int
    """Number of transformer blocks."""
    d_model: int
    """Residual stream width."""
    n_head: int
    """Attention heads; must divide d_model."""
    seq_len: int
    """Context length in tokens (windows are seq_len + 1 long: inputs and shifted targets)."""
    vocab_size: int = 256
    """Token vocabulary; 256 for the byte-level default tokenizer."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size", "mlp_ratio"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model: {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ConfigError(f"model: n_head {self.n_head} does not divide d_model {self.d_model}")


# Named presets.  tiny: milliseconds per step on one CPU core (tests, `hypertrain up`).
# proxy: the parity proxy of docs/design.md §8 (4 layers, d_model 128, sequence 256).
# gpt-125m: the GPT-2 small shape (12 x 768, ~124M parameters with a 50304-token
# vocabulary) for GPUs.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layer=2, d_model=64, n_head=4, seq_len=64),
    "proxy": ModelConfig(n_layer=4, d_model=128, n_head=4, seq_len=256),
    "small": ModelConfig(n_layer=6, d_model=384, n_head=6, seq_len=512),
    "gpt-125m": ModelConfig(n_layer=12, d_model=768, n_head=12, seq_len=1024, vocab_size=50304),
}


def preset(name: str) -> ModelConfig:
    """Return the named preset, or raise ConfigError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ConfigError(f"unknown model preset {name!r} (known: {known})") from None


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only language model with tied input/output embeddings."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 initialization from a private generator: N(0, 0.02), residual
        projections scaled by 1/sqrt(2 * n_layer), LayerNorm at (1, 0)."""
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in sorted(self.named_parameters()):
            if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = resid_std if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T]."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ConfigError(f"model: sequence of {t} tokens exceeds seq_len {self.cfg.seq_len}")
        x = self.wte(idx) + self.wpe.weight[:t]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)

    def loss(self, windows: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over windows [B, T+1] (inputs then shifted targets)."""
        logits = self(windows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def build_model(cfg: ModelConfig | str, seed: int = 0) -> GPT:
    """Build a model from a config or preset name, initialized from ``seed``."""
    return GPT(preset(cfg) if isinstance(cfg, str) else cfg, seed=seed)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def evaluate(
    model: GPT,
    windows: torch.Tensor,
    batch_size: int = 64,
    stop: Callable[[], bool] | None = None,
) -> float:
    """Mean held-out cross-entropy over ``windows`` [N, T+1], in fixed batches.

    Each batch's mean is weighted by its row count and summed in float64 in a
    fixed order, so the value is a pure function of (parameters, windows).
    ``stop``: checked between batches; when it says so the evaluation ends early
    and returns NaN (a daemon that is asked to stop does not wait for it)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, windows.shape[0], batch_size):
        if stop is not None and stop():
            model.train(was_training)
            return math.nan
        chunk = windows[start : start + batch_size]
        total += float(model.loss(chunk)) * chunk.shape[0]
    model.train(was_training)
    return total / windows.shape[0]
