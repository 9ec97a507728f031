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

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

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

    def hidden(
        self, idx: torch.Tensor, *, recompute: bool = False, head: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states [B, T, d_model] (after ``ln_f``) for token ids [B, T]: what
        the tied output head multiplies by ``wte.weight``.

        ``recompute``: keep only each block's input for the backward pass and run the block
        again there (activation checkpointing), instead of keeping everything its backward
        reads.  The values and gradients are the same to the bit (the same kernels on the
        same inputs); it costs one more forward pass of the blocks.

        ``head``: the output head's own leaf (a detached ``wte.weight``) when the caller
        multiplies by that instead; the embedding's gradient is then summed into the head's
        in place (``TiedLookup``)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ConfigError(f"model: sequence of {t} tokens exceeds seq_len {self.cfg.seq_len}")
        if head is None:
            x = self.wte(idx) + self.wpe.weight[:t]
        else:
            # (head,): not an input of the node, or its gradient would wait for this one's
            x = TiedLookup.apply(idx, self.wte.weight, (head,)) + self.wpe.weight[:t]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T]."""
        return F.linear(self.hidden(idx), self.wte.weight)

    def loss(self, windows: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over windows [B, T+1] (inputs then shifted targets).

        The value and the gradients are ``F.cross_entropy(self(windows[:, :-1]), ...)``'s to
        the bit; the training step's working memory is smaller (see ``recomputes`` and
        ``MeanCrossEntropy``)."""
        inputs = windows[:, :-1]
        recompute = torch.is_grad_enabled() and recomputes(self.cfg, inputs.shape[0])
        weight = self.wte.weight
        if (
            torch.is_grad_enabled()
            and weight.requires_grad
            and 4 * weight.numel() > TIED_BUDGET_BYTES
        ):
            head = weight.detach().requires_grad_()
            hidden = self.hidden(inputs, recompute=recompute, head=head)
        else:
            head, hidden = weight, self.hidden(inputs, recompute=recompute)
        logits = F.linear(hidden, head)
        logits, targets = logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)
        if 4 * logits.numel() <= LOGITS_BUDGET_BYTES:  # the pieces would only cost time
            return F.cross_entropy(logits, targets)
        return MeanCrossEntropy.apply(logits, targets)


# The training step's working memory.
#
# An island must train in 5 fp32 model copies + 512 MiB (parameters, gradients, AdamW's two
# moments, the sync base).  At gpt-125m (sequence 1024, vocabulary 50,304) a plain step's
# backward pass held about 1.1 GiB on top of the parameters, gradients and moments: the
# blocks' activations (about 600 MB) and the head's logits, log-softmax and their gradients
# (197 MiB each).  Both are cut here without changing a bit of the step, and so is autograd's
# sum of the tied weight's two gradients (``TiedLookup``: two more 147 MiB tensors).

#: Activations the blocks may keep for the backward pass, in bytes, before ``GPT.loss``
#: recomputes them instead (``recomputes``).
ACTIVATION_BUDGET_BYTES = 256 << 20

#: Logits up to this size take ``F.cross_entropy`` (the same bits, in whole-tensor kernels
#: that are faster than ``MeanCrossEntropy``'s pieces at small sizes); larger ones, whose
#: log-softmax and gradients would each be as large again, take ``MeanCrossEntropy``.
LOGITS_BUDGET_BYTES = 32 << 20

#: What a block keeps for its backward pass, per token, in units of d_model fp32 numbers
#: (measured with saved-tensor hooks: 16.0-16.1 at d_model 128 and 768, without its
#: weights): its input, the LayerNorms' outputs, q/k/v, the attention's output, the MLP's
#: two hidden tensors (mlp_ratio wide each) and the residual.
_BLOCK_WIDTHS = 16

#: Tied embeddings up to this size take autograd's own sum of the head's and the
#: embedding's gradients (the same bits, without ``TiedLookup``'s extra passes); larger
#: ones, where that sum holds two more weight-sized tensors, take ``TiedLookup``.
TIED_BUDGET_BYTES = 32 << 20

#: Rows of logits per piece of ``MeanCrossEntropy``'s work: its temporaries are three pieces
#: (log-softmax, the loss's gradient, the logits' gradient), 39 MiB at a 50,304 vocabulary.
_CE_ROWS = 64


def activation_bytes(cfg: ModelConfig, batch: int) -> int:
    """What the blocks keep for the backward pass of a batch of ``batch`` windows, in bytes
    (by ``_BLOCK_WIDTHS``)."""
    return 4 * _BLOCK_WIDTHS * batch * cfg.seq_len * cfg.d_model * cfg.n_layer


def recomputes(cfg: ModelConfig, batch: int) -> bool:
    """Whether ``GPT.loss`` checkpoints its blocks for a batch of ``batch`` windows: when
    their activations would exceed ``ACTIVATION_BUDGET_BYTES`` (gpt-125m at batch 1: 576 MiB;
    the proxy preset up to batch 32 and tiny up to 512 keep them)."""
    return activation_bytes(cfg, batch) > ACTIVATION_BUDGET_BYTES


class MeanCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits, targets)`` (the mean over rows), value and gradient bit for
    bit, that keeps only the logits for the backward pass and computes its gradient into
    them.

    ``F.cross_entropy`` keeps the log-softmax of the logits (one more logits-sized tensor)
    and makes two more in the backward pass (the loss's gradient and the logits').  Here the
    forward pass takes the log-softmax ``_CE_ROWS`` rows at a time and keeps only each row's
    target entry; the mean is ``F.nll_loss`` over those entries, which sums the same values
    in the same order as over the whole rows.  The backward pass runs the same two kernels
    as autograd (``nll_loss``'s gradient ``-(g / n)`` at the targets, then
    ``_log_softmax_backward_data``) a piece of rows at a time, each row's result the same in
    any piece, and writes the logits' gradient over the logits.  Autograd's version counter
    refuses a second backward pass through the overwritten logits."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        picked = torch.empty((n, 1), dtype=logits.dtype, device=logits.device)
        for a in range(0, n, _CE_ROWS):
            log_p = torch.log_softmax(logits[a : a + _CE_ROWS], dim=1)
            picked[a : a + _CE_ROWS] = log_p.gather(1, targets[a : a + _CE_ROWS, None])
        ctx.save_for_backward(logits, targets)
        return F.nll_loss(picked, torch.zeros(n, dtype=torch.long, device=logits.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets = ctx.saved_tensors
        n = logits.shape[0]
        scale = -(grad / n)  # nll_loss's gradient at each target: -(grad / total weight)
        for a in range(0, n, _CE_ROWS):
            rows = logits[a : a + _CE_ROWS]
            log_p = torch.log_softmax(rows, dim=1)
            g = torch.zeros_like(log_p)
            g.scatter_(1, targets[a : a + _CE_ROWS, None], scale.expand(rows.shape[0], 1))
            rows.copy_(torch._log_softmax_backward_data(g, log_p, 1, log_p.dtype))
        return logits, None


class TiedLookup(torch.autograd.Function):
    """``F.embedding(idx, weight)`` whose weight gradient is summed into the tied output
    head's in place: ``wte.weight``'s gradient bit for bit, without two weight-sized tensors.

    Autograd sums a tied weight's two gradients itself: it holds the head's (``G^T h``)
    until the embedding's arrives, a dense weight-sized tensor that is zero but for the rows
    of the batch's tokens, and adds them into a third (at gpt-125m, 147 MiB each, at the
    point of the backward pass where every other gradient exists).  Here the head
    multiplies by a leaf of its own (``head``, a detached ``wte.weight``, passed in a tuple
    so that it is no input of this node), whose gradient autograd stores as soon as the
    head's backward has run, long before the embedding's (which waits for every block).
    The backward pass takes that gradient, adds the embedding's rows into it in place, and
    returns it as ``weight``'s gradient.

    The sum is autograd's to the bit: each touched row is the head's row plus the row that
    ``embedding_dense_backward`` would give (the same kernel, over the batch's distinct
    tokens instead of the whole vocabulary, so the same additions in the same order); each
    other entry is the head's plus ``+0.0`` (which turns ``-0.0`` into ``+0.0``, as
    autograd's sum with the dense zeros does).  The head's gradient must have arrived: a
    ``torch.autograd.grad`` that does not ask for it is refused rather than answered
    without the head's part."""

    @staticmethod
    def forward(
        ctx: Any, idx: torch.Tensor, weight: torch.Tensor, head: tuple[torch.Tensor]
    ) -> torch.Tensor:
        ctx.save_for_backward(idx)
        (ctx.head,) = head
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (idx,) = ctx.saved_tensors
        head: torch.Tensor = ctx.head
        total = head.grad
        if total is None:
            raise RuntimeError(
                "GPT.loss: the tied head's gradient had not arrived when the embedding's did; "
                "its gradients are for loss.backward(), not torch.autograd.grad"
            )
        head.grad = None
        rows, at = torch.unique(idx, return_inverse=True)
        part = torch.ops.aten.embedding_dense_backward(grad, at, rows.numel(), -1, False)
        touched = total.index_select(0, rows).add_(part)
        total.add_(0.0)
        total.index_copy_(0, rows, touched)
        return None, total, None


def build_model(cfg: ModelConfig | str, seed: int = 0) -> GPT:
    """Build a model from a config or preset name, initialized from ``seed``."""
    return GPT(preset(cfg) if isinstance(cfg, str) else cfg, seed=seed)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Held-out evaluation, sized by memory.
#
# The logits of one window are seq_len * vocab_size fp32 numbers: 206 MB at gpt-125m, so a
# fixed batch of windows (64 of them: 13 GB) cannot be the unit.  ``evaluate`` runs the trunk
# (embeddings, blocks, ln_f) over as many windows at a time as the budget holds, then the tied
# head and the cross-entropy over slices of those positions, keeping every per-token loss.
# The value is the exactly rounded sum of the per-token losses divided by their number: it
# does not depend on how the work was cut (see ``evaluate``).

#: Transient memory, in bytes, that held-out evaluation may use on top of the model it
#: evaluates: activations, logits and the cross-entropy's temporaries.  The aggregator must run
#: in 3 fp32 model copies + 256 MiB; evaluation takes half of the extra (measured with its
#: allocator slack at gpt-125m: 104-133 MiB of resident memory on 2 cores).
EVAL_BUDGET_BYTES = 128 << 20

#: The most windows a batch holds, whatever the budget allows: the fixed batch of before.
#: Larger batches only cost time on CPU (measured, 512 holdout windows: tiny 15% slower in
#: batches of 227 than of 64; proxy fastest at 8-32).
EVAL_MAX_ROWS = 64

#: The fewest positions a head slice holds (unless a batch has fewer positions in all).  The
#: per-row result of a CPU matrix product does not depend on how many rows it has from 12 rows
#: up, but below that MKL takes other kernels whose rounding differs (measured: 1-3, 5-7 and
#: 9-11 rows), so a thinner slice would make the value depend on the budget.  Slices of one
#: batch differ by at most one position, so none is under half of this.
MIN_SLICE_POSITIONS = 32

#: The memory model of ``eval_plan``, in fp32 numbers, fitted to the peak resident memory
#: measured at gpt-125m (VmHWM over the resident size after building the model, cold, 2
#: threads; the slow test of tests/unit/test_model_eval.py bounds the whole evaluation's).
#: Per token of the trunk, in units of d_model, besides the MLP's two hidden tensors
#: (mlp_ratio * d_model each): the residual stream, LayerNorms, q/k/v, attention output,
#: copies and allocator slack (measured 20-25 in all at 1-8 windows; the model says 26).
_TRUNK_WIDTHS = 18

#: Per head position, in units of vocab_size: the logits and the cross-entropy's log-softmax
#: (measured 2.03-2.11 at 256-1024 positions; the model says 2.25).
_HEAD_WIDTHS = 2.25


@dataclass(frozen=True, slots=True)
class EvalPlan:
    """How ``evaluate`` cuts its work: ``rows`` windows through the trunk at a time, and the
    tied head plus cross-entropy over slices of at most ``positions`` of their positions."""

    rows: int
    positions: int
    peak_bytes: int
    """The memory model's transient peak for this plan: at most the budget, unless even one
    window's trunk and a slice of ``MIN_SLICE_POSITIONS`` exceed it."""


def eval_plan(cfg: ModelConfig, budget_bytes: int = EVAL_BUDGET_BYTES) -> EvalPlan:
    """The largest cut of the held-out evaluation of ``cfg`` whose transient memory fits
    ``budget_bytes``, by the memory model of ``_TRUNK_WIDTHS`` and ``_HEAD_WIDTHS``.

    Whole windows when one window's trunk and logits fit (as many as fit, up to
    ``EVAL_MAX_ROWS``, their head in one slice); otherwise one window at a time, its head in
    slices of positions.  The trunk's and the head's peaks add up: what the trunk frees stays
    resident in the C allocator's heap (measured), where the head's large logits (mappings of
    their own) do not reuse it."""
    if budget_bytes <= 0:
        raise ConfigError(f"evaluate: budget_bytes must be positive, got {budget_bytes}")
    t = cfg.seq_len
    trunk_row = 4 * t * (2 * cfg.mlp_ratio + _TRUNK_WIDTHS) * cfg.d_model
    hidden_row = 4 * t * cfg.d_model  # the trunk's output, kept while the head runs
    head_position = math.ceil(4 * _HEAD_WIDTHS * cfg.vocab_size)
    row = trunk_row + hidden_row + t * head_position
    if budget_bytes >= row:
        rows = min(EVAL_MAX_ROWS, budget_bytes // row)
        return EvalPlan(rows=rows, positions=rows * t, peak_bytes=rows * row)
    fit = (budget_bytes - trunk_row - hidden_row) // head_position
    positions = min(t, max(MIN_SLICE_POSITIONS, fit))
    peak = trunk_row + hidden_row + positions * head_position
    return EvalPlan(rows=1, positions=positions, peak_bytes=peak)


@torch.no_grad()
def evaluate(
    model: GPT,
    windows: torch.Tensor,
    budget_bytes: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> float:
    """Mean held-out cross-entropy over ``windows`` [N, T+1], in memory-sized pieces.

    The work is cut by ``eval_plan(model.cfg, budget_bytes)`` (default
    ``EVAL_BUDGET_BYTES``): whole windows through the trunk, then the tied head and the
    cross-entropy (fp32, one loss per token) over slices of their positions, so that the
    transient memory stays near the budget at any preset (gpt-125m: one window at a time,
    its logits in 10 slices of 102-103 positions).  The value is the exactly rounded float64
    sum (``math.fsum``) of the N * T per-token fp32 losses, divided by N * T: a pure function
    of (parameters, windows), whatever the budget, because each token's loss is computed by
    the same arithmetic in any cut (CPU: checked bit for bit in tests/unit/test_model_eval.py;
    on a GPU, kernels chosen by shape may round differently at another budget).

    Against the evaluation before it (fixed batches of 64 windows, each batch's fp32 mean
    weighted by its rows): the same value up to the rounding of those fp32 means, measured
    at most 1e-7 relative (9.3e-8 at tiny and 6.9e-8 at proxy on 1-512 real holdout windows,
    trained and untrained; 7.7e-8 at gpt-125m on 8 random windows); read it as a tolerance
    of 1e-6 relative.

    ``stop``: checked before each batch of windows and each head slice; when it says so the
    evaluation ends early and returns NaN (a daemon that is asked to stop does not wait for
    it).  A non-finite token loss makes the result NaN or inf."""
    plan = eval_plan(model.cfg, EVAL_BUDGET_BYTES if budget_bytes is None else budget_bytes)
    n, t = windows.shape[0], windows.shape[1] - 1
    if n * t == 0:
        raise ConfigError(
            f"evaluate: no tokens to evaluate in windows of shape {tuple(windows.shape)}"
        )
    weight = model.wte.weight
    losses = torch.empty(n * t, dtype=torch.float32, device=windows.device)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, n, plan.rows):
            if stop is not None and stop():
                return math.nan
            chunk = windows[start : start + plan.rows]
            hidden = model.hidden(chunk[:, :-1]).reshape(-1, weight.shape[1])
            targets = chunk[:, 1:].reshape(-1)
            m = hidden.shape[0]
            k = -(-m // plan.positions)  # slices of equal size, to one position
            edges = [m * i // k for i in range(k + 1)]
            for i, (a, b) in enumerate(itertools.pairwise(edges)):
                if i and stop is not None and stop():
                    return math.nan
                logits = F.linear(hidden[a:b], weight)
                base = start * t
                losses[base + a : base + b] = F.cross_entropy(
                    logits, targets[a:b], reduction="none"
                )
                del logits  # before the next slice's logits exist
            del hidden
    finally:
        model.train(was_training)
    parts = losses.cpu().split(1 << 16)
    return math.fsum(itertools.chain.from_iterable(p.tolist() for p in parts)) / (n * t)
